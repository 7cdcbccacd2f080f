// selfspec's decoding kernel for GGUF block-quantized weights (qlinear): y[M, N] = x[M, K] @ W[N, K]^T (+ bias)
// (+= y) with float32 activations, each weight dequantized in registers from its code (qcodes.h has the packed
// layout and why the weights are the dequantized model's bit for bit). step.cpp's compiled layers call it raw.
//
// Each column's 16 weights are one vector, so a tile of MC x-rows keeps MC accumulators of 16 outputs,
// one broadcast multiply-add per x-row and column, and no horizontal sums (as gemv.cpp).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "qcodes.h"
#include "simd.h"

using namespace qcodes;

namespace {

// AVX2, 3-4 x-rows: both halves' weights decoded first, then each x-row's two broadcasts feed all four of its
// multiply-adds. Row by row inside each half (below) the compiler kept every row's broadcasts live across the halves
// and spilled at 4 rows (8 sums): a block of 4 cost a block of 3 plus a single row. Same sums in the same order.
template <int BITS, int MC>
inline void column_pair_madd(const uint8_t* __restrict cg, int64_t g, int k, const vf* s, const vf* c, vf zv,
                             const float* __restrict xj, int64_t ldx, vf (*a)[NV], vf (*b)[NV]) {
  if constexpr (VL == 8 && MC >= 3) {
    vf w0[NV], w1[NV];
    for (int h = 0; h < NV; ++h) column_pair_weights<BITS>(cg, g, k, h, s[h], c[h], zv, w0[h], w1[h]);
    for (int m = 0; m < MC; ++m) {
      const vf x0 = bcast(xj[m * ldx + k]), x1 = bcast(xj[m * ldx + k + 1]);
      for (int h = 0; h < NV; ++h) {
        a[m][h] = fma(w0[h], x0, a[m][h]);
        b[m][h] = fma(w1[h], x1, b[m][h]);
      }
    }
    return;
  }
  for (int h = 0; h < NV; ++h) {
    vf w0, w1;
    column_pair_weights<BITS>(cg, g, k, h, s[h], c[h], zv, w0, w1);
    for (int m = 0; m < MC; ++m) {
      a[m][h] = fma(w0, bcast(xj[m * ldx + k]), a[m][h]);
      b[m][h] = fma(w1, bcast(xj[m * ldx + k + 1]), b[m][h]);
    }
  }
}

// AVX2, 5-8 x-rows: one half of the block (8 output rows) at a time, so that each decoded column feeds MC rows with
// MC accumulators live instead of 2 MC (16 registers in all). Each (row, half) sums over (j, k) in the order of the
// one-sum tile, so the results are bit for bit those of two 4-row tiles. Not inlined into run: inlined, it changes
// how the compiler builds the 2-row tile, for the worse.
template <int BITS, bool OFF, int MC>
__attribute__((noinline)) void tile_halves(const float* __restrict x, int64_t ldx, int64_t G, int64_t g,
                                           const uint8_t* __restrict codes, Sc sc, Sc of, float z, float* __restrict res) {
  const vf zv = bcast(z);
  const int64_t CB = group_bytes(BITS, g);
  for (int h = 0; h < NV; ++h) {
    vf a[MC];
    for (int m = 0; m < MC; ++m) a[m] = vf{};
    for (int64_t j = 0; j < G; ++j) {
      const vf s = sc.vec(j * L + VL * h);
      const vf c = OFF ? of.vec(j * L + VL * h) : zv * s;
      const uint8_t* cg = codes + j * CB;
      const float* xj = x + j * g;
      for (int k = 0; k < g; k += 2) {
        vf w0, w1;
        column_pair_weights<BITS>(cg, g, k, h, s, c, zv, w0, w1);
        for (int m = 0; m < MC; ++m) {
          a[m] = fma(w0, bcast(xj[m * ldx + k]), a[m]);
          a[m] = fma(w1, bcast(xj[m * ldx + k + 1]), a[m]);
        }
      }
    }
    for (int m = 0; m < MC; ++m) std::memcpy(res + m * L + VL * h, &a[m], sizeof(vf));
  }
}

#if defined(__AVX512F__)
// Codes on AVX-512, where decoding is most of a decoding step's work (one x-row reads each weight once): a 4-bit
// code's value q - z comes from a 16-entry table by one permute of its nibble (exact: a small integer), a 5-bit
// code's from a 32-entry table by one two-source permute of its word shifted, a byte's (Q8_0, Q6_K; z = 128) by
// flipping its top bit and reading it as signed; the value is multiplied into the x-row's sum of its group, and the
// group's sum is scaled once:
//     sum_k w_k x_k = s * sum_k (q_k - z) x_k              (w = (q - z) * s: Q4_0, Q5_0, Q8_0, Q6_K)
//     sum_k w_k x_k = s * sum_k q_k x_k  -  o * sum_k x_k  (w = q * s - o: the offset types; xsum = sum_k x_k)
// so a column costs a permute (or a conversion) and a multiply-add per row instead of a conversion, a
// multiply-subtract (the weight) and the multiply-add. The weights are the dequantized ones; the rounding is
// that of a float32 dot product reassociated: for the zero-point types the products keep the weight's sign (no
// cancellation; measured error against a float64 product 4e-8 of sum |w x|, half the decoding path's; Q8_0's LM
// head 6e-8 at most, 1.7e-7 by its weights), for the offset types the two terms may cancel (measured in
// docs/QUANTIZED.md, with the timings).
template <int BITS, bool OFF, int MC>
inline void tile_lookup(const float* __restrict x, int64_t ldx, int64_t G, int64_t g,
                        const uint8_t* __restrict codes, Sc sc, Sc of,
                        const float* __restrict xsum, float z, float* __restrict res) {
  static_assert(BITS == 4 || BITS == 5 || (BITS == 8 && !OFF), "4- or 5-bit codes, or bytes with z = 128");
  alignas(64) float t[32];
  for (int i = 0; i < 32; ++i) t[i] = (float)i - z;
  const __m512 table = _mm512_load_ps(t), table_hi = _mm512_load_ps(t + 16);
  // float(q - z) for a nibble q: vpermps reads only the low four bits of each index, so q needs no mask; for a
  // 5-bit code vpermt2ps reads the low five (the other codes of its word above them are ignored)
  const auto value = [&](vi q) -> vf { return (vf)_mm512_permutexvar_ps((__m512i)q, table); };
  const auto value5 = [&](vu q) -> vf { return (vf)_mm512_permutex2var_ps(table, (__m512i)q, table_hi); };
  const int gk = BITS == 5 ? 32 : (int)g;  // 5-bit codes come in groups of 32 (check_packed): loops unroll
  vf acc[MC];
  for (int m = 0; m < MC; ++m) acc[m] = vf{};
  const int64_t CB = group_bytes(BITS, g);
  for (int64_t j = 0; j < G; ++j) {
    prefetch_group<OFF>(codes, CB, sc, of, j);
    const uint8_t* cg = codes + j * CB;
    const float* xj = x + j * g;
    // partial sums per row, so that the multiply-adds do not wait on each other, while registers last: four for 1-3
    // rows, two for 4-7, one for 8: at each row count the number that times best in a whole step (four at 4 rows
    // does not)
    constexpr int NP = MC <= 3 ? 4 : MC < 8 ? 2 : 1;
    vf p[NP][MC];
    for (int i = 0; i < NP; ++i)
      for (int m = 0; m < MC; ++m) p[i][m] = vf{};
    vu W[5], S{};  // 5-bit codes: the group's five words (16 rows each) and their spare bits
    if constexpr (BITS == 5) S = words5(cg, W);
    const auto pair = [&](int k, vf* a, vf* b) {  // columns k, k + 1 into the sums a, b
      vf v0, v1;
      if constexpr (BITS == 5) {  // k even: k and k + 1 share a word, or are S's two codes
        const vu q = k < 30 ? (k % 6 ? W[k / 6] >> (5 * (k % 6)) : W[k / 6]) : S;
        v0 = value5(q);
        v1 = value5(q >> 5);
      } else if constexpr (BITS == 8) {  // q - 128 = the byte with its top bit flipped, read as signed (z is 128)
        const __m128i flip = _mm_set1_epi8(-128);
        const __m128i b0 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(cg + k * L)), flip);
        const __m128i b1 = _mm_xor_si128(_mm_loadu_si128((const __m128i*)(cg + (k + 1) * L)), flip);
        v0 = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0));
        v1 = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1));
      } else {
        const vi q = widen(cg + k * 8);  // byte r: column k's code in the low nibble, column k + 1's in the high
        v0 = value(q);
        v1 = value(q >> 4);
      }
      for (int m = 0; m < MC; ++m) {
        a[m] = fma(v0, bcast(xj[m * ldx + k]), a[m]);
        b[m] = fma(v1, bcast(xj[m * ldx + k + 1]), b[m]);
      }
    };
    if constexpr (NP == 4) {
#pragma GCC unroll 8
      for (int k = 0; k < gk; k += 4) {
        pair(k, p[0], p[1]);
        pair(k + 2, p[2], p[NP - 1]);
      }
    } else {
#pragma GCC unroll 16
      for (int k = 0; k < gk; k += 2) pair(k, p[0], p[NP - 1]);
    }
    const vf s = sc.vec(j * L);
    for (int m = 0; m < MC; ++m) {
      vf t = p[0][m];
      if constexpr (NP == 4) t = (p[0][m] + p[1][m]) + (p[2][m] + p[NP - 1][m]);
      else if constexpr (NP == 2) t = p[0][m] + p[NP - 1][m];
      acc[m] = fma(t, s, acc[m]);
      if constexpr (OFF) acc[m] = fma(-of.vec(j * L), bcast(xsum[m * G + j]), acc[m]);
    }
  }
  for (int m = 0; m < MC; ++m) std::memcpy(res + m * L, &acc[m], sizeof(vf));
}
#endif

