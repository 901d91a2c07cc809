// A fixed set of helper threads that split one CPU kernel's loop (see pool.cc).
#pragma once

#include <functional>

namespace emily::pool {

// The threads `run` spreads work over, the caller's included: OpenBLAS's thread count
// (its OPENBLAS_NUM_THREADS), so that Emily's kernels use the cores its BLAS calls do.
int parts();

// Calls `part(i)` for each i in [0, n), on the calling thread and the helpers, each
// part on one of them, and returns when all are done. `part` must not call MLX.
void run(int n, const std::function<void(int)>& part);

}  // namespace emily::pool
