// A fixed set of helper threads that split one CPU kernel's loop (see pool.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>

namespace emily::pool {

// The threads `run` spreads work over, the caller's included: OpenBLAS's thread count
// (its OPENBLAS_NUM_THREADS), so that Emily's kernels use the cores its BLAS calls do.
int parts();

// Calls `part(i)` for each i in [0, n), on the calling thread and the helpers, each
// part on one of them, and returns when all are done. `part` must not call MLX.
void run(int n, const std::function<void(int)>& part);

// Calls `range(begin, end)` over [0, n) items of `width` elements each, split into one
// contiguous range per thread, each but the last a multiple of `align` items long (a
// kernel's vector width, so every element is computed in the lanes or the tail it would
// be in one pass), when the items hold at least 64K elements: some tens of microseconds
// of work, past the cost of waking the helpers. Below that, `range(0, n)` on the caller.
inline void ranges(size_t n, size_t width, size_t align, const std::function<void(size_t, size_t)>& range) {
  int k = n * width < (size_t{1} << 16) ? 1 : parts();
  size_t step = (n / k + align - 1) / align * align;
  if (k == 1 || step == 0) return range(0, n);
  run(k, [&](int i) {
    size_t begin = std::min(n, i * step), end = i == k - 1 ? n : std::min(n, begin + step);
    if (begin < end) range(begin, end);
  });
}

}  // namespace emily::pool
