// Guards for MLX ops that crash on some arguments instead of throwing: they would kill
// the whole VM, so the arguments are checked first. (The integer-division traps are
// guarded in binary.h.)
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>

#include "mlx/mlx.h"

namespace emily {

// MLX divides by each stride to size a slice: a zero stride is a division by zero.
inline mlx::core::Shape nonzero_strides(mlx::core::Shape strides) {
  for (auto st : strides) {
    if (st == 0) throw std::invalid_argument("[slice] strides must be non-zero");
  }
  return strides;
}

// MLX's LAPACK-backed linalg divides by the matrix size: an empty input would trap.
inline const mlx::core::array& nonempty(const mlx::core::array& a) {
  if (a.size() == 0) throw std::invalid_argument("linear algebra needs a non-empty input");
  return a;
}

// MLX's CUDA arange crashes on an empty range (seen on an H200, MLX 0.32.4).
inline mlx::core::array arange_checked(double start, double stop, double step, mlx::core::Dtype dtype,
                                       mlx::core::StreamOrDevice s) {
  if (step != 0 && !(std::ceil((stop - start) / step) > 0)) {
    return mlx::core::full(mlx::core::Shape{0}, mlx::core::array(0, dtype), dtype, s);
  }
  return mlx::core::arange(start, stop, step, dtype, s);
}

// MLX's CUDA FFT crashes on an empty input (seen on an H200, MLX 0.32.4, found by the
// fuzzer). `out` is the op as MLX built it, so its argument checks and output shape
// stand; an empty input (zero-padded to the lengths asked for) transforms to zeros.
inline mlx::core::array fft_checked(mlx::core::array out, const mlx::core::array& a, mlx::core::StreamOrDevice s) {
  if (a.size() == 0) return mlx::core::zeros(out.shape(), out.dtype(), s);
  return out;
}

// An int argument MLX divides by (a group size, a bit width): zero would trap.
inline int positive(int64_t x, const char* name) {
  if (x <= 0 || x > INT32_MAX) {
    throw std::invalid_argument(std::string(name) + " must be a positive 32-bit integer, got " + std::to_string(x));
  }
  return static_cast<int>(x);
}

}  // namespace emily
