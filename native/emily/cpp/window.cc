// Window glue: see window.h.
#include "window.h"

#include <limits>
#include <optional>
#include <stdexcept>

#include "index.h"
#include "shape.h"

namespace emily {
namespace mx = mlx::core;
using mx::Shape;

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument(m); }

std::vector<int> per_axis(const std::vector<int>& v, int ndim, int fallback,
                          const std::string& name) {
  if (v.empty()) return std::vector<int>(ndim, fallback);
  if (static_cast<int>(v.size()) != ndim) {
    fail("expected " + std::to_string(ndim) + " " + name + ", got " +
         std::to_string(v.size()));
  }
  return v;
}

void check_positive(const std::vector<int>& v, const std::string& name) {
  for (int x : v) {
    if (x < 1) fail(name + " must be positive");
  }
}

std::string str(const Shape& shape) {
  std::string out = "{";
  for (size_t i = 0; i < shape.size(); i++) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "}";
}

// Row-major element strides of `shape`.
std::vector<int64_t> row_major(const Shape& shape) {
  std::vector<int64_t> st(shape.size(), 1);
  for (int i = static_cast<int>(shape.size()) - 2; i >= 0; i--) st[i] = st[i + 1] * shape[i + 1];
  return st;
}

// The windows of the row-major `x` as a view of shape out ++ window.
array windows(const array& x, const Shape& out, const std::vector<int>& window,
              const std::vector<int>& strides, const std::vector<int>& dilations,
              const Stream& s) {
  auto ps = row_major(x.shape());
  int r = x.ndim();
  Shape shape = out;
  mx::Strides st;
  for (int i = 0; i < r; i++) st.push_back(ps[i] * strides[i]);
  for (int i = 0; i < r; i++) {
    shape.push_back(window[i]);
    st.push_back(ps[i] * dilations[i]);
  }
  return mx::as_strided(x, shape, st, 0, s);
}

// Output dims of windows of extent (w - 1) * d + 1 stepped by `strides` over `padded`.
Shape window_out(const Shape& padded, const std::vector<int>& window,
                 const std::vector<int>& strides, const std::vector<int>& dilations) {
  Shape out;
  for (size_t i = 0; i < padded.size(); i++) {
    int64_t extent = static_cast<int64_t>(window[i] - 1) * dilations[i] + 1;
    if (extent > padded[i]) {
      fail("a window of extent " + std::to_string(extent) + " does not fit axis " +
           std::to_string(i) + " of padded size " + std::to_string(padded[i]));
    }
    out.push_back(static_cast<int>((padded[i] - extent) / strides[i] + 1));
  }
  return out;
}

// One axis of a window reduction: windows of `w` elements `d` apart, `st` apart, `out` of
// them. Small windows combine `w` strided slices elementwise, which is far faster on MLX
// than reducing a strided view; large ones reduce an as_strided view of that axis.
array reduce_axis(const array& x, int axis, int w, int st, int d, int out, const std::string& mode,
                  const Stream& s) {
  if (w == 1 && st == 1) return x;
  int r = x.ndim();
  if (w <= 32) {
    Shape start(r, 0), stop = x.shape(), steps(r, 1);
    steps[axis] = st;
    std::optional<array> acc;
    for (int j = 0; j < w; j++) {
      start[axis] = j * d;
      stop[axis] = j * d + (out - 1) * st + 1;
      array part = mx::slice(x, start, stop, steps, s);
      if (!acc) {
        acc = part;
      } else if (mode == "sum") {
        acc = mx::add(*acc, part, s);
      } else if (mode == "product") {
        acc = mx::multiply(*acc, part, s);
      } else if (mode == "max") {
        acc = mx::maximum(*acc, part, s);
      } else {
        acc = mx::minimum(*acc, part, s);
      }
    }
    return *acc;
  }
  auto ps = row_major(x.shape());
  Shape shape = x.shape();
  shape[axis] = out;
  shape.push_back(w);
  mx::Strides strides(ps.begin(), ps.end());
  strides[axis] = ps[axis] * st;
  strides.push_back(ps[axis] * d);
  array v = mx::as_strided(x, shape, strides, 0, s);
  array red = mode == "sum"       ? mx::sum(v, -1, false, s)
              : mode == "product" ? mx::prod(v, -1, false, s)
              : mode == "max"     ? mx::max(v, -1, false, s)
                                  : mx::min(v, -1, false, s);
  return mx::astype(red, x.dtype(), s);
}

std::vector<int> tail_axes(int from, int count) {
  std::vector<int> axes;
  for (int i = 0; i < count; i++) axes.push_back(from + i);
  return axes;
}

}  // namespace

