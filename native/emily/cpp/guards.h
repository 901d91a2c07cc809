// Guards for MLX ops whose CPU kernels trap on some inputs. A trap (SIGFPE) would kill
// the whole VM, so these inputs are steered away from the trapping instruction. Glue only:
// each guard composes MLX ops, and the result is what the unguarded op means.
#pragma once

#include <stdexcept>

#include "mlx/mlx.h"

namespace emily {

// x86's integer division faults on MIN / -1 (the quotient does not fit). Dividing by -1
// is negation, which wraps MIN to itself, as two's complement arithmetic does elsewhere;
// the remainder is 0.
inline mlx::core::array guarded_floor_divide(const mlx::core::array& a, const mlx::core::array& b,
                                             mlx::core::StreamOrDevice s) {
  using namespace mlx::core;
  auto t = promote_types(a.dtype(), b.dtype());
  if (!issubdtype(t, signedinteger)) return floor_divide(a, b, s);
  auto by_minus_one = equal(b, array(-1, t), s);
  auto divisor = where(by_minus_one, array(1, t), b, s);
  return where(by_minus_one, negative(astype(a, t, s), s), floor_divide(a, divisor, s), s);
}

inline mlx::core::array guarded_remainder(const mlx::core::array& a, const mlx::core::array& b,
                                          mlx::core::StreamOrDevice s) {
  using namespace mlx::core;
  auto t = promote_types(a.dtype(), b.dtype());
  if (!issubdtype(t, signedinteger)) return remainder(a, b, s);
  auto by_minus_one = equal(b, array(-1, t), s);
  auto divisor = where(by_minus_one, array(1, t), b, s);
  return where(by_minus_one, zeros_like(astype(a, t, s), s), remainder(a, divisor, s), s);
}

// MLX divides by each stride to size a slice: a zero stride is a division by zero.
inline mlx::core::Shape nonzero_strides(mlx::core::Shape strides) {
  for (auto st : strides) {
    if (st == 0) throw std::invalid_argument("[slice] strides must be non-zero");
  }
  return strides;
}

}  // namespace emily
