// Shape glue (optable/shape.ops): Nx's pad, and checked forms of MLX's strided views and
// splits.
#pragma once

#include <string>
#include <vector>

#include "emily.h"

namespace emily {

// Nx's pad: per axis `lo` and `hi` (negative crops) and `interior` (values inserted between
// neighbours), filled with the scalar `value` (cast to a's dtype).
array pad_nx(const array& a, const array& value, const std::vector<int>& lo,
             const std::vector<int>& hi, const std::vector<int>& interior, const Stream& s);

// MLX's pad with a mode ("constant" with zeros, "edge", "reflect", "symmetric") on every
// axis; `lo` and `hi` are non-negative.
array pad_mode(const array& a, const std::vector<int>& lo, const std::vector<int>& hi,
               const std::string& mode, const Stream& s);

// A view with `shape` and element `strides` from `offset` into a's row-major elements;
// every element it reaches must lie inside `a`.
array as_strided_checked(const array& a, const mlx::core::Shape& shape,
                         const std::vector<int>& strides, int64_t offset, const Stream& s);

// Splits `a` along `axis` into parts of the given sizes (summing to the axis).
std::vector<array> split_sizes(const array& a, const std::vector<int>& sizes, int axis,
                               const Stream& s);

}  // namespace emily
