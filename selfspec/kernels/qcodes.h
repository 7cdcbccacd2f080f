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
//   scales   # [N / 16, G, 16] float32   s of each row's group: float16 for the legacy types; on AVX-512 builds the
//                                         K-quants' two levels (sub-scale bytes, float16 d per super-block) as the
//                                         GGUF stores them, [N / 16, G / P, 16 P + 32] bytes (see Scales)
//   offsets  # the same form as scales    o (only for types with one; else an empty tensor)
// Inside a group of 16 rows x g columns (k = 0 .. g-1), CB bytes:
//   bits 4: g / 2 vectors of 16 bytes, byte r of vector p = q[r][2p] | q[r][2p + 1] << 4;
//   bits 5 (g = 32), AVX-512 builds ("words"): 5 vectors of 16 32-bit words; bits 5c .. 5c + 4 of word r of
//           vector w hold q[r][6w + c] (columns 0-29), and the words' top two bits hold columns 30 and 31: with
//           S = sum_w (word_w >> 30) << 2w, q[r][30] = S & 31 and q[r][31] = S >> 5. 320 bytes, 5 bits a code;
//   bits 5, AVX2 builds ("planes"): the 4-bit layout, then one 16-bit plane per column (bit r = bit 4 of q[r][k]);
//   bits 8: g vectors of 16 bytes, byte r of vector k = q[r][k].
// Worked example, bits 5, one row: codes 1, 2, 3, 4, 5, 6 of columns 0-5 make word 0 = 1 | 2 << 5 | 3 << 10 |
// 4 << 15 | 5 << 20 | 6 << 25 (+ S's bits 0-1 << 30); a column's code is one shift (and a mask) of its word, so
// the AVX-512 path (qlinear.cpp) gets its value from a 32-entry table with one two-source permute, which reads only
// the index's low five bits, and the int8 mode's bytes with one vpmultishiftqb. With planes the fifth bit
// costs a mask load and a masked add per column: ~4 vector ops a column against ~2.8 (docs/QUANTIZED.md has the
// A/B). AVX2 has neither permute, and its paths run slower on words than on planes (the int8 mode's most), so AVX2
// builds keep planes: the layout is the build's (words5(), PACK_VERSION's layout tag in the packed cache).
//
// This header holds what the kernel files for these weights share: the codes' unpacking (planes, words, column
// pairs, a group's bytes and prefetch, a group dequantized), the dispatch on code width, the argument checks, and
// the parts of the decoding kernels that qargmax.cpp reuses. The kernels themselves: qlinear.cpp (float32
// activations; qlinear_amx.cpp: its group sums on AMX tiles), qlinear_i8.cpp (the 8-bit activation mode),
// qargmax.cpp (the greedy screen and its bound table), qdense.cpp (dequantized rows and tiles), qgemm.cpp (the
// prefill's panels).
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace qcodes {

using simd::bcast;
using simd::fma;
using simd::loadf;
using simd::vf;
// lanes per vector (simd.h): on AVX-512 a block's 16 rows are one register, on AVX2 two (halves h = 0, 1)
using simd::VL;

constexpr int L = 16;  // output rows per block
constexpr int64_t CALL_ROWS = 16;  // the FMA kernels take a prefill's rows in runs of this many (as separate calls)
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

inline vi widen_signed(const uint8_t* p) {  // VL bytes read as int8 -> VL int32 (vpmovsxbd)
#if defined(__AVX512F__)
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
#endif
}

inline vf halves(const uint16_t* p) {  // VL float16 -> VL float32 (exact)
#if defined(__AVX512F__)
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#endif
}

// A packed weight's scales (or offsets) in any of its forms (Scales), and as the decoding tiles read them (Sc).
//
// Scales: one value per output row and group, read 16 (a block's rows) at a time.
// Value i is group i / 16's, row i % 16's (flat over blocks and groups: block b's group j starts at (b G + j) 16).
// Three forms, each holding exactly the values formats.py decodes, so every kernel computes with the same weights
// whichever a weight has (selfspec/quant/packing.py makes them):
//   F32   [NB, G, 16] float32;
//   F16   [NB, G, 16] float16: the legacy types, whose d and m are float16 in the GGUF (widening is exact);
//   K     the K-quants' two levels as the GGUF stores them: per super-block of P = 256 / g groups, P x 16 sub-scale
//         bytes (Q4_K / Q5_K's 6-bit sc or m: unsigned, KU8; Q6_K's int8 sc: signed, KI8), then the super-block's
//         16 float16 d (or dmin): [NB, G / P, 16 P + 32] bytes, 1.125 bytes a value at P = 8 (F32: 4). The value is
//         d * sub in float32, the product gguf-py forms (exact: 11 significant bits times at most 8).
// The paths that are not bound by a decoding step's instructions (panels, dense rows and tiles, the screen's table)
// read every form through Scales; the decoding tiles read a block's values through Sc (below).
enum ScKind : int { F32 = 0, F16 = 1, KU8 = 2, KI8 = 3 };
struct Scales {
  const void* p = nullptr;
  int kind = F32;
  int shift = 0;      // K forms: log2 P
  int64_t base = 0;   // K forms: the index of p's value 0 (operator+ moves this, not p)
  bool k() const { return kind >= KU8; }
  const char* superblock(int64_t v) const { return (const char*)p + ((v >> 4) >> shift) * ((16 << shift) + 32); }
  const char* addr(int64_t i) const {  // of value i (K forms: its sub-scale byte)
    if (!k()) return (const char*)p + i * (kind == F16 ? 2 : 4);
    const int64_t v = base + i;
    return superblock(v) + ((v >> 4) & ((1 << shift) - 1)) * 16 + (v & 15);
  }
  const uint16_t* super(int64_t i) const {  // K forms: the float16 d (dmin) that value i's sub-scale multiplies
    const int64_t v = base + i;
    return (const uint16_t*)(superblock(v) + (16 << shift)) + (v & 15);
  }
  Scales operator+(int64_t i) const {
    if (!p) return *this;
    return k() ? Scales{p, kind, shift, base + i} : Scales{addr(i), kind, shift, 0};
  }
  vf vec(int64_t i) const {  // VL values from value i (i % 16 is 0 or, on AVX2, 8)
    if (kind == F32) return loadf((const float*)p + i);
    if (kind == F16) return halves((const uint16_t*)p + i);
    const uint8_t* s = (const uint8_t*)addr(i);
    const vi sub = kind == KU8 ? widen(s) : widen_signed(s);
    return halves(super(i)) * __builtin_convertvector(sub, vf);
  }
  float at(int64_t i) const {
    if (kind == F32) return ((const float*)p)[i];
    if (kind == F16) return _cvtsh_ss(((const uint16_t*)p)[i]);
    const uint8_t s = *(const uint8_t*)addr(i);
    return _cvtsh_ss(*super(i)) * (float)(kind == KU8 ? (int)s : (int)(int8_t)s);
  }
};

// A block's scales (or offsets) as the decoding tiles read them: float32, or float16 where every value is exact in
// it (the legacy types' d and m, as the GGUF stores them); widening a half is exact. The flag is per weight and
// checked per group (a predictable branch beside a group's 16-32 columns of work). A K form reaches the tiles
// expanded (expand_block), so their per-group work is that of a float32 weight's.
struct Sc {
  const void* p = nullptr;
  bool half = false;
  const char* addr(int64_t i) const { return (const char*)p + i * (half ? 2 : 4); }  // of value i
  Sc operator+(int64_t i) const { return {p ? addr(i) : nullptr, half}; }
  vf vec(int64_t i) const { return half ? halves((const uint16_t*)p + i) : loadf((const float*)p + i); }
  float at(int64_t i) const { return half ? _cvtsh_ss(((const uint16_t*)p)[i]) : ((const float*)p)[i]; }
};

// Block ``s``'s values (``sc + b G 16``) for the tiles: a float32 or float16 form as it is; a K form expanded once per
// block into ``out`` (16 G floats; a super-block's d widened once for its P groups): d * sub in float32, the values
// Scales::vec gives. A K form's blocks start on a super-block (G is a multiple of P).
inline Sc expand_block(Scales s, int64_t G, float* out) {
  if (!s.p) return {};
  if (!s.k()) return {s.p, s.kind == F16};
  const int64_t P = int64_t(1) << s.shift, SB = 16 * P + 32;
  const char* first = s.superblock(s.base);
  for (int64_t q = 0; q < G / P; ++q) {
    const uint8_t* sub = (const uint8_t*)(first + q * SB);
    const uint16_t* d = (const uint16_t*)(sub + 16 * P);
    for (int h = 0; h < L / VL; ++h) {
      const vf dv = halves(d + VL * h);
      for (int64_t r = 0; r < P; ++r) {
        const vi v = s.kind == KU8 ? widen(sub + r * 16 + VL * h) : widen_signed(sub + r * 16 + VL * h);
        const vf val = dv * __builtin_convertvector(v, vf);
        std::memcpy(out + (q * P + r) * L + VL * h, &val, sizeof(vf));
      }
    }
  }
  return {out, false};
}

// Block b's scales and offsets for the tiles (expand_block); a K form's go into this thread's buffer (grown as needed
// and kept between calls), one per slot, so that two blocks' (slot 0, 1: a pair on AMX tiles) are alive at once.
// Offsets without a pointer stay empty.
struct BlockSc {
  Sc s, o;
};
inline BlockSc block_scales(Scales sc, Scales of, int64_t b, int64_t G, int slot = 0) {
  float* buf = nullptr;
  if (sc.k()) {
    thread_local std::vector<float> kept[2];
    std::vector<float>& k = kept[slot];
    if ((int64_t)k.size() < 2 * G * L) k.resize(2 * G * L);
    buf = k.data();
  }
  return {expand_block(sc + b * G * L, G, buf), expand_block(of + b * G * L, G, buf ? buf + G * L : nullptr)};
}

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
inline const PlaneTable<16> plane16;

// q plus 16 in the lanes (of half h) whose bit is set in the 16-bit plane of column k (one table row).
inline vi add_plane(vi q, const uint8_t* planes, int k, int h) {
  const int32_t* row = plane16.v[planes[2 * k + h]];  // byte h: lanes 8h .. 8h + 7
  vi t;
  std::memcpy(&t, row, sizeof t);
  return q + t;
}
#endif

// 5-bit codes as words (AVX-512 builds, so one vector holds a word's 16 rows): word w of a group, all five words
// with their spare bits S (columns 30 and 31, returned).
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

// Whether a type's codes take the group-sum path (tile_lookup: AVX-512; 4- and 5-bit codes, bytes without offsets).
template <int BITS, bool OFF>
constexpr bool LOOKUP = VL == 16 && (BITS == 4 || BITS == 5 || (BITS == 8 && !OFF));

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

// res[mc][16] (+ bias) into y's rows (stride ldy), the first ``rows`` columns of the block, or added to them.
inline void store_tile(const float* res, int64_t mc, float* y, int64_t ldy, int64_t rows, const float* bias,
                       bool accumulate) {
  for (int64_t m = 0; m < mc; ++m)
    for (int64_t r = 0; r < rows; ++r) {
      const float v = res[m * L + r] + (bias ? bias[r] : 0.f);
      y[m * ldy + r] = accumulate ? y[m * ldy + r] + v : v;
    }
}

// qlinear_amx.cpp: the exact kernel's group sums on AMX tiles, for 4- and 5-bit codes in groups of 32 and bytes in
// groups of 16 or 32 (AMX_CODES, amx_takes).
// amx_on(): the build has AMX, Linux granted the tile state, and neither SELFSPEC_AMX=0 nor amx_set(false) turned
// it off; qlinear's run and tile_rows then take it for every row count (bytes: from AMX_BYTES_ROWS rows of a call),
// so that qlinear and qargmax agree bit for bit.
bool amx_available();
bool amx_on();
void amx_set(bool on);
template <int BITS>
constexpr bool AMX_CODES = BITS == 4 || BITS == 5 || BITS == 8;  // the code widths the tiles take
constexpr int64_t AMX_ROWS = 16;  // x-rows per call of amx_rows (a tile's rows)
// bfloat16 limb values per activation in amx_limbs' layout: 3 (groups of 32), 4 (groups of 16: one limb padded)
inline int64_t amx_width(int64_t g) { return g == 16 ? 4 : 3; }
// x [M, ldx] -> out, per tile of AMX_ROWS x-rows (mc rows in the last), each group's three limbs (x = x0 + x1 + x2
// exactly) as A tiles of contiguous rows: groups of 32 [K / 32, 3, mc, 32] (one limb a tile), groups of 16
// [K / 16, 2, mc, 32] (x0 | x1, then x2 | zeros). Their columns come in the order of the codes' B tiles (swap: 4-bit
// codes, 0 2 1 3 in every four).
void amx_limbs(const float* x, int64_t M, int64_t K, int64_t ldx, int64_t g, bool swap, uint16_t* out);
void amx_config(int64_t mc);  // this thread's tiles for mc <= AMX_ROWS x-rows
void amx_release();
// res[mc][16] for one block, as tile_rows: a = the mc rows' limbs (amx_limbs)
template <int BITS, bool OFF>
void amx_rows(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint8_t* cb, Sc sc, Sc of, const float* xs,
              float z, float* res);
// the same for two blocks at once (they share the limbs' tile loads): each block's res as amx_rows gives it
template <int BITS, bool OFF>
void amx_rows2(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint8_t* cb0, Sc sc0, Sc of0,
               const uint8_t* cb1, Sc sc1, Sc of1, const float* xs, float z, float* res0, float* res1);
// a prefill's tiles of x-rows share each block's B tiles, decoded once: amx_decode's out # [G, 16 * 32] bf16
template <int BITS>
void amx_decode(const uint8_t* cb, int64_t G, int64_t g, float z, uint16_t* out);
// res[mc][16] for one block as amx_rows gives it, its B tiles from amx_decode (b)
template <int BITS, bool OFF>
void amx_rows_pre(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint16_t* b, Sc sc, Sc of,
                  const float* xs, float* res);
template <int BITS, bool OFF>
void amx_rows2_pre(int64_t mc, const uint16_t* a, int64_t K, int64_t G, const uint16_t* b0, Sc sc0, Sc of0,
                   const uint16_t* b1, Sc sc1, Sc of1, const float* xs, float* res0, float* res1);
constexpr int64_t AMX_CHUNK_BYTES = 2 << 20;  // a prefill's x-rows per pass over the blocks: their limbs' bytes
constexpr int64_t AMX_PAIR_ROWS = 8;  // up to this many x-rows, qlinear's run takes blocks in pairs (registers)
// Bytes take the tiles from this many rows of a call: their conversion to bfloat16 costs more than the tiles save
// below it (docs/QUANTIZED.md), so a step's LM head stays on the FMA kernel. Bytes in groups of 16 (Q6_K: two tiles
// and a read of the sums per 16 columns) gain only in a prefill, past one tile of rows.
constexpr int64_t AMX_BYTES_ROWS = 8;
// whether a call of M x-rows on groups of g takes the tiles (qlinear's run and qargmax decide it for the whole call)
template <int BITS>
inline bool amx_takes(int64_t g, int64_t M) {
  if constexpr (BITS == 8)
    return ((g == 32 && M >= AMX_BYTES_ROWS) || (g == 16 && M > AMX_ROWS)) && amx_on();
  return AMX_CODES<BITS> && g == 32 && amx_on();
}

// M(BITS, OFF) for every code width and offset case dispatch covers (explicit instantiations of the tile functions).
#define SELFSPEC_EACH_CODE(M) M(4, false) M(4, true) M(5, false) M(5, true) M(8, false) M(8, true)

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

inline void check_packed(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                         int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "code width must be 4, 5 or 8 bits, got ", bits);
  TORCH_CHECK(group % 2 == 0 && group > 0, "group size must be even, got ", group);
  TORCH_CHECK(bits != 5 || group == 32, "5-bit codes come in groups of 32, got ", group);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes: [N/16, G, CB] uint8");
  TORCH_CHECK(codes.size(2) == group_bytes(bits, group), "codes: ", codes.size(2), " bytes per group, expected ",
              group_bytes(bits, group));
  const auto type = scales.scalar_type();
  const bool k = type == at::kByte || type == at::kChar;
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == codes.size(0) &&
                  (type == at::kFloat || type == at::kHalf || k),
              "scales: [N/16, G, 16] float32 or float16, or the K-quants' [N/16, G/P, 16 P + 32] uint8 or int8");
  if (k) {
    const int64_t P = (scales.size(2) - 32) / 16;
    TORCH_CHECK(P > 0 && (P & (P - 1)) == 0 && scales.size(2) == 16 * P + 32 && scales.size(1) * P == codes.size(1),
                "K-quant scales: [N/16, G/P, 16 P + 32] bytes with P a power of two, got ", scales.sizes(), " for ",
                codes.size(1), " groups");
  } else {
    TORCH_CHECK(scales.size(1) == codes.size(1) && scales.size(2) == L, "scales: [N/16, G, 16]");
  }
  TORCH_CHECK(offsets.numel() == 0 || (offsets.sizes() == scales.sizes() && offsets.is_contiguous() &&
                                       offsets.scalar_type() == scales.scalar_type()),
              "offsets: empty or shaped (and typed) like scales");
}

