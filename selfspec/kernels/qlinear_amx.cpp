// The exact decoding kernel on Intel AMX tiles for 4- and 5-bit codes in groups of 32 (Q4_0, Q4_1, Q4_K, Q5_0,
// Q5_1, Q5_K) and bytes in groups of 32 or 16 (Q8_0, Q6_K): qlinear's arithmetic class (float32 activations times the dequantized weights, float32 sums) with the group sums on the
// matrix unit. qlinear.cpp's run and tile_rows call it where amx_on() (qcodes.h declares what is shared).
//
// Limbs. Each float32 activation is split into three bfloat16 limbs, x = x0 + x1 + x2 exactly (x0 = bf16(x) rounded
// to nearest, x1 = bf16(x - x0), x2 = x - x0 - x1: 8 + 8 + 8 significant bits cover float32's 24, and each
// difference is exact in float32). A code's value q - z (at most 8 bits) is exact in bfloat16, so every product
// limb x code is exact, and TDPBF16PS sums them in float32. A group's sum accumulates its three limbs' products in
// one tile, limb after limb, and
//     y += s_g * S_g  (- o_g * sum_{k in g} x_k)      in group order, as tile_lookup forms it (qlinear.cpp)
// so the weights are the dequantized model's and only the order of the float32 sums differs from F.linear, as it
// does for the FMA kernels (one edge: a float32 within half a bfloat16 step of FLT_MAX rounds x0 to infinity). A
// row's arithmetic depends on no other row: a block of n rows gives bit for bit what each row gives alone, whatever
// call, pair of blocks or tile it falls in.
//
// Tiles (one 16-output block, one group of 32 columns, one limb at a time):
//     A  # [mc, 32] bf16       the x-rows' limb l of the group (amx_limbs: [G, 3, mc, 32] a tile of mc <= 16 rows;
//                              groups of 16: two limbs side by side, [G, 2, mc, 32])
//     B  # [16, 16 x 2] bf16   the block's codes in pairs of columns: row p holds two columns of each output row
//     C  # [mc, 16] fp32       sum over the limbs of A B^T, stored and scaled per x-row with the group's scale
// Tiles per group: each limb's A (tmm4, 5) against the block's B (tmm6; a pair of blocks shares the limbs' loads,
// the second block's B is tmm7) into C (tmm 0-3: two blocks, two parities of groups). B is decoded two groups ahead
// into a ring of buffers and each group's C is read one group later, so that the vector stores, tile loads, the
// multiplies and the tile store of one group overlap the next's (read back at once, a group cost twice as long).
//
// Setup: the process asks Linux for the tile state once (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA); where that
// fails, or the build has no AMX, amx_on() is false and the FMA kernels run. Each thread loads its tile
// configuration before its first tile instruction in every call (other libraries' tile code, oneDNN's, may have
// loaded another in between).

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "qcodes.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define SELFSPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace qcodes {

namespace {
std::atomic<int> amx_wanted{-1};  // -1: not set (SELFSPEC_AMX decides), 0 / 1: set_amx's choice

bool amx_granted() {
#if defined(SELFSPEC_AMX)
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
#else
  return false;
#endif
}
}  // namespace

bool amx_available() { return amx_granted(); }

bool amx_on() {
  int w = amx_wanted.load(std::memory_order_relaxed);
  if (w < 0) {
    const char* e = std::getenv("SELFSPEC_AMX");
    w = !(e && std::strcmp(e, "0") == 0);
    amx_wanted.store(w, std::memory_order_relaxed);
  }
  return w && amx_granted();
}

void amx_set(bool on) { amx_wanted.store(on ? 1 : 0, std::memory_order_relaxed); }

#if defined(SELFSPEC_AMX)

