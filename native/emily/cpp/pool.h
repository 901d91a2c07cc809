// A fixed set of helper threads that split one CPU kernel's loop (see pool.cc).
#pragma once

#include <functional>

namespace emily::pool {

// The number of parts `run` splits work into: OpenBLAS's thread count (its
// OPENBLAS_NUM_THREADS), so that Emily's kernels use the cores its BLAS calls do.
int parts();

// Calls `part(i)` for i in [0, n), part 0 on the calling thread and the others on
// helpers, and returns when all are done. `part` must not call MLX.
void run(int n, const std::function<void(int)>& part);

}  // namespace emily::pool
