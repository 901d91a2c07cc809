// Indexing glue: see index.h.
#include "index.h"

#include "cuda_kernels.h"

#include <limits>
#include <stdexcept>

namespace emily {
namespace mx = mlx::core;
using mx::Dtype;
using mx::Shape;

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument(m); }

std::string str(const Shape& shape) {
  std::string out = "{";
  for (size_t i = 0; i < shape.size(); i++) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "}";
}

void check_integer(const array& a, const std::string& what) {
  if (!mx::issubdtype(a.dtype(), mx::integer)) fail(what + " must be an integer tensor");
}

bool is_signed(const array& a) { return mx::issubdtype(a.dtype(), mx::signedinteger); }

// Narrow index types widen so that the bounds below fit in them.
array widen(const array& idx, const Stream& s) {
  if (idx.itemsize() >= 4) return idx;
  return mx::astype(idx, is_signed(idx) ? mx::int32 : mx::uint32, s);
}

// Indices clamped into [0, dim - 1] (dim > 0).
array clamp_index(const array& idx, int dim, const Stream& s) {
  array i = widen(idx, s);
  array hi(static_cast<int64_t>(dim - 1), i.dtype());
  if (!is_signed(i)) return mx::minimum(i, hi, s);
  return mx::clip(i, array(0, i.dtype()), hi, s);
}

// Whether each index lies in [0, dim).
array in_range(const array& idx, int dim, const Stream& s) {
  array i = widen(idx, s);
  array ok = mx::less(i, array(static_cast<int64_t>(dim), i.dtype()), s);
  if (is_signed(i)) ok = mx::logical_and(ok, mx::greater_equal(i, array(0, i.dtype()), s), s);
  return ok;
}

std::vector<int> check_axes(const std::vector<int>& axes, int ndim) {
  std::vector<int> out;
  std::vector<bool> seen(ndim, false);
  for (int ax : axes) {
    int a = normalize_axis(ax, ndim);
    if (seen[a]) fail("axis " + std::to_string(ax) + " appears twice");
    seen[a] = true;
    out.push_back(a);
  }
  return out;
}

// Column j of the last axis of `indices` (a slice: take refuses empty inputs).
array column(const array& indices, int j, const Stream& s) {
  int r = indices.ndim();
  Shape start(r, 0), stop = indices.shape();
  start[r - 1] = j;
  stop[r - 1] = j + 1;
  return mx::squeeze(mx::slice(indices, start, stop, s), r - 1, s);
}

thread_local StartsMemo* starts_memo = nullptr;

array clamp_starts_now(const array& starts, const std::vector<int64_t>& limit, const Stream& s);

std::vector<array> columns_of(const array& starts, const Stream& s) {
  std::vector<array> out;
  for (int i = 0; i < starts.shape(0); i++) out.push_back(mx::slice(starts, {i}, {i + 1}, s));
  return out;
}

// The memo's entry for `starts` and `limit` (made on the first call), or nullptr
// without a memo.
StartsMemo::Entry* starts_entry(const array& starts, const std::vector<int64_t>& limit,
                                const Stream& s) {
  if (!starts_memo) return nullptr;
  for (auto& e : starts_memo->entries)
    if (e.id == starts.id() && e.stream == s.index && e.limit == limit) return &e;
  starts_memo->entries.push_back(
      {starts.id(), limit, s.index, clamp_starts_now(starts, limit, s), {}});
  return &starts_memo->entries.back();
}

// `starts` (one per axis) clamped to [0, limit[i]] and made int32 (once per StartsMemo).
array clamp_starts(const array& starts, const std::vector<int64_t>& limit, const Stream& s) {
  auto* e = starts_entry(starts, limit, s);
  return e ? e->value : clamp_starts_now(starts, limit, s);
}

// The clamped starts as one {1} index array per axis (once per StartsMemo).
std::vector<array> clamped_columns(const array& starts, const std::vector<int64_t>& limit,
                                   const Stream& s) {
  auto* e = starts_entry(starts, limit, s);
  if (!e) return columns_of(clamp_starts_now(starts, limit, s), s);
  if (e->columns.empty()) e->columns = columns_of(e->value, s);
  return e->columns;
}

