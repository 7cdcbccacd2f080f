// selfspec's CPU kernels for GGUF block-quantized weights: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+= y),
// W kept as small integer codes with a scale (and offset) per group of 16 or 32 weights, each
// weight dequantized in registers and multiplied against float32 activations.
//
// Exactness. selfspec/quant/formats.py decodes every GGUF block type into the same form
//     w = (q - z) * s - o          q: integer code, z: the type's zero point, s, o: float32 per group
// whose float32 evaluation (one multiply, one subtract) gives bit for bit the weight that gguf-py's
// dequantize (and so transformers) computes: e.g. Q4_1 is d * q + m (o = -m), Q4_K is
// (d * sc) * q - dmin * m, Q8_0 is d * (q - 128) with q = int8 + 128, Q6_K is (d * sc) * (q - 128) with
// q = q6 + 96 (its 6-bit codes kept as bytes, formats.py). Where an offset is subtracted, q * s is exact in
// float32 (a half-precision scale, or a half times a 6-bit integer, times a code of at most 5 bits), so a
// fused multiply-subtract rounds identically. The weights of the product are thus the dequantized model's;
// only the summation order differs from F.linear, as it does for the float32 kernel (gemv.cpp).
//
// Packed layout (one tensor, made once at load by selfspec/quant/weight.py):
//   codes    # [N / 16, G, CB] uint8     16 output rows (one vector of lanes) by G groups of g weights
//   scales   # [N / 16, G, 16] float32   s of each row's group (float16 for the legacy types: exact, see Sc)
//   offsets  # [N / 16, G, 16] float32   o (only for types with one; else an empty tensor), typed like scales
// Inside a group of 16 rows x g columns (k = 0 .. g-1), CB bytes:
//   bits 4: g / 2 vectors of 16 bytes, byte r of vector p = q[r][2p] | q[r][2p + 1] << 4;
//   bits 5 (g = 32), AVX-512 builds ("words"): 5 vectors of 16 32-bit words; bits 5c .. 5c + 4 of word r of
//           vector w hold q[r][6w + c] (columns 0-29), and the words' top two bits hold columns 30 and 31: with
//           S = sum_w (word_w >> 30) << 2w, q[r][30] = S & 31 and q[r][31] = S >> 5. 320 bytes, 5 bits a code;
//   bits 5, AVX2 builds ("planes"): the 4-bit layout, then one 16-bit plane per column (bit r = bit 4 of q[r][k]);
//   bits 8: g vectors of 16 bytes, byte r of vector k = q[r][k].
// Worked example, bits 5, one row: codes 1, 2, 3, 4, 5, 6 of columns 0-5 make word 0 = 1 | 2 << 5 | 3 << 10 |
// 4 << 15 | 5 << 20 | 6 << 25 (+ S's bits 0-1 << 30); a column's code is one shift (and a mask) of its word, so
// the AVX-512 path below gets its value from a 32-entry table with one two-source permute, which reads only
// the index's low five bits, and the int8 mode's bytes with one vpmultishiftqb. With planes the fifth bit
// costs a mask load and a masked add per column: ~4 vector ops a column against ~2.8 (docs/QUANTIZED.md has the
// A/B). AVX2 has neither permute, and its paths run slower on words than on planes (the int8 mode's most), so AVX2
// builds keep planes: the layout is the build's (words5(), PACK_VERSION's layout tag in the packed cache).
//
// Each column's 16 weights are one vector, so a tile of MC x-rows keeps MC accumulators of 16 outputs,
// one broadcast multiply-add per x-row and column, and no horizontal sums (as gemv.cpp).

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using simd::bcast;
using simd::fma;
using simd::loadf;
using simd::vf;
// lanes per vector (simd.h): on AVX-512 a block's 16 rows are one register, on AVX2 two (halves h = 0, 1)
using simd::VL;

constexpr int L = 16;  // output rows per block
constexpr int MCMAX = 8;   // x-rows per tile (not 16 on AVX-512: 16 row pointers spill; AVX2: tile_halves)
constexpr int NV = L / VL;  // vectors per block row
typedef int32_t vi __attribute__((vector_size(VL * 4)));

inline vi widen(const uint8_t* p) {  // VL bytes -> VL int32 (vpmovzxbd; GCC's generic conversion inserts bytewise)
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
#else
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
}

// A packed weight's scales (or offsets), 16 per group: float32, or float16 where every value is exact in it (the
// legacy types' d and m are float16 in the GGUF: their packed copy keeps them so, 2 bytes a value instead of 4;
// selfspec/quant/weight.py). Widening a half to float32 is exact, so the weights are the same either way; the flag is
// per weight and checked per group (a predictable branch beside a group's 16-32 columns of work).
struct Sc {
  const void* p = nullptr;
  bool half = false;
  const char* addr(int64_t i) const { return (const char*)p + i * (half ? 2 : 4); }  // of value i
  Sc operator+(int64_t i) const { return {p ? addr(i) : nullptr, half}; }
  vf vec(int64_t i) const {  // VL values from value i
    if (half) {
#if defined(__AVX512F__)
      return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i)));
#else
      return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)p + i)));
#endif
    }
    return loadf((const float*)p + i);
  }
  float at(int64_t i) const { return half ? _cvtsh_ss(((const uint16_t*)p)[i]) : ((const float*)p)[i]; }
};

#if defined(__AVX512F__)
constexpr bool WORDS5 = true;  // 5-bit codes as words (the layout above)
#else
constexpr bool WORDS5 = false;  // 5-bit codes as nibbles and planes
// AVX2 has no masked add: the 8 lanes of a half get a plane's bits from a table, one row per byte value (lane r of
// row b holds ADD where bit r of b is set, else 0), so a plane costs one add with its load folded in instead of a
// broadcast, a lane-bit test and a mask (8 KB per table, L1-resident).
template <int32_t ADD>
struct PlaneTable {
  alignas(32) int32_t v[256][VL];
  PlaneTable() {
    for (int b = 0; b < 256; ++b)
      for (int r = 0; r < VL; ++r) v[b][r] = (b >> r & 1) ? ADD : 0;
  }
};
const PlaneTable<16> plane16;

