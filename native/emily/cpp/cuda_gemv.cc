// A decoding step's products on MLX's CUDA backend: x (M, K), M <= 8, or one row of any
// shape (..., K), times a weight stored (K, N), the layout of Axon's and Bumblebee's dense
// kernels.
//
// MLX has its own gemv kernel only for a weight stored (N, K) (x · Wᵀ, PyTorch's and
// mlx-lm's layout); for (K, N) it calls cuBLAS, which it captures into a CUDA graph of
// its own per call. On an H200 that costs the host about 11 us more per product than a
// plain kernel (18.6 against 7.4 us per bf16 product in a chain of 196, Qwen3-0.6B's
// shapes), and a decoding pass waits on the host's encoding. This kernel is one node
// that reads the weight once, coalesced along its rows; on an H100 a decode's products
// take as long on the device as mlx-lm's through MLX's gemv (bench/README.md).
#include "cuda_kernels.h"

#include <mlx/backend/cuda/cuda.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cuda_launch.h"

namespace emily {
namespace mx = mlx::core;

namespace {

// Each block computes TILE = 32 * C columns of every row of x: its WARPS warps split K
// (warp w reads weight rows w, w + WARPS, ...), each lane C adjacent columns, so a warp
// reads 32 * C contiguous elements of a row. The warps' f32 partial sums meet in shared
// memory; one rounding to T at the end. Several weights of one x are one kernel: block b
// computes tile b of the first weight's tiles, then of the second's, and so on (`TILES`:
// the tiles up to each weight's), each column as alone.
constexpr const char* kTile = R"(
template <typename T, int M, int C, int WARPS>
__device__ void emily_gemv_tile(const T* x, long long xs0, long long xs1, const T* wt, T* out, int K, int N,
                                int tile, float (*red)[32 * C]) {
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
      for (int c = 0; c < C; ++c) wv[c] = to_float(p[c]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const float xv = to_float(x[m * xs0 + k * xs1]);
#pragma unroll
        for (int c = 0; c < C; ++c) acc[m][c] += xv * wv[c];
      }
    }
  } else if (col0 < N) {
    for (int k = w; k < K; k += WARPS)
      for (int c = 0; c < C && col0 + c < N; ++c)
        for (int m = 0; m < M; ++m)
          acc[m][c] += to_float(x[m * xs0 + k * xs1]) * to_float(wt[(size_t)k * N + col0 + c]);
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
      if (n < N) out[(size_t)m * N + n] = from_float<T>(s);
    }
    __syncthreads();
  }
}
)";

constexpr int kColumns = 1;  // C: a warp reads 32 contiguous elements of a row
constexpr int kWarps = 32;
constexpr int kMaxRows = 8;
constexpr int kMaxWeights = 3;

// The kernel of x (m rows of type t) times weights of `tiles` (each weight's tiles, in
// order): parameters x, w0, w1, ..., out0, out1, ..., x's strides along its rows and its
// last axis (x is read where it lies), then each weight's K and N.
cuda::Kernel gemv_kernel(mx::Dtype t, int m, int last_axis, const std::vector<int>& tiles) {
  int n = static_cast<int>(tiles.size()), total = 0;
  std::string src = cuda::kTypes;
  src += "using T = " + std::string(cuda::type_name(t)) + ";\nconstexpr int M = " + std::to_string(m) +
         ", C = " + std::to_string(kColumns) + ", WARPS = " + std::to_string(kWarps) + ";\n";
  src += kTile;
  std::string sig, body;
  std::vector<cuda::Param> params{{cuda::Param::Input, 0}};
  for (int i = 0; i < n; i++) {
    sig += ", const T* w" + std::to_string(i);
    params.push_back({cuda::Param::Input, i + 1});
  }
  for (int i = 0; i < n; i++) {
    sig += ", T* out" + std::to_string(i);
    params.push_back({cuda::Param::Output, i});
  }
  sig += ", long long xs0, long long xs1";
  params.push_back({cuda::Param::Stride, 0, 0});
  params.push_back({cuda::Param::Stride, 0, last_axis});
  for (int i = 0; i < n; i++) {
    auto w = std::to_string(i);
    sig += ", int K" + w + ", int N" + w;
    params.push_back({cuda::Param::Dim, i + 1, 0});
    params.push_back({cuda::Param::Dim, i + 1, 1});
    int before = total;
    total += tiles[i];
    body += "  " + std::string(i ? "else " : "") + (i == n - 1 ? "" : "if (b < " + std::to_string(total) + ") ") +
            "emily_gemv_tile<T, M, C, WARPS>(x, xs0, xs1, w" + w + ", out" + w + ", K" + w + ", N" + w + ", b - " +
            std::to_string(before) + ", red);\n";
  }
  src += "extern \"C\" __global__ void emily_gemv(const T* x" + sig + ") {\n" +
         "  __shared__ float red[WARPS][32 * C];\n  const int b = blockIdx.x;\n" + body + "}\n";
  return {"emily_gemv", std::move(src), std::move(params), {static_cast<unsigned>(total), 1, 1}, {32, kWarps, 1}};
}

bool supported(mx::Dtype t) { return t == mx::float32 || t == mx::bfloat16 || t == mx::float16; }

}  // namespace

bool cuda_gemv_applies(const array& x, const array& b, const Stream& s) {
  static const bool cuda = mx::cu::is_available();
  if (!cuda || s.device != mx::Device::gpu || !cuda::available()) return false;
  if (x.ndim() < 1 || b.ndim() != 2 || x.shape(-1) != b.shape(0)) return false;
  int k = x.shape(-1), n = b.shape(1);
  if (k < 1 || n < 1) return false;
  // Rows: a matrix's (at most kMaxRows), or one row of any shape (its axes before the last
  // all 1), read along its last axis.
  size_t m = x.size() / k;
  if (x.ndim() == 2 ? m < 1 || m > kMaxRows : m != 1) return false;
  if (x.dtype() != b.dtype() || !supported(x.dtype())) return false;
  // The weight's layout is known once it is evaluated (a program's input, a parameter);
  // one stored transposed is MLX's own gemv case, and a lazy one is left to MLX.
  return b.status() != array::Status::unscheduled && b.flags().row_contiguous;
}

array cuda_gemv(const array& x, const array& b, const Stream& s) { return cuda_gemvs(x, {b}, s)[0]; }

std::vector<array> cuda_gemvs(const array& x, const std::vector<array>& bs, const Stream& s) {
  std::vector<array> out;
  int m = static_cast<int>(x.size() / x.shape(-1)), last = static_cast<int>(x.ndim()) - 1;
  mx::Shape rows(x.shape().begin(), x.shape().end() - 1);
  for (size_t first = 0; first < bs.size(); first += kMaxWeights) {
    int n = static_cast<int>(std::min<size_t>(kMaxWeights, bs.size() - first));
    std::vector<array> inputs{x};
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> types;
    std::vector<int> tiles;
    std::string key = "gemv " + std::to_string(static_cast<int>(x.dtype().val())) + " " + std::to_string(m) + " " +
                      std::to_string(last);
    for (int i = 0; i < n; i++) {
      const array& b = bs[first + i];
      tiles.push_back((b.shape(1) + 32 * kColumns - 1) / (32 * kColumns));
      key += " " + std::to_string(tiles.back());
      inputs.push_back(b);
      shapes.push_back(rows);
      shapes.back().push_back(b.shape(1));
      types.push_back(x.dtype());
    }
    auto& kernel = cuda::instance(key, [&] { return gemv_kernel(x.dtype(), m, last, tiles); });
    auto part = cuda::launch(kernel, inputs, shapes, types, s);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

}  // namespace emily
