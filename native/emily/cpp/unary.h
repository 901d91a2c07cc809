// Unary ops that MLX lacks, composed from MLX ops (optable/unary.ops).
#pragma once

#include "emily.h"

namespace emily {

// Rounds half away from zero (Nx's `round`); MLX's `round` rounds half to even.
array round_half_away(const array& a, const Stream& s);
// The complementary error function, accurate in the tail where 1 - erf(x) is not.
array erfc(const array& a, const Stream& s);
// expm1 and sigmoid, composed for complex64 (MLX has no complex kernel for them).
array expm1_any(const array& a, const Stream& s);
array sigmoid_any(const array& a, const Stream& s);
// round(a, decimals), with f64 scaled in f64 (MLX scales every type in f32).
array round_decimals(const array& a, int decimals, const Stream& s);
// The real cube root; negative inputs give negative roots. Complex inputs give the
// principal root.
array cbrt(const array& a, const Stream& s);
// Set bits per element, over the two's complement bits of integer types.
array population_count(const array& a, const Stream& s);
// Leading zero bits per element, over the two's complement bits of integer types.
array count_leading_zeros(const array& a, const Stream& s);

}  // namespace emily