array clamp_starts_now(const array& starts, const std::vector<int64_t>& limit, const Stream& s) {
  check_integer(starts, "starts");
  int n = static_cast<int>(limit.size());
  if (starts.size() != limit.size()) {
    fail(std::to_string(starts.size()) + " start indices for " + std::to_string(n) +
         " axes");
  }
  array st = mx::reshape(widen(starts, s), {n}, s);
  array hi = mx::astype(array(limit.begin(), {n}, mx::int64), st.dtype(), s);
  st = is_signed(st) ? mx::clip(st, array(0, st.dtype()), hi, s) : mx::minimum(st, hi, s);
  return mx::astype(st, mx::int32, s);
}

}  // namespace

StartsMemo::StartsMemo() : previous(starts_memo) { starts_memo = this; }
StartsMemo::~StartsMemo() { starts_memo = previous; }

int normalize_axis(int axis, int ndim) {
  int a = axis < 0 ? axis + ndim : axis;
  if (a < 0 || a >= ndim) {
    fail("axis " + std::to_string(axis) + " is out of range for a rank-" +
         std::to_string(ndim) + " tensor");
  }
  return a;
}

array lowest_value(Dtype t) {
  if (t == mx::bool_) return array(false);
  if (mx::issubdtype(t, mx::inexact)) return array(-std::numeric_limits<float>::infinity(), t);
  if (mx::issubdtype(t, mx::signedinteger)) return array(mx::iinfo(t).min, t);
  return array(static_cast<uint64_t>(0), t);
}

array highest_value(Dtype t) {
  if (t == mx::bool_) return array(true);
  if (mx::issubdtype(t, mx::inexact)) return array(std::numeric_limits<float>::infinity(), t);
  if (mx::issubdtype(t, mx::signedinteger)) return array(static_cast<int64_t>(mx::iinfo(t).max), t);
  return array(mx::iinfo(t).max, t);
}

array slice_dynamic(const array& a, const array& starts, const std::vector<int>& axes_in,
                    const Shape& sizes, const std::vector<int>& strides_in, const Stream& s) {
  int r = a.ndim();
  if (static_cast<int>(sizes.size()) != r) {
    fail("sizes " + str(sizes) + " do not match a rank-" + std::to_string(r) + " tensor");
  }
  for (int i = 0; i < r; i++) {
    if (sizes[i] < 0 || sizes[i] > a.shape(i)) {
      fail("size " + std::to_string(sizes[i]) + " does not fit axis " + std::to_string(i) +
           " of " + str(a.shape()));
    }
  }
  std::vector<int> strides = strides_in.empty() ? std::vector<int>(r, 1) : strides_in;
  if (static_cast<int>(strides.size()) != r) fail("expected one stride per axis");
  for (int st : strides) {
    if (st < 1) fail("strides must be positive");
  }
  auto axes = check_axes(axes_in, r);
  array out = a;
  if (axes.empty()) {
    out = mx::slice(a, Shape(r, 0), sizes, s);
  } else {
    std::vector<int64_t> limit;
    for (int ax : axes) limit.push_back(a.shape(ax) - sizes[ax]);
    out = mx::slice(a, clamp_starts(starts, limit, s), axes, sizes, s);
  }
  for (int st : strides) {
    if (st != 1) {
      return mx::slice(out, Shape(r, 0), sizes, Shape(strides.begin(), strides.end()), s);
    }
  }
  return out;
}

array slice_update_dynamic(const array& a, const array& update, const array& starts,
                           const std::vector<int>& axes, const Stream& s) {
  return slice_update_repeated(a, update, starts, axes, 0, 1, s);
}

