// selfspec's fused attention for the decoding hot loop (float32; ops.cpp has the other fused ops and their
// reasons): causal grouped-query attention of new queries over one layer's static cache.
//
// Layouts (batch B, n new tokens, hq query heads, hkv key/value heads, head_dim d):
//   q      # [B, n, hq, d]                queries after rotary (ops.cpp's rope_qkv)
//   keys   # [B, hkv, capacity, d]        the static cache of one layer (values alike)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <omp.h>
#include <vector>

#include "kernels.h"
#include "simd.h"

using simd::exp_inplace;

// Causal attention of n new queries (positions start .. start + n - 1) over the cache's first
// start + n entries, grouped-query heads, optional sliding window (0: none): query at position p
// sees keys j with max(0, p - window + 1) <= j <= p. Returns [B, n, hq * d].
//
// The group * n query rows that share one key/value head are computed together, LANES rows to a work
// item, one row per vector lane: for each key, score[lane] = q[lane] . k over the head dim with the key's
// element broadcast (no horizontal sum per key), the softmax (max, exp, sum) lane-wise, then each row's
// weighted sum of values. A row's arithmetic is the same whatever the other lanes hold (masked keys
// weigh exactly 0), so a block of n queries gives bitwise the rows of n single-query calls: the int8
// numerics mode relies on that.
//
// LANES is one vector: 16 floats on AVX-512, 8 on AVX2 (where 16 lanes cost two vectors, and a single step's rows,
// the query heads of one key/value head, 3 on SmolLM2 and 7 on Qwen2.5-0.5B, left most of them idle). One width per
// build, so a row's arithmetic never depends on the block it came in.
constexpr int64_t LANES = simd::VL;