// MC rows of x (row stride ldx) against one block of 16 output rows: res[MC][16]. Each x-row keeps four
// (one row), two (up to 7 rows on AVX-512, 2 on AVX2) or one partial sum per vector, so that for few rows the
// multiply-adds do not wait on each other. xsum # [MC, G]: each x-row's group sums (the offset types' table path).
template <int BITS, bool OFF, int MC>
inline void tile(const float* __restrict x, int64_t ldx, int64_t G, int64_t g, const uint8_t* __restrict codes,
                 Sc sc, Sc of, const float* __restrict xsum, float z,
                 float* __restrict res) {
  if constexpr (VL == 8 && MC >= 5) {
    tile_halves<BITS, OFF, MC>(x, ldx, G, g, codes, sc, of, z, res);
    return;
  }
#if defined(__AVX512F__)
  if constexpr (LOOKUP<BITS, OFF>) {
    tile_lookup<BITS, OFF, MC>(x, ldx, G, g, codes, sc, of, xsum, z, res);
    return;
  }
#else
  (void)xsum;
#endif
  vf a0[MC][NV], a1[MC][NV], a2[MC][NV], a3[MC][NV];
  for (int m = 0; m < MC; ++m)
    for (int h = 0; h < NV; ++h) a0[m][h] = a1[m][h] = a2[m][h] = a3[m][h] = vf{};
  const vf zv = bcast(z);
  const int64_t CB = group_bytes(BITS, g);
  for (int64_t j = 0; j < G; ++j) {
    prefetch_group<OFF>(codes, CB, sc, of, j);
    vf s[NV], c[NV];
    for (int h = 0; h < NV; ++h) {
      s[h] = sc.vec(j * L + VL * h);
      c[h] = OFF ? of.vec(j * L + VL * h) : zv * s[h];
    }
    const uint8_t* cg = codes + j * CB;
    const float* xj = x + j * g;
    if constexpr (MC == 1) {
      for (int k = 0; k < g; k += 4) {
        column_pair_madd<BITS, MC>(cg, g, k, s, c, zv, xj, ldx, a0, a1);
        column_pair_madd<BITS, MC>(cg, g, k + 2, s, c, zv, xj, ldx, a2, a3);
      }
    } else if constexpr ((VL == 16 && MC < 8) || (VL == 8 && MC <= 2)) {  // two sums per row while registers last
      for (int k = 0; k < g; k += 2) column_pair_madd<BITS, MC>(cg, g, k, s, c, zv, xj, ldx, a0, a1);
    } else {
      for (int k = 0; k < g; k += 2) column_pair_madd<BITS, MC>(cg, g, k, s, c, zv, xj, ldx, a0, a0);
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int h = 0; h < NV; ++h) {
      const vf t = (a0[m][h] + a1[m][h]) + (a2[m][h] + a3[m][h]);
      std::memcpy(res + m * L + VL * h, &t, sizeof(vf));
    }
}

}  // namespace

