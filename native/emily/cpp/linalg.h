// Glue for the products of optable/linalg.ops that are more than one MLX call.
#pragma once

#include <vector>

#include "emily.h"

namespace emily {

// Nx's dot/7: contracts `contract_a` of `a` with `contract_b` of `b`, pairing batch axes
// `batch_a` with `batch_b`. The result is laid out batch axes, then a's free axes, then
// b's free axes (in their original order). Inexact types go through one batched matmul;
// integer and bool types, which MLX's matmul rejects, through multiply + sum.
array dot_general(const array& a, const std::vector<int>& contract_a, const std::vector<int>& batch_a,
                  const array& b, const std::vector<int>& contract_b, const std::vector<int>& batch_b,
                  const Stream& s);

// x · w over x's axis `axis` and w's first for each w of `ws`, as dot_general computes
// each: a decoding step's rows times several weights (a layer's query, key and value
// projections, a gated unit's gate and up) as one node where Emily's kernels compute
// them over x's last axis (gemv.h, cuda_kernels.h).
std::vector<array> dots(const array& x, int axis, const std::vector<array>& ws, const Stream& s);

// x · w + bias over x's last axis (Axon's dense layer): x (..., K), w (K, N), bias (N),
// one floating type. The same function as dot_general's product plus the bias, with the
// bias added inside the product where that is a matrix product (within the sum's rounding).
array dense(const array& x, const array& w, const array& bias, const Stream& s);

}  // namespace emily
