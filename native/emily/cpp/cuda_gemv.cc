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

#include <algorithm>
#include <string>
#include <vector>

namespace emily {
namespace mx = mlx::core;

namespace {

// Each block computes TILE = 32 * C columns of every row of x: its WARPS warps split K
// (warp w reads weight rows w, w + WARPS, ...), each lane C adjacent columns, so a warp
// reads 32 * C contiguous elements of a row. The warps' f32 partial sums meet in shared
// memory; one rounding to T at the end. Several weights of one x are one kernel: block b
// computes tile b of the first weight's tiles, then of the second's, and so on (the
// kernel's `TILES<i>`: the tiles before weight i + 1), each column as alone.
constexpr const char* kHeader = R"(
template <typename T, int M, int C, int WARPS>
__device__ void emily_gemv_tile(const T* x, const T* wt, T* out, int K, int N, int tile,
                                float (*red)[32 * C]) {
  constexpr int TILE = 32 * C;
  const int lane = threadIdx.x, w = threadIdx.y;
  const int col0 = tile * TILE + lane * C;
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
      const int n = tile * TILE + j;
      if (n < N) out[(size_t)m * N + n] = (T)s;
    }
    __syncthreads();
  }
}
)";

constexpr int kColumns = 1;  // C: a warp reads 32 contiguous elements of a row
constexpr int kMaxRows = 8;
constexpr int kMaxWeights = 3;

// The kernel of `n` weights (inputs x, w0, w1, ...; outputs out0, out1, ...).
std::string source(int n) {
  std::string src = "  __shared__ float red[WARPS][32 * C];\n  const int b = blockIdx.x;\n";
  for (int i = 0; i < n; i++) {
    auto w = std::to_string(i);
    std::string before = i == 0 ? "0" : "TILES" + std::to_string(i - 1);
    src += "  " + std::string(i ? "else " : "") + (i == n - 1 ? "" : "if (b < TILES" + w + ") ") +
           "emily_gemv_tile<T, M, C, WARPS>(x, w" + w + ", out" + w + ", w" + w + "_shape[0], w" + w + "_shape[1], b - " +
           before + ", red);\n";
  }
  return src;
}

const mx::fast::CustomKernelFunction& kernel(int n) {
  static const auto kernels = [] {
    std::vector<mx::fast::CustomKernelFunction> ks;
    for (int n = 1; n <= kMaxWeights; n++) {
      std::vector<std::string> inputs{"x"}, outputs;
      for (int i = 0; i < n; i++) {
        inputs.push_back("w" + std::to_string(i));
        outputs.push_back("out" + std::to_string(i));
      }
      auto name = n == 1 ? std::string("emily_gemv_kn") : "emily_gemv_kn" + std::to_string(n);
      ks.push_back(mx::fast::cuda_kernel(name, inputs, outputs, source(n), kHeader));
    }
    return ks;
  }();
  return kernels[n - 1];
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

array cuda_gemv(const array& x, const array& b, const Stream& s) { return cuda_gemvs(x, {b}, s)[0]; }

std::vector<array> cuda_gemvs(const array& x, const std::vector<array>& bs, const Stream& s) {
  std::vector<array> out;
  for (size_t first = 0; first < bs.size(); first += kMaxWeights) {
    int n = static_cast<int>(std::min<size_t>(kMaxWeights, bs.size() - first));
    int m = x.shape(0), warps = 32, tiles = 0;
    std::vector<array> inputs{x};
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> types;
    TemplateArgs args{
        {"T", x.dtype()}, {"M", m}, {"C", kColumns}, {"WARPS", warps}};
    for (int i = 0; i < n; i++) {
      const array& b = bs[first + i];
      tiles += (b.shape(1) + 32 * kColumns - 1) / (32 * kColumns);
      if (i < n - 1) args.push_back({"TILES" + std::to_string(i), tiles});
      inputs.push_back(b);
      shapes.push_back({m, b.shape(1)});
      types.push_back(x.dtype());
    }
    auto part = cached_kernel(kernel(n), inputs, shapes, types, {tiles * 32, warps, 1}, {32, warps, 1}, args, s);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

}  // namespace emily
