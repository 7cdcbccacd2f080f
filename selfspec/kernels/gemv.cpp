// selfspec's CPU linear kernel for decoding: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+= into y) for
// few rows (M <= 16: one decoding step, a verification block, a draft).
//
// Why: one decoding step reads every weight once, so it is bound by memory bandwidth. MKL's and
// oneDNN's general GEMMs reach about half of this machine's read bandwidth at M = 1; this kernel
// reads the weight as one sequential stream per block of 8 output rows and reaches the bandwidth.
//
// Packed weight layout (made once by selfspec/kernels/linear.py):  # [N / R, K / V, R, V]
//   block b holds output rows [b * R, b * R + R); inside it, chunk c holds columns [c * V, c * V + V)
//   of those R rows, one after the other. A block is R * K contiguous floats.
// Worked example, R = 2, V = 2, W = [[a0 a1 a2 a3], [b0 b1 b2 b3]]: packed = a0 a1 b0 b1 a2 a3 b2 b3.
//
// For M x-rows the kernel walks each block once per tile of (MC <= 8 rows of x) x (RS rows of W);
// the first walk brings the block (R * K * 4 bytes) into L1/L2, later walks of the same block hit
// the cache, so the weight is read from memory once whatever M is.
#include <torch/extension.h>
#include <cstring>

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats: one AVX2 register (half an AVX-512 one)
constexpr int R = 8;  // output rows per block
constexpr int V = 8;  // columns per chunk

inline float hsum(v8 v) {
  float s = 0.f;
  for (int i = 0; i < V; ++i) s += v[i];
  return s;
}

// One tile: MC rows of x against RS rows (r0 .. r0 + RS) of one block.
template <int MC, int RS>
inline void tile(const float* x, int64_t K, const float* blk, int r0, float* acc_out) {
  v8 acc[MC][RS];
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < RS; ++r) acc[m][r] = v8{};
  const int64_t KC = K / V;
  for (int64_t c = 0; c < KC; ++c) {
    const float* w = blk + (c * R + r0) * V;
    v8 wv[RS];
    for (int r = 0; r < RS; ++r) std::memcpy(&wv[r], w + r * V, sizeof(v8));
    for (int m = 0; m < MC; ++m) {
      v8 xv;
      std::memcpy(&xv, x + m * K + c * V, sizeof(v8));
      for (int r = 0; r < RS; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < MC; ++m)
    for (int r = 0; r < RS; ++r) acc_out[m * R + r0 + r] = hsum(acc[m][r]);
}

template <int MC>
inline void block_rows(const float* x, int64_t K, const float* blk, float* out) {
  // Rows of W per walk, measured on this project's CPUs (docs/BENCHMARKS.md): up to 4 x-rows, all 8
  // rows in one walk (the accumulators spill to L1, which keeps up); 5-8 x-rows, one W row per walk
  // with 5-8 accumulators in registers (the block is re-read from L1).
  constexpr int RS = MC <= 4 ? 8 : 1;
  for (int r0 = 0; r0 < R; r0 += RS) tile<MC, RS>(x, K, blk, r0, out);
}

}  // namespace

// x [M, K] float32 contiguous; packed [N_pad / R, K / V, R, V]; bias [N] or empty; out [M, N]
// (written, or added to when accumulate). Returns out.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, torch::Tensor out,
                     bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == R && packed.size(3) == V && packed.is_contiguous(),
              "packed weight: [N/8, K/8, 8, 8]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) * V == K, "x has ", K, " columns, the weight ", packed.size(1) * V);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.is_contiguous() && N <= NB * R, "out: [M, N]");
  TORCH_CHECK(M >= 1 && M <= 16, "the decoding kernel takes 1 to 16 rows, got ", M);
  const float* xp = x.data_ptr<float>();
  const float* pp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = out.data_ptr<float>();
  // OpenMP directly: torch's own pool (libgomp, sized by torch.set_num_threads); measured faster here
  // than at::parallel_for for these ~100-block loops.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b) {
    float res[16 * R];
    const float* blk = pp + b * K * R;
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const float* xm = xp + m0 * K;
      float* rm = res + m0 * R;
      switch (std::min<int64_t>(8, M - m0)) {
        case 1: block_rows<1>(xm, K, blk, rm); break;
        case 2: block_rows<2>(xm, K, blk, rm); break;
        case 3: block_rows<3>(xm, K, blk, rm); break;
        case 4: block_rows<4>(xm, K, blk, rm); break;
        case 5: block_rows<5>(xm, K, blk, rm); break;
        case 6: block_rows<6>(xm, K, blk, rm); break;
        case 7: block_rows<7>(xm, K, blk, rm); break;
        default: block_rows<8>(xm, K, blk, rm); break;
      }
    }
    const int64_t rows = std::min<int64_t>(R, N - b * R);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = b * R + r;
        const float v = res[m * R + r] + (bp ? bp[n] : 0.f);
        yp[m * N + n] = accumulate ? yp[m * N + n] + v : v;
      }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y = x @ W^T (+ bias) (+= into out) with a packed weight, 1 <= M <= 16");
}
