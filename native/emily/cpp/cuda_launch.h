// Emily's CUDA kernels, compiled by NVRTC and launched by a primitive of Emily's own.
//
// MLX's custom-kernel call (`mx::fast::cuda_kernel`) formats the kernel's name, hashes its
// whole source, looks its module up by that name and packs its arguments into a deque of
// variants at every evaluation: 6.9 us of host time a node on an H100, where MLX's own
// gemv costs 3.7 (bench/README.md, "GPU: models"), and a decoding pass waits on the
// host's encoding. Here a kernel is compiled once per instance, and evaluating its node
// allocates the outputs, writes the arguments its instance lists into an array and adds
// one kernel node to the stream's CUDA graph.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "emily.h"

namespace emily::cuda {

// One parameter of a kernel, in the order of its signature.
struct Param {
  enum Kind : uint8_t {
    Input,   // the input's data: a pointer
    Output,  // the output's data: a pointer
    Dim,     // the input's size along `axis`: an int
    Stride,  // the input's stride along `axis`, in elements: a long long
    Int,     // `value`: an int
    // The input's stride along `axis` as broadcast to rank `value` (axes aligned at the
    // end), 0 where it has no such axis or a unit one: a long long.
    BroadcastStride,
  };
  Kind kind;
  int index = 0;  // the input or output
  int axis = 0;
  int value = 0;
};

// A kernel: one `extern "C" __global__` function `entry` in `source`, a translation unit
// that includes nothing (it starts with `kTypes`), launched on `grid` blocks of `block`
// threads with `params`. Where `in_place` names an input (of the output's shape and
// type), the output starts as that input's elements and the kernel writes some of them:
// the output takes the input's buffer where MLX may donate it (row-contiguous, no other
// reader), as MLX's own updates do, and is otherwise first filled with a copy.
struct Kernel {
  std::string entry;
  std::string source;
  std::vector<Param> params;
  std::array<unsigned, 3> grid{1, 1, 1};
  std::array<unsigned, 3> block{1, 1, 1};
  int in_place = -1;
};

struct Instance;

// Whether kernels can run here: a CUDA build whose libmlx has a GPU, with the CUDA driver,
// NVRTC and libmlx's device allocator found (cuda_launch.cc). The first call looks them up.
bool available();

// The instance `key` names (everything `make` reads: the kernel's constants, its types,
// its grid), made by `make` at the first call with that key and kept; its module is
// compiled at the first evaluation. Callers compute a key cheaply and the source only
// once.
Instance& instance(const std::string& key, const std::function<Kernel()>& make);

// One node of `kernel` over `inputs` on the GPU stream `s`, its outputs of `shapes` and
// `types`. Inputs are read where they lie: the kernel reads strided ones through the
// strides it takes.
std::vector<array> launch(Instance& kernel, const std::vector<array>& inputs, std::vector<mlx::core::Shape> shapes,
                          std::vector<mlx::core::Dtype> types, const Stream& s);

// The storage types a kernel's source names for MLX's floating types (`float`, `bf16_t`,
// `f16_t`; `bool` for bool) and the conversions of kTypes.
const char* type_name(mlx::core::Dtype t);
// The unsigned integer type of `bytes` bytes (1, 2, 4 or 8), for kernels that move
// elements of any type without reading them.
const char* bits_type(size_t bytes);

// The start of every kernel's source: bf16_t and f16_t, `to_float(x)` and
// `from_float<T>(f)`, which rounds to nearest even as CUDA's own conversions do.
extern const char* const kTypes;

}  // namespace emily::cuda
