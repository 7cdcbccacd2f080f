// selfspec's 8-bit activation mode for GGUF block-quantized weights (qlinear_i8; opt-in: ModelConfig.numerics =
// "int8"): qlinear (qlinear.cpp) with x rounded to 8 bits per group, each group's dot product an integer sum.
// The packed layout: qcodes.h.
//
// Activations are rounded to 8 bits per group of the weight's group size (d = max|x| / 127, q = x / d rounded
// to nearest, ties to even; llama.cpp's Q8 blocks round ties away from zero), so a group's dot product is an exact integer sum of code x code products:
//     sum_k w_k x_k  ~=  d_x * (s * sum_k q_k qx_k - (z * s + o) * sum_k qx_k)
// With AVX-512 VNNI one vpdpbusd multiplies 4 columns x 16 rows of unsigned codes by 4 signed activation
// bytes; with AVX2, vpmaddubsw does code pairs (xpairs, code_pairs below); elsewhere the same integer sums are
// formed with int32 vector ops. Every x-row goes through the same
// operations whatever the number of rows, so a block of n rows gives bitwise the results of n single rows.

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"
#include "qcodes.h"
#include "simd.h"

using namespace qcodes;

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__BMI2__)
// 5-bit codes of columns k .. k + 3 (k a multiple of 4) from a group's words W and spare bits S: dword r =
// q[r][k .. k + 3]. vpmultishiftqb picks each byte from any bit offset of its qword (two rows' words), so the
// four codes are one pick and a mask; where they span two words (k % 6 == 4) the last two come from the next
// word (or S, whose codes sit at bits 0 and 5) by a second, merging pick.
__attribute__((always_inline)) inline __m512i quad5(const vu* W, vu S, int k) {
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
// vpermb's byte indices that gather four columns' codes of a group's 16 rows into dword r (four_columns): for bytes
// (16 k + r for column k of the four), and for nibble pairs (row r's byte of the first and of the second column pair,
// each twice, before the nibbles are split). Tables at namespace scope, made once at load: a function-local static
// has a guard that kept GCC from inlining four_columns into the one-row tile, which then called it per four columns.
struct ColumnIndex {
  alignas(64) uint8_t bytes[64];
  alignas(64) uint8_t nibbles[64];
  ColumnIndex() {
    for (int r = 0; r < 16; ++r) {
      for (int kk = 0; kk < 4; ++kk) bytes[4 * r + kk] = (uint8_t)(16 * kk + r);
      nibbles[4 * r] = nibbles[4 * r + 1] = (uint8_t)r;
      nibbles[4 * r + 2] = nibbles[4 * r + 3] = (uint8_t)(16 + r);
    }
  }
};
const ColumnIndex column_index;

// The codes of columns k .. k + 3 of a group's 16 rows as one register: dword r = q[r][k .. k + 3]. Always inlined:
// a call per four columns (with the tile's sums spilled around it) made one-row int8 calls slower than two-row ones.
template <int BITS>
__attribute__((always_inline)) inline __m512i four_columns(const uint8_t* c, int64_t g, int k) {
  __m512i w;
  if constexpr (BITS == 8) {
    w = _mm512_permutexvar_epi8(_mm512_load_si512(column_index.bytes), _mm512_loadu_si512(c + k * L));
  } else if constexpr (BITS == 5) {
    (void)g;
    vu W[5];
    const vu S = words5(c, W);
    w = quad5(W, S, k);
  } else {
    (void)g;
    const __m512i t = _mm512_permutexvar_epi8(_mm512_load_si512(column_index.nibbles),
                                              _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(c + k * 8))));
    const __m512i nib = _mm512_set1_epi8(15);
    w = _mm512_mask_blend_epi8(0xAAAAAAAAAAAAAAAAull, _mm512_and_si512(t, nib),
                               _mm512_and_si512(_mm512_srli_epi16(t, 4), nib));
  }
  return w;
}
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

}  // namespace

namespace qcodes {

// Rows [m0, m0 + mc) of the rounded activations (mc <= MC_I8) against block b: res[mc][16].
template <int BITS, bool OFF>
void tile_i8_rows(const int8_t* qx, const int8_t* xp, const float* dx, const int32_t* sx, int64_t m0,
                  int64_t mc, int64_t K, int64_t G, int64_t g, const uint8_t* codes, Scales sc, Scales of, int64_t b,
                  float z, float* res) {
  const int64_t CB = group_bytes(BITS, g);
  const int8_t* q = qx + m0 * K;
  const int8_t* p = PAIRS ? xp + m0 * K * pair_bytes(BITS) : nullptr;
  const float* d = dx + m0 * G;
  const int32_t* sm = sx + m0 * G;
  const uint8_t* cb = codes + b * G * CB;
  const auto [sb, ob] = block_scales(sc, of, b, G);  // K forms expanded once a call
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

// The instantiations qargmax.cpp calls: every code width, with and without offsets (dispatch's cases).
#define SELFSPEC_INSTANTIATE(BITS, OFF)                                                                             \
  template void tile_i8_rows<BITS, OFF>(const int8_t*, const int8_t*, const float*, const int32_t*, int64_t, int64_t, \
                                        int64_t, int64_t, int64_t, const uint8_t*, Scales, Scales, int64_t, float, float*);
SELFSPEC_EACH_CODE(SELFSPEC_INSTANTIATE)
#undef SELFSPEC_INSTANTIATE

// x rounded to 8 bits per group (qcodes.h's Rounded: its rounding, code sums and, on AVX2, activation pairs).
Rounded::Rounded(const float* xp, int64_t M, int64_t K, int64_t group, int64_t bits)
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

}  // namespace qcodes

namespace {

template <int BITS, bool OFF>
void run_i8(const int8_t* qx, const int8_t* xp, const float* dx, const int32_t* sx, int64_t M, int64_t K,
            const uint8_t* codes,
            Scales sc, Scales of, int64_t NB, int64_t G, int64_t g, float z, const float* bias, float* y,
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

}  // namespace

void raw::qlinear_i8(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
                     bool accumulate) {
  const int64_t K = w.G * w.group;
  const Rounded r(x, M, K, w.group, w.bits);
  dispatch(w.bits, w.offsets != nullptr, [&](auto B, auto O) {
    run_i8<decltype(B)::value, decltype(O)::value>(r.qx.get(), r.pairs.get(), r.dx.data(), r.sx.data(), M, K, w.codes,
                                                   scales_of(w), offsets_of(w), w.NB, w.G, w.group,
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
