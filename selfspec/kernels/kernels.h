// The functions selfspec's CPU kernel files call across files (one extension: gemv.cpp; the block-quantized kernels
// qlinear.cpp, qlinear_amx.cpp, qlinear_i8.cpp, qargmax.cpp, qdense.cpp, qgemm.cpp, which share qcodes.h; ops.cpp, attention.cpp;
// step.cpp; peak.cpp; ops.cpp binds them all to Python).
#pragma once
// Only the ATen headers the kernels use (the tensor, its factories, parallel_for): torch/extension.h pulls in most of
// torch's headers, and compiling them dominates each file that includes it; the two files that bind to Python add
// pybind's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/softmax.h>

namespace pybind11 {
class module_;
}

// f(i) for i in [0, n): split over the threads (static schedule) when ``parallel``, else on the calling thread without
// entering an OpenMP region: a region that an if clause keeps on one thread still pays libgomp's team start and end,
// and a decoding step's layer would make four (its norms, rotary and silu of a few rows).
template <typename F>
inline void for_range(int64_t n, bool parallel, const F& f) {
  if (parallel) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) f(i);
  } else {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
}

// The fused ops' argument check (ops.cpp, attention.cpp).
inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), name, " must be contiguous float32");
}

// gemv.cpp
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor bias, at::Tensor out, bool accumulate);

// qlinear.cpp
at::Tensor qlinear(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                      int64_t group, double z, at::Tensor bias, at::Tensor out, bool accumulate);
// qlinear_amx.cpp (qcodes.h has the kernel's interface)
namespace qcodes {
bool amx_available();
bool amx_on();
void amx_set(bool on);
}  // namespace qcodes
// qlinear_i8.cpp
at::Tensor qlinear_i8(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets,
                         int64_t bits, int64_t group, double z, at::Tensor bias, at::Tensor out,
                         bool accumulate);
bool qlinear_i8_vnni();
// qargmax.cpp
int64_t qargmax(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                int64_t group, double z, int64_t n, at::Tensor ebound, at::Tensor out);
at::Tensor qgroup_l1(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                        double z, at::Tensor out);
// qgemm.cpp
at::Tensor qgemm(at::Tensor x, at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits,
                    int64_t group, double z, at::Tensor bias, at::Tensor out, bool accumulate);
// qdense.cpp
bool qcodes5_words();
at::Tensor qdense_t(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                       double z, int64_t b0, int64_t b1, at::Tensor out);
at::Tensor qdequant(at::Tensor codes, at::Tensor scales, at::Tensor offsets, int64_t bits, int64_t group,
                       double z, at::Tensor ids, at::Tensor out);

// peak.cpp: multiply-adds a second of a register-only loop of instruction ``kind`` on ``threads`` threads (0: absent)
double compute_peak(int64_t kind, double seconds, int64_t threads);

// ops.cpp
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
at::Tensor rope_qkv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor keys,
                       at::Tensor values, int64_t start, int64_t hq, int64_t hkv);
at::Tensor silu_mul(at::Tensor gu);
at::Tensor argmax_rows(at::Tensor x);
// attention.cpp
at::Tensor attention(at::Tensor q, at::Tensor keys, at::Tensor values, int64_t start, int64_t window,
                        double scale);

// The same kernels on raw pointers, for step.cpp's compiled layers: no tensor is made or checked per call (the
// tensor functions above check their arguments, then call these). A step's ~10 kernel calls a layer through the
// tensor functions would make several tensors and dozens of checks and views a layer, on a small model as much time
// as the arithmetic.
namespace raw {
// A packed block-quantized weight (qcodes.h's layout): checked once by qweight (qlinear.cpp).
struct QWeight {
  const uint8_t* codes;   // [NB, G, group bytes]
  const void* scales;     // qcodes.h's Scales: [NB, G, 16] float32 or float16, or the K-quants' two-level bytes
  const void* offsets;    // the same form, or nullptr (the type has none)
  int scale_kind;         // qcodes::ScKind of both
  int scale_shift;        // K forms: log2 of the groups per super-block
  int64_t NB, G, group, bits;
  float z;
};
QWeight qweight(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& offsets, int64_t bits,
                int64_t group, double z);
// y [M, N] (row stride ldy) = or += x [M, K = G * group] @ W^T (+ bias [N] or nullptr); N within W's blocks
// (qlinear.cpp; qlinear_i8.cpp: x rounded to 8 bits per group).
void qlinear(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
             bool accumulate);
void qlinear_i8(const float* x, int64_t M, const QWeight& w, const float* bias, float* y, int64_t ldy, int64_t N,
                bool accumulate);
// gemv.cpp's linear: packed [NB, K, 8]; y [M, N] contiguous; 1 <= M <= 16, K % 4 == 0.
void linear(const float* x, int64_t M, int64_t K, const float* packed, int64_t NB, const float* bias, float* y,
            int64_t N, bool accumulate);
void rms_norm(const float* x, const float* w, float* y, int64_t M, int64_t H, double eps);  // y may be x
void rope_qkv(const float* qkv, const float* cos, const float* sin, float* q, float* keys, float* values, int64_t B,
              int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t cap, int64_t start, int64_t rot);
void attention(const float* q, const float* keys, const float* values, float* out, int64_t B, int64_t n, int64_t hq,
               int64_t d, int64_t hkv, int64_t cap, int64_t start, int64_t window, double scale);
void silu_mul(const float* gu, float* y, int64_t M, int64_t I);
void argmax_rows(const float* x, int64_t M, int64_t N, int64_t* out);  // N > 0
}  // namespace raw

// step.cpp: LayerPlan, run_layers
void bind_step(pybind11::module_& m);
