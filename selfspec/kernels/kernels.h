// The functions selfspec's CPU kernel files call across files (one extension: gemv.cpp, quant.cpp, ops.cpp,
// step.cpp; ops.cpp binds them all to Python).
#pragma once
#include <torch/extension.h>

// gemv.cpp
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out, bool accumulate);

// quant.cpp
torch::Tensor qlinear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                      int64_t group, double z, torch::Tensor bias, torch::Tensor out, bool accumulate);
torch::Tensor qlinear_i8(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                         int64_t bits, int64_t group, double z, torch::Tensor bias, torch::Tensor out,
                         bool accumulate);
bool qlinear_i8_vnni();
int64_t qargmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                int64_t group, double z, int64_t n, torch::Tensor ebound, torch::Tensor out);
bool qcodes5_words();
torch::Tensor qgemm(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                    int64_t group, double z, torch::Tensor bias, torch::Tensor out, bool accumulate);
torch::Tensor qdense_t(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits, int64_t group,
                       double z, int64_t b0, int64_t b1, torch::Tensor out);
torch::Tensor qgroup_l1(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits, int64_t group,
                        double z, torch::Tensor out);
torch::Tensor qdequant(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets, int64_t bits, int64_t group,
                       double z, torch::Tensor ids, torch::Tensor out);

// ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rope_qkv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                       torch::Tensor values, int64_t start, int64_t hq, int64_t hkv);
torch::Tensor attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t start, int64_t window,
                        double scale);
torch::Tensor silu_mul(torch::Tensor gu);
torch::Tensor argmax_rows(torch::Tensor x);

// step.cpp: LayerPlan, run_layers
void bind_step(pybind11::module_& m);
