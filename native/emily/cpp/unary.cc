// Unary ops composed from MLX ops. Each stays lazy: it only adds graph nodes.
#include "unary.h"

#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels.h"

namespace emily {
using namespace mlx::core;

namespace {

// Types whose transcendental math runs in f32: f16 and bf16 lose too much in the
// intermediate steps of a composed formula.
Dtype compute_type(const Dtype& t) {
  if (t == float64) return float64;
  return float32;
}

Dtype unsigned_of(const Dtype& t) {
  switch (t.size()) {
    case 1: return uint8;
    case 2: return uint16;
    case 4: return uint32;
    default: return uint64;
  }
}

// A real input of a composed float function: the result type (the input's float type,
// else f32) and the input in its compute type.
std::pair<Dtype, array> real_float_input(const char* op, const array& a, const Stream& s) {
  if (issubdtype(a.dtype(), complexfloating)) {
    throw std::invalid_argument(std::string(op) + ": complex input is not supported");
  }
  auto out_t = issubdtype(a.dtype(), floating) ? a.dtype() : float32;
  return {out_t, astype(a, compute_type(out_t), s)};
}

void require_integer(const char* op, const array& a) {
  if (!issubdtype(a.dtype(), integer)) {
    throw std::invalid_argument(std::string(op) + " expects an integer array");
  }
}

// SWAR population count on an unsigned array of `bits` bits.
array popcount_unsigned(const array& x0, int bits, const Stream& s) {
  auto t = x0.dtype();
  auto c = [&](uint64_t v) { return array(v, t); };
  auto x = subtract(x0, bitwise_and(right_shift(x0, c(1), s), c(0x5555555555555555ULL), s), s);
  x = add(bitwise_and(x, c(0x3333333333333333ULL), s),
          bitwise_and(right_shift(x, c(2), s), c(0x3333333333333333ULL), s), s);
  x = bitwise_and(add(x, right_shift(x, c(4), s), s), c(0x0f0f0f0f0f0f0f0fULL), s);
  if (bits > 8) {
    // Each byte holds its own count; the product sums them into the top byte.
    x = right_shift(multiply(x, c(0x0101010101010101ULL), s), c(bits - 8), s);
  }
  return x;
}

}  // namespace

array round_half_away(const array& a, const Stream& s) {
  if (!issubdtype(a.dtype(), floating)) return round(a, 0, s);
  auto t = trunc(a, s);
  // a - trunc(a) is exact in floating point, so the halfway test is exact too.
  auto frac = abs(subtract(a, t, s), s);
  auto half = array(0.5, a.dtype());
  return where(greater_equal(frac, half, s), add(t, sign(a, s), s), t, s);
}

array erfc(const array& a, const Stream& s) {
  auto [out_t, x] = real_float_input("erfc", a, s);
  auto ct = x.dtype();
  auto c = [&](double v) { return array(v, ct); };
  // erfc(30) underflows even float64, so larger magnitudes (and inf) are clamped there
  // rather than carried into inf - inf below; NaN passes through minimum.
  auto z = minimum(abs(x, s), c(30.0), s);
  auto t = divide(c(1.0), add(c(1.0), multiply(c(0.5), z, s), s), s);
  // Chebyshev fit of erfc (Numerical Recipes' erfcc): fractional error below 1.2e-7.
  const double k[] = {-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806,
                      0.27886807,  -1.13520398, 1.48851587, -0.82215223, 0.17087277};
  auto p = c(k[9]);
  for (int i = 8; i >= 0; i--) p = add(c(k[i]), multiply(t, p, s), s);
  // exp(-z^2 + p) as three factors, so no large argument to exp carries a rounding
  // error: z = zh + (z - zh) with zh on a 1/64 grid below 32 (11 significant bits),
  // so zh^2 is exact even in float32, and -z^2 = -zh^2 - (z - zh)(z + zh).
  auto zh = divide(floor(multiply(z, c(64.0), s), s), c(64.0), s);
  auto e = multiply(multiply(exp(negative(multiply(zh, zh, s), s), s), exp(p, s), s),
                    exp(negative(multiply(subtract(z, zh, s), add(z, zh, s), s), s), s), s);
  auto ans = multiply(t, e, s);
  auto r = where(greater_equal(x, c(0.0), s), ans, subtract(c(2.0), ans, s), s);
  // NaN fails the comparison above and lands in 2 - ans, which is NaN as well.
  return astype(r, out_t, s);
}

// MLX has no complex kernel for expm1, sigmoid or cbrt: each is composed from ops it
// has, with the principal branch Nx's Complex library uses.
namespace {

bool is_complex(const array& a) { return issubdtype(a.dtype(), complexfloating); }

// re + i im, the two parts laid side by side and read as one complex64: exact for
// infinite parts too, where re + im * i would make a NaN of inf * 0.
array complex_of(const array& re, const array& im, const Stream& s) {
  auto parts = stack({astype(re, float32, s), astype(im, float32, s)}, -1, s);
  return squeeze(view(contiguous(parts, false, s), complex64, s), -1, s);
}

// m * t, where a zero factor t gives 0 even for an infinite magnitude m: a part of a
// complex number at angle 0 (or pi / 2) is exactly zero, not inf * 0.
array scaled(const array& m, const array& t, const Stream& s) {
  return where(equal(t, array(0.0f), s), zeros_like(t, s), multiply(m, t, s), s);
}

}  // namespace

array expm1_any(const array& a, const Stream& s) {
  if (!is_complex(a)) return expm1(a, s);
  // exp(x + iy) - 1 = (expm1(x) cos y - 2 sin^2(y / 2)) + i exp(x) sin y: no cancellation
  // near zero, where exp(z) - 1 would lose the digits expm1 is for.
  auto x = real(a, s), y = imag(a, s);
  auto h = sin(multiply(y, array(0.5f), s), s);
  auto re = subtract(multiply(expm1(x, s), cos(y, s), s), multiply(array(2.0f), multiply(h, h, s), s), s);
  return complex_of(re, scaled(exp(x, s), sin(y, s), s), s);
}

array sigmoid_any(const array& a, const Stream& s) {
  if (!is_complex(a)) return kernels::sigmoid(a, s);
  return reciprocal(add(array(complex64_t(1, 0)), exp(negative(a, s), s), s), s);
}

array cbrt(const array& a, const Stream& s) {
  if (is_complex(a)) {
    // The principal root: |z|^(1/3) at a third of z's phase (Complex.cbrt).
    auto r = cbrt(abs(a, s), s);
    auto theta = divide(arctan2(imag(a, s), real(a, s), s), array(3.0f), s);
    return complex_of(scaled(r, cos(theta, s), s), scaled(r, sin(theta, s), s), s);
  }
  auto [out_t, x] = real_float_input("cbrt", a, s);
  auto ct = x.dtype();
  auto ax = abs(x, s);
  auto r = power(ax, array(1.0 / 3.0, ct), s);
  // One Newton step on r^3 = |x| removes the error of the rounded exponent 1/3; 0, inf
  // and NaN are already exact and would turn into NaN in it.
  auto step = add(r, divide(subtract(divide(ax, multiply(r, r, s), s), r, s), array(3.0, ct), s), s);
  auto finite = logical_and(isfinite(r, s), not_equal(r, array(0.0, ct), s), s);
  r = where(finite, step, r, s);
  return astype(where(less(x, array(0.0, ct), s), negative(r, s), r, s), out_t, s);
}

array round_decimals(const array& a, int decimals, const Stream& s) {
  // MLX scales by 10^decimals in f32 whatever the input's type: f64 would come back at
  // f32 precision. So f64 scales in f64, dividing by the power of ten rather than
  // multiplying by its (inexact) reciprocal, as NumPy does; a product that overflows
  // keeps the input (it has no digit at that position to round).
  if (a.dtype() != float64 || decimals == 0) return round(a, decimals, s);
  auto p = array(std::pow(10.0, std::abs(decimals)), float64);
  auto y = decimals > 0 ? multiply(a, p, s) : divide(a, p, s);
  auto r = decimals > 0 ? divide(round(y, 0, s), p, s) : multiply(round(y, 0, s), p, s);
  return where(isfinite(y, s), r, a, s);
}

array population_count(const array& a, const Stream& s) {
  require_integer("population_count", a);
  int bits = static_cast<int>(a.dtype().size()) * 8;
  auto u = astype(a, unsigned_of(a.dtype()), s);
  return astype(popcount_unsigned(u, bits, s), a.dtype(), s);
}

array count_leading_zeros(const array& a, const Stream& s) {
  require_integer("count_leading_zeros", a);
  int bits = static_cast<int>(a.dtype().size()) * 8;
  auto ut = unsigned_of(a.dtype());
  auto x = astype(a, ut, s);
  // Smear the highest set bit into every lower bit; the zeros left are the leading ones.
  for (int k = 1; k < bits; k *= 2) x = bitwise_or(x, right_shift(x, array(k, ut), s), s);
  auto ones = popcount_unsigned(x, bits, s);
  return astype(subtract(array(bits, ut), ones, s), a.dtype(), s);
}

}  // namespace emily
