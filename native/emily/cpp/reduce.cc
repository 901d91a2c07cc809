// Reductions composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "reduce.h"

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

}  // namespace

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
