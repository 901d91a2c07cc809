// Scans composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "scan.h"

namespace emily {
using namespace mlx::core;

namespace {

bool is_half(const array& a) { return a.dtype() == float16 || a.dtype() == bfloat16; }

}  // namespace

array cummax_nan(const array& a, int axis, bool reverse, bool inclusive, const Stream& s) {
  if (!is_half(a)) return cummax(a, axis, reverse, inclusive, s);
  return astype(cummax(astype(a, float32, s), axis, reverse, inclusive, s), a.dtype(), s);
}

array cummin_nan(const array& a, int axis, bool reverse, bool inclusive, const Stream& s) {
  if (!is_half(a)) return cummin(a, axis, reverse, inclusive, s);
  return astype(cummin(astype(a, float32, s), axis, reverse, inclusive, s), a.dtype(), s);
}

}  // namespace emily
