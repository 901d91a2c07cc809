// Sorts composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "sort.h"

#include <stdexcept>
#include <string>

namespace emily {
using namespace mlx::core;

namespace {

int checked_axis(const char* op, const array& a, int axis) {
  int nd = static_cast<int>(a.ndim());
  int ax = axis < 0 ? axis + nd : axis;
  if (ax < 0 || ax >= nd) {
    throw std::invalid_argument(std::string(op) + ": axis " + std::to_string(axis) +
                                " is out of bounds for an array of " + std::to_string(nd) + " dimensions");
  }
  return ax;
}

}  // namespace

array sort_axis(const array& a, int axis, bool descending, const Stream& s) {
  if (!descending) return sort(a, axis, s);
  int ax = checked_axis("sort", a, axis);
  return flip(sort(flip(a, ax, s), ax, s), ax, s);
}

array argsort_axis(const array& a, int axis, bool descending, const Stream& s) {
  if (!descending) return argsort(a, axis, s);
  int ax = checked_axis("argsort", a, axis);
  // Position j of the reversed axis is position n - 1 - j of the input.
  auto j = flip(argsort(flip(a, ax, s), ax, s), ax, s);
  return subtract(array(a.shape(ax) - 1, j.dtype()), j, s);
}

std::pair<array, array> topk_sorted(const array& a, int k, int axis, const Stream& s) {
  int ax = checked_axis("topk_sorted", a, axis);
  int n = a.shape(ax);
  if (k < 0 || k > n) {
    throw std::invalid_argument("topk_sorted: k = " + std::to_string(k) + " is outside [0, " +
                                std::to_string(n) + "], the size of axis " + std::to_string(axis));
  }
  auto idx = argsort_axis(a, ax, true, s);
  Shape start(a.ndim(), 0);
  Shape stop = idx.shape();
  stop[ax] = k;
  idx = slice(idx, start, stop, s);
  return {take_along_axis(a, idx, ax, s), idx};
}

}  // namespace emily
