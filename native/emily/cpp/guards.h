// Guards for MLX ops that crash on some arguments instead of throwing (they would kill
// the whole VM, so the arguments are checked first) or return wrong values. (The
// integer-division traps are guarded in binary.h.)
#pragma once

#include <cmath>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>

#include "mlx/backend/metal/metal.h"
#include "kernels.h"
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

// MLX's CUDA quantized matmul is wrong when one group spans each row of w (affine,
// transposed, group_size >= K: what MLX sends to its sm90 kernel) and x has more than one
// row: values off by 1% to 1e36, or NaN, and a larger such call never returned (seen on an
// H200, MLX 0.32.4, from Python MLX alike). Such weights have at most 128 columns: on a
// CUDA GPU they are dequantized and multiplied, which is what the op means. `out` is the
// op as MLX built it, so its argument checks, dtype and shape stand.
inline mlx::core::array quantized_matmul_checked(mlx::core::array out, const mlx::core::array& x,
                                                 const mlx::core::array& w, const mlx::core::array& scales,
                                                 const std::optional<mlx::core::array>& biases, bool transpose,
                                                 int group_size, int bits, const std::string& mode,
                                                 mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  // MLX's CPU quantized matmul divides by the sizes of its operands: an empty x or w
  // (no rows, or no columns) traps. The product is then all zeros (or empty).
  if (x.size() == 0 || w.size() == 0) return mx::zeros(out.shape(), out.dtype(), s);
  if (!transpose || mode != "affine" || x.ndim() == 0 || x.shape(-1) > group_size ||
      mx::to_stream(s).device != mx::Device::gpu || mx::metal::is_available()) {
    return out;
  }
  mx::array dw = mx::dequantize(w, scales, biases, group_size, bits, mode, std::nullopt, out.dtype(), s);
  return mx::matmul(mx::astype(x, out.dtype(), s), mx::swapaxes(dw, -1, -2, s), s);
}

// Whether each matrix (the last two axes) of `a` has only finite entries (keepdims).
inline mlx::core::array finite_matrices(const mlx::core::array& a, mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  mx::array ok = mx::issubdtype(a.dtype(), mx::complexfloating)
                     ? mx::logical_and(mx::isfinite(mx::real(a, s), s), mx::isfinite(mx::imag(a, s), s), s)
                     : mx::isfinite(a, s);
  return mx::all(ok, {-2, -1}, /*keepdims=*/true, s);
}

// `x` where `finite`, else a NaN of x's type (complex: NaN in both parts).
inline mlx::core::array nan_where_nonfinite(const mlx::core::array& finite, const mlx::core::array& x,
                                            mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  return mx::where(finite, x, mx::astype(mx::array(mx::complex64_t(NAN, NAN)), x.dtype(), s), s);
}

// `a` with each matrix that is not `finite` replaced by zeros: what LAPACK is given.
inline mlx::core::array zeros_where_nonfinite(const mlx::core::array& finite, const mlx::core::array& a,
                                              mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  return mx::where(finite, a, mx::zeros_like(a, s), s);
}

// LAPACK's geev, behind MLX's CPU eig and eigvals, does not survive a NaN or an
// infinity: its balancing step refuses the matrix, and the steps after it run on bounds
// that were never set (OpenBLAS prints "illegal value" for them). eigvals of an all-
// infinite 3x3 then corrupted the heap, and MLX's eig, which pairs each eigenvalue with a
// non-zero imaginary part with the next one when it writes the eigenvectors, wrote past
// its eigenvector buffer on what geev left. So a matrix with a non-finite entry is
// replaced by zeros before MLX sees it, and its eigenvalues (and eigenvectors) are NaN,
// each matrix of a batch on its own. This needs no evaluation, so it holds in compiled
// programs too; MLX's own checks still see the input's shape and dtype.
inline std::pair<mlx::core::array, mlx::core::array> eig_checked(const mlx::core::array& a,
                                                                 mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (a.ndim() < 2 || !mx::issubdtype(a.dtype(), mx::inexact)) return mx::linalg::eig(a, s);
  mx::array finite = finite_matrices(a, s);
  auto [values, vectors] = mx::linalg::eig(zeros_where_nonfinite(finite, a, s), s);
  return {nan_where_nonfinite(mx::squeeze(finite, -1, s), values, s), nan_where_nonfinite(finite, vectors, s)};
}

