// selfspec's fused CPU ops for the decoding hot loop (float32, a few rows per call). Each replaces a
// chain of small torch ops whose per-op dispatch cost (~2-20 us each, ~60 per layer) was a quarter of
// a decoding step (docs/BENCHMARKS.md has the profile). Same math as transformers' modules; only
// float rounding differs (the tests compare logits with the reference path).
//
// Layouts (batch B, n new tokens, hq query heads, hkv key/value heads, head_dim d):
//   qkv    # [B, n, (hq + 2 * hkv) * d]   the fused projection's output
//   q      # [B, n, hq, d]                queries after rotary
//   keys   # [B, hkv, capacity, d]        the static cache of one layer (values alike)
//   cos    # [B, n, rot]                  rotary tables (rot <= d: partial rotary leaves the rest)
#include <torch/extension.h>
#include <cmath>
#include <vector>

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out,
                     bool accumulate);  // gemv.cpp

torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                      int64_t group, double z, torch::Tensor bias, torch::Tensor out, bool accumulate);  // quant.cpp
torch::Tensor qlinear_i8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double z, torch::Tensor bias, torch::Tensor out,
                         bool accumulate);  // quant.cpp
bool qlinear_i8_vnni();  // quant.cpp
torch::Tensor qdequant(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits, int64_t group,
                       double z, torch::Tensor ids, torch::Tensor out);  // quant.cpp

namespace {
void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous(), name, " must be contiguous float32");
}
}  // namespace

// y = x / sqrt(mean(x^2) + eps) * w over the last dim (w already 1 + w for Gemma's norms).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t H = x.size(-1), M = x.numel() / H;
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
    float* yr = yp + m * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * r);
  }
  return y;
}

// Rotary on the q and k heads of qkv; k and v written into the cache at [start, start + n).
// Returns q [B, n, hq, d]. rotate_half: out[j] = x[j] cos[j] - x[j + h] sin[j] (j < h),
//                                       out[j] = x[j] cos[j] + x[j - h] sin[j] (h <= j < rot).
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                       torch::Tensor values, int64_t start, int64_t hq, int64_t hkv) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  check_f32(keys, "keys");
  check_f32(values, "values");
  const int64_t B = qkv.size(0), n = qkv.size(1), d = keys.size(3), cap = keys.size(2);
  const int64_t rot = cos.size(-1), half = rot / 2, heads = hq + 2 * hkv;
  TORCH_CHECK(qkv.size(2) == heads * d, "qkv width");
  TORCH_CHECK(start + n <= cap, "cache too small");
  auto q = torch::empty({B, n, hq, d}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) {
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
    }
  return q;
}

// Causal attention of n new queries (positions start .. start + n - 1) over the cache's first
// start + n entries, grouped-query heads, optional sliding window (0: none): query at position p
// sees keys j with max(0, p - window + 1) <= j <= p. Returns [B, n, hq * d].
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start,
                        int64_t window, double scale) {
  check_f32(q, "q");
  check_f32(keys, "keys");
  check_f32(values, "values");
  const int64_t B = q.size(0), n = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t hkv = keys.size(1), cap = keys.size(2), group = hq / hkv;
  auto out = torch::empty({B, n, hq * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#pragma omp parallel
  {
    std::vector<float> score(start + n);
    std::vector<float> acc(d);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < hq; ++h) {
        const float* K = kp + (b * hkv + h / group) * cap * d;
        const float* Vv = vp + (b * hkv + h / group) * cap * d;
        for (int64_t i = 0; i < n; ++i) {
          const float* qi = qp + ((b * n + i) * hq + h) * d;
          const int64_t pos = start + i;
          const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          float mx = -INFINITY;
          for (int64_t j = lo; j <= pos; ++j) {
            const float* kj = K + j * d;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t t = 0; t < d; ++t) s += qi[t] * kj[t];
            s *= sc;
            score[j] = s;
            mx = s > mx ? s : mx;
          }
          float total = 0.f;
          for (int64_t j = lo; j <= pos; ++j) {
            score[j] = std::exp(score[j] - mx);
            total += score[j];
          }
          for (int64_t t = 0; t < d; ++t) acc[t] = 0.f;
          for (int64_t j = lo; j <= pos; ++j) {
            const float* vj = Vv + j * d;
            const float p = score[j];
#pragma omp simd
            for (int64_t t = 0; t < d; ++t) acc[t] += p * vj[t];
          }
          float* o = op + ((b * n + i) * hq + h) * d;
          const float inv = 1.f / total;
          for (int64_t t = 0; t < d; ++t) o[t] = acc[t] * inv;
        }
      }
  }
  return out;
}

// silu(gate) * up for gu = [gate | up] along the last dim: [..., 2I] -> [..., I].
torch::Tensor silu_mul(torch::Tensor gu) {
  check_f32(gu, "gate_up");
  const int64_t I = gu.size(-1) / 2, M = gu.numel() / (2 * I);
  auto sizes = gu.sizes().vec();
  sizes.back() = I;
  auto y = torch::empty(sizes, gu.options());
  const float* g = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* gm = g + m * 2 * I;
    float* ym = yp + m * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float x = gm[i];
      ym[i] = x / (1.f + std::exp(-x)) * gm[I + i];
    }
  }
  return y;
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
  m.def("qlinear", &qlinear, "y = x @ W^T (+ bias) (+= into out) with a block-quantized packed weight", nogil);
  m.def("qlinear_i8", &qlinear_i8, "qlinear with activations rounded to 8 bits per group (int8 numerics)", nogil);
  m.def("qlinear_i8_vnni", &qlinear_i8_vnni, "whether qlinear_i8 uses AVX-512 VNNI");
  m.def("qdequant", &qdequant, "rows of a block-quantized packed weight as float32", nogil);
}
