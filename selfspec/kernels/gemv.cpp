// selfspec's CPU linear kernel for decoding: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) (+= into y) for
// few rows (M <= 16: one decoding step, a verification block, a draft).
//
// Why: one decoding step reads every weight once, so it is bound by memory bandwidth. MKL's and
// oneDNN's general GEMMs reach about half of this machine's read bandwidth at M = 1 and grow almost
// linearly in M; this kernel reads each weight as one sequential stream and stays near the bandwidth
// up to M = 8 (docs/BENCHMARKS.md).
//
// Packed weight layout (made once by selfspec/kernels/linear.py):  # [N / R, K, R]
//   block b holds output rows [b * R, b * R + R); inside it, column k of those R rows is R
//   consecutive floats: one vector register. A block is R * K contiguous floats.
// Worked example, R = 2: W = [[a0 a1 a2], [b0 b1 b2]] packs as a0 b0 a1 b1 a2 b2.
//
// For each block and each k: load the R weights of column k once, broadcast x[m, k] for each of
// the MC (<= 12) rows of x, and accumulate MC vectors of R outputs: MC fused multiply-adds per weight
// load, accumulators in registers, no horizontal sums. With one x-row the k loop is split into U = 4
// interleaved partial sums so the additions do not wait on each other.
#include <cstring>

#include "kernels.h"

namespace {

typedef float v8 __attribute__((vector_size(32)));  // 8 floats: one AVX2 register (half an AVX-512 one)
constexpr int R = 8;  // output rows per block

// MC rows of x against one block; U interleaved partial sums over k (K % U == 0).
template <int MC, int U>
inline void tile(const float* __restrict x, int64_t K, const float* __restrict blk, float* __restrict out) {
  v8 acc[U][MC];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MC; ++m) acc[u][m] = v8{};
  for (int64_t k = 0; k < K; k += U) {
    for (int u = 0; u < U; ++u) {
      v8 w;
      std::memcpy(&w, blk + (k + u) * R, sizeof(v8));
      for (int m = 0; m < MC; ++m) acc[u][m] += w * x[m * K + k + u];
    }
  }
  for (int m = 0; m < MC; ++m) {
    v8 s = acc[0][m];
    for (int u = 1; u < U; ++u) s += acc[u][m];
    std::memcpy(out + m * R, &s, sizeof(v8));
  }
}

}  // namespace

void raw::linear(const float* xp, int64_t M, int64_t K, const float* pp, int64_t NB, const float* bp, float* yp,
                 int64_t N, bool accumulate) {
  // OpenMP directly: torch's own pool (libgomp, sized by torch.set_num_threads), without at::parallel_for's
  // dispatch around it, which these ~100-block loops would pay at every call.
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < NB; ++b) {
    float res[16 * R];
    const float* blk = pp + b * K * R;
    for (int64_t m0 = 0; m0 < M; m0 += 12) {
      const float* xm = xp + m0 * K;
      float* rm = res + m0 * R;
      switch (std::min<int64_t>(12, M - m0)) {
        case 1: tile<1, 4>(xm, K, blk, rm); break;
        case 2: tile<2, 2>(xm, K, blk, rm); break;
        case 3: tile<3, 2>(xm, K, blk, rm); break;
        case 4: tile<4, 1>(xm, K, blk, rm); break;
        case 5: tile<5, 1>(xm, K, blk, rm); break;
        case 6: tile<6, 1>(xm, K, blk, rm); break;
        case 7: tile<7, 1>(xm, K, blk, rm); break;
        case 8: tile<8, 1>(xm, K, blk, rm); break;
        case 9: tile<9, 1>(xm, K, blk, rm); break;
        case 10: tile<10, 1>(xm, K, blk, rm); break;
        case 11: tile<11, 1>(xm, K, blk, rm); break;
        default: tile<12, 1>(xm, K, blk, rm); break;
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
}

// x [M, K] float32 contiguous; packed [N_pad / R, K, R]; bias [N] or empty; out [M, N]
// (written, or added to when accumulate). Returns out.
at::Tensor linear(at::Tensor x, at::Tensor packed, at::Tensor bias, at::Tensor out,
                     bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat, "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == R && packed.is_contiguous(), "packed weight: [N/8, K, 8]");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), NB = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && K % 4 == 0, "x has ", K, " columns, the weight ", packed.size(1));
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.is_contiguous() && N <= NB * R, "out: [M, N]");
  TORCH_CHECK(M >= 1 && M <= 16, "the decoding kernel takes 1 to 16 rows, got ", M);
  raw::linear(x.data_ptr<float>(), M, K, packed.data_ptr<float>(), NB, bias.numel() ? bias.data_ptr<float>() : nullptr,
              out.data_ptr<float>(), N, accumulate);
  return out;
}
