// Reductions composed from MLX ops (optable/reduce.ops).
#pragma once

#include "emily.h"

namespace emily {

// argmax/argmin that return the last index among ties (MLX returns the first): the
// first index along the reversed axis, mapped back.
array argmax_last(const array& a, int axis, bool keepdims, const Stream& s);
array argmin_last(const array& a, int axis, bool keepdims, const Stream& s);

}  // namespace emily
