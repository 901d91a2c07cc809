// Type glue: see types.h.
#include "types.h"

#include <stdexcept>
#include <string>
#include <vector>

namespace emily {
namespace mx = mlx::core;

namespace {

[[noreturn]] void fail(const std::string& m) { throw std::invalid_argument(m); }

void check_bits(int bits) {
  if (bits != 1 && bits != 2 && bits != 4) {
    fail("bits must be 1, 2 or 4, got " + std::to_string(bits));
  }
}

// Shift of each of the 8 / bits slots of a byte, most significant slot first.
array slot_shifts(int bits) {
  std::vector<uint8_t> v;
  for (int sh = 8 - bits; sh >= 0; sh -= bits) v.push_back(static_cast<uint8_t>(sh));
  return array(v.begin(), {static_cast<int>(v.size())}, mx::uint8);
}

}  // namespace

array unpack_bits(const array& packed, int bits, bool is_signed, int64_t count, const Stream& s) {
  check_bits(bits);
  if (packed.dtype() != mx::uint8) fail("packed bytes must be a u8 tensor");
  int per = 8 / bits;
  int64_t bytes = static_cast<int64_t>(packed.size());
  if (count < 0 || count > bytes * per) {
    fail(std::to_string(bytes) + " bytes do not hold " + std::to_string(count) +
         " values of " + std::to_string(bits) + " bits");
  }
  array mask(static_cast<uint8_t>((1 << bits) - 1), mx::uint8);
  array column = mx::reshape(packed, {static_cast<int>(bytes), 1}, s);
  array v = mx::bitwise_and(mx::right_shift(column, slot_shifts(bits), s), mask, s);
  v = mx::reshape(v, {static_cast<int>(bytes * per)}, s);
  v = mx::slice(v, {0}, {static_cast<int>(count)}, s);
  if (!is_signed) return v;
  // Two's complement: values with the top bit set are value - 2^bits.
  array w = mx::astype(v, mx::int8, s);
  array half(static_cast<int8_t>(1 << (bits - 1)), mx::int8);
  return mx::where(mx::greater_equal(w, half, s),
                   mx::subtract(w, array(static_cast<int8_t>(1 << bits), mx::int8), s), w, s);
}

array pack_bits(const array& a, int bits, const Stream& s) {
  check_bits(bits);
  if (!mx::issubdtype(a.dtype(), mx::integer) && a.dtype() != mx::bool_) {
    fail("expected an integer or bool tensor");
  }
  int per = 8 / bits;
  int n = static_cast<int>(a.size());
  int bytes = (n + per - 1) / per;
  array mask(static_cast<uint8_t>((1 << bits) - 1), mx::uint8);
  array u = mx::bitwise_and(mx::astype(mx::reshape(a, {n}, s), mx::uint8, s), mask, s);
  u = mx::pad(u, {0}, {0}, {bytes * per - n}, array(static_cast<uint8_t>(0), mx::uint8),
              "constant", s);
  u = mx::left_shift(mx::reshape(u, {bytes, per}, s), slot_shifts(bits), s);
  // The slots' bits are disjoint, so their sum is their bitwise or.
  return mx::astype(mx::sum(u, 1, false, s), mx::uint8, s);
}

}  // namespace emily
