// Reductions composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "reduce.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace emily {
using namespace mlx::core;

namespace {

template <typename F>
array arg_last(const char* op, F arg_first, const array& a, int axis, bool keepdims, const Stream& s) {
  int nd = static_cast<int>(a.ndim());
  int ax = axis < 0 ? axis + nd : axis;
  if (ax < 0 || ax >= nd) {
    throw std::invalid_argument(std::string(op) + ": axis " + std::to_string(axis) +
                                " is out of bounds for an array of " + std::to_string(nd) + " dimensions");
  }
  auto i = arg_first(flip(a, ax, s), ax, keepdims, s);
  return subtract(array(a.shape(ax) - 1, i.dtype()), i, s);
}

std::vector<int> normalized_axes(const array& a, const std::vector<int>& axes) {
  int nd = static_cast<int>(a.ndim());
  std::vector<int> out;
  for (int ax : axes) out.push_back(ax < 0 ? ax + nd : ax);
  return out;
}

// The number of elements each reduction over `axes` sees (0 for an axis out of range:
// MLX's own reduction then reports it).
double reduced_count(const array& a, const std::vector<int>& axes) {
  double n = 1;
  for (int ax : normalized_axes(a, axes)) {
    if (ax < 0 || ax >= static_cast<int>(a.ndim())) return 0;
    n *= a.shape(ax);
  }
  return n;
}

// `index` where `a` has no NaN along `axis`, else the index of its last NaN.
array last_nan_or(const array& a, array index, int axis, bool keepdims, const Stream& s) {
  if (!issubdtype(a.dtype(), floating) || a.size() == 0) return index;
  auto nan = isnan(a, s);
  auto at = arg_last(
      "argmax", [](const array& x, int ax, bool k, const Stream& st) { return argmax(x, ax, k, st); }, nan, axis,
      keepdims, s);
  return where(any(nan, axis, keepdims, s), at, index, s);
}

}  // namespace

array mean_wide(const array& a, const std::vector<int>& axes, bool keepdims, const Stream& s) {
  if (!issubdtype(a.dtype(), integer)) return mean(a, axes, keepdims, s);
  // MLX sums an integer mean in the integer type, which wraps. Up to 32 bits a 64-bit sum
  // cannot overflow; 64-bit values are summed as their high and low 32-bit halves, each
  // exactly, and recombined in float.
  bool is_signed = issubdtype(a.dtype(), signedinteger);
  Dtype wide = is_signed ? int64 : uint64;
  array total = array(0.0f);
  if (a.dtype().size() < 8) {
    total = astype(sum(astype(a, wide, s), axes, keepdims, s), float32, s);
  } else {
    auto x = astype(a, wide, s);
    auto hi = right_shift(x, array(32, wide), s);
    auto lo = bitwise_and(x, array(0xffffffffLL, wide), s);
    auto hi_sum = astype(sum(hi, axes, keepdims, s), float32, s);
    auto lo_sum = astype(sum(lo, axes, keepdims, s), float32, s);
    total = add(multiply(hi_sum, array(4294967296.0f), s), lo_sum, s);
  }
  return divide(total, array(static_cast<float>(reduced_count(a, axes))), s);
}

array var_scaled(const array& a, const std::vector<int>& axes, bool keepdims, int ddof, bool root,
                 const Stream& s) {
  // MLX's var is mean(x^2) - mean(x)^2 in the input's type: x^2 overflows f16, bf16 and
  // f32 long before the variance (or the deviation) does, wraps for integers, and
  // cancels. Here: two passes over the deviations, f16/bf16/integers in f32, each
  // deviation divided by the largest one, so only a result too large for its type
  // overflows.
  if (issubdtype(a.dtype(), complexfloating) || a.size() == 0) {
    return root ? mlx::core::std(a, axes, keepdims, ddof, s) : var(a, axes, keepdims, ddof, s);
  }
  Dtype out_t = issubdtype(a.dtype(), floating) ? a.dtype() : float32;
  Dtype ct = out_t == float64 ? float64 : float32;
  auto x = astype(a, ct, s);
  auto d = subtract(x, mean(x, axes, true, s), s);
  auto scale = max(abs(d, s), axes, true, s);
  scale = where(logical_and(isfinite(scale, s), greater(scale, array(0.0, ct), s), s), scale, array(1.0, ct), s);
  double n = reduced_count(a, axes);
  auto factor = array(n / std::max(n - ddof, 0.0), ct);
  auto q = multiply(mean(square(divide(d, scale, s), s), axes, keepdims, s), factor, s);
  auto sc = keepdims ? scale : squeeze(scale, normalized_axes(a, axes), s);
  auto r = root ? multiply(sqrt(q, s), sc, s) : multiply(q, square(sc, s), s);
  return astype(r, out_t, s);
}

array argmax_nan_last(const array& a, int axis, bool keepdims, const Stream& s) {
  return last_nan_or(a, argmax(a, axis, keepdims, s), axis, keepdims, s);
}

array argmin_nan_last(const array& a, int axis, bool keepdims, const Stream& s) {
  return last_nan_or(a, argmin(a, axis, keepdims, s), axis, keepdims, s);
}

array argmax_last(const array& a, int axis, bool keepdims, const Stream& s) {
  return arg_last(
      "argmax_last", [](const array& x, int ax, bool k, const Stream& st) { return argmax(x, ax, k, st); }, a,
      axis, keepdims, s);
}

array argmin_last(const array& a, int axis, bool keepdims, const Stream& s) {
  return arg_last(
      "argmin_last", [](const array& x, int ax, bool k, const Stream& st) { return argmin(x, ax, k, st); }, a,
      axis, keepdims, s);
}

}  // namespace emily