namespace {

inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The byte indices that place, for B rows from the 64 bytes of vectors 4c .. 4c + 3, output row n's byte of vector
// 2h in word 2n and its byte of vector 2h + 1 in word 2n + 1 (both bytes of each word: only the low one is read).
struct PairIndex {
  alignas(64) uint8_t v[2][64];
  PairIndex() {
    for (int h = 0; h < 2; ++h)
      for (int n = 0; n < 16; ++n) {
        v[h][4 * n] = v[h][4 * n + 1] = (uint8_t)(32 * h + n);
        v[h][4 * n + 2] = v[h][4 * n + 3] = (uint8_t)(32 * h + 16 + n);
      }
  }
};
const PairIndex pair_index;

// vpmultishiftqb's bit offsets for B row 3w + c (5-bit words): in each qword (output rows 2i, 2i + 1) the codes of
// columns 6w + 2c and 6w + 2c + 1 of both rows, one to a word; c = 3 is the spare bits' pair (columns 30, 31) of S.
struct ShiftIndex {
  alignas(64) uint8_t v[4][64];
  ShiftIndex() {
    for (int c = 0; c < 4; ++c)
      for (int q = 0; q < 8; ++q) {
        const int a = c < 3 ? 10 * c : 0;
        const uint8_t o[8] = {(uint8_t)a, (uint8_t)a, (uint8_t)(a + 5), (uint8_t)(a + 5),
                              (uint8_t)(32 + a), (uint8_t)(32 + a), (uint8_t)(37 + a), (uint8_t)(37 + a)};
        std::memcpy(v[c] + 8 * q, o, 8);
      }
  }
};
const ShiftIndex shift_index;

// vpermb's byte indices that make B rows 2c, 2c + 1 from bytes' vectors 4c .. 4c + 3 (vector k: column k's 16 rows):
// byte 2n + h of row 2c + i is row n's byte of column 4c + 2i + h.
struct BytePairIndex {
  alignas(64) uint8_t v[64];
  BytePairIndex() {
    for (int i = 0; i < 2; ++i)
      for (int n = 0; n < 16; ++n)
        for (int h = 0; h < 2; ++h) v[32 * i + 2 * n + h] = (uint8_t)(32 * i + 16 * h + n);
  }
};
const BytePairIndex byte_pairs;

// One group's B tile: 16 rows of 32 bf16 values, each output row's pair of columns in one dword; vpermw reads
// each value from a 32-entry table by its word's low five bits (a code's value q - z is exact in bfloat16).
//   4 bits: from vectors 4c .. 4c + 3 (byte r of vector p = q[r][2p] | q[r][2p + 1] << 4), vpermb pairs vector
//           4c + 2h's byte with vector 4c + 2h + 1's; the low nibbles make row 4c + 2h (columns 8c + 4h and
//           8c + 4h + 2), the high ones (a 4-bit shift) row 4c + 2h + 1 (columns 8c + 4h + 1, 8c + 4h + 3). The
//           table repeats its 16 values, so the fifth bit is not read. A's columns come in the same order
//           (amx_limbs with swap: 0 2 1 3 in every four).
//   5 bits: the words layout (qcodes.h); vpmultishiftqb takes each row's pair of 5-bit codes out of its word, so
//           the columns stay in order (rows 0-14: columns 0-29 in pairs, row 15: the spare bits' columns 30, 31).
//   8 bits: vectors of bytes, one a column (g of them); vpermb pairs columns 2p, 2p + 1 of each row, and the code's
//           value q - 128 (the bytes' zero point, formats.py) goes through int32 and float32 to bf16, exactly. A
//           group of 16 fills rows 0-7 and repeats them in rows 8-15: its A tiles hold two limbs side by side.
template <int BITS>
inline void decode_b(const uint8_t* cg, uint16_t* out, __m512i table, int64_t g) {
  if constexpr (BITS == 8) {
    const __m512i idx = _mm512_load_si512(byte_pairs.v), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t c = 0; c < g / 4; ++c) {
      const __m512i v = _mm512_xor_si512(_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(cg + 64 * c)), flip);
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 0)));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 1)));
      const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 2)));
      const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, 3)));
      const __m512i r0 = (__m512i)_mm512_cvtne2ps_pbh(f1, f0), r1 = (__m512i)_mm512_cvtne2ps_pbh(f3, f2);
      _mm512_store_si512(out + 32 * (2 * c), r0);
      _mm512_store_si512(out + 32 * (2 * c + 1), r1);
      if (g == 16) {
        _mm512_store_si512(out + 32 * (2 * c + 8), r0);
        _mm512_store_si512(out + 32 * (2 * c + 9), r1);
      }
    }
  } else if constexpr (BITS == 4) {
    for (int c = 0; c < 4; ++c) {
      const __m512i x = _mm512_loadu_si512(cg + 64 * c);
      for (int h = 0; h < 2; ++h) {
        const __m512i d = _mm512_permutexvar_epi8(_mm512_load_si512(pair_index.v[h]), x);
        _mm512_store_si512(out + 32 * (4 * c + 2 * h), _mm512_permutexvar_epi16(d, table));
        _mm512_store_si512(out + 32 * (4 * c + 2 * h + 1), _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), table));
      }
    }
  } else {
    vu W[5];
    const vu S = words5(cg, W);
    for (int w = 0; w < 5; ++w)
      for (int c = 0; c < 3; ++c) {
        const __m512i d = _mm512_multishift_epi64_epi8(_mm512_load_si512(shift_index.v[c]), (__m512i)W[w]);
        _mm512_store_si512(out + 32 * (3 * w + c), _mm512_permutexvar_epi16(d, table));
      }
    const __m512i d = _mm512_multishift_epi64_epi8(_mm512_load_si512(shift_index.v[3]), (__m512i)S);
    _mm512_store_si512(out + 32 * 15, _mm512_permutexvar_epi16(d, table));
  }
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Group j's sums of NBK output blocks (one or two: a pair shares the limbs' tile loads) into C of parity P and block
// i (tmm 2P + i), stored to cbuf[i] (16 floats a row): the group's LT limb tiles (tmm4, tmm5, tmm4 again; in the
// limbs buffer one after another per group: three for groups of 32, two for groups of 16) against block i's B tile
// (tmm 6 + i), accumulated in C in limb order, so a row's sums are the same whatever the pairing. The tile numbers
// must be literals (GCC's AMX intrinsics name the register in their assembly).
#define SELFSPEC_AMX_GROUP(C0, C1)                                 \
  _tile_loadd(6, bbuf[0], 64);                                     \
  if constexpr (NBK == 2) _tile_loadd(7, bbuf[1], 64);             \
  _tile_zero(C0);                                                  \
  if constexpr (NBK == 2) _tile_zero(C1);                          \
  _tile_loadd(4, a + (LT * j) * tile, 64);                           \
  _tile_dpbf16ps(C0, 4, 6);                                        \
  if constexpr (NBK == 2) _tile_dpbf16ps(C1, 4, 7);                \
  _tile_loadd(5, a + (LT * j + 1) * tile, 64);                       \
  _tile_dpbf16ps(C0, 5, 6);                                        \
  if constexpr (NBK == 2) _tile_dpbf16ps(C1, 5, 7);                \
  if constexpr (LT == 3) {                                         \
    _tile_loadd(4, a + (LT * j + 2) * tile, 64);                   \
    _tile_dpbf16ps(C0, 4, 6);                                      \
    if constexpr (NBK == 2) _tile_dpbf16ps(C1, 4, 7);              \
  }                                                                \
  _tile_stored(C0, cbuf[0], 64);                                   \
  if constexpr (NBK == 2) _tile_stored(C1, cbuf[1], 64);
