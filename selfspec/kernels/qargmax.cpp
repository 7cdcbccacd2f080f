// selfspec's LM head screen for greedy verification (selfspec/quant/screen.py): qargmax, the argmax of x @ W^T
// for a GGUF block-quantized W, screened by the int8 kernel (qlinear_i8.cpp) and finished by the exact one
// (qlinear.cpp); and qgroup_l1, the bound table it screens with. The packed layout: qcodes.h.
//
// A greedy verification needs only each row's argmax of the LM head's logits, not the logits. The int8 kernel
// (qlinear_i8.cpp) computes them approximately at the cost of one read of the weight; its error is bounded per block
// of 16 output rows, so only the blocks whose bound can reach the best row need the exact kernel. Per x-row m and
// block b:
//     |approx - exact| <= B[m][b] = sum_j E[b][j] * dx[m][j]
// where dx is the group's rounding step (max|x| / 127) and E (``ebound``, selfspec/quant/screen.py) the block's
// largest sum_k |w_k| / 2 in group j (rounding moves each x by at most dx / 2), plus room for the float32 rounding of
// both kernels. The true argmax r* has exact >= exact of every row, so approx[r*] + B >= max_r (approx[r] - B) =: lo:
// every block whose best approx + B reaches lo is a candidate, and no other block can hold r*. The candidates go
// through the exact kernel with the same x-row tiles as qlinear's (tile_rows, as qlinear.cpp's run), so their logits
// are bit for bit qlinear's, and the first maximum among them is torch.argmax of qlinear's output. Worked example (one
// x-row, three blocks with best approx 9.0, 7.5, 3.0 and bounds 1.0, 1.0, 1.0): lo = 8.0; blocks 0 (10.0 >= 8) and 1
// (8.5 >= 8) are computed exactly, block 2 (4.0 < 8) is not.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "qcodes.h"
#include "simd.h"

using namespace qcodes;

// out [M] int64: each row's argmax, or -1 for every row when an activation is not finite (the caller computes the
// logits instead). Returns the number of candidate blocks.
int64_t qargmax(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                int64_t group, double z, int64_t n, at::Tensor ebound, at::Tensor out) {
  check_packed(codes, scales, offsets, bits, group);
  check_x(x, codes, bits, group, z);
  TORCH_CHECK(n <= codes.size(0) * L && n > (codes.size(0) - 1) * L, "n: ", n, " output rows for ", codes.size(0), " blocks");
  struct {
    const uint8_t* codes;
    Scales scales, offsets;
    float z;
    bool off;
  } const a{codes.data_ptr<uint8_t>(), sc_of(scales), sc_of(offsets), (float)z, offsets.numel() > 0};
  const int64_t M = x.size(0), K = x.size(1), G = codes.size(1), NB = codes.size(0), N = n;
  TORCH_CHECK(M >= 1 && M <= 16, "qargmax takes 1-16 rows of x, got ", M);
  TORCH_CHECK(ebound.dim() == 2 && ebound.size(0) == NB && ebound.size(1) == G && ebound.is_contiguous() &&
                  ebound.scalar_type() == at::kFloat,
              "ebound: [N/16, G] float32");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == M && out.scalar_type() == at::kLong, "out: [M] int64");
  int64_t* ids = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const Rounded r(xp, M, K, group, bits);
  if (!r.finite) {
    for (int64_t m = 0; m < M; ++m) ids[m] = -1;
    return 0;
  }
  const float* E = ebound.data_ptr<float>();
  std::vector<float> best(M * NB), bound(M * NB);  // [M, NB]: a block's best approximate logit, its error bound
  dispatch(bits, a.off, [&](auto B, auto O) {
    constexpr int BB = decltype(B)::value;
    constexpr bool OO = decltype(O)::value;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < NB; ++b) {
      float res[MC_I8 * L];
      const int64_t rows = std::min<int64_t>(L, N - b * L);
      for (int64_t m0 = 0; m0 < M; m0 += MC_I8) {
        const int64_t mc = std::min<int64_t>(MC_I8, M - m0);
        tile_i8_rows<BB, OO>(r.qx.get(), r.pairs.get(), r.dx.data(), r.sx.data(), m0, mc, K, G, group, a.codes,
                             a.scales, a.offsets, b, a.z, res);
        for (int64_t m = m0; m < m0 + mc; ++m) {
          float v = res[(m - m0) * L];
          for (int64_t i = 1; i < rows; ++i) v = std::max(v, res[(m - m0) * L + i]);
          float e = 0.f;
          for (int64_t j = 0; j < G; ++j) e += E[b * G + j] * r.dx[m * G + j];
          best[m * NB + b] = v;
          bound[m * NB + b] = e;
        }
      }
    }
  });
  // lo per row, then the candidate blocks. The comparisons get a margin of 2^-20 of the largest magnitude in play,
  // for the rounding of the sums and differences themselves (bounds are >= 0; a NaN best counts as a candidate).
  std::vector<char> cand(NB, 0);
  for (int64_t m = 0; m < M; ++m) {
    const float* bm = best.data() + m * NB;
    const float* bd = bound.data() + m * NB;
    float lo = -INFINITY, mag = 0.f;
    for (int64_t b = 0; b < NB; ++b) {
      lo = std::max(lo, bm[b] - bd[b]);
      mag = std::max(mag, std::fabs(bm[b]) + bd[b]);
    }
    const float cut = lo - mag * 0x1p-20f;
    for (int64_t b = 0; b < NB; ++b)
      if (!(bm[b] + bd[b] < cut)) cand[b] = 1;
  }
  std::vector<int64_t> blocks;
  for (int64_t b = 0; b < NB; ++b)
    if (cand[b]) blocks.push_back(b);
  const int64_t C = (int64_t)blocks.size();
  std::vector<float> exact(C * M * L);  // [C, M, 16]: the candidates' exact logits, as run (qlinear) computes them
  dispatch(bits, a.off, [&](auto B, auto O) {
    constexpr int BB = decltype(B)::value;
    constexpr bool OO = decltype(O)::value;
    const int64_t CB = group_bytes(BB, group);
    const std::vector<float> xsum = group_sums<BB, OO>(xp, M, G, group);  // as run
    for_range(C, C > 8, [&](int64_t c) {
      const int64_t b = blocks[c];
      float res[MCMAX * L];
      const uint8_t* cb = a.codes + b * G * CB;
      const auto [sb, ob] = block_scales(a.scales, a.offsets, b, G);  // as run
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t mc = std::min<int64_t>(M - m0, MCMAX);
        const float* xm = xp + m0 * K;
        const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
        tile_rows<BB, OO>(M, mc, xm, K, G, group, cb, sb, ob, xs, a.z, res);  // as run: qlinear's bits
        std::memcpy(exact.data() + (c * M + m0) * L, res, mc * L * sizeof(float));
        m0 += mc;
      }
    });
  });
  // The first maximum in row order (torch.argmax's choice among equal values; a NaN is a maximum, as there).
  for (int64_t m = 0; m < M; ++m) {
    int64_t arg = -1;
    float v = 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t b = blocks[c], rows = std::min<int64_t>(L, N - b * L);
      for (int64_t i = 0; i < rows; ++i) {
        const float e = exact[(c * M + m) * L + i];
        if (arg < 0 || (!std::isnan(v) && (e > v || std::isnan(e)))) {
          arg = b * L + i;
          v = e;
        }
      }
    }
    ids[m] = arg;
  }
  return C;
}