static void attend(const float* __restrict qp, const float* __restrict kp, const float* __restrict vp, float* __restrict op,
                   int64_t B, int64_t n, int64_t hq, int64_t d, int64_t hkv, int64_t cap, int64_t start, int64_t window,
                   float sc) {
  const int64_t group = hq / hkv, rows = group * n, chunks = (rows + LANES - 1) / LANES, len = start + n;
#pragma omp parallel
  {
    std::vector<float> qt(d * LANES), score(len * LANES);
    alignas(64) float mx[LANES], total[LANES];
    alignas(64) int32_t lo[LANES], hi[LANES];
#pragma omp for collapse(3) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < hkv; ++g)
        for (int64_t c = 0; c < chunks; ++c) {
          const float* K = kp + (b * hkv + g) * cap * d;
          const float* V = vp + (b * hkv + g) * cap * d;
          const int64_t r0 = c * LANES, nr = std::min(LANES, rows - r0);
          int64_t jlo = len, jhi = 0;
          for (int64_t l = 0; l < LANES; ++l) {  // lane l: query i = r / group of head g * group + r % group
            const int64_t r = r0 + l, i = r / group, h = g * group + r % group;
            const bool live = l < nr;
            const int64_t pos = start + i;
            lo[l] = live ? static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0) : 1;
            hi[l] = live ? static_cast<int32_t>(pos) : 0;  // a padding lane sees no key (lo > hi)
            for (int64_t t = 0; t < d; ++t) qt[t * LANES + l] = live ? qp[((b * n + i) * hq + h) * d + t] : 0.f;
            if (live) {
              jlo = std::min<int64_t>(jlo, lo[l]);
              jhi = std::max<int64_t>(jhi, hi[l]);
            }
            mx[l] = -INFINITY;
            total[l] = 0.f;
          }
          // keys KB at a time: KB independent multiply-add chains per lane (one chain per key is
          // latency-bound; fewer chains leave the two FMA pipes partly idle, more gain nothing); each key's dot
          // is still summed over t in order, so a row's score never depends on how the keys were grouped (bit for
          // bit the same for any KB)
          constexpr int64_t KB = 8;
          for (int64_t j0 = jlo; j0 <= jhi; j0 += KB) {
            const int64_t nk = std::min<int64_t>(KB, jhi - j0 + 1);
            alignas(64) float d4[KB][LANES];
            const float* k4[KB];
            for (int64_t u = 0; u < KB; ++u) k4[u] = K + (j0 + (u < nk ? u : 0)) * d;
            for (int64_t u = 0; u < KB; ++u)
#pragma omp simd
              for (int64_t l = 0; l < LANES; ++l) d4[u][l] = 0.f;
            for (int64_t t = 0; t < d; ++t) {
              const float* qt_t = qt.data() + t * LANES;
              float a[KB];
              for (int64_t u = 0; u < KB; ++u) a[u] = k4[u][t];
#pragma omp simd
              for (int64_t l = 0; l < LANES; ++l) {
                const float x = qt_t[l];
                for (int64_t u = 0; u < KB; ++u) d4[u][l] += x * a[u];
              }
            }
            for (int64_t u = 0; u < nk; ++u) {
              const int64_t j = j0 + u;
              float* sj = score.data() + (j - jlo) * LANES;
#pragma omp simd
              for (int64_t l = 0; l < LANES; ++l) {
                const float s = (j >= lo[l] && j <= hi[l]) ? d4[u][l] * sc : -INFINITY;
                sj[l] = s;
                mx[l] = s > mx[l] ? s : mx[l];
              }
            }
          }
          for (int64_t j = jlo; j <= jhi; ++j) {  // e^(s - max), 0 for masked keys; x < -87 gives e^-87
            float* sj = score.data() + (j - jlo) * LANES;
            alignas(64) float e[LANES];
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) e[l] = std::max(sj[l] - mx[l], -87.f);
            exp_inplace(e, LANES);
#pragma omp simd
            for (int64_t l = 0; l < LANES; ++l) {
              sj[l] = sj[l] == -INFINITY ? 0.f : e[l];
              total[l] += sj[l];
            }
          }
          // weighted values, all lanes at once, eight head-dim columns per pass (eight accumulators of
          // LANES rows): each value element is broadcast against the lanes' weights, so the values are
          // read once per chunk, not once per row
#pragma omp simd
          for (int64_t l = 0; l < LANES; ++l) total[l] = 1.f / total[l];
          for (int64_t t0 = 0; t0 < d; t0 += 8) {
            const int64_t nt = std::min<int64_t>(8, d - t0);
            alignas(64) float a8[8][LANES] = {};
            for (int64_t j = jlo; j <= jhi; ++j) {
              const float* pj = score.data() + (j - jlo) * LANES;
              const float* vj = V + j * d + t0;
              for (int64_t u = 0; u < nt; ++u) {
                const float v = vj[u];
#pragma omp simd
                for (int64_t l = 0; l < LANES; ++l) a8[u][l] += pj[l] * v;
              }
            }
            for (int64_t l = 0; l < nr; ++l) {
              const int64_t r = r0 + l, i = r / group, h = g * group + r % group;
              float* o = op + ((b * n + i) * hq + h) * d + t0;
              for (int64_t u = 0; u < nt; ++u) o[u] = a8[u][l] * total[l];
            }
          }
        }
  }
}

