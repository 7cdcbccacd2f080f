// The CPU's multiply peaks: register-only loops of each multiply instruction the exact kernels use or could use, run
// on every thread at once. bench-forward divides a block's GFLOP/s by them, so its report says what bounds t(n) where
// the memory does not (a block of n rows reads the weights once and multiplies n times).
//
//     kind 0  vfmadd231ps      float32 FMA: the exact kernels' sums on every CPU        (AVX-512: 16 lanes, AVX2: 8)
//     kind 1  vpdpbusd         int8 dot, 4 products a lane (AVX-512 VNNI)
//     kind 2  vdpbf16ps        bfloat16 dot, 2 products a lane (AVX-512 BF16)
//     kind 3  tdpbf16ps        bfloat16 tiles, 16 x 16 x 32 products (AMX, where amx_on())
//
// A float32-accurate product from bfloat16 or int8 takes three limbs of the activation (qlinear_amx.cpp), so those
// kinds multiply float32 activations at a third of their rate; the caller divides. Each loop keeps ten independent
// accumulators (more than any of these instructions' latency x throughput here), so it measures issue rate, not
// latency. 0 where the build or the CPU lacks the instruction.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "qcodes.h"

namespace {

using Clock = std::chrono::steady_clock;

// multiply-adds per loop iteration of each kind (10 instructions)
double products_per_iter(int kind) {
#if defined(__AVX512F__)
  constexpr double lanes = 16;
#else
  constexpr double lanes = 8;
#endif
  switch (kind) {
    case 0: return 10 * lanes;
    case 1: return 10 * 64;
    case 2: return 10 * 32;
    case 3: return 4 * 16 * 16 * 32;  // 4 tile multiplies an iteration
    default: return 0;
  }
}

bool has_kind(int kind) {
  switch (kind) {
    case 0: return true;
#if defined(__AVX512VNNI__)
    case 1: return true;
#endif
#if defined(__AVX512BF16__)
    case 2: return true;
#endif
    case 3: return qcodes::amx_on();
    default: return false;
  }
}

// ten independent accumulators, each starting at init(i) and stepped by step() iters times; the sum of sink()s
// depends on every one, and each step is opaque to the optimizer, so none is folded away (unrolled, the ten stay in
// registers)
template <typename V, typename Init, typename Step, typename Sink>
float ten_chains(int64_t iters, Init init, Step step, Sink sink) {
  V a[10];
#pragma GCC unroll 10
  for (int i = 0; i < 10; ++i) a[i] = init(i);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 10
    for (int i = 0; i < 10; ++i) {
      a[i] = step(a[i]);
      __asm__ volatile("" : "+v"(a[i]));  // opaque to the optimizer, kept in its register
    }
  }
  float s = 0.f;
#pragma GCC unroll 10
  for (int i = 0; i < 10; ++i) s += sink(a[i]);
  return s;
}

// iters iterations of kind's loop
float run_loop(int kind, int64_t iters) {
  if (kind == 0) {
#if defined(__AVX512F__)
    const __m512 b = _mm512_set1_ps(0.5f), c = _mm512_set1_ps(0.25f);
    return ten_chains<__m512>(iters, [](int i) { return _mm512_set1_ps((float)i); },
                              [&](__m512 v) { return _mm512_fmadd_ps(v, b, c); },
                              [](__m512 v) { return _mm512_reduce_add_ps(v); });
#else
    const __m256 b = _mm256_set1_ps(0.5f), c = _mm256_set1_ps(0.25f);
    return ten_chains<__m256>(iters, [](int i) { return _mm256_set1_ps((float)i); },
                              [&](__m256 v) { return _mm256_fmadd_ps(v, b, c); },
                              [](__m256 v) { return _mm_cvtss_f32(_mm256_castps256_ps128(v)); });
#endif
  }
#if defined(__AVX512VNNI__)
  if (kind == 1) {
    const __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
    return ten_chains<__m512i>(iters, [](int i) { return _mm512_set1_epi32(i); },
                               [&](__m512i v) { return _mm512_dpbusd_epi32(v, b, c); },
                               [](__m512i v) { return (float)_mm512_reduce_add_epi32(v); });
  }
#endif
#if defined(__AVX512BF16__)
  if (kind == 2) {
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f00);  // bfloat16 0.5
    return ten_chains<__m512>(iters, [](int i) { return _mm512_set1_ps((float)i); },
                              [&](__m512 v) { return _mm512_dpbf16_ps(v, b, b); },
                              [](__m512 v) { return _mm512_reduce_add_ps(v); });
  }
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  if (kind == 3) {
    alignas(64) static thread_local uint16_t zeros[16 * 32] = {};
    alignas(64) float out[16 * 16];
    qcodes::amx_config(16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    _tile_loadd(6, zeros, 64);
    _tile_loadd(7, zeros, 64);
    for (int64_t n = 0; n < iters; ++n) {  // four independent accumulators, as the kernel's pair of blocks has
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    float sink = out[0];
    _tile_stored(3, out, 64);
    sink += out[255];
    qcodes::amx_release();
    return sink;
  }
#endif
  return 0.f;
}

}  // namespace

// Multiply-adds a second over ``threads`` threads for ``kind`` (the table above), each thread running its loop for
// about ``seconds``; the slowest thread's time sets the rate (a block waits for its slowest thread). 0: no such
// instruction here.
double compute_peak(int64_t kind, double seconds, int64_t threads) {
  const int k = (int)kind;
  if (!has_kind(k) || seconds <= 0 || threads < 1) return 0.0;
  // iterations for ~seconds, from a short probe on this thread
  int64_t iters = 1 << 12;
  for (;;) {
    const auto t0 = Clock::now();
    volatile float s = run_loop(k, iters);
    (void)s;
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (dt > 0.01 || iters > (int64_t(1) << 40)) {
      iters = std::max<int64_t>(1, (int64_t)(iters * seconds / std::max(dt, 1e-9)));
      break;
    }
    iters *= 4;
  }
  std::vector<double> took((size_t)threads, 0.0);
#pragma omp parallel num_threads((int)threads)
  {
    const int t = omp_get_thread_num();
    run_loop(k, std::max<int64_t>(1, iters / 8));  // warm: the clock and, for AMX, the tile state
#pragma omp barrier
    const auto t0 = Clock::now();
    volatile float s = run_loop(k, iters);
    (void)s;
    if (t < threads) took[(size_t)t] = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  const int team = (int)std::count_if(took.begin(), took.end(), [](double x) { return x > 0; });
  const double slowest = *std::max_element(took.begin(), took.end());
  return slowest > 0 ? products_per_iter(k) * (double)iters * team / slowest : 0.0;
}
