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

// Reads one op's arguments in the order the generated Rust NIF wrote them. The tensors
// are `t` in order, or, given `slots` (a program's instruction), `t[slots[0]]`,
// `t[slots[1]]`, ...: a program's replay reads its inputs in place.
class Reader {
 public:
  Reader(const std::vector<array>& t, const std::vector<uint32_t>* slots, rust::Slice<const int64_t> i,
         rust::Slice<const double> f, rust::Slice<const rust::String> s)
      : t_(t), slots_(slots), i_(i), f_(f), s_(s) {}

  const array& tensor() {
    size_t k = ti_++;
    return t_.at(slots_ ? slots_->at(k) : k);
  }
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
  const std::vector<uint32_t>* slots_;
  rust::Slice<const int64_t> i_;
  rust::Slice<const double> f_;
  rust::Slice<const rust::String> s_;
  size_t ti_ = 0, ii_ = 0, fi_ = 0, si_ = 0;
};

// An op's result, appended to `out` (which a replay reuses from op to op).
inline void append_outputs(std::vector<array>& out, array a) { out.push_back(std::move(a)); }
inline void append_outputs(std::vector<array>& out, std::vector<array> v) {
  for (auto& a : v) out.push_back(std::move(a));
}
template <typename A, typename B>
void append_outputs(std::vector<array>& out, std::pair<A, B> p) {
  out.push_back(std::move(p.first));
  out.push_back(std::move(p.second));
}
template <typename... T>
void append_outputs(std::vector<array>& out, std::tuple<T...> t) {
  std::apply([&out](auto&&... a) { (out.push_back(std::move(a)), ...); }, std::move(t));
}

// Runs op `op` (its id in the op table) on the arguments `r` reads and appends its results
// to `out`, each checked against the memory limit; throws for an id that names no
// generated op. The one way in for NIFs (`op_call`) and programs (dispatch.cc, generated).
void run_op(uint32_t op, Reader& r, const Stream& s, std::vector<array>& out);

}  // namespace emily