template <int NBK, int P, int LT>
inline void group_tiles(const uint16_t* a, int64_t tile, int64_t j, const uint16_t* const* bbuf, float* const* cbuf) {
  if constexpr (P == 0) {
    SELFSPEC_AMX_GROUP(0, 1)
  } else {
    SELFSPEC_AMX_GROUP(2, 3)
  }
}
#undef SELFSPEC_AMX_GROUP

// acc[m] += s * S[m] (- o * xsum[m, j]): group j's sums of mc x-rows.
template <bool OFF>
inline void extract(int64_t mc, const float* cbuf, Sc sc, Sc of, const float* xs, int64_t G, int64_t j,
                    __m512* acc) {
  const __m512 s = (__m512)sc.vec(j * L);
  __m512 o{};
  if constexpr (OFF) o = -(__m512)of.vec(j * L);
  for (int64_t m = 0; m < mc; ++m) {
    acc[m] = _mm512_fmadd_ps(_mm512_load_ps(cbuf + 16 * m), s, acc[m]);
    if constexpr (OFF) acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[m * G + j]), acc[m]);
  }
}

// One output block's codes, scales and offsets, and where its res[mc][16] goes.
struct Block {
  const uint8_t* cb;
  Sc sc, of;
  float* res;
};

template <int BITS>
inline __m512i code_table(float z) {  // vpermw's table: code i -> bf16(i - z) (4 bits: i & 15)
  alignas(64) uint16_t table_v[32];
  for (int i = 0; i < 32; ++i) {
    const float v = (float)(BITS == 4 ? i & 15 : i) - z;
    table_v[i] = (uint16_t)(_mm_cvtsi128_si32((__m128i)_mm_cvtneps_pbh(_mm_set_ss(v))) & 0xffff);
  }
  return _mm512_load_si512(table_v);
}