// The zero point a packed weight's codes are read with.
inline void check_zero(int64_t bits, double z) {
  // bytes are read as q - 128 (tile_lookup flips the top bit; the int8 mode's AVX2 path subtracts 128)
  TORCH_CHECK(bits != 8 || z == 128.0, "8-bit codes must have zero point 128 (Q8_0, Q6_K), got ", z);
}

// The arguments of qlinear / qlinear_i8, checked.
// x [M, K] against a checked packed weight, and the zero point its codes are read with.
inline void check_x(const at::Tensor& x, const at::Tensor& codes, int64_t bits, int64_t group, double z) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(x.size(1) == codes.size(1) * group, "x has ", x.size(1), " columns, the weight ", codes.size(1) * group);
  check_zero(bits, z);
}

inline void check_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
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
inline Scales sc_of(const at::Tensor& t) {
  if (!t.numel()) return {};
  const auto type = t.scalar_type();
  if (type == at::kFloat || type == at::kHalf) return {t.data_ptr(), type == at::kHalf ? F16 : F32};
  const int64_t P = (t.size(2) - 32) / 16;  // groups per super-block (check_packed: a power of two)
  return {t.data_ptr(), type == at::kByte ? KU8 : KI8, __builtin_ctzll(P)};
}

// The raw pointers and sizes of a checked qlinear / qlinear_i8 call (the packed weight, bias, output).
struct LinearArgs {
  int64_t M, K, NB, G, N, ldy;
  const uint8_t* codes;
  Scales scales;
  Scales offsets;  // p == nullptr: the type has no offsets
  const float* bias;     // nullptr: none
  float* y;
  float z;
  bool off;
};

