// The C++ side of the cxx bridge (src/bridge.rs): declarations only. Glue, no logic:
// each function forwards to MLX's C++ API and lets its exceptions reach Rust.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace emily {

using mlx::core::array;
using mlx::core::Stream;

// A list of arrays crossing the bridge (inputs and outputs of one op).
struct ArrayVec {
  std::vector<array> items;
};

std::unique_ptr<ArrayVec> array_vec_new(size_t capacity);
void array_vec_push(ArrayVec& v, const array& a);
size_t array_vec_len(const ArrayVec& v);
void array_vec_clear(ArrayVec& v);
std::unique_ptr<array> array_vec_take(ArrayVec& v, size_t i);

// stream.cc
rust::String mlx_version();
bool device_available(int32_t device);
std::unique_ptr<Stream> stream_new(int32_t device);
void synchronize(const Stream& s);
// Makes `s` its device's default stream on the calling thread (MLX keeps defaults per thread).
void stream_set_default(const Stream& s);
// Registers (once) an exit handler that lets workers finish before MLX's static objects
// are destroyed (see worker.rs). Call it after MLX's allocator and scheduler exist.
void install_exit_guard();

// cuda_launch.cc: whether Emily's own CUDA kernels run here (cuda_launch.h).
bool cuda_kernels_available();

// loads.cc: the same large bytes loaded twice share one array (loads.h). A release notes
// that the registry may hold an array alone, a worker out of jobs prunes it, a session's
// end empties it.
void loads_released();
void loads_prune();
void loads_clear();

// tensor.cc
std::unique_ptr<array> from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                                  uint8_t dtype_val, uint8_t dtype_size);
std::unique_ptr<array> clone_array(const array& a);
// Evaluates `arrays` and replaces each one that is not row-contiguous by an evaluated
// row-contiguous copy, one at a time (true if there was one): what leaves a thread
// (exports, program_eval's outputs) is read as plain bytes.
bool evaluate_row_contiguous(std::vector<array>& arrays, const Stream& s);
// Evaluates `a` into a row-contiguous array whose data() can be exported without a copy.
std::unique_ptr<array> export_array(const array& a, const Stream& s);
// Evaluates the arrays of `v` in one graph evaluation, leaving each as it comes out.
void eval_arrays(const ArrayVec& v);
// The same, queued: returns once MLX has the graph, without waiting for the values.
void async_eval_arrays(const ArrayVec& v);
const uint8_t* array_data(const array& a);
size_t array_nbytes(const array& a);
rust::Vec<int32_t> array_shape(const array& a);
uint8_t array_dtype_val(const array& a);

// dispatch.cc (generated from the op table): runs op `op`, replacing `out`'s arrays by
// its results.
void op_call(uint32_t op, const ArrayVec& tensors, rust::Slice<const int64_t> ints, rust::Slice<const double> floats,
             rust::Slice<const rust::String> strs, const Stream& s, ArrayVec& out);

}  // namespace emily