inline mlx::core::array eigvals_checked(const mlx::core::array& a, mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (a.ndim() < 2 || !mx::issubdtype(a.dtype(), mx::inexact)) return mx::linalg::eigvals(a, s);
  mx::array finite = finite_matrices(a, s);
  mx::array values = mx::linalg::eigvals(zeros_where_nonfinite(finite, a, s), s);
  return nan_where_nonfinite(mx::squeeze(finite, -1, s), values, s);
}

// LAPACK's bidiagonal QR (OpenBLAS's sbdsqr, behind MLX's CPU svd with its vectors and
// so behind pinv) never returns on a matrix with an infinity: it spins, holding the CPU
// worker, and the VM's exit waits on that worker. A NaN makes it fail instead. So, as
// for eig, a matrix with a non-finite entry is replaced by zeros before MLX sees it, and
// its factors (or its pseudo-inverse) are NaN, each matrix of a batch on its own.
inline std::vector<mlx::core::array> svd_checked(const mlx::core::array& a, bool compute_uv,
                                                 mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (a.ndim() < 2 || !mx::issubdtype(a.dtype(), mx::inexact)) return mx::linalg::svd(a, compute_uv, s);
  mx::array finite = finite_matrices(a, s);
  auto out = mx::linalg::svd(zeros_where_nonfinite(finite, a, s), compute_uv, s);
  for (auto& x : out) x = nan_where_nonfinite(x.ndim() == a.ndim() ? finite : mx::squeeze(finite, -1, s), x, s);
  return out;
}

