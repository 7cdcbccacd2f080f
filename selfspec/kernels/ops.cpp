// selfspec's fused CPU ops for the decoding hot loop (float32, a few rows per call). Each replaces a chain of small
// torch ops (dozens per layer), each paying torch's per-op dispatch, which at a few rows a call weighs on a decoding
// step as much as the arithmetic (docs/BENCHMARKS.md has the profile). Same math as transformers' modules; only float
// rounding differs (the tests compare logits with the reference path). This file has the norm, rotary, silu and
// argmax ops and binds every kernel to Python; attention is attention.cpp's.
//
// Layouts (batch B, n new tokens, hq query heads, hkv key/value heads, head_dim d):
//   qkv    # [B, n, (hq + 2 * hkv) * d]   the fused projection's output
//   q      # [B, n, hq, d]                queries after rotary
//   keys   # [B, hkv, capacity, d]        the static cache of one layer (values alike)
//   cos    # [B, n, rot]                  rotary tables (rot <= d: partial rotary leaves the rest)
#include <torch/csrc/utils/pybind.h>  // binds to Python (PYBIND11_MODULE / bind_step)

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "simd.h"

namespace {
// Rows from which the row-wise ops (norm, rotary, silu) split their rows over the threads: a prefill's hundreds
// of rows (a decoding step's few rows stay on one thread: a parallel region costs more than their work).
constexpr int64_t PARALLEL_ROWS = 32;

using simd::any_eq;
using simd::any_nan;
using simd::bcast;
using simd::exp_inplace;
using simd::hmax;
using simd::loadf;
using simd::vf;
using simd::vmax;
using simd::VL;
}  // namespace

// y = x / sqrt(mean(x^2) + eps) * w over the last dim (w already 1 + w for Gemma's norms).
void raw::rms_norm(const float* xp, const float* wp, float* yp, int64_t M, int64_t H, double eps) {
  for_range(M, M >= PARALLEL_ROWS, [&](int64_t m) {
    const float* xr = xp + m * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    float* yr = yp + m * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * r);
  });
}

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t H = x.size(-1), M = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "w: ", H, " weights, got ", w.numel());
  auto y = at::empty_like(x);
  raw::rms_norm(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), M, H, eps);
  return y;
}

// Rotary on the q and k heads of qkv; k and v written into the cache at [start, start + n).
// Returns q [B, n, hq, d]. rotate_half: out[j] = x[j] cos[j] - x[j + h] sin[j] (j < h),
//                                       out[j] = x[j] cos[j] + x[j - h] sin[j] (h <= j < rot).
void raw::rope_qkv(const float* src, const float* cp, const float* sp, float* qp, float* kp, float* vp, int64_t B,
                   int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t cap, int64_t start, int64_t rot) {
  const int64_t half = rot / 2, heads = hq + 2 * hkv;
  for_range(B * n, B * n >= PARALLEL_ROWS, [&](int64_t bi) {  // row bi = b * n + i
    const int64_t b = bi / n, i = bi % n;
    const float* row = src + (b * n + i) * heads * d;
    const float* c = cp + (b * n + i) * rot;
    const float* s = sp + (b * n + i) * rot;
    for (int64_t h = 0; h < hq + hkv; ++h) {
      const float* x = row + h * d;
      float* out = h < hq ? qp + ((b * n + i) * hq + h) * d
                          : kp + ((b * hkv + (h - hq)) * cap + start + i) * d;
      for (int64_t j = 0; j < half; ++j) out[j] = x[j] * c[j] - x[j + half] * s[j];
      for (int64_t j = half; j < rot; ++j) out[j] = x[j] * c[j] + x[j - half] * s[j];
      for (int64_t j = rot; j < d; ++j) out[j] = x[j];
    }
    for (int64_t h = 0; h < hkv; ++h) {
      const float* x = row + (hq + hkv + h) * d;
      float* out = vp + ((b * hkv + h) * cap + start + i) * d;
      for (int64_t j = 0; j < d; ++j) out[j] = x[j];
    }
  });
}

at::Tensor rope_qkv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                       at::Tensor values, int64_t start, int64_t hq, int64_t hkv) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(keys, "keys");
  check_f32(values, "values");
  const int64_t B = qkv.size(0), n = qkv.size(1), d = keys.size(3), cap = keys.size(2);
  const int64_t rot = cos.size(-1), heads = hq + 2 * hkv;
  TORCH_CHECK(qkv.size(2) == heads * d, "qkv width");
  TORCH_CHECK(start + n <= cap, "cache too small");
  auto q = at::empty({B, n, hq, d}, qkv.options());
  raw::rope_qkv(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                keys.data_ptr<float>(), values.data_ptr<float>(), B, n, hq, hkv, d, cap, start, rot);
  return q;
}