// q plus 16 in the lanes (of half h) whose bit is set in the 16-bit plane of column k (one table row).
inline vi add_plane(vi q, const uint8_t* planes, int k, int h) {
  const int32_t* row = plane16.v[planes[2 * k + h]];  // byte h: lanes 8h .. 8h + 7
  vi t;
  std::memcpy(&t, row, sizeof t);
  return q + t;
}
#endif

// 5-bit codes as words (AVX-512 builds, so one vector holds a word's 16 rows): word w of a group, all five words
// with their spare bits S (columns 30 and 31, returned), one row's code of column k.
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
inline vu word5(const uint8_t* cg, int w) {
  vu v;
  std::memcpy(&v, cg + w * L * 4, sizeof v);
  return v;
}
inline vu words5(const uint8_t* cg, vu* W) {
  for (int w = 0; w < 5; ++w) W[w] = word5(cg, w);
  vu S = W[4] >> 30;
  for (int w = 3; w >= 0; --w) {
#if defined(__AVX512VBMI2__)
    S = (vu)_mm512_shldi_epi32((__m512i)S, (__m512i)W[w], 2);  // (S << 2) | (W[w] >> 30)
#else
    S = (S << 2) | (W[w] >> 30);
#endif
  }
  return S;
}
inline int32_t code5_at(const uint8_t* cg, int64_t k, int64_t lane) {  // one row's code (qdequant)
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

inline int64_t group_bytes(int bits, int64_t g) {
  return bits == 8 ? g * L : bits == 5 ? g * 10 : g * 8;
}

// Group j + AHEAD's codes, scales (and offsets) on their way to L1 while group j is computed (past the block's last
// group: the next block's first, which this thread computes next): one row's kernel streams them, and the hardware
// prefetcher alone leaves it short of the bandwidth. 32 groups ahead (8 KB of 4-bit codes), not a few: a block of
// several rows, whose multiply-adds take longer per byte, still waits on memory with a short distance, and 8 KB
// stays well inside L1 (docs/QUANTIZED.md, "Prefetch distance").
constexpr int64_t AHEAD = 32;
template <bool OFF>
inline void prefetch_group(const uint8_t* codes, int64_t CB, Sc sc, Sc of, int64_t j) {
  for (int64_t o = 0; o < CB; o += 64) _mm_prefetch((const char*)(codes + (j + AHEAD) * CB + o), _MM_HINT_T0);
  _mm_prefetch(sc.addr((j + AHEAD) * L), _MM_HINT_T0);
  if constexpr (OFF) _mm_prefetch(of.addr((j + AHEAD) * L), _MM_HINT_T0);
}

// The codes of columns k and k + 1 of one group (k even), lanes [VL h, VL h + VL).
template <int BITS>
inline void column_pair(const uint8_t* c, int64_t g, int k, int h, vi& q0, vi& q1) {
  (void)g;
  if constexpr (BITS == 8) {
    q0 = widen(c + k * L + VL * h);
    q1 = widen(c + (k + 1) * L + VL * h);
  } else if constexpr (BITS == 5 && WORDS5) {  // k even: k and k + 1 share a word (or are S's two codes); h is 0
    vu W[5];
    const vu v = k < 30 ? word5(c, k / 6) >> (5 * (k % 6)) : words5(c, W);
    q0 = (vi)(v & 31);
    q1 = (vi)((v >> 5) & 31);
  } else {
    const vi q = widen(c + k * 8 + VL * h);
    q0 = q & 15;
    q1 = q >> 4;
#if !defined(__AVX512F__)
    if constexpr (BITS == 5) {
      q0 = add_plane(q0, c + g * 8, k, h);
      q1 = add_plane(q1, c + g * 8, k + 1, h);
    }
#endif
  }
}

// The weights of columns k, k + 1 of one group (16 rows each), multiplied into MC x-rows' sums a and b.
// c = o, or z * s (exact: z is a power of two); w = q * s - c in one rounding, which is the two-step value
// since q * s is exact for these types; 8-bit codes keep (q - z) * s (Q6_K's bytes times d * sc may round).
template <int BITS>
inline void column_pair_weights(const uint8_t* __restrict cg, int64_t g, int k, int h, vf s, vf c, vf zv, vf& w0,
                                vf& w1) {
  vi q0, q1;
  column_pair<BITS>(cg, g, k, h, q0, q1);
  if constexpr (BITS == 8) {
    w0 = (__builtin_convertvector(q0, vf) - zv) * s;
    w1 = (__builtin_convertvector(q1, vf) - zv) * s;
  } else {
    w0 = fma(__builtin_convertvector(q0, vf), s, -c);
    w1 = fma(__builtin_convertvector(q1, vf), s, -c);
  }
}

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

// Whether a type's codes take the group-sum path (tile_lookup: AVX-512; 4- and 5-bit codes, bytes without offsets).
template <int BITS, bool OFF>
constexpr bool LOOKUP = VL == 16 && (BITS == 4 || BITS == 5 || (BITS == 8 && !OFF));

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

// [M, G] each x-row's group sums, for the offset types' table path (tile_lookup); empty for the other types.
template <int BITS, bool OFF>
std::vector<float> group_sums(const float* x, int64_t M, int64_t G, int64_t g) {
  std::vector<float> xsum;
  if constexpr (OFF && LOOKUP<BITS, OFF>) {
    xsum.resize(M * G);
    for (int64_t i = 0; i < M * G; ++i) {
      float t = 0.f;
      for (int64_t k = 0; k < g; ++k) t += x[i * g + k];
      xsum[i] = t;
    }
  }
  return xsum;
}

// mc <= MCMAX x-rows against one block: the tile run (qlinear) and qargmax both take, so a row's arithmetic is the
// same in both (its tile's size decides its partial sums).
template <int BITS, bool OFF>
inline void tile_rows(int64_t mc, const float* xm, int64_t K, int64_t G, int64_t g, const uint8_t* cb, Sc sb, Sc ob,
                      const float* xs, float z, float* res) {
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

// res[mc][16] (+ bias) into y's rows (stride ldy), the first ``rows`` columns of the block, or added to them.
inline void store_tile(const float* res, int64_t mc, float* y, int64_t ldy, int64_t rows, const float* bias,
                       bool accumulate) {
  for (int64_t m = 0; m < mc; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = res[m * L + r] + (bias ? bias[r] : 0.f);
      y[m * ldy + r] = accumulate ? y[m * ldy + r] + v : v;
    }
}

// f(bits, has offsets) with both as compile-time constants (std::integral_constant), for the kernels' templates.
template <typename F>
void dispatch(int64_t bits, bool off, F&& f) {
  using std::false_type, std::true_type;
  using B4 = std::integral_constant<int, 4>;
  using B5 = std::integral_constant<int, 5>;
  using B8 = std::integral_constant<int, 8>;
  switch (bits * 2 + (off ? 1 : 0)) {
    case 8: f(B4{}, false_type{}); break;
    case 9: f(B4{}, true_type{}); break;
    case 10: f(B5{}, false_type{}); break;
    case 11: f(B5{}, true_type{}); break;
    case 16: f(B8{}, false_type{}); break;
    default: f(B8{}, true_type{}); break;
  }
}

template <int BITS, bool OFF>
void run(const float* x, int64_t M, int64_t K, const uint8_t* codes, Sc sc, Sc of, int64_t NB,
         int64_t G, int64_t g, float z, const float* bias, float* y, int64_t ldy, int64_t N, bool accumulate) {
  const int64_t CB = group_bytes(BITS, g);
  const std::vector<float> xsum = group_sums<BITS, OFF>(x, M, G, g);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b) {
    float res[MCMAX * L];
    const uint8_t* cb = codes + b * G * CB;
    const Sc sb = sc + b * G * L;
    const Sc ob = OFF ? of + b * G * L : Sc{};
    const int64_t rows = std::min<int64_t>(L, N - b * L);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int64_t mc = std::min<int64_t>(left, MCMAX);
      const float* xm = x + m0 * K;
      const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
      tile_rows<BITS, OFF>(mc, xm, K, G, g, cb, sb, ob, xs, z, res);
      store_tile(res, mc, y + m0 * ldy + b * L, ldy, rows, bias ? bias + b * L : nullptr, accumulate);
      m0 += mc;
    }
  }
}

