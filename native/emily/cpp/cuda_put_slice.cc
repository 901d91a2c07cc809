// A dynamic update (`put_slice` at start indices computed on the device) on MLX's CUDA
// backend as one kernel node.
//
// A decoding step writes each layer's new key and value row into its cache at the step's
// position. MLX's own dynamic update is two kernels (the offset from the starts, then
// the copy), and the scatter Emily used in its place needs the starts clamped, split
// into index columns and the update given a leading axis: with Bumblebee's grouped-query
// caches, whose update repeats each key/value head over its query heads, six graph
// nodes per cache a layer, each paid for in host time at every step. This kernel
// reads the unrepeated update through its strides, clamps the starts itself, and writes
// into the cache's buffer where MLX may donate it (cuda_launch.h's `in_place`): one node.
// It moves elements without reading them, so any type of 1, 2, 4 or 8 bytes.
#include "cuda_kernels.h"

#include <mlx/backend/cuda/cuda.h>

#include "cuda_launch.h"

namespace emily {
namespace mx = mlx::core;

namespace {

constexpr int kMaxRank = 8;
constexpr unsigned kBlock = 256;

// One thread per element of the repeated update, whose index along AXIS reads the
// update's index / REPEATS. START_AXES lists the axes `starts` gives starts for, in
// order; each start clamps into [0, dim - size] as Nx clamps it.
constexpr const char* kSource = R"(
extern "C" __global__ void emily_put_slice(T* out, const T* update, const S* starts, ARGS) {
  const long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= SIZE) return;
  const int dims[RANK] = {DIMS};
  const int udims[RANK] = {UDIMS};
  const long long ustrides[RANK] = {USTRIDES};
  const int axes[] = {START_AXES};
  long long first[RANK] = {0};
#pragma unroll
  for (int j = 0; j < (int)(sizeof(axes) / sizeof(int)); ++j) {
    const int ax = axes[j];
    const long long hi = dims[ax] - (long long)udims[ax] * (ax == AXIS ? REPEATS : 1);
    const long long v = (long long)starts[j * sstride];
    first[ax] = v < 0 ? 0 : (v > hi ? hi : v);
  }
  long long rest = n, from = 0, to = 0, step = 1;
#pragma unroll
  for (int k = RANK - 1; k >= 0; --k) {
    const long long size = (long long)udims[k] * (k == AXIS ? REPEATS : 1);
    const long long i = rest % size;
    rest /= size;
    from += (k == AXIS ? i / REPEATS : i) * ustrides[k];
    to += (i + first[k]) * step;
    step *= dims[k];
  }
  out[to] = update[from];
}
)";

cuda::Kernel put_slice_kernel(const array& a, const array& update, const array& starts, const std::vector<int>& axes,
                              int axis, int repeats, long long size) {
  using P = cuda::Param;
  auto num = [](auto v) { return std::to_string(v); };
  int rank = a.ndim();
  std::vector<P> params{{P::Output, 0}, {P::Input, 1}, {P::Input, 2}, {P::Stride, 2, 0}};
  std::string args = "long long sstride", dims, udims, ustrides, start_axes;
  for (int k = 0; k < rank; k++) {
    std::string sep = k ? ", " : "";
    args += ", int d" + num(k) + ", int u" + num(k) + ", long long us" + num(k);
    params.push_back({P::Dim, 0, k});
    params.push_back({P::Dim, 1, k});
    params.push_back({P::Stride, 1, k});
    dims += sep + "d" + num(k);
    udims += sep + "u" + num(k);
    ustrides += sep + "us" + num(k);
  }
  for (size_t j = 0; j < axes.size(); j++) start_axes += (j ? ", " : "") + num(axes[j]);
  std::string src = cuda::kTypes;
  src += "using T = " + std::string(cuda::bits_type(a.itemsize())) + ";\nusing S = " +
         (starts.dtype() == mx::int32 ? "int" : "long long") + ";\n";
  src += "#define RANK " + num(rank) + "\n#define AXIS " + num(axis) + "\n#define REPEATS " + num(repeats) +
         "\n#define SIZE " + num(size) + "LL\n#define ARGS " + args + "\n#define DIMS " + dims + "\n#define UDIMS " +
         udims + "\n#define USTRIDES " + ustrides + "\n#define START_AXES " + start_axes + "\n";
  src += kSource;
  auto blocks = static_cast<unsigned>((size + kBlock - 1) / kBlock);
  cuda::Kernel k{"emily_put_slice", std::move(src), std::move(params), {blocks, 1, 1}, {kBlock, 1, 1}};
  k.in_place = 0;
  return k;
}

}  // namespace

bool cuda_put_slice_applies(const array& a, const array& update, const array& starts, const std::vector<int>& axes,
                            const Stream& s) {
  static const bool cuda = mx::cu::is_available();
  if (!cuda || s.device != mx::Device::gpu || !cuda::available()) return false;
  size_t bytes = a.itemsize();
  return a.ndim() >= 1 && a.ndim() <= kMaxRank && update.ndim() == a.ndim() && update.dtype() == a.dtype() &&
         update.size() > 0 && !axes.empty() && starts.ndim() == 1 && starts.size() == axes.size() &&
         (starts.dtype() == mx::int32 || starts.dtype() == mx::int64) &&
         (bytes == 1 || bytes == 2 || bytes == 4 || bytes == 8);
}

array cuda_put_slice(const array& a, const array& update, const array& starts, const std::vector<int>& axes, int axis,
                     int repeats, const Stream& s) {
  long long size = static_cast<long long>(update.size()) * repeats;
  auto num = [](auto v) { return std::to_string(v); };
  std::string key = "put_slice " + num(a.itemsize()) + " " + num(static_cast<int>(starts.dtype().val())) + " " +
                    num(a.ndim()) + " " + num(axis) + " " + num(repeats) + " " + num(size) + " axes";
  for (int ax : axes) key += " " + num(ax);
  auto& kernel = cuda::instance(key, [&] { return put_slice_kernel(a, update, starts, axes, axis, repeats, size); });
  return cuda::launch(kernel, {a, update, starts}, {a.shape()}, {a.dtype()}, s)[0];
}

}  // namespace emily
