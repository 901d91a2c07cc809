// Reductions composed from MLX ops (optable/reduce.ops).
#pragma once

#include "emily.h"

namespace emily {

// argmax/argmin that return the last index among ties (MLX returns the first): the
// first index along the reversed axis, mapped back.
array argmax_last(const array& a, int axis, bool keepdims, const Stream& s);
array argmin_last(const array& a, int axis, bool keepdims, const Stream& s);
// argmax/argmin with MLX's tie-break (the first index) but the last NaN, as Nx's
// BinaryBackend.
array argmax_nan_last(const array& a, int axis, bool keepdims, const Stream& s);
array argmin_nan_last(const array& a, int axis, bool keepdims, const Stream& s);
// An integer mean accumulated without wrapping (MLX sums in the integer type).
array mean_wide(const array& a, const std::vector<int>& axes, bool keepdims, const Stream& s);
// var (root false) or std (root true) from scaled deviations: overflows only where the
// result does not fit its type.
array var_scaled(const array& a, const std::vector<int>& axes, bool keepdims, int ddof, bool root,
                 const Stream& s);

}  // namespace emily