void check_packed(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                  int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "code width must be 4, 5 or 8 bits, got ", bits);
  TORCH_CHECK(group % 2 == 0 && group > 0, "group size must be even, got ", group);
  TORCH_CHECK(bits != 5 || group == 32, "5-bit codes come in groups of 32, got ", group);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes: [N/16, G, CB] uint8");
  TORCH_CHECK(codes.size(2) == group_bytes(bits, group), "codes: ", codes.size(2), " bytes per group, expected ",
              group_bytes(bits, group));
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == codes.size(0) &&
                  scales.size(1) == codes.size(1) && scales.size(2) == L &&
                  (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf),
              "scales: [N/16, G, 16] float32 or float16");
  TORCH_CHECK(offsets.numel() == 0 || (offsets.sizes() == scales.sizes() && offsets.is_contiguous() &&
                                       offsets.scalar_type() == scales.scalar_type()),
              "offsets: empty or shaped (and typed) like scales");
}

// The zero point a packed weight's codes are read with.
void check_zero(int64_t bits, double z) {
  // bytes are read as q - 128 (tile_lookup flips the top bit; the int8 mode's AVX2 path subtracts 128)
  TORCH_CHECK(bits != 8 || z == 128.0, "8-bit codes must have zero point 128 (Q8_0, Q6_K), got ", z);
}

// The arguments of qlinear / qlinear_i8, checked.
// x [M, K] against a checked packed weight, and the zero point its codes are read with.
void check_x(const at::Tensor& x, const at::Tensor& codes, int64_t bits, int64_t group, double z) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(x.size(1) == codes.size(1) * group, "x has ", x.size(1), " columns, the weight ", codes.size(1) * group);
  check_zero(bits, z);
}

void check_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const at::Tensor& offsets, int64_t bits, int64_t group, double z, const at::Tensor& bias,
                  const at::Tensor& out) {
  check_packed(codes, scales, offsets, bits, group);
  check_x(x, codes, bits, group, z);
  const int64_t NB = codes.size(0), N = out.size(1);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 && out.scalar_type() == at::kFloat &&
                  N <= NB * L && N > (NB - 1) * L,
              "out: [M, N] float32 with unit column stride");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias: [N] or empty");
}

// A checked scales or offsets tensor as the kernels read it (an empty tensor: none).
Sc sc_of(const at::Tensor& t) {
  return {t.numel() ? t.data_ptr() : nullptr, t.scalar_type() == at::kHalf};
}

// The raw pointers and sizes of a checked qlinear / qlinear_i8 call (the packed weight, bias, output).
struct LinearArgs {
  int64_t M, K, NB, G, N, ldy;
  const uint8_t* codes;
  Sc scales;
  Sc offsets;  // p == nullptr: the type has no offsets
  const float* bias;     // nullptr: none
  float* y;
  float z;
  bool off;
};