// ---- the LM head screen's bound table (selfspec/quant/screen.py): each row's sum of |w| over each group -------------
namespace {

template <int BITS, bool OFF>
void group_l1(const uint8_t* codes, Scales sc, Scales of, int64_t NB, int64_t G, int64_t g, float z, float* out) {
  const vf zv = bcast(z);
#pragma omp parallel
  {
    std::vector<float> w(g * L);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < NB; ++b)
      for (int64_t j = 0; j < G; ++j) {
        group_t<BITS, OFF>(codes, sc, of, G, g, zv, b, j, w.data(), L);  // w[k][r]: the weights qdequant gives
        float acc[L] = {};
        for (int64_t k = 0; k < g; ++k)
          for (int r = 0; r < L; ++r) acc[r] += std::fabs(w[k * L + r]);  // in order of k, as a row's sum
        std::memcpy(out + (b * G + j) * L, acc, sizeof acc);
      }
  }
}

}  // namespace

// out [NB, G, 16] float32: out[b, j, r] = sum over the group's columns k of |w| of output row 16 b + r (padding rows
// of a last block: their codes and scales give 0). The bound table of ``ScreenedArgmax`` from the packed weight in
// one pass, instead of dequantizing every row to float32 and summing it apart.
at::Tensor qgroup_l1(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                        double z, at::Tensor out) {
  check_packed(codes, scales, offsets, bits, group);
  const int64_t NB = codes.size(0), G = codes.size(1);
  TORCH_CHECK(out.dim() == 3 && out.size(0) == NB && out.size(1) == G && out.size(2) == L && out.is_contiguous() &&
                  out.scalar_type() == at::kFloat,
              "out: [NB, G, 16] float32 contiguous");
  const bool off = offsets.numel() > 0;
  dispatch(bits, off, [&](auto B, auto O) {
    group_l1<decltype(B)::value, decltype(O)::value>(codes.data_ptr<uint8_t>(), sc_of(scales), sc_of(offsets), NB, G,
                                                     group, (float)z, out.data_ptr<float>());
  });
  return out;
}