array slice_update_repeated(const array& a, const array& update_in, const array& starts,
                            const std::vector<int>& axes_in, int axis_in, int repeats,
                            const Stream& s) {
  int r = a.ndim();
  if (update_in.ndim() != a.ndim()) {
    fail("the update " + str(update_in.shape()) + " and the tensor " + str(a.shape()) +
         " differ in rank");
  }
  if (repeats < 1) fail("repeats must be positive, got " + std::to_string(repeats));
  int axis = r == 0 && repeats == 1 ? 0 : normalize_axis(axis_in, r);
  Shape repeated = update_in.shape();
  for (int i = 0; i < r; i++) {
    // In 64 bits: a product that wrapped in Shape's int could pass the checks and send
    // the kernel's writes outside the tensor.
    int64_t size = int64_t{update_in.shape(i)} * (i == axis ? repeats : 1);
    if (size > a.shape(i)) {
      std::string what = repeats == 1 ? "" : " repeated " + std::to_string(repeats) + " times along axis " +
                                                 std::to_string(axis);
      fail("the update " + str(update_in.shape()) + what + " does not fit in " + str(a.shape()));
    }
    repeated[i] = static_cast<int>(size);
  }
  if (repeats > 1 && repeated[axis] != a.shape(axis)) {
    fail("an update repeated along axis " + std::to_string(axis) + " must cover it: " +
         str(repeated) + " into " + str(a.shape()));
  }
  auto axes = check_axes(axes_in, r);
  array update = update_in.dtype() == a.dtype() ? update_in : mx::astype(update_in, a.dtype(), s);
  if (cuda_put_slice_applies(a, update, starts, axes, s)) {
    return cuda_put_slice(a, update, starts, axes, axis, repeats, s);
  }
  if (repeats > 1) {
    // `a` viewed with `axis` split into (heads, repeats), the update broadcast over the
    // repeats: the same elements, the repeat never copied. The split axis's start clamps
    // to 0 either way (the update covers it), the axes after it move one along.
    Shape split = a.shape(), split_update = update.shape();
    split[axis] /= repeats;
    split.insert(split.begin() + axis + 1, repeats);
    split_update.insert(split_update.begin() + axis + 1, repeats);
    array u = mx::broadcast_to(mx::expand_dims(update, axis + 1, s), split_update, s);
    std::vector<int> split_axes;
    for (int ax : axes) split_axes.push_back(ax > axis ? ax + 1 : ax);
    return mx::reshape(slice_update_repeated(mx::reshape(a, split, s), u, starts, split_axes, 0, 1, s),
                       a.shape(), s);
  }
  if (axes.empty()) return mx::slice_update(a, update, Shape(r, 0), update.shape(), s);
  std::vector<int64_t> limit;
  for (int ax : axes) limit.push_back(a.shape(ax) - update.shape(ax));
  if (s.device == mx::Device::gpu && update.size() > 0 && a.itemsize() < 8) {
    // Without Emily's kernel (cuda_put_slice.cc), a scatter of the whole update at the
    // starts: one kernel where MLX's dynamic update is two (the offset from the starts,
    // then the copy). Both write in place where `a`'s buffer can be donated, and read the
    // update through its strides. (MLX's GPU scatter takes no 8-byte types.)
    return mx::scatter(a, clamped_columns(starts, limit, s), mx::expand_dims(update, 0, s),
                       axes, s);
  }
  return mx::slice_update(a, update, clamp_starts(starts, limit, s), axes, s);
}