// Decoding blocks (at most DECODE_ROWS new tokens): each query row and head on its own, its keys in the vector lanes.
// The kernel above puts the query rows of a key/value head in the lanes, so a single step's few rows (3 on
// SmolLM2-135M, 7 on Qwen2.5-0.5B) would leave most lanes idle for every key and head dimension, where attention over a
// long context is a large part of a small model's decoding step. Here a key's score is its q * k products over the head
// dimension in lanes, VL keys' vectors summed across their lanes by one fixed tree of horizontal adds (sum_lanes), so a
// block of VL keys comes out as one vector of scores; the softmax runs over those vectors; the weighted values
// accumulate with the head dimension in lanes (two accumulators: even and odd keys). Blocks start at multiples of VL
// and a row's arithmetic depends only on its own key range, so a block of n queries still gives bitwise the rows of n
// single-query calls (what the int8 mode relies on). Prefills (more rows) keep the kernel above: every lane a live row,
// the better layout there.
// A work item takes a key/value head's query heads (and rows) together (attend_rows), so the head's keys and values
// are read once per work item, not once per query head of its group: with one work item per (row, query head), a
// shape like Qwen2.5-0.5B's (7 query heads a key/value head) would read each key 7 times and lose to the
// rows-in-lanes kernel even with 9 of its 16 lanes idle.
namespace {
constexpr int64_t DECODE_ROWS = 16;
// Query heads per key/value head up to which decoding blocks take this kernel (a model's choice, never a block's:
// a block's rows and single steps must take the same one). Set past every model this project has met
// (Qwen2.5-0.5B: 7); attend_rows' scratch is sized per call, so the bound is not a buffer's.
constexpr int64_t DECODE_GROUP = 64;
using simd::bcast;
using simd::fma;
using simd::loadf;
using simd::storef;
using simd::vf;
using simd::VL;  // lanes: keys per block, head-dimension floats per vector
using simd::hmax;
using simd::vmax;
#if defined(__AVX512F__)
inline vf in_range(vf keep, vf alt, vf j, float hi) {  // keep where 0 <= j <= hi (exact small integers), else alt
  const __mmask16 m = _mm512_cmp_ps_mask((__m512)j, _mm512_setzero_ps(), _CMP_GE_OQ) &
                      _mm512_cmp_ps_mask((__m512)j, (__m512)bcast(hi), _CMP_LE_OQ);
  return (vf)_mm512_mask_mov_ps((__m512)alt, m, (__m512)keep);
}
#else
inline vf in_range(vf keep, vf alt, vf j, float hi) {
  const __m256 m = _mm256_and_ps(_mm256_cmp_ps((__m256)j, _mm256_setzero_ps(), _CMP_GE_OQ),
                                 _mm256_cmp_ps((__m256)j, (__m256)bcast(hi), _CMP_LE_OQ));
  return (vf)_mm256_blendv_ps((__m256)alt, (__m256)keep, m);
}
#endif

// Eight vectors' lane sums, in order: [sum a0, ..., sum a7] (a fixed tree of horizontal adds).
inline __m256 sum_lanes8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 low 128 | a0..a3 high 128]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// VL vectors' lane sums as one vector, lane u = the sum of key u's lanes, the keys' vectors given in the tree's
// order: a[(u >> 2) + 4 (u & 3)] is key u's (AVX-512; AVX2: a[u]). Four levels of two shuffles and an add.
inline vf sum_lanes(const vf* a) {
#if defined(__AVX512F__)
  __m512 q[8], r[4], s[2];
  for (int i = 0; i < 8; ++i)  // [a 2i halves summed | a 2i+1 halves summed]
    q[i] = _mm512_add_ps(_mm512_shuffle_f32x4((__m512)a[2 * i], (__m512)a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4((__m512)a[2 * i], (__m512)a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarters: four vectors' partial sums of four
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(q[2 * i], q[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // per quarter: two vectors' partial sums of two
    s[i] = _mm512_add_ps(_mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(r[2 * i], r[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return (vf)_mm512_add_ps(_mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
#else
  const __m256* h = reinterpret_cast<const __m256*>(a);  // vf is __m256's layout on AVX2 builds
  return (vf)sum_lanes8(h);
#endif
}
#if defined(__AVX512F__)
inline int tree_slot(int u) { return (u >> 2) + 4 * (u & 3); }
#else
inline int tree_slot(int u) { return u; }
#endif

inline float hsum(vf v) {  // a fixed order: lanes 0, 1, ... in turn
  alignas(64) float t[VL];
  storef(t, v);
  float s = t[0];
  for (int i = 1; i < VL; ++i) s += t[i];
  return s;
}

// Query rows r < R of G heads each (row r: q + r qs [G, NV VL], the query heads of one key/value head, at
// position pos0 + r, seeing keys lo_r .. pos0 + r, lo_r = max(0, pos0 + r - window + 1) with a window, else 0)
// against keys / values [cap, NV VL] -> row r's out + r qs [G, NV VL]. Each (row, head)'s arithmetic is that of a
// lone row of one head: the same operations in the same order (key blocks at multiples of VL, the values' pairs at
// even keys); the rows and heads only share the reads. A block of VL keys stays in L1 while every row and head takes
// its scores from it; values come CH keys at a time, each (row, head)'s two accumulators parked in ``acc`` between
// chunks. e: scratch of R G (pos0 + R + 2 VL + 1) floats; acc: 2 R G NV VL; mxs: R G VL.
template <int NV>
void attend_rows(const float* __restrict q, int64_t qs, int64_t R, int64_t G, const float* __restrict K,
                 const float* __restrict V, int64_t pos0, int64_t window, float sc, float* __restrict e,
                 float* __restrict acc, float* __restrict mxs, float* __restrict out) {
  constexpr int64_t D = NV * VL;
  constexpr int64_t CH = 64;  // values a chunk (16 KB at d 64): even, so a pair of keys never spans two chunks
  const int64_t stride = pos0 + R + 2 * VL + 1;  // e of (row r, head h): e + (r G + h) stride, indexed j - j0_r
  const auto lo_of = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, pos0 + r - window + 1) : 0; };
  alignas(64) float iota[VL];
  for (int u = 0; u < VL; ++u) iota[u] = static_cast<float>(u);
  const vf lanes = loadf(iota), neg = bcast(-INFINITY), scale = bcast(sc);
  for (int64_t i = 0; i < R * G; ++i) storef(mxs + i * VL, neg);
  const int64_t jfirst = lo_of(0) - lo_of(0) % VL, hmax_all = pos0 + R - 1;
  for (int64_t jb = jfirst; jb <= hmax_all; jb += VL) {  // scores, -inf outside lo .. hi
    for (int64_t r = 0; r < R; ++r) {
      const int64_t lo = lo_of(r), hi = pos0 + r, j0 = lo - lo % VL;
      if (jb < j0 || jb > hi) continue;
      const float span = static_cast<float>(hi - lo);
      for (int64_t h = 0; h < G; ++h) {
        vf qv[NV];
        for (int c = 0; c < NV; ++c) qv[c] = loadf(q + r * qs + h * D + c * VL);
        vf part[VL];
        for (int u = 0; u < VL; ++u) {
          const int64_t j = jb + u;
          if (j < lo || j > hi) {
            part[tree_slot(u)] = vf{};
            continue;
          }
          const float* k = K + j * D;
          vf s = qv[0] * loadf(k);
          for (int c = 1; c < NV; ++c) s = fma(qv[c], loadf(k + c * VL), s);
          part[tree_slot(u)] = s;
        }
        const vf s = in_range(sum_lanes(part) * scale, neg, bcast(static_cast<float>(jb - lo)) + lanes, span);
        const int64_t x = r * G + h;
        storef(e + x * stride + (jb - j0), s);
        storef(mxs + x * VL, vmax(loadf(mxs + x * VL), s));
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lo = lo_of(r), hi = pos0 + r, j0 = lo - lo % VL;
    const float span = static_cast<float>(hi - lo);
    for (int64_t h = 0; h < G; ++h) {  // e^(s - max), 0 for masked keys; x < -87 gives e^-87
      const int64_t x = r * G + h;
      const float m = hmax(loadf(mxs + x * VL));
      vf tot = vf{};
      for (int64_t jb = j0; jb <= hi; jb += VL) {
        float* ej = e + x * stride + (jb - j0);
        alignas(64) float t[VL];
        storef(t, vmax(loadf(ej) - bcast(m), bcast(-87.f)));
        exp_inplace(t, VL);
        const vf p = in_range(loadf(t), vf{}, bcast(static_cast<float>(jb - lo)) + lanes, span);
        storef(ej, p);
        tot = tot + p;
      }
      mxs[x * VL] = 1.f / hsum(tot);  // the maximum is spent: its slot keeps 1 / the sum
    }
  }
  // weighted values, even and odd keys in two accumulators (a0: acc + 2 x D, a1: acc + (2 x + 1) D); an odd first key
  // alone into a1, then pairs (j, j + 1) at even j, then an even last key alone into a0
  for (int64_t i = 0; i < 2 * R * G * D; i += VL) storef(acc + i, vf{});
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lo = lo_of(r), j0 = lo - lo % VL;
    if (!(lo & 1)) continue;
    for (int64_t h = 0; h < G; ++h) {
      const int64_t x = r * G + h;
      const vf w = bcast(e[x * stride + (lo - j0)]);
      float* a1 = acc + (2 * x + 1) * D;
      for (int c = 0; c < NV; ++c) storef(a1 + c * VL, fma(w, loadf(V + lo * D + c * VL), loadf(a1 + c * VL)));
    }
  }
  const int64_t cfirst = (lo_of(0) + 1) & ~int64_t{1};
  for (int64_t c0 = cfirst - cfirst % CH; c0 + 1 <= hmax_all; c0 += CH) {
    for (int64_t r = 0; r < R; ++r) {
      const int64_t lo = lo_of(r), hi = pos0 + r, j0 = lo - lo % VL;
      const int64_t from = std::max(c0, (lo + 1) & ~int64_t{1}), to = std::min(hi, c0 + CH - 1);
      if (from + 1 > to) continue;
      for (int64_t h = 0; h < G; ++h) {
        const int64_t x = r * G + h;
        const float* p = e + x * stride - j0;
        vf a0[NV], a1[NV];
        for (int c = 0; c < NV; ++c) {
          a0[c] = loadf(acc + 2 * x * D + c * VL);
          a1[c] = loadf(acc + (2 * x + 1) * D + c * VL);
        }
        for (int64_t j = from; j + 1 <= to; j += 2) {
          const vf w0 = bcast(p[j]), w1 = bcast(p[j + 1]);
          const float* v0 = V + j * D;
          for (int c = 0; c < NV; ++c) {
            a0[c] = fma(w0, loadf(v0 + c * VL), a0[c]);
            a1[c] = fma(w1, loadf(v0 + D + c * VL), a1[c]);
          }
        }
        for (int c = 0; c < NV; ++c) {
          storef(acc + 2 * x * D + c * VL, a0[c]);
          storef(acc + (2 * x + 1) * D + c * VL, a1[c]);
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t lo = lo_of(r), hi = pos0 + r, j0 = lo - lo % VL;
    const int64_t first = (lo + 1) & ~int64_t{1};  // the first pair's key
    const int64_t last = first + ((hi - first + 1) & ~int64_t{1});  // the key after the last pair
    for (int64_t h = 0; h < G; ++h) {
      const int64_t x = r * G + h;
      float* a0 = acc + 2 * x * D;
      const float* a1 = acc + (2 * x + 1) * D;
      if (last <= hi) {
        const vf w = bcast(e[x * stride + (last - j0)]);
        for (int c = 0; c < NV; ++c) storef(a0 + c * VL, fma(w, loadf(V + last * D + c * VL), loadf(a0 + c * VL)));
      }
      const vf inv = bcast(mxs[x * VL]);
      for (int c = 0; c < NV; ++c)
        storef(out + r * qs + h * D + c * VL, (loadf(a0 + c * VL) + loadf(a1 + c * VL)) * inv);
    }
  }
}

// attend for n <= DECODE_ROWS and a head dimension of NV * VL. Work items are (b, key/value head, a part of the
// rows, a part of the query heads): every row and head of an item reads the item's keys and values once. The rows
// stay together when the (b, key/value head) pairs already spread evenly over the threads, else they are split into
// the fewest parts that do (else one row an item); with fewer items than threads (one row, one key/value head) the
// heads are split. A row's and head's arithmetic does not depend on its item (attend_rows).
template <int NV>
void attend_decode(const float* __restrict qp, const float* __restrict kp, const float* __restrict vp,
                   float* __restrict op, int64_t B, int64_t n, int64_t hq, int64_t hkv, int64_t cap, int64_t start,
                   int64_t window, float sc) {
  constexpr int64_t d = NV * VL;
  const int64_t group = hq / hkv, len = start + n, base = B * hkv;
  const int64_t threads = omp_get_max_threads();
  int64_t rparts = n;
  for (int64_t p = 1; p <= n; ++p)
    if (base * p % threads == 0) {
      rparts = p;
      break;
    }
  const int64_t rper = (n + rparts - 1) / rparts, items = base * rparts;
  const int64_t hparts = items >= threads ? 1 : std::min<int64_t>(group, (threads + items - 1) / items);
  const int64_t hper = (group + hparts - 1) / hparts;
#pragma omp parallel
  {
    const int64_t slots = rper * hper;
    std::vector<float> e(slots * (len + 2 * VL + 1)), acc(2 * slots * d), mxs(slots * VL);
#pragma omp for collapse(4) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < hkv; ++g)
        for (int64_t rp = 0; rp < rparts; ++rp)
          for (int64_t hp = 0; hp < hparts; ++hp) {
            const int64_t r0 = rp * rper, R = std::min(rper, n - r0), h0 = hp * hper, G = std::min(hper, group - h0);
            if (R <= 0 || G <= 0) continue;
            const int64_t at = (b * n + r0) * hq + g * group + h0;
            attend_rows<NV>(qp + at * d, hq * d, R, G, kp + (b * hkv + g) * cap * d, vp + (b * hkv + g) * cap * d,
                            start + r0, window, sc, e.data(), acc.data(), mxs.data(), op + at * d);
          }
  }
}

}  // namespace

// The decoding kernel for this head dimension, or false (then the rows-in-lanes kernel runs).
static bool attend_decode_any(const float* qp, const float* kp, const float* vp, float* op, int64_t B, int64_t n,
                              int64_t hq, int64_t d, int64_t hkv, int64_t cap, int64_t start, int64_t window,
                              float sc) {
  if (n > DECODE_ROWS || d % VL != 0 || hq / hkv > DECODE_GROUP) return false;
  switch (d / VL) {
#define SELFSPEC_NV(k) \
  case k: attend_decode<k>(qp, kp, vp, op, B, n, hq, hkv, cap, start, window, sc); return true;
    SELFSPEC_NV(1) SELFSPEC_NV(2) SELFSPEC_NV(3) SELFSPEC_NV(4) SELFSPEC_NV(5) SELFSPEC_NV(6) SELFSPEC_NV(7)
    SELFSPEC_NV(8)
#if !defined(__AVX512F__)
    SELFSPEC_NV(16)
#endif
#undef SELFSPEC_NV
    default: return false;
  }
}

void raw::attention(const float* qp, const float* kp, const float* vp, float* op, int64_t B, int64_t n, int64_t hq,
                    int64_t d, int64_t hkv, int64_t cap, int64_t start, int64_t window, double scale) {
  if (!attend_decode_any(qp, kp, vp, op, B, n, hq, d, hkv, cap, start, window, static_cast<float>(scale)))
    attend(qp, kp, vp, op, B, n, hq, d, hkv, cap, start, window, static_cast<float>(scale));
}

at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start,
                        int64_t window, double scale) {
  check_f32(q, "q");
  check_f32(keys, "keys");
  check_f32(values, "values");
  const int64_t B = q.size(0), n = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t hkv = keys.size(1), cap = keys.size(2);
  TORCH_CHECK(start + n <= cap, "cache too small");
  auto out = at::empty({B, n, hq * d}, q.options());
  raw::attention(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(), out.data_ptr<float>(), B, n,
                 hq, d, hkv, cap, start, window, scale);
  return out;
}