namespace qcodes {

// mc <= MCMAX x-rows against one block: the tile run (qlinear) and qargmax both take, so a row's arithmetic is the
// same in both (its tile's size decides its partial sums).
template <int BITS, bool OFF>
void tile_rows(int64_t call_rows, int64_t mc, const float* xm, int64_t K, int64_t G, int64_t g, const uint8_t* cb,
               Sc sb, Sc ob, const float* xs, float z, float* res) {
  if constexpr (AMX_CODES<BITS>) {
    if (amx_takes<BITS>(g, call_rows)) {
      thread_local std::vector<uint16_t> a;
      a.resize(amx_width(g) * mc * K);
      amx_limbs(xm, mc, K, K, g, BITS == 4, a.data());
      amx_config(mc);
      amx_rows<BITS, OFF>(mc, a.data(), K, G, cb, sb, ob, xs, z, res);
      amx_release();
      return;
    }
  }
  switch (mc) {
    case 1: tile<BITS, OFF, 1>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 2: tile<BITS, OFF, 2>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 3: tile<BITS, OFF, 3>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 4: tile<BITS, OFF, 4>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 5: tile<BITS, OFF, 5>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 6: tile<BITS, OFF, 6>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    case 7: tile<BITS, OFF, 7>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
    default: tile<BITS, OFF, MCMAX>(xm, K, G, g, cb, sb, ob, xs, z, res); break;
  }
}

// The instantiations qargmax.cpp calls: every code width, with and without offsets (dispatch's cases).
#define SELFSPEC_INSTANTIATE(BITS, OFF)                                                                         \
  template void tile_rows<BITS, OFF>(int64_t, int64_t, const float*, int64_t, int64_t, int64_t, const uint8_t*, Sc, Sc, \
                                     const float*, float, float*);
SELFSPEC_EACH_CODE(SELFSPEC_INSTANTIATE)
#undef SELFSPEC_INSTANTIATE

}  // namespace qcodes