LinearArgs linear_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t bits, int64_t group, double z, const at::Tensor& bias,
                       at::Tensor& out) {
  check_linear(x, codes, scales, offsets, bits, group, z, bias, out);
  const bool off = offsets.numel() > 0;
  return {x.size(0), x.size(1), codes.size(0), codes.size(1), out.size(1), out.stride(0),
          codes.data_ptr<uint8_t>(), sc_of(scales), sc_of(offsets),
          bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), (float)z, off};
}

// The checked call's weight as the raw kernels take it.
raw::QWeight weight_of(const LinearArgs& a, int64_t bits, int64_t group) {
  return {a.codes, a.scales.p, a.offsets.p, a.scales.half, a.NB, a.G, group, bits, a.z};
}

}  // namespace

raw::QWeight raw::qweight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets,
                          int64_t bits, int64_t group, double z) {
  check_packed(codes, scales, offsets, bits, group);
  check_zero(bits, z);
  const Sc s = sc_of(scales), o = sc_of(offsets);
  return {codes.data_ptr<uint8_t>(), s.p, o.p, s.half, codes.size(0), codes.size(1), group, bits, (float)z};
}

void raw::qlinear(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
                  bool accumulate) {
  dispatch(w.bits, w.offsets != nullptr, [&](auto B, auto O) {
    run<decltype(B)::value, decltype(O)::value>(x, M, w.G * w.group, w.codes, Sc{w.scales, w.half},
                                                Sc{w.offsets, w.half}, w.NB, w.G, w.group, w.z, bias, y, ldy, N,
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

// ---- the 8-bit activation mode (opt-in: ModelConfig.numerics = "int8") ------------------------------------
// Activations are rounded to 8 bits per group of the weight's group size (d = max|x| / 127, q = x / d rounded
// to nearest, ties to even; llama.cpp's Q8 blocks round ties away from zero), so a group's dot product is an exact integer sum of code x code products:
//     sum_k w_k x_k  ~=  d_x * (s * sum_k q_k qx_k - (z * s + o) * sum_k qx_k)
// With AVX-512 VNNI one vpdpbusd multiplies 4 columns x 16 rows of unsigned codes by 4 signed activation
// bytes; with AVX2, vpmaddubsw does code pairs (xpairs, code_pairs below); elsewhere the same integer sums are
// formed with int32 vector ops. Every x-row goes through the same
// operations whatever the number of rows, so a block of n rows gives bitwise the results of n single rows.
namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__BMI2__)
constexpr bool VNNI = true;
// 5-bit codes of columns k .. k + 3 (k a multiple of 4) from a group's words W and spare bits S: dword r =
// q[r][k .. k + 3]. vpmultishiftqb picks each byte from any bit offset of its qword (two rows' words), so the
// four codes are one pick and a mask; where they span two words (k % 6 == 4) the last two come from the next
// word (or S, whose codes sit at bits 0 and 5) by a second, merging pick.
inline __m512i quad5(const vu* W, vu S, int k) {
  const int w = k / 6, c = k % 6;  // column k's word and slot: c is 0, 2 or 4
  const auto picks = [](int o0, int o1, int o2, int o3) {  // byte offsets in a qword: the low row's, the high row's
    uint64_t v = 0;
    const int o[4] = {o0, o1, o2, o3};
    for (int i = 0; i < 4; ++i) v |= (uint64_t)o[i] << (8 * i) | (uint64_t)(o[i] + 32) << (8 * (i + 4));
    return _mm512_set1_epi64((int64_t)v);
  };
  const __m512i a = (__m512i)W[w];
  __m512i r;
  if (c <= 2) {
    r = _mm512_multishift_epi64_epi8(picks(5 * c, 5 * c + 5, 5 * c + 10, 5 * c + 15), a);
  } else {
    const __m512i b = (__m512i)(w + 1 < 5 ? W[w + 1] : S);
    r = _mm512_multishift_epi64_epi8(picks(20, 25, 0, 0), a);
    r = _mm512_mask_multishift_epi64_epi8(r, 0xCCCCCCCCCCCCCCCCull, picks(0, 0, 0, 5), b);
  }
  return _mm512_and_si512(r, _mm512_set1_epi8(31));
}
// The codes of columns k .. k + 3 of a group's 16 rows as one register: dword r = q[r][k .. k + 3].
template <int BITS>
inline __m512i four_columns(const uint8_t* c, int64_t g, int k) {
  __m512i w;
  if constexpr (BITS == 8) {
    static const __m512i idx = [] {
      alignas(64) uint8_t t[64];
      for (int r = 0; r < 16; ++r)
        for (int kk = 0; kk < 4; ++kk) t[4 * r + kk] = (uint8_t)(16 * kk + r);
      return _mm512_load_si512(t);
    }();
    w = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(c + k * L));
  } else if constexpr (BITS == 5) {
    (void)g;
    vu W[5];
    const vu S = words5(c, W);
    w = quad5(W, S, k);
  } else {
    (void)g;
    static const __m512i idx = [] {
      alignas(64) uint8_t t[64];
      for (int r = 0; r < 16; ++r) {
        t[4 * r] = t[4 * r + 1] = (uint8_t)r;
        t[4 * r + 2] = t[4 * r + 3] = (uint8_t)(16 + r);
      }
      return _mm512_load_si512(t);
    }();
    const __m512i t = _mm512_permutexvar_epi8(idx, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(c + k * 8))));
    const __m512i nib = _mm512_set1_epi8(15);
    w = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_and_si512(t, nib),
                               _mm512_and_si512(_mm512_srli_epi16(t, 4), nib));
  }
  return w;
}
#else
constexpr bool VNNI = false;
#endif

constexpr int64_t ROUND_PARALLEL = 1 << 15;  // activations (rows x columns) from which rounding them is parallel
// Bytes of activation pairs per activation (AVX2, xpairs): a 32-byte register per 4 columns, per 2 for 8-bit codes.
constexpr int64_t pair_bytes(int64_t bits) { return bits == 8 ? 16 : 8; }

