// Guards for MLX ops that crash on some arguments instead of throwing: they would kill
// the whole VM, so the arguments are checked first. (The integer-division traps are
// guarded in binary.h.)
#pragma once

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

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

// MLX's CPU eig of a real matrix (LAPACK geev) writes the eigenvectors by pairing each
// eigenvalue that has a non-zero imaginary part with the next one, without checking that
// there is a next one. When geev refuses its input (a NaN or an infinity makes it report
// an illegal value) it leaves the eigenvalue buffer as it found it, and that loop can
// write a row past the end of the eigenvector buffer: heap corruption found later, in
// some other free. So a matrix with a non-finite entry is replaced by zeros before MLX
// sees it, and its eigenvalues and eigenvectors are NaN (each matrix of a batch on its
// own). Complex input takes another LAPACK path, without that loop. This needs no
// evaluation, so it holds in compiled programs too.
inline std::pair<mlx::core::array, mlx::core::array> eig_checked(const mlx::core::array& a,
                                                                 mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (a.ndim() < 2 || !mx::issubdtype(a.dtype(), mx::floating)) return mx::linalg::eig(a, s);
  mx::array finite = mx::all(mx::isfinite(a, s), {-2, -1}, /*keepdims=*/true, s);
  auto [values, vectors] = mx::linalg::eig(mx::where(finite, a, mx::zeros_like(a, s), s), s);
  mx::array nan(mx::complex64_t(NAN, NAN));
  return {mx::where(mx::squeeze(finite, -1, s), values, nan, s), mx::where(finite, vectors, nan, s)};
}

// MLX's CPU LU factorization (LUF) records its packed LU output's size in bytes where
// MLX expects elements (MLX 0.32.4): an elementwise op on it then reads and writes
// itemsize times too many elements, past the end of the buffer when it reuses that
// buffer for its result. A row-major copy, which reads it by shape and strides, is what
// leaves the op; MLX's own lu, det and slogdet consume it safely.
inline std::pair<mlx::core::array, mlx::core::array> lu_factor_checked(const mlx::core::array& a,
                                                                       mlx::core::StreamOrDevice s) {
  auto [lu, pivots] = mlx::core::linalg::lu_factor(a, s);
  return {mlx::core::contiguous(lu, /*allow_col_major=*/false, s), pivots};
}

// An int argument MLX divides by (a group size, a bit width): zero would trap.
inline int positive(int64_t x, const char* name) {
  if (x <= 0 || x > INT32_MAX) {
    throw std::invalid_argument(std::string(name) + " must be a positive 32-bit integer, got " + std::to_string(x));
  }
  return static_cast<int>(x);
}

}  // namespace emily