array gather_nx(const array& a, const array& indices, const std::vector<int>& axes_in,
                const Stream& s) {
  check_integer(indices, "indices");
  if (indices.ndim() < 1) fail("indices must have rank at least 1");
  int r = a.ndim();
  int k = indices.shape(-1);
  if (static_cast<int>(axes_in.size()) != k) {
    fail("indices " + str(indices.shape()) + " address " + std::to_string(k) +
         " axes, but " + std::to_string(axes_in.size()) + " axes were given");
  }
  auto axes = check_axes(axes_in, r);
  Shape batch(indices.shape().begin(), indices.shape().end() - 1);
  int nb = static_cast<int>(batch.size());
  if (k == 0) {
    Shape ones(nb, 1), out = batch;
    ones.insert(ones.end(), a.shape().begin(), a.shape().end());
    out.insert(out.end(), a.shape().begin(), a.shape().end());
    return mx::broadcast_to(mx::reshape(a, ones, s), out, s);
  }
  Shape slice_sizes = a.shape();
  std::vector<array> idx;
  std::vector<int> squeeze_axes;
  for (int j = 0; j < k; j++) {
    int dim = a.shape(axes[j]);
    if (dim == 0 && indices.size() > 0) {
      fail("cannot index axis " + std::to_string(axes[j]) + " of size 0");
    }
    array col = column(indices, j, s);
    idx.push_back(dim == 0 ? col : clamp_index(col, dim, s));
    slice_sizes[axes[j]] = 1;
    squeeze_axes.push_back(nb + axes[j]);
  }
  return mx::squeeze(mx::gather(a, idx, axes, slice_sizes, s), squeeze_axes, s);
}

array take_clamped(const array& a, const array& indices, int axis, const Stream& s) {
  check_integer(indices, "indices");
  int ax = normalize_axis(axis, a.ndim());
  if (a.shape(ax) == 0 && indices.size() > 0) fail("cannot index an axis of size 0");
  if (a.shape(ax) == 0) return mx::take(a, indices, ax, s);
  return mx::take(a, clamp_index(indices, a.shape(ax), s), ax, s);
}

array take_flat_clamped(const array& a, const array& indices, const Stream& s) {
  check_integer(indices, "indices");
  if (a.size() == 0 && indices.size() > 0) fail("cannot index an empty tensor");
  if (a.size() == 0) return mx::take(a, indices, s);
  if (a.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    fail("the tensor has more elements than an index can address");
  }
  return mx::take(a, clamp_index(indices, static_cast<int>(a.size()), s), s);
}

array take_along_axis_clamped(const array& a, const array& indices, int axis,
                              const Stream& s) {
  check_integer(indices, "indices");
  int ax = normalize_axis(axis, a.ndim());
  if (indices.ndim() != a.ndim()) {
    fail("indices " + str(indices.shape()) + " and the tensor " + str(a.shape()) +
         " differ in rank");
  }
  if (a.shape(ax) == 0 && indices.size() > 0) {
    fail("cannot index an axis of size 0");
  }
  if (a.shape(ax) == 0) return mx::take_along_axis(a, indices, ax, s);
  return mx::take_along_axis(a, clamp_index(indices, a.shape(ax), s), ax, s);
}

namespace {

void check_along_axis(const array& a, const array& indices) {
  check_integer(indices, "indices");
  if (indices.ndim() != a.ndim()) {
    fail("indices " + str(indices.shape()) + " and the tensor " + str(a.shape()) +
         " differ in rank");
  }
}

}  // namespace

array put_along_axis_nx(const array& a, const array& indices, const array& values, int axis,
                        const Stream& s) {
  check_along_axis(a, indices);
  int ax = normalize_axis(axis, a.ndim());
  int dim = a.shape(ax);
  // Out-of-range writes land in one extra slot past the end, cut off afterwards.
  array padded = mx::pad(a, {ax}, {0}, {1}, array(0, a.dtype()), "constant", s);
  array i = widen(indices, s);
  array routed = mx::where(in_range(i, dim, s), i, array(static_cast<int64_t>(dim), i.dtype()), s);
  array out = mx::put_along_axis(padded, routed, mx::astype(values, a.dtype(), s), ax, s);
  return mx::slice(out, Shape(a.ndim(), 0), a.shape(), s);
}

array add_along_axis_nx(const array& a, const array& indices, const array& values, int axis,
                        const Stream& s) {
  check_along_axis(a, indices);
  int ax = normalize_axis(axis, a.ndim());
  int dim = a.shape(ax);
  if (dim == 0) return a;
  array v = mx::where(in_range(indices, dim, s), mx::astype(values, a.dtype(), s),
                      array(0, a.dtype()), s);
  return mx::scatter_add_axis(a, clamp_index(indices, dim, s), v, ax, s);
}

