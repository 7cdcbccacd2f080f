// The build's float vectors, shared by the kernel files (the block-quantized kernels' qcodes.h, ops.cpp,
// attention.cpp): VL lanes, 16 on AVX-512 builds and 8 on AVX2 ones (kernels/build.py compiles with -march=native).
// vf is a GCC vector type, so + - * are the plain vector instructions. GCC fuses a multiply and an add written
// apart into one FMA where it sees both (-ffp-contract=fast, its default for C++, -std=c++20 included), so whether
// it does can depend on inlining: paths that must agree bit for bit call the same functions, and a fused
// multiply-add that matters is asked for by name.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace simd {

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vf __attribute__((vector_size(VL * 4)));

inline vf loadf(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void storef(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf bcast(float v) {  // (vf{} + v would add a zero: -0.0 + 0.0 is +0.0, so it is not dropped)
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(v);
#else
  return (vf)_mm256_set1_ps(v);
#endif
}

inline vf fma(vf a, vf b, vf c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// Lane-wise maxima and tests, and a vector's largest lane (ops.cpp's argmax_rows, attention.cpp).
#if defined(__AVX512F__)
inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }  // b where a is NaN
inline bool any_eq(vf a, vf b) { return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_EQ_OQ) != 0; }
inline bool any_nan(vf a) { return _mm512_cmp_ps_mask((__m512)a, (__m512)a, _CMP_UNORD_Q) != 0; }
#else
inline vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
inline bool any_eq(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_EQ_OQ)) != 0; }
inline bool any_nan(vf a) { return _mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)a, _CMP_UNORD_Q)) != 0; }
#endif

inline float hmax(vf v) {
  alignas(64) float t[VL];
  storef(t, v);
  float m = t[0];
  for (int i = 1; i < VL; ++i) m = std::max(m, t[i]);
  return m;
}

// e^x for x in [-87, 88], branch-free so that it vectorizes in a `omp simd` loop (std::exp does not without
// -ffast-math): x = k ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial (relative error < 2e-7),
// 2^k through the exponent bits (e^88 = 1.65e38 is still finite).
inline float exp_poly(float x) {
  const float y = x * 1.44269504f + 0.5f;
  const float t = static_cast<float>(static_cast<int32_t>(y));  // floor(y) as truncation, one down below zero:
  const float k = t > y ? t - 1.f : t;  // bitwise std::floor here, which GCC 12 did not vectorize (a scalar call)
  const float r = x - k * 0.693145752f - k * 1.42860677e-6f;  // ln2 split in two for an exact k ln2
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// e^x of n values in place, each already within [-87, 88] (the callers clamp in a loop of their own: GCC 12
// vectorized neither a clamp nor a select in the same loop as exp_poly, which then ran as scalar code).
inline void exp_inplace(float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] = exp_poly(x[i]);
}

}  // namespace simd