// silu(gate) * up for gu = [gate | up] along the last dim: [..., 2I] -> [..., I].
void raw::silu_mul(const float* g, float* yp, int64_t M, int64_t I) {
  constexpr int64_t CHUNK = 256;
  for_range(M, M >= PARALLEL_ROWS, [&](int64_t m) {
    const float* gm = g + m * 2 * I;
    float* ym = yp + m * I;
    for (int64_t i0 = 0; i0 < I; i0 += CHUNK) {  // e^-x clamped to [-87, 88], then x / (1 + e^-x) * up
      const int64_t c = std::min(CHUNK, I - i0);
      alignas(64) float e[CHUNK];
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) e[i] = std::min(std::max(-gm[i0 + i], -87.f), 88.f);
      exp_inplace(e, c);
#pragma omp simd
      for (int64_t i = 0; i < c; ++i) ym[i0 + i] = gm[i0 + i] / (1.f + e[i]) * gm[I + i0 + i];
    }
  });
}

at::Tensor silu_mul(at::Tensor gu) {
  check_f32(gu, "gate_up");
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / (2 * I);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = at::empty(sizes, gu.options());
  raw::silu_mul(gu.data_ptr<float>(), y.data_ptr<float>(), M, I);
  return y;
}

// Each row's argmax of x [M, N] float32 -> int64 [M]: the first index of the largest value, or of the first NaN
// when the row has one: torch.argmax's answer, in one pass of lane-wise maxima and one to find its index
// (no torch dispatch, and the lane-wise pass keeps up with the memory over a vocabulary's logits, e.g. Qwen2.5's
// 151,936).
void raw::argmax_rows(const float* xp, int64_t M, int64_t N, int64_t* op) {
  for_range(M, M * N >= (int64_t{1} << 20), [&](int64_t m) {
    const float* r = xp + m * N;
    vf mx = bcast(-INFINITY);
    bool nan = false;
    int64_t i = 0;
    for (; i + VL <= N; i += VL) {  // max(v, mx) is mx where v is NaN: NaNs are found apart
      const vf v = loadf(r + i);
      mx = vmax(v, mx);
      nan |= any_nan(v);
    }
    float best = hmax(mx);
    for (; i < N; ++i) {
      best = r[i] > best ? r[i] : best;
      nan |= r[i] != r[i];
    }
    int64_t at = 0;  // the first NaN, else the first largest value
    if (nan) {
      while (at + VL <= N && !any_nan(loadf(r + at))) at += VL;
      while (r[at] == r[at]) ++at;
    } else {
      const vf b = bcast(best);
      while (at + VL <= N && !any_eq(loadf(r + at), b)) at += VL;
      while (r[at] != best) ++at;
    }
    op[m] = at;
  });
}

at::Tensor argmax_rows(at::Tensor x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x: [..., N] with N > 0");
  const int64_t N = x.size(-1), M = x.numel() / N;
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  raw::argmax_rows(x.data_ptr<float>(), M, N, out.data_ptr<int64_t>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every op releases the GIL while it runs, so two Python threads (the one-device pipeline,
  // selfspec.pipeline) run their layers at the same time.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("linear", &linear, "y = x @ W^T (+ bias) (+= into out) with a packed weight, 1 <= M <= 16", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim", nogil);
  m.def("rope_qkv", &rope_qkv, "rotary on q and k of a fused qkv; k, v written into the cache; returns q", nogil);
  m.def("attention", &attention, "causal grouped-query attention of new queries over the cache", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up", nogil);
  m.def("argmax_rows", &argmax_rows, "each row's argmax over the last dim (torch.argmax's index)", nogil);
  m.def("qlinear", &qlinear, "y = x @ W^T (+ bias) (+= into out) with a block-quantized packed weight", nogil);
  m.def("qlinear_i8", &qlinear_i8, "qlinear with activations rounded to 8 bits per group (int8 numerics)", nogil);
  m.def("qgemm", &qgemm, "qlinear for many rows (a prefill): panels of the weight dequantized once", nogil);
  m.def("qargmax", &qargmax, "each row's argmax of x @ W^T, screened by the int8 kernel (greedy verification)", nogil);
  m.def("compute_peak", &compute_peak, "multiply-adds a second of a register-only loop of one multiply instruction "
        "(0 FMA, 1 VNNI int8 dot, 2 bf16 dot, 3 AMX bf16 tiles) on n threads; 0 where absent", nogil);
  m.def("qlinear_i8_vnni", &qlinear_i8_vnni, "whether qlinear_i8 uses AVX-512 VNNI");
  m.def("amx_available", &qcodes::amx_available, "whether this build has AMX and Linux granted the tile state");
  m.def("amx_on", &qcodes::amx_on, "whether qlinear takes AMX tiles for 4- and 5-bit codes (amx_available, not turned off)");
  m.def("set_amx", &qcodes::amx_set, "turn the AMX path on or off for this process (SELFSPEC_AMX=0 starts it off)");
  m.def("qcodes5_words", &qcodes5_words, "whether this build packs 5-bit codes as words (else nibbles and planes)");
  m.def("qdequant", &qdequant, "rows of a block-quantized packed weight as float32", nogil);
  m.def("qgroup_l1", &qgroup_l1, "each row's sum of |w| per group of a packed weight (the screen's table)", nogil);
  m.def("qdense_t", &qdense_t, "blocks of a block-quantized packed weight as float32, transposed [K, rows]", nogil);
  bind_step(m);  // step.cpp: LayerPlan, run_layers
}