// PRE: each block's B tiles were decoded beforehand (amx_decode: pre[i] # [G, 16 * 32]), as a prefill's many tiles
// of x-rows share them; else each group's tile is decoded here, two groups ahead.
// LT: a group's limb tiles (3: groups of 32; 2: groups of 16, bytes only)
template <int BITS, bool OFF, int NBK, bool PRE, int LT>
void rows_amx(int64_t mc, const uint16_t* a, int64_t G, const Block* blk, const float* xs, float z,
              const uint16_t* const* pre) {
  constexpr int64_t g = LT == 3 ? 32 : 16;
  static_assert(LT == 3 || BITS == 8, "groups of 16 are bytes'");
  constexpr int64_t CB = BITS == 8 ? 16 * g : BITS == 4 ? 256 : 320;  // bytes of a group of 16 x g codes
  const __m512i table = PRE || BITS == 8 ? __m512i{} : code_table<BITS>(z);
  const int64_t tile = mc * 32;  // elements of one limb tile (amx_limbs: [G, LT, mc, 32])
  alignas(64) uint16_t bbuf[NBK][PRE ? 1 : 4][16 * 32];
  alignas(64) float cbuf[2][NBK][16 * 16];
  __m512 acc[NBK][16];
  for (int i = 0; i < NBK; ++i)
    for (int64_t m = 0; m < mc; ++m) acc[i][m] = _mm512_setzero_ps();
  constexpr int64_t LEAD = 2;
  if constexpr (!PRE)
    for (int64_t j = 0; j < LEAD && j < G; ++j)
      for (int i = 0; i < NBK; ++i) decode_b<BITS>(blk[i].cb + j * CB, bbuf[i][j % 4], table, g);
  for (int64_t j = 0; j < G; ++j) {
    const uint16_t* bj[NBK];
    float* cj[NBK];
    float* cprev[NBK];
    for (int i = 0; i < NBK; ++i) {
      if constexpr (PRE) {
        bj[i] = pre[i] + j * 16 * 32;
      } else {
        prefetch_group<OFF>(blk[i].cb, CB, blk[i].sc, blk[i].of, j);
        if (j + LEAD < G) decode_b<BITS>(blk[i].cb + (j + LEAD) * CB, bbuf[i][(j + LEAD) % 4], table, g);
        bj[i] = bbuf[i][j % 4];
      }
      cj[i] = cbuf[j % 2][i];
      cprev[i] = cbuf[1 - j % 2][i];
    }
    if (j % 2 == 0) group_tiles<NBK, 0, LT>(a, tile, j, bj, cj);
    else group_tiles<NBK, 1, LT>(a, tile, j, bj, cj);
    if (j > 0)
      for (int i = 0; i < NBK; ++i) extract<OFF>(mc, cprev[i], blk[i].sc, blk[i].of, xs, G, j - 1, acc[i]);
  }
  for (int i = 0; i < NBK; ++i) {
    extract<OFF>(mc, cbuf[(G - 1) % 2][i], blk[i].sc, blk[i].of, xs, G, G - 1, acc[i]);
    for (int64_t m = 0; m < mc; ++m) _mm512_storeu_ps(blk[i].res + m * L, acc[i][m]);
  }
}