#if !defined(__AVX512F__) && defined(__AVX2__)
constexpr bool PAIRS = true;  // AVX2: vpmaddubsw on code pairs (below)
// AVX2 has no vpdpbusd; vpmaddubsw multiplies 32 unsigned code bytes by 32 signed activation bytes and adds each
// adjacent pair into an int16. Columns k .. k + 3 of a group's 16 rows become two registers of code pairs:
//     A  lane 0, int16 i: (q[i][k], q[i][k + 1])      lane 1, int16 i: (q[i][k + 2], q[i][k + 3])     rows 0-7
//     B  the same for rows 8-15
// against one register of activation pairs per x-row, arranged once per call (xpairs): lane 0 (x_k, x_k+1) x 8,
// lane 1 (x_k+2, x_k+3) x 8. Row i's sum over the 4 columns is then int16 i of lane 0 plus int16 i of lane 1.
// The int16 sums are exact while they stay under 32767: a pair is at most 2 * qmax * 127, so QUADS_I16 column
// quads (15 -> 8, 31 -> 4, 63 -> 2) are added as int16 before widening to int32. 8-bit codes (q + 128, up to 255)
// overflow a pair as they are; signed, one pair fits but two do not, and widening every quad costs more than
// vpmaddwd: (q - 128) widened to int16, times int16 x pairs, summed straight into int32; the group gets
// 128 * sum(x) back, so the integer is the same. Integer sums are exact, so these are bit for bit the int32 sums
// of the portable path.
template <int BITS>
constexpr int QUADS_I16 = BITS == 4 ? 8 : 4;  // 4- and 5-bit codes (8-bit codes sum in int32)


// Codes with a bit set in their 16-bit plane (8 bytes: planes of columns k .. k + 3) get ADD (A: rows 0-7, the
// planes' low bytes; B: rows 8-15, the high bytes).
template <int ADD>
inline void add_planes(const uint8_t* planes, int k, __m256i& A, __m256i& B) {
  int64_t bits;
  std::memcpy(&bits, planes + 2 * k, 8);
  const __m256i pb = _mm256_set1_epi64x(bits);
  const __m256i pick_a = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,  //
                                          4, 6, 4, 6, 4, 6, 4, 6, 4, 6, 4, 6, 4, 6, 4, 6);
  const __m256i row_bit = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128,  //
                                           1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128, -128);
  const __m256i add = _mm256_set1_epi8(ADD);
  const __m256i sa = _mm256_and_si256(_mm256_shuffle_epi8(pb, pick_a), row_bit);
  const __m256i sb = _mm256_and_si256(_mm256_shuffle_epi8(pb, _mm256_add_epi8(pick_a, _mm256_set1_epi8(1))), row_bit);
  A = _mm256_or_si256(A, _mm256_and_si256(_mm256_cmpeq_epi8(sa, row_bit), add));
  B = _mm256_or_si256(B, _mm256_and_si256(_mm256_cmpeq_epi8(sb, row_bit), add));
}

// 4- and 5-bit codes of columns k .. k + 3: the nibble pairs (k, k + 1) | (k + 2, k + 3) of 16 rows, plus the plane.
template <int BITS>
inline void code_pairs(const uint8_t* c, int64_t g, int k, __m256i& A, __m256i& B) {
  static_assert(BITS == 4 || BITS == 5, "8-bit codes take vpmaddwd (tile_i8)");
  const __m256i v = _mm256_loadu_si256((const __m256i*)(c + k * 8));
  const __m256i m4 = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
  A = _mm256_unpacklo_epi8(lo, hi);
  B = _mm256_unpackhi_epi8(lo, hi);
  if constexpr (BITS == 5) add_planes<16>(c + g * 8, k, A, B);
}

// qx [M, K] -> [M, K / 4] registers of activation pairs (see above); 8-bit codes: [M, K / 2] registers of one
// pair (x_k, x_k+1) as int16, 8 times.
void xpairs(const int8_t* qx, int64_t M, int64_t K, int64_t bits, int8_t* out) {
  if (bits == 8) {
    for_range(M * K / 2, M * K >= ROUND_PARALLEL, [&](int64_t i) {
      const uint32_t lo = (uint16_t)(int16_t)qx[2 * i], hi = (uint16_t)(int16_t)qx[2 * i + 1];
      const int32_t two = (int32_t)(lo | hi << 16);
      _mm256_storeu_si256((__m256i*)(out + 32 * i), _mm256_set1_epi32(two));
    });
    return;
  }
  const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                          2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  for_range(M * K / 4, M * K >= ROUND_PARALLEL, [&](int64_t i) {
    int32_t four;
    std::memcpy(&four, qx + 4 * i, 4);
    _mm256_storeu_si256((__m256i*)(out + 32 * i), _mm256_shuffle_epi8(_mm256_set1_epi32(four), spread));
  });
}
#else
constexpr bool PAIRS = false;
#endif