array scatter_nx(const array& a, const array& indices, const array& updates,
                 const std::vector<int>& axes_in, const std::string& mode, const Stream& s) {
  if (mode != "put" && mode != "add" && mode != "max" && mode != "min" && mode != "prod") {
    fail("unknown scatter mode " + mode);
  }
  check_integer(indices, "indices");
  if (indices.ndim() != 2) {
    fail("indices must have shape {n, k}, got " + str(indices.shape()));
  }
  int r = a.ndim();
  int n = indices.shape(0), k = indices.shape(1);
  if (k == 0) fail("indices must address at least one axis");
  if (static_cast<int>(axes_in.size()) != k) {
    fail("indices " + str(indices.shape()) + " address " + std::to_string(k) +
         " axes, but " + std::to_string(axes_in.size()) + " axes were given");
  }
  auto axes = check_axes(axes_in, r);
  if (static_cast<int>(updates.ndim()) != 1 + r - k || updates.shape(0) != n) {
    fail("updates " + str(updates.shape()) + " do not match indices " +
         str(indices.shape()) + " on a tensor " + str(a.shape()) + " (expected rank " +
         std::to_string(1 + r - k) + ", leading axis " + std::to_string(n) + ")");
  }
  std::vector<bool> indexed(r, false);
  for (int ax : axes) indexed[ax] = true;
  for (int i = 0, u = 1; i < r; i++) {
    if (indexed[i]) continue;
    if (updates.shape(u) > a.shape(i)) {
      fail("updates " + str(updates.shape()) + " do not fit in the tensor " +
           str(a.shape()));
    }
    u++;
  }
  bool empty_target = false;
  for (int ax : axes) empty_target = empty_target || a.shape(ax) == 0;
  if (n == 0 || a.size() == 0 || empty_target) return a;

  std::vector<int> insert;
  for (int ax = 0; ax < r; ax++) {
    if (indexed[ax]) insert.push_back(1 + ax);
  }
  array upd = mx::expand_dims(mx::astype(updates, a.dtype(), s), insert, s);

  std::vector<array> cols;
  std::optional<array> valid;
  for (int j = 0; j < k; j++) {
    array col = widen(column(indices, j, s), s);
    array ok = in_range(col, a.shape(axes[j]), s);
    valid = valid ? mx::logical_and(*valid, ok, s) : ok;
    cols.push_back(col);
  }

  if (mode == "put") {
    // No identity to neutralise a put: out-of-range rows write to one extra slot past the
    // end of every indexed axis, cut off afterwards.
    array padded = mx::pad(a, axes, Shape(k, 0), Shape(k, 1), array(0, a.dtype()), "constant", s);
    for (int j = 0; j < k; j++) {
      array trash(static_cast<int64_t>(a.shape(axes[j])), cols[j].dtype());
      cols[j] = mx::where(*valid, cols[j], trash, s);
    }
    return mx::slice(mx::scatter(padded, cols, upd, axes, s), Shape(r, 0), a.shape(), s);
  }

  // Out-of-range rows turn into the combiner's identity at a clamped position.
  for (int j = 0; j < k; j++) cols[j] = clamp_index(cols[j], a.shape(axes[j]), s);
  array identity = mode == "add"   ? array(0, a.dtype())
                   : mode == "prod" ? array(1, a.dtype())
                   : mode == "max"  ? lowest_value(a.dtype())
                                    : highest_value(a.dtype());
  Shape mask_shape(1 + r, 1);
  mask_shape[0] = n;
  upd = mx::where(mx::reshape(*valid, mask_shape, s), upd, identity, s);
  if (mode == "add") return mx::scatter_add(a, cols, upd, axes, s);
  if (mode == "prod") return mx::scatter_prod(a, cols, upd, axes, s);
  if (mode == "max") return mx::scatter_max(a, cols, upd, axes, s);
  return mx::scatter_min(a, cols, upd, axes, s);
}

}  // namespace emily