inline mlx::core::array pinv_checked(const mlx::core::array& a, mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (a.ndim() < 2 || !mx::issubdtype(a.dtype(), mx::inexact)) return mx::linalg::pinv(a, s);
  mx::array finite = finite_matrices(a, s);
  return nan_where_nonfinite(finite, mx::linalg::pinv(zeros_where_nonfinite(finite, a, s), s), s);
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

// gather_qmm traps on empty operands like quantized_matmul; `out` is the op as MLX built
// it (shape and argument checks).
inline mlx::core::array gather_qmm_checked(mlx::core::array out, const mlx::core::array& x, const mlx::core::array& w,
                                           mlx::core::StreamOrDevice s) {
  if (x.size() == 0 || w.size() == 0) return mlx::core::zeros(out.shape(), out.dtype(), s);
  return out;
}

// gather_mm and gather_qmm read the matrices their indices name unchecked (an index
// past the batch reads memory outside the array): indices are clamped into the batch,
// as every other read index is (index.h). `batch` is the operand's batch shape.
inline std::optional<mlx::core::array> clamp_batch_indices(const std::optional<mlx::core::array>& idx,
                                                           const mlx::core::array& operand, int matrix_rank,
                                                           mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (!idx) return idx;
  if (!mx::issubdtype(idx->dtype(), mx::integer)) {
    throw std::invalid_argument("gather indices must be integers");
  }
  int64_t n = 1;
  for (int i = 0; i + matrix_rank < static_cast<int>(operand.ndim()); i++) n *= operand.shape(i);
  if (n == 0) throw std::invalid_argument("gather indices index an empty batch");
  auto i64 = mx::astype(*idx, mx::int64, s);
  auto c = mx::clip(i64, mx::array(int64_t{0}), mx::array(static_cast<int64_t>(n - 1)), s);
  return mx::astype(c, mx::uint32, s);
}

// Viewing bytes as bool would let any byte stand for a bool; a bool is 0 or 1 in Emily
// (MLX's kernels assume it: logical_not of 2 is 2), so the bytes are compared with 0.
inline mlx::core::array view_checked(const mlx::core::array& a, mlx::core::Dtype dtype, mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  if (dtype != mx::bool_ || a.dtype() == mx::bool_) return mx::view(a, dtype, s);
  return mx::not_equal(mx::view(a, mx::uint8, s), mx::array(0, mx::uint8), s);
}

// MLX's eigh reads only the first letter of `uplo` and takes anything but "U" as "L".
inline const std::string& uplo_checked(const std::string& uplo) {
  if (uplo != "L" && uplo != "U") throw std::invalid_argument("uplo must be \"L\" or \"U\", got \"" + uplo + "\"");
  return uplo;
}

// MLX's flip flips an axis listed twice once; a repeated axis is refused, as MLX's other
// axis lists (transpose, squeeze, the reductions) are.
inline mlx::core::array flip_checked(const mlx::core::array& a, const std::vector<int>& axes,
                                     mlx::core::StreamOrDevice s) {
  int nd = static_cast<int>(a.ndim());
  std::set<int> seen;
  for (int ax : axes) {
    int n = ax < 0 ? ax + nd : ax;
    if (!seen.insert(n).second) throw std::invalid_argument("[flip] axis " + std::to_string(ax) + " is repeated");
  }
  return mlx::core::flip(a, axes, s);
}

// scaled_dot_product_attention: MLX divides the query heads by the key/value heads (an
// empty head axis traps) and ignores mask_mode "array" when no mask is given.
inline mlx::core::array sdpa_checked(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                     float scale, const std::string& mask_mode,
                                     const std::optional<mlx::core::array>& mask,
                                     const std::optional<mlx::core::array>& sinks, const mlx::core::Stream& s) {
  namespace mx = mlx::core;
  if (mask_mode == "array" && !mask) throw std::invalid_argument("mask_mode \"array\" needs a mask");
  if (q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k.shape(1) == 0) {
    if (q.shape(1) != 0) throw std::invalid_argument("keys and values have no heads");
    return mx::zeros({q.shape(0), 0, q.shape(2), v.shape(3)}, q.dtype(), s);
  }
  return emily::kernels::attention(q, k, v, scale, mask_mode, mask, sinks, s);
}

// LAPACK's Cholesky stops at the first pivot that is not positive and leaves the rest of
// the matrix as it was, and MLX returns that without a word. Nx's cholesky gives NaN from
// such a pivot on (the square root of a negative number). Each failed matrix of a batch
// (a diagonal entry of its factor negative or NaN, or zero before the last) is NaN in
// the factor's triangle (the other triangle stays zero, as Nx's), so the failure cannot
// pass for a factor. A zero last pivot (a positive semi-definite matrix) completes, as
// it does in Nx.
inline mlx::core::array cholesky_checked(const mlx::core::array& a, bool upper, mlx::core::StreamOrDevice s) {
  namespace mx = mlx::core;
  auto l = mx::linalg::cholesky(a, upper, s);
  if (a.ndim() < 2 || a.shape(-1) == 0 || !mx::issubdtype(l.dtype(), mx::floating)) return l;
  int n = a.shape(-1);
  auto d = mx::diagonal(l, 0, -2, -1, s);
  auto zero = mx::array(0.0, l.dtype());
  auto pos = mx::arange(n, mx::int32, s);
  auto bad = mx::logical_or(mx::logical_not(mx::greater_equal(d, zero, s), s),
                            mx::logical_and(mx::equal(d, zero, s), mx::less(pos, mx::array(n - 1), s), s), s);
  auto failed = mx::expand_dims(mx::any(bad, -1, /*keepdims=*/true, s), -1, s);
  auto tri = upper ? mx::triu(mx::ones({n, n}, mx::bool_, s), 0, s) : mx::tril(mx::ones({n, n}, mx::bool_, s), 0, s);
  return mx::where(mx::logical_and(failed, tri, s), mx::array(NAN, l.dtype()), l, s);
}

// An int argument MLX divides by (a group size, a bit width): zero would trap.
inline int positive(int64_t x, const char* name) {
  if (x <= 0 || x > INT32_MAX) {
    throw std::invalid_argument(std::string(name) + " must be a positive 32-bit integer, got " + std::to_string(x));
  }
  return static_cast<int>(x);
}

}  // namespace emily