// MC quantized x-rows against one block of 16 output rows: res[MC][16]. xp: the rows' activation pairs (AVX2).
template <int BITS, bool OFF, int MC>
void tile_i8(const int8_t* __restrict qx, const int8_t* __restrict xp, const float* __restrict dx,
             const int32_t* __restrict sx, int64_t K, int64_t G, int64_t g, const uint8_t* __restrict codes,
             Sc sc, Sc of, float z, float* __restrict res) {
  vf acc[MC][NV];
  for (int m = 0; m < MC; ++m)
    for (int h = 0; h < NV; ++h) acc[m][h] = vf{};
  const int64_t CB = group_bytes(BITS, g);
  const vf zv = bcast(z);
  for (int64_t j = 0; j < G; ++j) {
    const uint8_t* cg = codes + j * CB;
    vi isum[MC][NV];
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__BMI2__)
    __m512i is[2][MC];  // two independent integer sums per row (exact: their order cannot matter)
    for (int m = 0; m < MC; ++m) is[0][m] = is[1][m] = _mm512_setzero_si512();
    vu W[5], S{};  // 5-bit codes: the group's words and spare bits, read once (quad5)
    prefetch_group<OFF>(codes, CB, sc, of, j);  // as the exact kernels (the same stream)
    if constexpr (BITS == 5) S = words5(cg, W);
    const int gk = BITS == 5 ? 32 : (int)g;
#pragma GCC unroll 4
    for (int k = 0; k < gk; k += 8) {
      __m512i w0, w1;
      if constexpr (BITS == 5) {
        w0 = quad5(W, S, k);
        w1 = quad5(W, S, k + 4);
      } else {
        w0 = four_columns<BITS>(cg, g, k);
        w1 = four_columns<BITS>(cg, g, k + 4);
      }
      for (int m = 0; m < MC; ++m) {
        int32_t xb[2];
        std::memcpy(xb, qx + m * K + j * g + k, 8);
        is[0][m] = _mm512_dpbusd_epi32(is[0][m], w0, _mm512_set1_epi32(xb[0]));
        is[1][m] = _mm512_dpbusd_epi32(is[1][m], w1, _mm512_set1_epi32(xb[1]));
      }
    }
    for (int m = 0; m < MC; ++m) isum[m][0] = (vi)_mm512_add_epi32(is[0][m], is[1][m]);
#elif !defined(__AVX512F__) && defined(__AVX2__)
    (void)qx;
    __m256i is[MC][2];
    for (int m = 0; m < MC; ++m) is[m][0] = is[m][1] = _mm256_setzero_si256();
    prefetch_group<OFF>(codes, CB, sc, of, j);
    const int8_t* xj = xp + j * g * pair_bytes(BITS);  // row m's pairs of column k: xj + (m K + k) pair_bytes
    if constexpr (BITS == 8) {  // column pairs as int16 (q - 128) against int16 x pairs: vpmaddwd, int32 sums
      for (int k = 0; k < g; k += 2) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(cg + k * L)), _mm256_set1_epi8(-128));
        const __m128i c0 = _mm256_castsi256_si128(v), c1 = _mm256_extracti128_si256(v, 1);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(c0, c1));  // rows 0-7: (q[i][k], q[i][k + 1])
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(c0, c1));  // rows 8-15
        for (int m = 0; m < MC; ++m) {
          const __m256i x = _mm256_loadu_si256((const __m256i*)(xj + (m * K + k) * 16));
          is[m][0] = _mm256_add_epi32(is[m][0], _mm256_madd_epi16(w0, x));
          is[m][1] = _mm256_add_epi32(is[m][1], _mm256_madd_epi16(w1, x));
        }
      }
    } else {  // column quads of code pairs (vpmaddubsw), QUADS_I16 of them summed as int16, then widened
      constexpr int Q = QUADS_I16<BITS>;
      for (int k0 = 0; k0 < g; k0 += 4 * Q) {
        __m256i s16[MC][2];
        for (int m = 0; m < MC; ++m) s16[m][0] = s16[m][1] = _mm256_setzero_si256();
        for (int k = k0; k < k0 + 4 * Q && k < g; k += 4) {
          __m256i A, B;
          code_pairs<BITS>(cg, g, k, A, B);
          for (int m = 0; m < MC; ++m) {
            const __m256i x = _mm256_loadu_si256((const __m256i*)(xj + (m * K + k) * 8));
            s16[m][0] = _mm256_add_epi16(s16[m][0], _mm256_maddubs_epi16(A, x));
            s16[m][1] = _mm256_add_epi16(s16[m][1], _mm256_maddubs_epi16(B, x));
          }
        }
        for (int m = 0; m < MC; ++m)
          for (int h = 0; h < 2; ++h) {
            const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[m][h]));
            const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[m][h], 1));
            is[m][h] = _mm256_add_epi32(is[m][h], _mm256_add_epi32(lo, hi));
          }
      }
    }
    for (int m = 0; m < MC; ++m)
      for (int h = 0; h < 2; ++h) {
        isum[m][h] = (vi)is[m][h];
        if constexpr (BITS == 8) isum[m][h] += 128 * sx[m * G + j];
      }
#else
    (void)xp;
    for (int m = 0; m < MC; ++m)
      for (int h = 0; h < NV; ++h) isum[m][h] = vi{};
    for (int k = 0; k < g; k += 2)
      for (int h = 0; h < NV; ++h) {
        vi q0, q1;
        column_pair<BITS>(cg, g, k, h, q0, q1);
        for (int m = 0; m < MC; ++m)
          isum[m][h] += q0 * (int32_t)qx[m * K + j * g + k] + q1 * (int32_t)qx[m * K + j * g + k + 1];
      }
#endif
    for (int h = 0; h < NV; ++h) {
      const vf s = sc.vec(j * L + VL * h);
      const vf cz = OFF ? zv * s + of.vec(j * L + VL * h) : zv * s;
      for (int m = 0; m < MC; ++m) {
        const vf t = s * __builtin_convertvector(isum[m][h], vf) - cz * (float)sx[m * G + j];
        acc[m][h] = fma(t, bcast(dx[m * G + j]), acc[m][h]);
      }
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int h = 0; h < NV; ++h) std::memcpy(res + m * L + VL * h, &acc[m][h], sizeof(vf));
}

// x-rows per int8 tile: 8 with VNNI (16 integer sums and two code registers fit in 32 registers; at 5-8 rows the
// weights are then decoded once instead of twice), 4 on AVX2 (16 registers). Integer sums are exact and each row's
// float scaling is the same in any tile, so the tile size changes no result.
constexpr int64_t MC_I8 = VNNI ? 8 : 4;