// rows_amx for a weight's group width (K / G: 32, or 16 for Q6_K's bytes)
template <int BITS, bool OFF, int NBK, bool PRE>
void rows_amx_g(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const Block* blk, const float* xs, float z,
                const uint16_t* const* pre) {
  if constexpr (BITS == 8) {
    if (K == 16 * G) return rows_amx<BITS, OFF, NBK, PRE, 2>(mc, a, G, blk, xs, z, pre);
  }
  rows_amx<BITS, OFF, NBK, PRE, 3>(mc, a, G, blk, xs, z, pre);
}

}  // namespace

void amx_limbs(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t g, bool swap, uint16_t* out) {
  const __m512i order = swap ? _mm512_set_epi32(15, 13, 14, 12, 11, 9, 10, 8, 7, 5, 6, 4, 3, 1, 2, 0)
                             : _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t W = amx_width(g);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t0 = m / AMX_ROWS * AMX_ROWS, mc = std::min<int64_t>(AMX_ROWS, M - t0);
    uint16_t* ot = out + t0 * W * K + (m - t0) * 32;  // row m's tile, row m - t0 of each of its A tiles
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_permutexvar_ps(order, _mm512_loadu_ps(x + m * ldx + k));
      const __m256i h0 = to_bf16(v);
      const __m512 r1 = _mm512_sub_ps(v, widen_bf16(h0));
      const __m256i h1 = to_bf16(r1);
      const __m256i h2 = to_bf16(_mm512_sub_ps(r1, widen_bf16(h1)));
      if (g == 16) {  // group k / 16: x0 | x1 in one tile, x2 | zeros in the next
        uint16_t* o = ot + (k / 16) * 2 * mc * 32;
        _mm256_storeu_si256((__m256i*)o, h0);
        _mm256_storeu_si256((__m256i*)(o + 16), h1);
        _mm256_storeu_si256((__m256i*)(o + mc * 32), h2);
        _mm256_storeu_si256((__m256i*)(o + mc * 32 + 16), _mm256_setzero_si256());
      } else {  // group k / 32: limbs 0, 1, 2 (one A tile each)
        uint16_t* o = ot + (k / 32) * 3 * mc * 32 + k % 32;
        _mm256_storeu_si256((__m256i*)o, h0);
        _mm256_storeu_si256((__m256i*)(o + mc * 32), h1);
        _mm256_storeu_si256((__m256i*)(o + 2 * mc * 32), h2);
      }
    }
  }
}