array window_reduce(const array& a, const std::vector<int>& window_in,
                    const std::vector<int>& strides_in, const std::vector<int>& lo_in,
                    const std::vector<int>& hi_in, const std::vector<int>& dilations_in,
                    const std::string& mode, const Stream& s) {
  int r = a.ndim();
  if (static_cast<int>(window_in.size()) != r) {
    fail("expected " + std::to_string(r) + " window dimensions, got " +
         std::to_string(window_in.size()));
  }
  auto window = window_in;
  auto strides = per_axis(strides_in, r, 1, "strides");
  auto lo = per_axis(lo_in, r, 0, "low paddings");
  auto hi = per_axis(hi_in, r, 0, "high paddings");
  auto dilations = per_axis(dilations_in, r, 1, "dilations");
  check_positive(window, "window dimensions");
  check_positive(strides, "strides");
  check_positive(dilations, "dilations");

  array init = mode == "sum"       ? array(0, a.dtype())
               : mode == "product" ? array(1, a.dtype())
               : mode == "max"     ? lowest_value(a.dtype())
               : mode == "min"     ? highest_value(a.dtype())
                                   : (fail("unknown window mode " + mode), array(0));
  array x = pad_nx(a, init, lo, hi, {}, s);
  Shape out = window_out(x.shape(), window, strides, dilations);
  // A box window is separable: reduce one axis at a time.
  for (int i = 0; i < r; i++) {
    x = reduce_axis(x, i, window[i], strides[i], dilations[i], out[i], mode, s);
  }
  return x;
}

array window_scatter(const array& a, const array& source, const array& init,
                     const std::vector<int>& window, const std::vector<int>& strides_in,
                     const std::vector<int>& lo_in, const std::vector<int>& hi_in,
                     const std::string& mode, const Stream& s) {
  if (mode != "max" && mode != "min") fail("unknown window scatter mode " + mode);
  int r = a.ndim();
  if (static_cast<int>(window.size()) != r) {
    fail("expected " + std::to_string(r) + " window dimensions, got " +
         std::to_string(window.size()));
  }
  auto strides = per_axis(strides_in, r, 1, "strides");
  auto lo = per_axis(lo_in, r, 0, "low paddings");
  auto hi = per_axis(hi_in, r, 0, "high paddings");
  auto ones = std::vector<int>(r, 1);
  check_positive(window, "window dimensions");
  check_positive(strides, "strides");
  for (int i = 0; i < r; i++) {
    if (lo[i] < 0 || hi[i] < 0) fail("padding must be non-negative");
  }
  if (init.size() != 1) fail("the init value must hold one element");

  std::vector<int> all_axes = tail_axes(0, r);
  Shape plo(lo.begin(), lo.end()), phi(hi.begin(), hi.end());
  array filler = mode == "max" ? lowest_value(a.dtype()) : highest_value(a.dtype());
  array x = mx::pad(a, all_axes, plo, phi, filler, "constant", s);
  Shape out = window_out(x.shape(), window, strides, ones);
  if (source.shape() != out) {
    fail("source has shape " + str(source.shape()) + ", the windows " + str(out));
  }
  int64_t window_size = 1;
  for (int w : window) window_size *= w;
  if (window_size > std::numeric_limits<int32_t>::max()) fail("the window is too large");
  int k = static_cast<int>(window_size);
  Shape flat = out;
  flat.push_back(k);

  // The selected element of each window: the last one equal to the window's extreme among
  // the tensor's own elements (a mask keeps padding out even when it ties).
  array valid = mx::pad(mx::full(a.shape(), array(true), s), all_axes, plo, phi, array(false),
                        "constant", s);
  array xw = mx::reshape(windows(x, out, window, strides, ones, s), flat, s);
  array vw = mx::reshape(windows(valid, out, window, strides, ones, s), flat, s);
  array masked = mx::where(vw, xw, filler, s);
  array extreme = mode == "max" ? mx::max(masked, -1, true, s) : mx::min(masked, -1, true, s);
  array hit = mx::logical_and(mx::equal(xw, extreme, s), vw, s);
  array from_end = mx::argmax(mx::flip(hit, -1, s), -1, true, s);
  array pick = mx::subtract(array(k - 1, mx::int32), mx::astype(from_end, mx::int32, s), s);

  // Row-major positions in the padded tensor, windowed the same way, give each pick's
  // target position.
  int64_t padded_size = static_cast<int64_t>(x.size());
  if (padded_size > std::numeric_limits<int32_t>::max()) fail("the tensor is too large");
  array pos = mx::reshape(mx::arange(static_cast<double>(padded_size), mx::int32, s), x.shape(), s);
  array pw = mx::reshape(windows(pos, out, window, strides, ones, s), flat, s);
  array target = mx::flatten(mx::take_along_axis(pw, pick, -1, s), s);

  mx::Dtype dtype = mx::promote_types(source.dtype(), init.dtype());
  array init_value = mx::astype(mx::reshape(init, {}, s), dtype, s);
  array base = mx::full({static_cast<int>(padded_size)}, init_value, s);
  array src = mx::reshape(mx::astype(source, dtype, s), {static_cast<int>(source.size()), 1}, s);
  array acc = mx::scatter_add(base, {target}, src, std::vector<int>{0}, s);
  Shape stop;
  for (int i = 0; i < r; i++) stop.push_back(lo[i] + a.shape(i));
  return mx::slice(mx::reshape(acc, x.shape(), s), plo, stop, s);
}

}  // namespace emily