// Rows [m0, m0 + mc) of the rounded activations (mc <= MC_I8) against block b: res[mc][16].
template <int BITS, bool OFF>
inline void tile_i8_rows(const int8_t* qx, const int8_t* xp, const float* dx, const int32_t* sx, int64_t m0,
                         int64_t mc, int64_t K, int64_t G, int64_t g, const uint8_t* codes, Sc sc, Sc of, int64_t b,
                         float z, float* res) {
  const int64_t CB = group_bytes(BITS, g);
  const int8_t* q = qx + m0 * K;
  const int8_t* p = PAIRS ? xp + m0 * K * pair_bytes(BITS) : nullptr;
  const float* d = dx + m0 * G;
  const int32_t* sm = sx + m0 * G;
  const uint8_t* cb = codes + b * G * CB;
  const Sc sb = sc + b * G * L;
  const Sc ob = OFF ? of + b * G * L : Sc{};
  switch (mc) {
    case 1: tile_i8<BITS, OFF, 1>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    case 2: tile_i8<BITS, OFF, 2>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    case 3: tile_i8<BITS, OFF, 3>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    case 4: tile_i8<BITS, OFF, 4>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__BMI2__)
    case 5: tile_i8<BITS, OFF, 5>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    case 6: tile_i8<BITS, OFF, 6>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    case 7: tile_i8<BITS, OFF, 7>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
    default: tile_i8<BITS, OFF, 8>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
#else
    default: tile_i8<BITS, OFF, 4>(q, p, d, sm, K, G, g, cb, sb, ob, z, res); break;
#endif
  }
}

template <int BITS, bool OFF>
void run_i8(const int8_t* qx, const int8_t* xp, const float* dx, const int32_t* sx, int64_t M, int64_t K,
            const uint8_t* codes,
            Sc sc, Sc of, int64_t NB, int64_t G, int64_t g, float z, const float* bias, float* y,
            int64_t ldy, int64_t N, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b) {
    float res[MC_I8 * L];
    const int64_t rows = std::min<int64_t>(L, N - b * L);
    for (int64_t m0 = 0; m0 < M; m0 += MC_I8) {
      const int64_t mc = std::min<int64_t>(MC_I8, M - m0);
      tile_i8_rows<BITS, OFF>(qx, xp, dx, sx, m0, mc, K, G, g, codes, sc, of, b, z, res);
      store_tile(res, mc, y + m0 * ldy + b * L, ldy, rows, bias ? bias + b * L : nullptr, accumulate);
    }
  }
}

// x [M, K] rounded to 8 bits per group of ``group`` columns (d = max|x| / 127, x / d to nearest, ties to even):
// qx [M, K], dx and the code sums sx [M, G], and on AVX2 the activation pairs (xpairs). ``finite``: every x was.
struct Rounded {
  std::unique_ptr<int8_t[]> qx, pairs;
  std::vector<float> dx;
  std::vector<int32_t> sx;
  bool finite = true;
  Rounded(const float* xp, int64_t M, int64_t K, int64_t group, int64_t bits)
      : qx(new int8_t[M * K]), dx(M * K / group), sx(M * K / group) {  // qx uninitialized: every byte is written
    const int64_t MG = M * K / group;
    int bad = 0;
    const auto round_group = [&](int64_t i) {  // row m = i / G, group j = i % G; -> whether an x was not finite
      const float* xg = xp + i * group;
      float amax = 0.f;
      int b = 0;
      for (int64_t k = 0; k < group; ++k) {
        const float v = std::fabs(xg[k]);
        amax = std::max(amax, v);
        b |= !(v <= FLT_MAX);  // NaN or infinite (std::max drops a NaN)
      }
      const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < group; ++k) {  // round to nearest, ties to even (vroundps / cvtps2dq)
        const int32_t q = (int32_t)__builtin_nearbyintf(xg[k] * id);
        qx[i * group + k] = (int8_t)q;
        sum += q;
      }
      dx[i] = d;
      sx[i] = sum;
      return b;
    };
    // Groups are independent: a prefill's rows are rounded on every thread; a step's few rows on this one, without
    // an OpenMP region (see for_range).
    if (M * K >= ROUND_PARALLEL) {
#pragma omp parallel for schedule(static) reduction(| : bad)
      for (int64_t i = 0; i < MG; ++i) bad |= round_group(i);
    } else {
      for (int64_t i = 0; i < MG; ++i) bad |= round_group(i);
    }
    finite = !bad;
#if !defined(__AVX512F__) && defined(__AVX2__)
    pairs.reset(new int8_t[M * K * pair_bytes(bits)]);
    xpairs(qx.get(), M, K, bits, pairs.get());
#else
    (void)bits;
#endif
  }
};

}  // namespace

void raw::qlinear_i8(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
                     bool accumulate) {
  const int64_t K = w.G * w.group;
  const Rounded r(x, M, K, w.group, w.bits);
  dispatch(w.bits, w.offsets != nullptr, [&](auto B, auto O) {
    run_i8<decltype(B)::value, decltype(O)::value>(r.qx.get(), r.pairs.get(), r.dx.data(), r.sx.data(), M, K, w.codes,
                                                   Sc{w.scales, w.half}, Sc{w.offsets, w.half}, w.NB, w.G, w.group,
                                                   w.z, bias, y, ldy, N, accumulate);
  });
}

// As qlinear, with x rounded to 8 bits per group of the weight's group size (the int8 numerics mode).
at::Tensor qlinear_i8(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                         int64_t bits, int64_t group, double z, at::Tensor bias, at::Tensor out, bool accumulate) {
  const LinearArgs a = linear_args(x, codes, scales, offsets, bits, group, z, bias, out);
  raw::qlinear_i8(x.data_ptr<float>(), a.M, weight_of(a, bits, group), a.bias, a.y, a.ldy, a.N, accumulate);
  return out;
}

