// The build's float vectors, shared by the kernel files (quant.cpp, ops.cpp): VL lanes, 16 on AVX-512 builds and 8
// on AVX2 ones (kernels/build.py compiles with -march=native). vf is a GCC vector type, so + - * are the plain
// vector instructions (the extension is built as ISO C++, which contracts no multiply and add into one FMA);
// a fused multiply-add is asked for by name.
#pragma once
#include <immintrin.h>

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

}  // namespace simd
