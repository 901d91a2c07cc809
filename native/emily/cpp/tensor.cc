// Tensors: creation from bytes, evaluation, export, and what Rust reads off an array.
#include <cstring>

#include "emily.h"
#include "kernels.h"
#include "loads.h"

namespace emily {
namespace mx = mlx::core;

std::unique_ptr<ArrayVec> array_vec_new(size_t capacity) {
  auto v = std::make_unique<ArrayVec>();
  v->items.reserve(capacity);
  return v;
}
void array_vec_push(ArrayVec& v, const array& a) { v.items.push_back(a); }
size_t array_vec_len(const ArrayVec& v) { return v.items.size(); }
void array_vec_clear(ArrayVec& v) { v.items.clear(); }
std::unique_ptr<array> array_vec_take(ArrayVec& v, size_t i) {
  return std::make_unique<array>(std::move(v.items.at(i)));
}

std::unique_ptr<array> from_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape,
                                  uint8_t dtype_val, uint8_t dtype_size) {
  mx::Shape s(shape.begin(), shape.end());
  mx::Dtype dt(static_cast<mx::Dtype::Val>(dtype_val), dtype_size);
  if (dt == mx::bool_) {
    // A bool is 0 or 1 in Emily whatever byte made it: MLX's kernels read the byte
    // (logical_not of 2 is 2, a sum adds 255).
    std::vector<uint8_t> bits(data.size());
    for (size_t i = 0; i < data.size(); i++) bits[i] = data[i] != 0;
    return std::make_unique<array>(bits.data(), std::move(s), dt, [](void*) {});
  }
  return std::make_unique<array>(loads::from_bytes(data, std::move(s), dt));
}

std::unique_ptr<array> clone_array(const array& a) { return std::make_unique<array>(a); }

bool evaluate_row_contiguous(std::vector<array>& arrays, const Stream& s) {
  mx::eval(arrays);
  bool strided = false;
  // Each copy evaluated before the next is made: the view it replaces (which MLX lets go
  // once the copy is computed) frees its memory first where nothing else holds it.
  for (auto& a : arrays) {
    if (!a.flags().row_contiguous) {
      a = kernels::contiguous(a, s);
      mx::eval(a);
      loads::prune_now();
      strided = true;
    }
  }
  return strided;
}

std::unique_ptr<array> export_array(const array& a, const Stream& s) {
  std::vector<array> out{a};
  evaluate_row_contiguous(out, s);
  return std::make_unique<array>(std::move(out[0]));
}

void eval_arrays(const ArrayVec& v) { mx::eval(v.items); }
void async_eval_arrays(const ArrayVec& v) { mx::async_eval(v.items); }

const uint8_t* array_data(const array& a) { return a.data<uint8_t>(); }
size_t array_nbytes(const array& a) { return a.nbytes(); }
rust::Vec<int32_t> array_shape(const array& a) {
  rust::Vec<int32_t> v;
  for (auto d : a.shape()) v.push_back(d);
  return v;
}
uint8_t array_dtype_val(const array& a) { return static_cast<uint8_t>(a.dtype().val()); }

}  // namespace emily