bool qlinear_i8_vnni() { return VNNI; }

// ---- greedy verification: the argmax of x @ W^T, screened by the int8 kernel (qargmax) ----------------------------
// A greedy verification needs only each row's argmax of the LM head's logits, not the logits. The int8 kernel
// (above) computes them approximately at the cost of one read of the weight; its error is bounded per block of 16
// output rows, so only the blocks whose bound can reach the best row need the exact kernel. Per x-row m and block b:
//     |approx - exact| <= B[m][b] = sum_j E[b][j] * dx[m][j]
// where dx is the group's rounding step (max|x| / 127) and E (``ebound``, selfspec/quant/screen.py) the block's
// largest sum_k |w_k| / 2 in group j (rounding moves each x by at most dx / 2), plus room for the float32 rounding of
// both kernels. The true argmax r* has exact >= exact of every row, so approx[r*] + B >= max_r (approx[r] - B) =: lo:
// every block whose best approx + B reaches lo is a candidate, and no other block can hold r*. The candidates go
// through the exact kernel with the same x-row tiles as qlinear's (run), so their logits are bit for bit qlinear's,
// and the first maximum among them is torch.argmax of qlinear's output. Worked example (one x-row, three blocks
// with best approx 9.0, 7.5, 3.0 and bounds 1.0, 1.0, 1.0): lo = 8.0; blocks 0 (10.0 >= 8) and 1 (8.5 >= 8) are
// computed exactly, block 2 (4.0 < 8) is not.
// out [M] int64: each row's argmax, or -1 for every row when an activation is not finite (the caller computes the
// logits instead). Returns the number of candidate blocks.
int64_t qargmax(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                int64_t group, double z, int64_t n, at::Tensor ebound, at::Tensor out) {
  check_packed(codes, scales, offsets, bits, group);
  check_x(x, codes, bits, group, z);
  TORCH_CHECK(n <= codes.size(0) * L && n > (codes.size(0) - 1) * L, "n: ", n, " output rows for ", codes.size(0), " blocks");
  struct {
    const uint8_t* codes;
    Sc scales, offsets;
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
      const Sc sb = a.scales + b * G * L;
      const Sc ob = OO ? a.offsets + b * G * L : Sc{};
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t mc = std::min<int64_t>(M - m0, MCMAX);
        const float* xm = xp + m0 * K;
        const float* xs = xsum.empty() ? nullptr : xsum.data() + m0 * G;
        tile_rows<BB, OO>(mc, xm, K, G, group, cb, sb, ob, xs, a.z, res);  // as run: qlinear's bits
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
  const Sc sp = sc_of(scales), op = sc_of(offsets);
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

// ---- prefill: dequantized weights for torch's GEMM (qdense_t) and for the panels below (selfspec/quant/weight.py) --
namespace {

// Group j of block b dequantized and transposed: o[k * ldo + r] = weight of output row 16 b + r, column g j + k.
template <int BITS, bool OFF>
inline void group_t(const uint8_t* codes, Sc sc, Sc of, int64_t G, int64_t g, vf zv, int64_t b,
                    int64_t j, float* o, int64_t ldo) {
  const uint8_t* cg = codes + (b * G + j) * group_bytes(BITS, g);
  for (int h = 0; h < NV; ++h) {
    const vf s = sc.vec((b * G + j) * L + VL * h);
    const vf c = OFF ? of.vec((b * G + j) * L + VL * h) : zv * s;
    for (int k = 0; k < g; k += 2) {
      vf w0, w1;
      column_pair_weights<BITS>(cg, g, k, h, s, c, zv, w0, w1);
      std::memcpy(o + k * ldo + VL * h, &w0, sizeof(vf));
      std::memcpy(o + (k + 1) * ldo + VL * h, &w1, sizeof(vf));
    }
  }
}

template <int BITS, bool OFF>
void dense_t(const uint8_t* codes, Sc sc, Sc of, int64_t G, int64_t g, float z, int64_t b0,
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

// ---- the LM head screen's bound table (selfspec/quant/screen.py): each row's sum of |w| over each group -------------
namespace {

template <int BITS, bool OFF>
void group_l1(const uint8_t* codes, Sc sc, Sc of, int64_t NB, int64_t G, int64_t g, float z, float* out) {
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

// ---- prefill: many rows of x against panels of the weight dequantized once (qgemm) ----------------------------
// The decoding kernel (run) decodes every weight again for each tile of <= 8 x-rows; a prefill of hundreds of rows
// is then bound by decoding, not by multiply-adds. Here, as in a GEMM, a panel of PR output rows x KC columns is
// dequantized once into a buffer that stays in L1/L2 (the kernel's own weights: the formula of column_pair_weights,
// so gguf-py's values bit for bit) and a register tile of MR x-rows x PR outputs multiplies against it: per column,
// PV weight vectors loaded, MR broadcasts, MR * PV multiply-adds. Loop order (per call):
//     for each chunk of MB x-rows (kept in L2 across panels)
//       for each panel of PR output rows (parallel)           C[MB][PR] = 0
//         for each chunk of KC columns: dequantize W[KC][PR], then every MR x-rows of the chunk: C += x W^T
//         y = (y if accumulate) + C + bias
// Each output is one sequential float32 sum over k = 0 .. K - 1 (the partial sums live in C between column chunks),
// so its value does not depend on how many rows the call has.
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
void panel(const uint8_t* codes, Sc sc, Sc of, int64_t NB, int64_t G, int64_t g, float z,
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
void run_gemm(const float* x, int64_t M, int64_t K, const uint8_t* codes, Sc sc, Sc of,
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
