// One row times a matrix on a CPU stream, reading the matrix once (see gemv.cc).
#pragma once

#include <vector>

#include "emily.h"

namespace emily {

// Whether `row_gemv` computes `mx::matmul(x, b, s)` for these operands: a CPU stream on
// Linux, x of shape (1, K) and b of shape (K, N), K and N nonzero, both f32, or both bf16
// on a CPU that runs Emily's vector kernels.
bool row_gemv_applies(const array& x, const array& b, const Stream& s);

// x (1, K) times b (K, N), as `mx::matmul` computes it, where `row_gemv_applies`.
array row_gemv(const array& x, const array& b, const Stream& s);

// x (1, K) times each of `bs`, where `row_gemv_applies` to each: one node, whose columns
// are computed in one pass over the cores (one wake of the helpers for all of them).
std::vector<array> row_gemvs(const array& x, const std::vector<array>& bs, const Stream& s);

}  // namespace emily