namespace {

// More x-rows than a tile (a prefill): in chunks of rows whose limbs stay in L2, each block's B tiles decoded once a
// chunk and shared by its tiles of rows. A row's arithmetic is amx_rows' (the same tiles in the same order).
template <int BITS, bool OFF>
void run_amx_chunks(const float* x, const std::vector<float>& xsum, int64_t M, int64_t K, const uint8_t* codes,
                    Scales sc, Scales of, int64_t NB, int64_t G, int64_t CB, float z, const float* bias, float* y,
                    int64_t ldy, int64_t N, bool accumulate) {
  const int64_t W = amx_width(K / G);
  const int64_t chunk = std::max<int64_t>(AMX_ROWS, AMX_CHUNK_BYTES / (2 * W * K) / AMX_ROWS * AMX_ROWS);
  thread_local std::vector<uint16_t> limbs;  // one chunk's (kept between calls: a prefill makes hundreds)
  limbs.resize(W * std::min(M, chunk) * K);
  uint16_t* a = limbs.data();
#pragma omp parallel
  {
    float res[2][AMX_ROWS * L];
    thread_local std::vector<uint16_t> bdec;  // a pair of blocks' B tiles (kept: fresh pages cost their zeroing)
    bdec.resize(std::max<size_t>(bdec.size(), 2 * G * 16 * 32 + 32));
    uint16_t* bp = (uint16_t*)(((uintptr_t)bdec.data() + 63) & ~(uintptr_t)63);
    uint16_t* bq = bp + G * 16 * 32;
    int64_t configured = 0;
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
#pragma omp for schedule(static)
      for (int64_t t = c0; t < c1; t += AMX_ROWS)  // the chunk's limbs, a tile of rows at a time
        amx_limbs(x + t * K, std::min<int64_t>(AMX_ROWS, c1 - t), K, K, K / G, BITS == 4, a + W * (t - c0) * K);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < (NB + 1) / 2; ++p) {  // blocks in pairs: they share the limbs' tile loads
        const int64_t b = 2 * p, nb = std::min<int64_t>(2, NB - b);
        const auto [sb, ob] = block_scales(sc, of, b, G);
        const BlockSc next = nb == 2 ? block_scales(sc, of, b + 1, G, 1) : BlockSc{};
        amx_decode<BITS>(codes + b * G * CB, G, K / G, z, bp);
        if (nb == 2) amx_decode<BITS>(codes + (b + 1) * G * CB, G, K / G, z, bq);
        for (int64_t m0 = c0; m0 < c1; m0 += AMX_ROWS) {
          const int64_t mc = std::min<int64_t>(c1 - m0, AMX_ROWS);
          if (mc != configured) amx_config(configured = mc);
          const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
          const uint16_t* am = a + W * (m0 - c0) * K;
          if (nb == 2) amx_rows2_pre<BITS, OFF>(mc, am, K, G, bp, sb, ob, bq, next.s, next.o, xs, res[0], res[1]);
          else amx_rows_pre<BITS, OFF>(mc, am, K, G, bp, sb, ob, xs, res[0]);
          for (int64_t i = 0; i < nb; ++i) {
            const int64_t bi = b + i, rows = std::min<int64_t>(L, N - bi * L);
            store_tile(res[i], mc, y + m0 * ldy + bi * L, ldy, rows, bias ? bias + bi * L : nullptr, accumulate);
          }
        }
      }
    }
    if (configured) amx_release();
  }
}

