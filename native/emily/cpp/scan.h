// Scans composed from MLX ops (optable/scan.ops).
#pragma once

#include "emily.h"

namespace emily {

// MLX's cummax/cummin, except that float16 and bfloat16 scan in float32 (a lossless
// round trip for a selection): MLX's half-precision kernels turn NaN into 0 and then
// carry the 0 on, where NaN must propagate.
array cummax_nan(const array& a, int axis, bool reverse, bool inclusive, const Stream& s);
array cummin_nan(const array& a, int axis, bool reverse, bool inclusive, const Stream& s);

}  // namespace emily
