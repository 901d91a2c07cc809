// Shared by the generated per-family dispatch files (see build/codegen.rs).
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "emily.h"
#include "guards.h"

namespace emily {

// Reads one op's arguments in the order the generated Rust NIF wrote them.
class Reader {
 public:
  Reader(const std::vector<array>& t, rust::Slice<const int64_t> i, rust::Slice<const double> f,
         rust::Slice<const rust::String> s)
      : t_(t), i_(i), f_(f), s_(s) {}

  const array& tensor() { return t_.at(ti_++); }
  std::optional<array> opt_tensor() {
    if (int_() == 0) return std::nullopt;
    return tensor();
  }
  std::vector<array> tensors() {
    auto n = static_cast<size_t>(int_());
    std::vector<array> v;
    v.reserve(n);
    for (size_t k = 0; k < n; k++) v.push_back(tensor());
    return v;
  }
  int64_t int_() { return i_.at(ii_++); }
  int int32_() { return int32(int_()); }
  std::vector<int> ints() {
    auto n = static_cast<size_t>(int_());
    std::vector<int> v(n);
    for (size_t k = 0; k < n; k++) v[k] = int32(int_());
    return v;
  }
  mlx::core::Shape shape() {
    auto n = static_cast<size_t>(int_());
    mlx::core::Shape v(n);
    for (size_t k = 0; k < n; k++) v[k] = int32(int_());
    return v;
  }
  double float_() { return f_.at(fi_++); }
  mlx::core::Dtype dtype() {
    auto val = static_cast<mlx::core::Dtype::Val>(int_());
    auto size = static_cast<uint8_t>(int_());
    return mlx::core::Dtype(val, size);
  }
  std::string str() { return std::string(s_.at(si_++)); }

 private:
  // MLX takes axes, shapes and sizes as 32-bit ints: refuse what would wrap.
  static int32_t int32(int64_t x) {
    if (x < INT32_MIN || x > INT32_MAX) {
      throw std::invalid_argument("integer argument " + std::to_string(x) + " does not fit in 32 bits");
    }
    return static_cast<int32_t>(x);
  }

  const std::vector<array>& t_;
  rust::Slice<const int64_t> i_;
  rust::Slice<const double> f_;
  rust::Slice<const rust::String> s_;
  size_t ti_ = 0, ii_ = 0, fi_ = 0, si_ = 0;
};

inline std::vector<array> outputs(array a) { return {std::move(a)}; }
inline std::vector<array> outputs(std::vector<array> v) { return v; }
template <typename A, typename B>
std::vector<array> outputs(std::pair<A, B> p) {
  return {std::move(p.first), std::move(p.second)};
}
template <typename... T>
std::vector<array> outputs(std::tuple<T...> t) {
  return std::apply([](auto&&... a) { return std::vector<array>{std::move(a)...}; }, std::move(t));
}

}  // namespace emily
