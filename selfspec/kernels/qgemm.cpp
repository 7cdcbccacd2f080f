// selfspec's prefill kernel for GGUF block-quantized weights (qgemm; the packed layout: qcodes.h): many rows of x
// against panels of the weight dequantized once.
//
// The decoding kernel (qlinear.cpp's run) decodes every weight again for each tile of <= 8 x-rows; a prefill of
// hundreds of rows is then bound by decoding, not by multiply-adds. Here, as in a GEMM, a panel of PR output rows x KC
// columns is dequantized once into a buffer that stays in L1/L2 (the kernel's own weights: the formula of
// column_pair_weights, so gguf-py's values bit for bit) and a register tile of MR x-rows x PR outputs multiplies against
// it: per column, PV weight vectors loaded, MR broadcasts, MR * PV multiply-adds. Loop order (per call):
//     for each chunk of MB x-rows (kept in L2 across panels)
//       for each panel of PR output rows (parallel)           C[MB][PR] = 0
//         for each chunk of KC columns: dequantize W[KC][PR], then every MR x-rows of the chunk: C += x W^T
//         y = (y if accumulate) + C + bias
// Each output is one sequential float32 sum over k = 0 .. K - 1 (the partial sums live in C between column chunks),
// so its value does not depend on how many rows the call has.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include "kernels.h"
#include "qcodes.h"
#include "simd.h"

using namespace qcodes;

namespace {

constexpr int PV = 2;            // weight vectors per panel column
constexpr int PR = PV * VL;      // output rows per panel: 32 on AVX-512 (two 16-row blocks), 16 on AVX2 (one block)
constexpr int PB = PR / L;       // 16-row blocks per panel
constexpr int MR = VL == 16 ? 12 : 6;  // x-rows per register tile: MR * PV sums (24 of 32 zmm; 12 of 16 ymm)
constexpr int64_t MB = 240;      // x-rows per chunk (a multiple of MR)
constexpr int64_t KC = 256;      // columns per panel chunk: 32 KB of float32 weights (AVX-512), in L1 / L2

struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;
inline Buffer aligned_floats(int64_t n) {  // 64-byte aligned: a vector load never straddles two cache lines
  return Buffer(static_cast<float*>(std::aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64)));
}

// x-rows packed per register tile (``pack_tiles``): a tile of R rows as [K][R], so its R broadcasts of column k are
// R consecutive floats and the tile reads one sequential stream instead of R rows K floats apart. Unpacked (R streams
// kilobytes apart through L2), the 12-row tile waits on L2 and stays well below its two FMA ports' rate, and below
// MKL's GEMM at a prefill's shapes. Same multiply-adds in the same order: the same bits.
template <int R>
inline void gemm_tile(const float* __restrict xp, const float* __restrict w, int64_t kc,
                      float* __restrict c) {  // c[R][PR] += xp[kc][R]^T @ w[kc][PR]
  vf acc[R][PV];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < PV; ++v) acc[m][v] = loadf(c + m * PR + v * VL);
  for (int64_t k = 0; k < kc; ++k) {
    vf wv[PV];
    for (int v = 0; v < PV; ++v) wv[v] = loadf(w + k * PR + v * VL);
    for (int m = 0; m < R; ++m) {
      const vf xb = bcast(xp[k * R + m]);
      for (int v = 0; v < PV; ++v) acc[m][v] = fma(wv[v], xb, acc[m][v]);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < PV; ++v) std::memcpy(c + m * PR + v * VL, &acc[m][v], sizeof(vf));
}

// How a chunk's mb x-rows are cut into register tiles: tiles of R rows, the rest in tiles of R - 1, ...; f(tile, m) for
// each, ``tile`` an std::integral_constant holding its row count, m its first row. Packing and multiplying both walk
// it, so the tile holding row m starts at xp + m * K in the packed chunk.
template <int R, typename F>
inline void for_tiles(int64_t mb, const F& f, int64_t m = 0) {
  for (; m + R <= mb; m += R) f(std::integral_constant<int, R>{}, m);
  if constexpr (R > 1) {
    if (m < mb) for_tiles<R - 1>(mb, f, m);
  }
}

