// Type glue: see types.h.
#include "types.h"

#include <limits>
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
  if (count > std::numeric_limits<int32_t>::max()) fail("too many values");
  int needed = static_cast<int>((count + per - 1) / per);
  array column = mx::reshape(mx::slice(packed, {0}, {needed}, s), {needed, 1}, s);
  array v = column;
  if (is_signed) {
    // Each slot moved to the top of an int8, then shifted back down arithmetically:
    // sign-extended in two passes.
    std::vector<int8_t> up;
    for (int j = 0; j < per; j++) up.push_back(static_cast<int8_t>(j * bits));
    array shifts(up.begin(), {per}, mx::int8);
    array lift = mx::left_shift(mx::view(column, mx::int8, s), shifts, s);
    v = mx::right_shift(lift, array(static_cast<int8_t>(8 - bits), mx::int8), s);
  } else {
    array mask(static_cast<uint8_t>((1 << bits) - 1), mx::uint8);
    v = mx::bitwise_and(mx::right_shift(column, slot_shifts(bits), s), mask, s);
  }
  v = mx::reshape(v, {needed * per}, s);
  if (needed * per == count) return v;
  return mx::slice(v, {0}, {static_cast<int>(count)}, s);
}

array pack_bits(const array& a, int bits, const Stream& s) {
  check_bits(bits);
  if (!mx::issubdtype(a.dtype(), mx::integer) && a.dtype() != mx::bool_) {
    fail("expected an integer or bool tensor");
  }
  int per = 8 / bits;
  if (a.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    fail("too many values");
  }
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
