// Indexing glue (optable/index.ops): MLX's slice, gather and scatter composed with Nx's
// index semantics. MLX does not bounds-check indices, so every index that reaches MLX here
// is first clamped into range (reads) or routed away from the target (writes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "emily.h"

namespace emily {

// While one is alive on a thread, the clamped start indices of the dynamic slices and
// updates below are computed once per starts array and limit: a program's replay (each
// decoding step writes every layer's key and value cache at the same position) builds
// one clamp instead of one per update. The replay's slots keep every array alive, so
// an array's id is not reused while the memo holds it.
struct StartsMemo {
  StartsMemo();
  ~StartsMemo();
  StartsMemo(const StartsMemo&) = delete;
  StartsMemo& operator=(const StartsMemo&) = delete;

  struct Entry {
    std::uintptr_t id;
    std::vector<int64_t> limit;
    int stream;
    array value;
    // The value's entries as {1} arrays, made on the first GPU update (scatter's indices).
    std::vector<array> columns;
  };
  std::vector<Entry> entries;
  StartsMemo* previous;
};

// Dynamic slice of `sizes` (one per axis of `a`) starting at `starts` (one per entry of
// `axes`; other axes start at 0), clamped like Nx: start = min(max(start, 0), dim - size).
// Non-unit `strides` then step through the slice.
array slice_dynamic(const array& a, const array& starts, const std::vector<int>& axes,
                    const mlx::core::Shape& sizes, const std::vector<int>& strides,
                    const Stream& s);

// Writes `update` into `a` at `starts` (along `axes`, others at 0), clamped like Nx.
array slice_update_dynamic(const array& a, const array& update, const array& starts,
                           const std::vector<int>& axes, const Stream& s);

// The same for an update whose index along `axis` repeats `repeats` times (each head of a
// grouped-query key written over the query heads it serves), which must then cover that
// axis of `a`: the update is read unrepeated.
array slice_update_repeated(const array& a, const array& update, const array& starts,
                            const std::vector<int>& axes, int axis, int repeats,
                            const Stream& s);

// Nx's gather: `indices` of shape {..., k} address the k `axes`; the result has shape
// indices.shape[:-1] ++ the dims of the other axes. Indices are clamped into range.
array gather_nx(const array& a, const array& indices, const std::vector<int>& axes,
                const Stream& s);

// take / take (flat) / take_along_axis with indices clamped into range.
array take_clamped(const array& a, const array& indices, int axis, const Stream& s);
array take_flat_clamped(const array& a, const array& indices, const Stream& s);
array take_along_axis_clamped(const array& a, const array& indices, int axis,
                              const Stream& s);

// put_along_axis / add_along_axis: out-of-range indices are dropped.
array put_along_axis_nx(const array& a, const array& indices, const array& values, int axis,
                        const Stream& s);
array add_along_axis_nx(const array& a, const array& indices, const array& values, int axis,
                        const Stream& s);

// Nx's indexed_put / indexed_add (and max, min, prod): `indices` {n, k} address the k
// `axes`; `updates` {n, ...} holds a slice of the other axes per index (each no larger
// than the target's). Updates whose index is out of range are dropped. `mode` is one of
// "put", "add", "max", "min", "prod".
array scatter_nx(const array& a, const array& indices, const array& updates,
                 const std::vector<int>& axes, const std::string& mode, const Stream& s);

// Shared by the glue files: an axis in [-ndim, ndim) made non-negative, or an error.
int normalize_axis(int axis, int ndim);

// The identity of max (`lowest`) and min (`highest`) for `dtype`: -inf/+inf for floats,
// the integer range's ends, false/true for bool.
array lowest_value(mlx::core::Dtype dtype);
array highest_value(mlx::core::Dtype dtype);

}  // namespace emily