// run on AMX tiles (amx_takes): the x-rows' limbs made once, then each block's rows in calls of up to AMX_ROWS.
template <int BITS, bool OFF>
void run_amx(const float* x, int64_t M, int64_t K, const uint8_t* codes, Scales sc, Scales of, int64_t NB,
             int64_t G, int64_t g, float z, const float* bias, float* y, int64_t ldy, int64_t N, bool accumulate) {
  const int64_t CB = group_bytes(BITS, g);
  const std::vector<float> xsum = group_sums<BITS, OFF>(x, M, G, g);
  if (M > AMX_ROWS) {
    run_amx_chunks<BITS, OFF>(x, xsum, M, K, codes, sc, of, NB, G, CB, z, bias, y, ldy, N, accumulate);
    return;
  }
  std::vector<uint16_t> a(amx_width(g) * M * K);
  amx_limbs(x, M, K, K, g, BITS == 4, a.data());
#pragma omp parallel
  {
    float res[2][AMX_ROWS * L];
    int64_t configured = 0;
    // blocks in pairs (they share the limbs' tile loads) while each block's accumulators fit the registers
    const int64_t per = M <= AMX_PAIR_ROWS ? 2 : 1;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < (NB + per - 1) / per; ++p) {
      const int64_t b = p * per, nb = std::min<int64_t>(per, NB - b);
      const uint8_t* cb = codes + b * G * CB;
      const auto [sb, ob] = block_scales(sc, of, b, G);
      const BlockSc next = nb == 2 ? block_scales(sc, of, b + 1, G, 1) : BlockSc{};
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t mc = std::min<int64_t>(M - m0, AMX_ROWS);
        if (mc != configured) amx_config(configured = mc);
        const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
        const uint16_t* am = a.data() + amx_width(g) * m0 * K;
        if (nb == 2) {
          amx_rows2<BITS, OFF>(mc, am, K, G, cb, sb, ob, cb + G * CB, next.s, next.o, xs, z, res[0], res[1]);
        } else {
          amx_rows<BITS, OFF>(mc, am, K, G, cb, sb, ob, xs, z, res[0]);
        }
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t bi = b + i, rows = std::min<int64_t>(L, N - bi * L);
          store_tile(res[i], mc, y + m0 * ldy + bi * L, ldy, rows, bias ? bias + bi * L : nullptr, accumulate);
        }
        m0 += mc;
      }
    }
    if (configured) amx_release();
  }
}

