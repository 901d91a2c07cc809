// Binary ops composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "binary.h"

#include <cmath>
#include <optional>
#include <stdexcept>
#include <utility>

namespace emily {
using namespace mlx::core;

namespace {

Dtype promoted(const array& a, const array& b) { return promote_types(a.dtype(), b.dtype()); }

// The divisor with -1 replaced by 1, and the mask of where it was -1. Only signed types
// need it: MIN / -1 overflows and traps in integer division.
std::pair<array, array> without_minus_one(const array& b, const Stream& s) {
  auto t = b.dtype();
  auto m1 = equal(b, array(-1, t), s);
  return {where(m1, array(1, t), b, s), m1};
}

// Where the floored remainder `r` of `a` (signed integers) is non-zero and its sign
// differs from the dividend's: there, truncated and floored results differ by one step.
array floor_trunc_differ(const array& r, const array& a, const Stream& s) {
  auto zero = array(0, r.dtype());
  return logical_and(not_equal(r, zero, s), not_equal(less(r, zero, s), less(a, zero, s), s), s);
}

}  // namespace

array floor_divide_safe(const array& a, const array& b, const Stream& s) {
  auto t = promoted(a, b);
  if (!issubdtype(t, signedinteger)) return floor_divide(a, b, s);
  auto at = astype(a, t, s);
  auto [safe, m1] = without_minus_one(astype(b, t, s), s);
  return where(m1, negative(at, s), floor_divide(at, safe, s), s);
}

array remainder_safe(const array& a, const array& b, const Stream& s) {
  auto t = promoted(a, b);
  if (!issubdtype(t, signedinteger)) return remainder(a, b, s);
  auto at = astype(a, t, s);
  auto [safe, m1] = without_minus_one(astype(b, t, s), s);
  return where(m1, array(0, t), remainder(at, safe, s), s);
}

array fmod(const array& a, const array& b, const Stream& s) {
  auto t = promoted(a, b);
  if (issubdtype(t, complexfloating)) {
    throw std::invalid_argument("fmod: complex inputs are not supported");
  }
  if (issubdtype(t, signedinteger)) {
    // The floored remainder has the divisor's sign; where it differs from the
    // dividend's, the truncated one is one divisor away.
    auto at = astype(a, t, s);
    auto bt = astype(b, t, s);
    auto r = remainder_safe(at, bt, s);
    return where(floor_trunc_differ(r, at, s), subtract(r, bt, s), r, s);
  }
  if (!issubdtype(t, floating)) return remainder(a, b, s);
  auto at = astype(a, t, s);
  // On magnitudes the floored remainder is C's fmod, which is exact; the sign comes
  // from the dividend. A zero result keeps the dividend's sign (a * 0), as fmod does.
  auto r = remainder(abs(at, s), abs(astype(b, t, s), s), s);
  auto zero = array(0.0, t);
  auto signed_r = where(less(at, zero, s), negative(r, s), r, s);
  return where(equal(r, zero, s), multiply(at, zero, s), signed_r, s);
}

array trunc_divide(const array& a, const array& b, const Stream& s) {
  auto t = promoted(a, b);
  if (issubdtype(t, complexfloating)) {
    throw std::invalid_argument("trunc_divide: complex inputs are not supported");
  }
  if (issubdtype(t, signedinteger)) {
    auto at = astype(a, t, s);
    auto bt = astype(b, t, s);
    auto q = floor_divide_safe(at, bt, s);
    auto r = remainder_safe(at, bt, s);
    return where(floor_trunc_differ(r, at, s), add(q, array(1, t), s), q, s);
  }
  if (issubdtype(t, floating)) return trunc(divide(a, b, s), s);
  return floor_divide(a, b, s);
}

namespace {

// The promoted operands, the bit width, and the mask of counts outside [0, width).
struct ShiftArgs {
  array a, b, out_of_range;
  int bits;
  bool is_signed;
};

std::optional<ShiftArgs> shift_args(const array& a, const array& b, const Stream& s) {
  auto t = promoted(a, b);
  if (!issubdtype(t, integer)) return std::nullopt;
  int bits = static_cast<int>(t.size()) * 8;
  auto at = astype(a, t, s);
  auto bt = astype(b, t, s);
  bool is_signed = issubdtype(t, signedinteger);
  auto big = greater_equal(bt, array(bits, t), s);
  auto oor = is_signed ? logical_or(big, less(bt, array(0, t), s), s) : big;
  return ShiftArgs{at, bt, oor, bits, is_signed};
}

}  // namespace

array left_shift_safe(const array& a, const array& b, const Stream& s) {
  auto args = shift_args(a, b, s);
  if (!args) return left_shift(a, b, s);
  auto t = args->a.dtype();
  auto count = where(args->out_of_range, array(0, t), args->b, s);
  return where(args->out_of_range, array(0, t), left_shift(args->a, count, s), s);
}

array right_shift_safe(const array& a, const array& b, const Stream& s) {
  auto args = shift_args(a, b, s);
  if (!args) return right_shift(a, b, s);
  auto t = args->a.dtype();
  if (args->is_signed) {
    // An arithmetic shift by width - 1 already gives the sign fill.
    auto count = where(args->out_of_range, array(args->bits - 1, t), args->b, s);
    return right_shift(args->a, count, s);
  }
  auto count = where(args->out_of_range, array(0, t), args->b, s);
  return where(args->out_of_range, array(0, t), right_shift(args->a, count, s), s);
}

}  // namespace emily

namespace emily {

array arctan2_any(const array& a, const array& b, const Stream& s) {
  namespace mx = mlx::core;
  bool ca = mx::issubdtype(a.dtype(), mx::complexfloating), cb = mx::issubdtype(b.dtype(), mx::complexfloating);
  if (!ca && !cb) return mx::arctan2(a, b, s);
  // Nx's Complex.atan2 is the real atan2 of two real-valued complex numbers (it raises
  // for any other): a non-zero imaginary part gives NaN here.
  auto za = mx::astype(a, mx::complex64, s), zb = mx::astype(b, mx::complex64, s);
  auto zero = mx::array(0.0f);
  auto real_valued = mx::logical_and(mx::equal(mx::imag(za, s), zero, s), mx::equal(mx::imag(zb, s), zero, s), s);
  auto angle = mx::where(real_valued, mx::arctan2(mx::real(za, s), mx::real(zb, s), s), mx::array(NAN), s);
  return mx::astype(angle, mx::complex64, s);
}

}  // namespace emily
