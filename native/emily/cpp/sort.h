// Sorts composed from MLX ops (optable/sort.ops).
#pragma once

#include <utility>

#include "emily.h"

namespace emily {

// Stable sorts along `axis`. Ascending is MLX's own (stable, NaN last). Descending
// reverses the axis, sorts ascending (stable), and reverses the result: equal elements
// keep their input order and NaN comes first, as in Nx.
array sort_axis(const array& a, int axis, bool descending, const Stream& s);
array argsort_axis(const array& a, int axis, bool descending, const Stream& s);
// The k largest along `axis`, largest first, ties by lower index, NaN largest:
// {values, indices}.
std::pair<array, array> topk_sorted(const array& a, int k, int axis, const Stream& s);

}  // namespace emily