inline LinearArgs linear_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& offsets, int64_t bits, int64_t group, double z, const at::Tensor& bias,
                              at::Tensor& out) {
  check_linear(x, codes, scales, offsets, bits, group, z, bias, out);
  const bool off = offsets.numel() > 0;
  return {x.size(0), x.size(1), codes.size(0), codes.size(1), out.size(1), out.stride(0),
          codes.data_ptr<uint8_t>(), sc_of(scales), sc_of(offsets),
          bias.numel() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), (float)z, off};
}

// The checked call's weight as the raw kernels take it.
inline raw::QWeight weight_of(const LinearArgs& a, int64_t bits, int64_t group) {
  return {a.codes, a.scales.p, a.offsets.p, a.scales.kind, a.scales.shift, a.NB, a.G, group, bits, a.z};
}

// Group j of block b dequantized and transposed: o[k * ldo + r] = weight of output row 16 b + r, column g j + k
// (qdense_t's tiles, the prefill's panels, the screen's bound table).
template <int BITS, bool OFF>
inline void group_t(const uint8_t* codes, Scales sc, Scales of, int64_t G, int64_t g, vf zv, int64_t b,
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

// A raw weight's scales and offsets as the kernels read them.
inline Scales scales_of(const raw::QWeight& w) { return {w.scales, w.scale_kind, w.scale_shift}; }
inline Scales offsets_of(const raw::QWeight& w) { return {w.offsets, w.scale_kind, w.scale_shift}; }

// ---- what qargmax.cpp takes from the decoding kernels (qlinear.cpp, qlinear_i8.cpp) ----------------------------

// Whether the int8 kernel uses AVX-512 VNNI (qlinear_i8.cpp: vpdpbusd; else AVX2's vpmaddubsw or int32 vector ops).
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__BMI2__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// x-rows per int8 tile: 8 with VNNI (16 integer sums and two code registers fit in 32 registers; at 5-8 rows the
// weights are then decoded once instead of twice), 4 on AVX2 (16 registers). Integer sums are exact and each row's
// float scaling is the same in any tile, so the tile size changes no result.
constexpr int64_t MC_I8 = VNNI ? 8 : 4;

// mc <= MCMAX x-rows against one block (qlinear.cpp): xm [mc, K] (row stride K), the block's codes cb, scales sb and
// offsets ob, xs its rows' group sums (group_sums) -> res[mc][16], as qlinear computes them in a call of call_rows
// rows (which decides amx_takes).
template <int BITS, bool OFF>
void tile_rows(int64_t call_rows, int64_t mc, const float* xm, int64_t K, int64_t G, int64_t g, const uint8_t* cb,
               Sc sb, Sc ob, const float* xs, float z, float* res);

// x [M, K] rounded to 8 bits per group of ``group`` columns (d = max|x| / 127, x / d to nearest, ties to even):
// qx [M, K], dx and the code sums sx [M, G], and on AVX2 the activation pairs (xpairs). ``finite``: every x was.
struct Rounded {
  std::unique_ptr<int8_t[]> qx, pairs;
  std::vector<float> dx;
  std::vector<int32_t> sx;
  bool finite = true;
  Rounded(const float* xp, int64_t M, int64_t K, int64_t group, int64_t bits);  // qlinear_i8.cpp
};

// Rows [m0, m0 + mc) of the rounded activations (mc <= MC_I8) against block b: res[mc][16] (qlinear_i8.cpp).
template <int BITS, bool OFF>
void tile_i8_rows(const int8_t* qx, const int8_t* xp, const float* dx, const int32_t* sx, int64_t m0, int64_t mc,
                  int64_t K, int64_t G, int64_t g, const uint8_t* codes, Scales sc, Scales of, int64_t b, float z,
                  float* res);

}  // namespace qcodes