// Rows [0, mb) of x [mb][K] packed per tile, each tile of R rows as [K][R].
inline void pack_tiles(const float* __restrict x, int64_t K, int64_t mb, float* __restrict xp) {
  for_tiles<MR>(mb, [&](auto tile, int64_t m) {
    constexpr int R = decltype(tile)::value;
    for (int64_t k = 0; k < K; ++k)
      for (int r = 0; r < R; ++r) xp[m * K + k * R + r] = x[(m + r) * K + k];
  });
}

// c[mb][PR] += the packed chunk's columns [k0, k0 + kc) @ w[kc][PR], tile by tile.
inline void gemm_rows(const float* xp, int64_t K, int64_t k0, const float* w, int64_t kc, float* c, int64_t mb) {
  for_tiles<MR>(mb, [&](auto tile, int64_t m) {
    constexpr int R = decltype(tile)::value;
    gemm_tile<R>(xp + m * K + k0 * R, w, kc, c + m * PR);
  });
}

// Columns [k0, k0 + kc) of blocks [b, b + PB) dequantized into w[kc][PR] (blocks past NB are zeros).
template <int BITS, bool OFF>
void panel(const uint8_t* codes, Scales sc, Scales of, int64_t NB, int64_t G, int64_t g, float z,
           int64_t b, int64_t k0, int64_t kc, float* w) {
  const vf zv = bcast(z);
  for (int pb = 0; pb < PB; ++pb) {
    const int64_t bb = b + pb;
    if (bb >= NB) {
      for (int64_t k = 0; k < kc; ++k) std::memset(w + k * PR + pb * L, 0, L * sizeof(float));
      continue;
    }
    for (int64_t j = k0 / g; j < (k0 + kc) / g; ++j)
      group_t<BITS, OFF>(codes, sc, of, G, g, zv, bb, j, w + (j * g - k0) * PR + pb * L, PR);
  }
}

template <int BITS, bool OFF>
void run_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, Scales sc, Scales of,
              int64_t NB, int64_t G, int64_t g, float z, const float* bias, float* y, int64_t ldy, int64_t N,
              bool accumulate) {
  const int64_t NP = (NB + PB - 1) / PB;
  const int64_t kcs = std::max<int64_t>(g, KC / g * g);  // a whole number of groups
  // The chunk's x-rows packed per register tile (pack_tiles). (Before packing they were copied with a padded stride:
  // with K a multiple of 1024 a tile's 12 rows fell into one L1 set.)
  Buffer xs = aligned_floats(std::min<int64_t>(MB, M) * K);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min<int64_t>(MB, M - m0);
    pack_tiles(x + m0 * K, K, mb, xs.get());
#pragma omp parallel
    {
      Buffer w = aligned_floats(kcs * PR), c = aligned_floats(MB * PR);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < NP; ++p) {
        std::memset(c.get(), 0, mb * PR * sizeof(float));
        for (int64_t k0 = 0; k0 < K; k0 += kcs) {
          const int64_t kc = std::min<int64_t>(kcs, K - k0);
          panel<BITS, OFF>(codes, sc, of, NB, G, g, z, p * PB, k0, kc, w.get());
          gemm_rows(xs.get(), K, k0, w.get(), kc, c.get(), mb);
        }
        const int64_t n0 = p * PR, rows = std::min<int64_t>(PR, N - n0);
        for (int64_t m = 0; m < mb; ++m) {
          float* yr = y + (m0 + m) * ldy + n0;
          const float* cr = c.get() + m * PR;
          for (int64_t r = 0; r < rows; ++r) {
            const float v = cr[r] + (bias ? bias[n0 + r] : 0.f);
            yr[r] = accumulate ? yr[r] + v : v;
          }
        }
      }
    }
  }
}

}  // namespace

// As qlinear, for many rows of x (a prefill): panels of the weight dequantized once per chunk of x-rows.
at::Tensor qgemm(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                    int64_t group, double z, at::Tensor bias, at::Tensor out, bool accumulate) {
  const LinearArgs a = linear_args(x, codes, scales, offsets, bits, group, z, bias, out);
  dispatch(bits, a.off, [&](auto B, auto O) {
    run_gemm<decltype(B)::value, decltype(O)::value>(x.data_ptr<float>(), a.M, a.K, a.codes, a.scales, a.offsets,
                                                     a.NB, a.G, group, a.z, a.bias, a.y, a.ldy, a.N, accumulate);
  });
  return out;
}
