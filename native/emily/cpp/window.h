// Window glue (optable/window.ops). MLX has no window op: a window reduction is a pad
// and, axis by axis, an elementwise combination of strided slices (or, for long windows,
// a reduction over an as_strided view).
#pragma once

#include <string>
#include <vector>

#include "emily.h"

namespace emily {

// Nx's window_sum/product/max/min: `window` dims, `strides` (default 1), padding `lo`/`hi`
// (default 0; filled with the reduction's identity; negative crops) and window
// `dilations` (default 1) per axis. `mode` is "sum", "product", "max" or "min". The result
// keeps a's dtype, as Nx's window ops do.
array window_reduce(const array& a, const std::vector<int>& window,
                    const std::vector<int>& strides, const std::vector<int>& lo,
                    const std::vector<int>& hi, const std::vector<int>& dilations,
                    const std::string& mode, const Stream& s);

// Nx's window_scatter_max/min: for each window of `a` (padded by `lo`/`hi`, stepped by
// `strides`), the position of its max (min) receives the window's `source` value; values
// landing on one position are added to `init` (a scalar), which fills every other
// position. Ties go to the last position in the window, padding is never selected. The
// result has the dtype of source and init promoted together.
array window_scatter(const array& a, const array& source, const array& init,
                     const std::vector<int>& window, const std::vector<int>& strides,
                     const std::vector<int>& lo, const std::vector<int>& hi,
                     const std::string& mode, const Stream& s);

}  // namespace emily