template <int BITS, bool OFF>
void run(const float* x, int64_t M, int64_t K, const uint8_t* codes, Scales sc, Scales of, int64_t NB,
         int64_t G, int64_t g, float z, const float* bias, float* y, int64_t ldy, int64_t N, bool accumulate) {
  if constexpr (AMX_CODES<BITS>) {
    if (amx_takes<BITS>(g, M)) {
      run_amx<BITS, OFF>(x, M, K, codes, sc, of, NB, G, g, z, bias, y, ldy, N, accumulate);
      return;
    }
  }
  if (M > CALL_ROWS) {  // a prefill's rows in calls of CALL_ROWS (their x-rows stay in cache over the blocks)
    for (int64_t s = 0; s < M; s += CALL_ROWS)
      run<BITS, OFF>(x + s * K, std::min<int64_t>(CALL_ROWS, M - s), K, codes, sc, of, NB, G, g, z, bias,
                     y + s * ldy, ldy, N, accumulate);
    return;
  }
  const int64_t CB = group_bytes(BITS, g);
  const std::vector<float> xsum = group_sums<BITS, OFF>(x, M, G, g);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b) {
    float res[MCMAX * L];
    const uint8_t* cb = codes + b * G * CB;
    const auto [sb, ob] = block_scales(sc, of, b, G);  // K forms expanded once a block
    const int64_t rows = std::min<int64_t>(L, N - b * L);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int64_t mc = std::min<int64_t>(left, MCMAX);
      const float* xm = x + m0 * K;
      const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
      tile_rows<BITS, OFF>(M, mc, xm, K, G, g, cb, sb, ob, xs, z, res);
      store_tile(res, mc, y + m0 * ldy + b * L, ldy, rows, bias ? bias + b * L : nullptr, accumulate);
      m0 += mc;
    }
  }
}

}  // namespace

raw::QWeight raw::qweight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t bits, int64_t group, double z) {
  check_packed(codes, scales, offsets, bits, group);
  check_zero(bits, z);
  const Scales s = sc_of(scales), o = sc_of(offsets);
  return {codes.data_ptr<uint8_t>(), s.p, o.p, s.kind, s.shift, codes.size(0), codes.size(1), group, bits, (float)z};
}

void raw::qlinear(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
                  bool accumulate) {
  dispatch(w.bits, w.offsets != nullptr, [&](auto B, auto O) {
    run<decltype(B)::value, decltype(O)::value>(x, M, w.G * w.group, w.codes, scales_of(w), offsets_of(w), w.NB,
                                                w.G, w.group, w.z, bias, y, ldy, N,
                                                accumulate);
  });
}

// x [M, K] float32 contiguous; the packed weight (codes, scales, offsets, bits, group, zero point z);
// bias [N] or empty; out [M, >= N] with unit column stride (a column slice of a wider output is fine),
// written or added to. Returns out.
at::Tensor qlinear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                      int64_t group, double z, at::Tensor bias, at::Tensor out, bool accumulate) {
  const LinearArgs a = linear_args(x, codes, scales, offsets, bits, group, z, bias, out);
  raw::qlinear(x.data_ptr<float>(), a.M, weight_of(a, bits, group), a.bias, a.y, a.ldy, a.N, accumulate);
  return out;
}
