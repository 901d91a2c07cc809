// Identical tensors loaded from binaries share one array.
//
// A checkpoint can hand `from_binary` the same bytes more than once: Bumblebee reads a
// tied embedding from the file once for each parameter that names it (the input
// embedding and the language-modelling head), which would hold two copies of a model's
// largest matrix. MLX's arrays are immutable, and MLX donates a buffer to an op's output
// only where one array holds it, so two tensors can share one array with nothing to see
// but the memory saved. A worker therefore answers bytes of at least kMinBytes whose
// shape, type and every byte equal those of an array it made from bytes before, and that
// something still holds, with that array.
//
// The registry is the worker thread's own (each worker is one thread) and holds the
// arrays themselves: a loader reshapes what `from_binary` gives and drops the tensor it
// was given (Safetensors does), so the array lives on in other tensors' views. An array
// held by the registry alone is let go when the worker runs out of jobs after a release
// (`prune`), and after each view `evaluate_row_contiguous` replaces with a copy
// (`prune_now`), where the view was all that held a loaded matrix. The price: while the
// registry holds a loaded array, MLX never writes an op's output into its buffer (an op
// whose input is a loaded array its tensor dropped allocates its output anew).
#pragma once

#include "emily.h"

namespace emily::loads {

constexpr size_t kMinBytes = size_t{1} << 20;

// An array of `shape` and `dtype` holding `data`: one made from the same bytes before if
// something still holds it, else a copy, remembered if it is at least kMinBytes.
array from_bytes(rust::Slice<const uint8_t> data, mlx::core::Shape shape, mlx::core::Dtype dtype);

// Lets go the arrays held by the registry alone: `prune` only if a tensor was released
// since it last ran, `prune_now` whenever the registry holds any.
void prune();
void prune_now();

}  // namespace emily::loads
