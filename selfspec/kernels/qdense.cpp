// selfspec's dequantization of GGUF block-quantized weights (the packed layout: qcodes.h): rows as float32
// (qdequant: an embedding lookup, a slice of the LM head) and blocks of rows transposed (qdense_t: the tiles a
// prefill multiplies with torch's GEMM), by the formula the kernels use, so gguf-py's values bit for bit.

#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "qcodes.h"
#include "simd.h"

using namespace qcodes;

namespace {

// One row's code of column k of a group, 5-bit codes as words (AVX-512 builds; qcodes.h's layout).
inline int32_t code5_at(const uint8_t* cg, int64_t k, int64_t lane) {
  const auto word = [&](int64_t w) {
    uint32_t v;
    std::memcpy(&v, cg + (w * L + lane) * 4, 4);
    return v;
  };
  if (k < 30) return (int32_t)(word(k / 6) >> (5 * (k % 6)) & 31);
  uint32_t t = 0;
  for (int64_t w = 4; w >= 0; --w) t = t << 2 | word(w) >> 30;
  return (int32_t)(t >> (5 * (k - 30)) & 31);
}

}  // namespace

bool qcodes5_words() { return WORDS5; }

// Rows ``ids`` of the packed weight as float32: out [len(ids), K] (an embedding lookup, a slice of the
// LM head, the reference backend's on-demand weights). The same formula as the kernel.
at::Tensor qdequant(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                       double z, at::Tensor ids, at::Tensor out) {
  check_packed(codes, scales, offsets, bits, group);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids: [R] int64");
  const int64_t R = ids.size(0), NB = codes.size(0), G = codes.size(1), K = G * group;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && out.size(1) == K && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out: [R, K] float32");
  const int64_t CB = group_bytes(bits, group);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const Scales sp = sc_of(scales), op = sc_of(offsets);
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* yp = out.data_ptr<float>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < NB * L, "row id ", ip[i], " out of range");
  const float zf = (float)z;
  for_range(R, R * K > 65536, [&](int64_t i) {
    const int64_t b = ip[i] / L, lane = ip[i] % L;
    for (int64_t j = 0; j < G; ++j) {
      const uint8_t* c = cp + (b * G + j) * CB;
      const float s = sp.at((b * G + j) * L + lane);
      const float o = op.p ? op.at((b * G + j) * L + lane) : 0.f;
      for (int64_t k = 0; k < group; ++k) {
        int32_t q;
        if (bits == 8) q = c[k * L + lane];
        else if (bits == 5 && WORDS5) q = code5_at(c, k, lane);
        else {
          q = (c[(k / 2) * L + lane] >> (4 * (k % 2))) & 15;
          if (bits == 5) {
            uint16_t p;
            std::memcpy(&p, c + group * 8 + 2 * k, 2);
            q += ((p >> lane) & 1) << 4;
          }
        }
        const float w = ((float)q - zf) * s;
        yp[i * K + j * group + k] = op.p ? w - o : w;
      }
    }
  });
  return out;
}

namespace {

template <int BITS, bool OFF>
void dense_t(const uint8_t* codes, Scales sc, Scales of, int64_t G, int64_t g, float z, int64_t b0,
             int64_t b1, float* out) {
  const int64_t ldo = (b1 - b0) * L;
  const vf zv = bcast(z);
#pragma omp parallel for schedule(static)
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t j = 0; j < G; ++j) group_t<BITS, OFF>(codes, sc, of, G, g, zv, b, j, out + j * g * ldo + (b - b0) * L, ldo);
}

}  // namespace

// Blocks [b0, b1) of the packed weight (output rows 16 b0 .. 16 b1 - 1) dequantized and transposed: out [K, 16 (b1 - b0)]
// float32, column n holding output row 16 b0 + n. The kernel's own weights (the same formula, so gguf-py's values bit
// for bit, as qdequant), for x @ out as one GEMM when many rows of x share them (a prefill).
at::Tensor qdense_t(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                       double z, int64_t b0, int64_t b1, at::Tensor out) {
  check_packed(codes, scales, offsets, bits, group);
  const int64_t NB = codes.size(0), G = codes.size(1);
  TORCH_CHECK(0 <= b0 && b0 < b1 && b1 <= NB, "blocks [", b0, ", ", b1, ") out of range [0, ", NB, ")");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == G * group && out.size(1) == (b1 - b0) * L && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out: [K, 16 (b1 - b0)] float32 contiguous");
  const bool off = offsets.numel() > 0;
  dispatch(bits, off, [&](auto B, auto O) {
    dense_t<decltype(B)::value, decltype(O)::value>(codes.data_ptr<uint8_t>(), sc_of(scales), sc_of(offsets), G,
                                                    group, (float)z,
                                                    b0, b1, out.data_ptr<float>());
  });
  return out;
}
