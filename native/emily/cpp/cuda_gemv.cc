// A decoding step's products on MLX's CUDA backend: x (M, K), M <= 8, times a weight
// stored (K, N), the layout of Axon's and Bumblebee's dense kernels.
//
// MLX has its own gemv kernel only for a weight stored (N, K) (x · Wᵀ, PyTorch's and
// mlx-lm's layout); for (K, N) it calls cuBLAS, which it captures into a CUDA graph of
// its own per call. On an H200 that costs the host about 11 us more per product than a
// plain kernel (18.6 against 7.4 us per bf16 product in a chain of 196, Qwen3-0.6B's
// shapes), and a decode pass is bound by the host's encoding. This kernel is one node
// that reads the weight once, coalesced along its rows.
#include "cuda_kernels.h"

#include <mlx/backend/cuda/cuda.h>
#include <mlx/fast.h>

namespace emily {
namespace mx = mlx::core;

namespace {

// Each block computes TILE = 32 * C columns of every row of x: its WARPS warps split K
// (warp w reads weight rows w, w + WARPS, ...), each lane C adjacent columns, so a warp
// reads 32 * C contiguous elements of a row. The warps' f32 partial sums meet in shared
// memory; one rounding to T at the end.
constexpr const char* kSource = R"(
  constexpr int TILE = 32 * C;
  __shared__ float red[WARPS][TILE];
  const int K = wt_shape[0], N = wt_shape[1];
  const int lane = threadIdx.x, w = threadIdx.y;
  const int col0 = blockIdx.x * TILE + lane * C;
  float acc[M][C];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int c = 0; c < C; ++c) acc[m][c] = 0.f;
  if (col0 + C <= N) {
    const T* p = wt + (size_t)w * N + col0;
    const size_t step = (size_t)WARPS * N;
#pragma unroll 8
    for (int k = w; k < K; k += WARPS, p += step) {
      float wv[C];
#pragma unroll
      for (int c = 0; c < C; ++c) wv[c] = (float)p[c];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float xv = (float)x[m * K + k];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[m][c] += xv * wv[c];
      }
    }
  } else if (col0 < N) {
    for (int k = w; k < K; k += WARPS)
      for (int c = 0; c < C && col0 + c < N; ++c)
        for (int m = 0; m < M; ++m)
          acc[m][c] += (float)x[m * K + k] * (float)wt[(size_t)k * N + col0 + c];
  }
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int c = 0; c < C; ++c) red[w][lane * C + c] = acc[m][c];
    __syncthreads();
    for (int j = w * 32 + lane; j < TILE; j += WARPS * 32) {
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < WARPS; ++q) s += red[q][j];
      const int n = blockIdx.x * TILE + j;
      if (n < N) out[(size_t)m * N + n] = (T)s;
    }
    __syncthreads();
  }
)";

constexpr int kColumns = 1;  // C: a warp reads 32 contiguous elements of a row
constexpr int kMaxRows = 8;

const mx::fast::CustomKernelFunction& kernel() {
  static const auto k = mx::fast::cuda_kernel("emily_gemv_kn", {"x", "wt"}, {"out"}, kSource);
  return k;
}

bool supported(mx::Dtype t) { return t == mx::float32 || t == mx::bfloat16 || t == mx::float16; }

}  // namespace

bool cuda_gemv_applies(const array& x, const array& b, const Stream& s) {
  static const bool cuda = mx::cu::is_available();
  if (!cuda || s.device != mx::Device::gpu) return false;
  if (x.ndim() != 2 || b.ndim() != 2 || x.shape(1) != b.shape(0)) return false;
  int m = x.shape(0), k = x.shape(1), n = b.shape(1);
  if (m < 1 || m > kMaxRows || k < 1 || n < 1) return false;
  if (x.dtype() != b.dtype() || !supported(x.dtype())) return false;
  // The weight's layout is known once it is evaluated (a program's input, a parameter);
  // one stored transposed is MLX's own gemv case, and a lazy one is left to MLX.
  return b.status() != array::Status::unscheduled && b.flags().row_contiguous;
}

array cuda_gemv(const array& x, const array& b, const Stream& s) {
  int m = x.shape(0), n = b.shape(1);
  int warps = 32;
  int tiles = (n + 32 * kColumns - 1) / (32 * kColumns);
  auto out = kernel()({x, b}, {{m, n}}, {x.dtype()}, {tiles * 32, warps, 1}, {32, warps, 1},
                      {{"T", x.dtype()}, {"M", m}, {"C", kColumns}, {"WARPS", warps}}, std::nullopt, false, s);
  return out[0];
}

}  // namespace emily
