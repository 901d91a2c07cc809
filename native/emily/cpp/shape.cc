// Shape glue: see shape.h.
#include "shape.h"

#include <limits>
#include <stdexcept>

#include "index.h"

namespace emily {
namespace mx = mlx::core;
using mx::Shape;

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument(m); }

void check_per_axis(const std::vector<int>& v, int ndim, const std::string& name) {
  if (static_cast<int>(v.size()) != ndim) {
    fail("expected " + std::to_string(ndim) + " " + name + " values, got " +
         std::to_string(v.size()));
  }
}

}  // namespace

array pad_nx(const array& a, const array& value, const std::vector<int>& lo,
             const std::vector<int>& hi, const std::vector<int>& interior_in, const Stream& s) {
  int r = a.ndim();
  std::vector<int> interior = interior_in.empty() ? std::vector<int>(r, 0) : interior_in;
  check_per_axis(lo, r, "low padding");
  check_per_axis(hi, r, "high padding");
  check_per_axis(interior, r, "interior padding");
  if (value.size() != 1) fail("the pad value must hold one element");
  array v = mx::astype(mx::reshape(value, {}, s), a.dtype(), s);
  array x = a;

  // Interior: give each element a trailing block of `interior` pad values, then drop the
  // block after the last element.
  bool any_interior = false;
  for (int i = 0; i < r; i++) {
    if (interior[i] < 0) fail("interior padding must be non-negative");
    any_interior = any_interior || (interior[i] > 0 && a.shape(i) > 0);
  }
  if (any_interior) {
    Shape expanded, merged, stop;
    std::vector<int> new_axes;
    Shape ilo, ihi;
    for (int i = 0; i < r; i++) {
      int d = a.shape(i);
      expanded.push_back(d);
      if (interior[i] > 0 && d > 0) {
        expanded.push_back(1);
        new_axes.push_back(static_cast<int>(expanded.size()) - 1);
        ilo.push_back(0);
        ihi.push_back(interior[i]);
        int64_t grown = static_cast<int64_t>(d) * (1 + interior[i]);
        if (grown > std::numeric_limits<int32_t>::max()) {
          fail("interior padding makes axis " + std::to_string(i) + " too large");
        }
        merged.push_back(static_cast<int>(grown));
        stop.push_back(static_cast<int>(grown - interior[i]));
      } else {
        merged.push_back(d);
        stop.push_back(d);
      }
    }
    x = mx::pad(mx::reshape(x, expanded, s), new_axes, ilo, ihi, v, "constant", s);
    x = mx::slice(mx::reshape(x, merged, s), Shape(r, 0), stop, s);
  }

  // Edges: grow by the positive parts, then crop the negative ones.
  std::vector<int> all_axes;
  Shape glo, ghi, start, stop;
  bool grow = false, crop = false;
  for (int i = 0; i < r; i++) {
    all_axes.push_back(i);
    glo.push_back(std::max(lo[i], 0));
    ghi.push_back(std::max(hi[i], 0));
    grow = grow || lo[i] > 0 || hi[i] > 0;
    crop = crop || lo[i] < 0 || hi[i] < 0;
  }
  if (grow) x = mx::pad(x, all_axes, glo, ghi, v, "constant", s);
  if (!crop) return x;
  for (int i = 0; i < r; i++) {
    int64_t b = std::max<int64_t>(-static_cast<int64_t>(lo[i]), 0);
    int64_t e = x.shape(i) - std::max<int64_t>(-static_cast<int64_t>(hi[i]), 0);
    if (e < b) {
      fail("padding " + std::to_string(lo[i]) + ", " + std::to_string(hi[i]) +
           " leaves axis " + std::to_string(i) + " with a negative size");
    }
    start.push_back(static_cast<int>(b));
    stop.push_back(static_cast<int>(e));
  }
  return mx::slice(x, start, stop, s);
}

array pad_mode(const array& a, const std::vector<int>& lo, const std::vector<int>& hi,
               const std::string& mode, const Stream& s) {
  int r = a.ndim();
  check_per_axis(lo, r, "low padding");
  check_per_axis(hi, r, "high padding");
  if (mode != "constant" && mode != "edge" && mode != "reflect" && mode != "symmetric") {
    fail("unknown mode \"" + mode + "\" (constant, edge, reflect, symmetric)");
  }
  std::vector<int> axes;
  for (int i = 0; i < r; i++) {
    if (lo[i] < 0 || hi[i] < 0) fail("padding must be non-negative (see pad)");
    // Edge and reflect read the axis' own elements: an empty axis has none.
    if (mode != "constant" && a.shape(i) == 0 && (lo[i] > 0 || hi[i] > 0)) {
      fail("cannot pad empty axis " + std::to_string(i) + " in mode " + mode);
    }
    axes.push_back(i);
  }
  return mx::pad(a, axes, Shape(lo.begin(), lo.end()), Shape(hi.begin(), hi.end()),
                 array(0, a.dtype()), mode, s);
}

array as_strided_checked(const array& a, const Shape& shape, const std::vector<int>& strides,
                         int64_t offset, const Stream& s) {
  if (strides.size() != shape.size()) {
    fail(std::to_string(strides.size()) + " strides for " +
         std::to_string(shape.size()) + " dimensions");
  }
  if (offset < 0) fail("the offset must be non-negative");
  int64_t first = offset, last = offset;
  bool empty = false;
  for (size_t i = 0; i < shape.size(); i++) {
    if (shape[i] == 0) empty = true;
    int64_t reach = static_cast<int64_t>(shape[i] - 1) * strides[i];
    (reach < 0 ? first : last) += reach;
  }
  int64_t n = static_cast<int64_t>(a.size());
  if (!empty && (first < 0 || last >= n)) {
    fail("the view reaches elements " + std::to_string(first) + " to " +
         std::to_string(last) + ", outside the tensor's " + std::to_string(n));
  }
  return mx::as_strided(a, shape, mx::Strides(strides.begin(), strides.end()),
                        static_cast<size_t>(empty ? 0 : offset), s);
}

std::vector<array> split_sizes(const array& a, const std::vector<int>& sizes, int axis,
                               const Stream& s) {
  int ax = normalize_axis(axis, a.ndim());
  Shape cuts;
  int64_t total = 0;
  for (size_t i = 0; i < sizes.size(); i++) {
    if (sizes[i] < 0) fail("sizes must be non-negative");
    total += sizes[i];
    if (i + 1 < sizes.size()) cuts.push_back(static_cast<int>(total));
  }
  if (total != a.shape(ax)) {
    fail("sizes sum to " + std::to_string(total) + ", axis " + std::to_string(axis) +
         " has " + std::to_string(a.shape(ax)));
  }
  return mx::split(a, cuts, ax, s);
}

}  // namespace emily