void amx_config(int64_t mc) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) {  // C (tmm0-3) and the limbs' A (tmm4, 5): mc rows of 16 floats or 32 bf16
    c.rows[t] = (uint8_t)mc;
    c.colsb[t] = 64;
  }
  for (int t = 6; t < 8; ++t) {  // B: 16 rows of 32 bf16
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  // the configuration is read through a pointer GCC's builtin does not declare: keep its stores
  __asm__ __volatile__("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

void amx_release() { _tile_release(); }

template <int BITS, bool OFF>
void amx_rows(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint8_t* cb, Sc sc, Sc of,
              const float* xs, float z, float* res) {
  static_assert(AMX_CODES<BITS>, "AMX tiles take 4- and 5-bit codes and bytes");
  const Block blk[1] = {{cb, sc, of, res}};
  rows_amx_g<BITS, OFF, 1, false>(mc, a, K, G, blk, xs, z, nullptr);
}

template <int BITS>
void amx_decode(const uint8_t* cb, int64_t G, int64_t g, float z, uint16_t* out) {
  static_assert(AMX_CODES<BITS>, "AMX tiles take 4- and 5-bit codes and bytes");
  const int64_t CB = group_bytes(BITS, g);
  const __m512i table = BITS == 8 ? __m512i{} : code_table<BITS>(z);
  const char* end = (const char*)(cb + G * CB);
  for (int64_t j = 0; j < G; ++j) {
    for (int64_t o = 0; o < CB; o += 64)  // the codes a few groups on (they stream from memory once a call)
      if ((const char*)cb + (j + 8) * CB + o < end) _mm_prefetch((const char*)cb + (j + 8) * CB + o, _MM_HINT_T0);
    decode_b<BITS>(cb + j * CB, out + j * 16 * 32, table, g);
  }
}

template <int BITS, bool OFF>
void amx_rows_pre(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint16_t* b, Sc sc, Sc of,
                  const float* xs, float* res) {
  static_assert(AMX_CODES<BITS>, "AMX tiles take 4- and 5-bit codes and bytes");
  const Block blk[1] = {{nullptr, sc, of, res}};
  const uint16_t* pre[1] = {b};
  rows_amx_g<BITS, OFF, 1, true>(mc, a, K, G, blk, xs, 0.f, pre);
}

template <int BITS, bool OFF>
void amx_rows2_pre(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint16_t* b0, Sc sc0, Sc of0,
                   const uint16_t* b1, Sc sc1, Sc of1, const float* xs, float* res0, float* res1) {
  static_assert(AMX_CODES<BITS>, "AMX tiles take 4- and 5-bit codes and bytes");
  const Block blk[2] = {{nullptr, sc0, of0, res0}, {nullptr, sc1, of1, res1}};
  const uint16_t* pre[2] = {b0, b1};
  rows_amx_g<BITS, OFF, 2, true>(mc, a, K, G, blk, xs, 0.f, pre);
}

template <int BITS, bool OFF>
void amx_rows2(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint8_t* cb0, Sc sc0, Sc of0,
               const uint8_t* cb1, Sc sc1, Sc of1, const float* xs, float z, float* res0, float* res1) {
  static_assert(AMX_CODES<BITS>, "AMX tiles take 4- and 5-bit codes and bytes");
  const Block blk[2] = {{cb0, sc0, of0, res0}, {cb1, sc1, of1, res1}};
  rows_amx_g<BITS, OFF, 2, false>(mc, a, K, G, blk, xs, z, nullptr);
}

#else  // no AMX in this build: amx_on() is false and nothing below runs

void amx_limbs(const float*, int64_t, int64_t, int64_t, int64_t, bool, uint16_t*) {}
void amx_config(int64_t) {}
void amx_release() {}
template <int BITS, bool OFF>
void amx_rows(int64_t, const uint16_t*, int64_t, int64_t, const uint8_t*, Sc, Sc, const float*, float, float*) {}
template <int BITS, bool OFF>
void amx_rows2(int64_t, const uint16_t*, int64_t, int64_t, const uint8_t*, Sc, Sc, const uint8_t*, Sc, Sc,
               const float*, float, float*, float*) {}
template <int BITS, bool OFF>
void amx_rows2_pre(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, Sc, Sc, const uint16_t*, Sc, Sc,
                   const float*, float*, float*) {}
template <int BITS>
void amx_decode(const uint8_t*, int64_t, int64_t, float, uint16_t*) {}
template <int BITS, bool OFF>
void amx_rows_pre(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, Sc, Sc, const float*, float*) {}

#endif

#define SELFSPEC_INSTANTIATE(BITS, OFF)                                                                         \
  template void amx_rows<BITS, OFF>(int64_t, const uint16_t*, int64_t, int64_t, const uint8_t*, Sc, Sc, const float*, \
                                    float, float*);                                                                \
  template void amx_rows2<BITS, OFF>(int64_t, const uint16_t*, int64_t, int64_t, const uint8_t*, Sc, Sc,           \
                                     const uint8_t*, Sc, Sc, const float*, float, float*, float*);   \
  template void amx_rows2_pre<BITS, OFF>(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, Sc, Sc,   \
                                         const uint16_t*, Sc, Sc, const float*, float*, float*);                 \
  template void amx_rows_pre<BITS, OFF>(int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, Sc, Sc,    \
                                        const float*, float*);
SELFSPEC_EACH_CODE(SELFSPEC_INSTANTIATE)
#undef SELFSPEC_INSTANTIATE
template void amx_decode<4>(const uint8_t*, int64_t, int64_t, float, uint16_t*);
template void amx_decode<5>(const uint8_t*, int64_t, int64_t, float, uint16_t*);
template void amx_decode<8>(const uint8_t*, int64_t, int64_t, float, uint16_t*);

}  // namespace qcodes
