// A transposed matrix made row-contiguous. Bumblebee's dense kernels are transposes of
// their checkpoint's matrices, and a tensor's evaluated array must be row-contiguous
// (what leaves a thread is read as plain bytes), so a model's first call copies every
// weight so. MLX's CPU copy of a strided array walks its elements one at a time through
// general index arithmetic (about 0.7 GB/s here); this one copies square tiles, whose
// source rows and destination rows both stay in cache, split over the pool.
#include <cstdint>
#include <algorithm>
#include <typeinfo>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"

namespace emily::kernels {
namespace mx = mlx::core;

namespace {

constexpr int kTile = 32;

// out (rows, cols) row-major from src (cols, rows) row-major: out[i][j] = src[j][i].
template <typename T>
void transpose_rows(const T* src, T* out, size_t rows, size_t cols, size_t i0, size_t i1) {
  for (size_t ib = i0; ib < i1; ib += kTile) {
    size_t ie = std::min(i1, ib + kTile);
    for (size_t jb = 0; jb < cols; jb += kTile) {
      size_t je = std::min(cols, jb + kTile);
      for (size_t i = ib; i < ie; i++)
        for (size_t j = jb; j < je; j++) out[i * cols + j] = src[j * rows + i];
    }
  }
}

class TransposeCopy : public mx::UnaryPrimitive {
 public:
  explicit TransposeCopy(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& in = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([in = array::unsafe_weak_copy(in), out = array::unsafe_weak_copy(out)]() mutable {
      size_t rows = in.shape(0), cols = in.shape(1);
      auto run = [&](auto* src, auto* dst) {
        pool::ranges(rows, cols, kTile, [&](size_t a, size_t b) { transpose_rows(src, dst, rows, cols, a, b); });
      };
      switch (in.itemsize()) {
        case 1: run(in.data<uint8_t>(), out.data<uint8_t>()); break;
        case 2: run(in.data<uint16_t>(), out.data<uint16_t>()); break;
        case 4: run(in.data<uint32_t>(), out.data<uint32_t>()); break;
        default: run(in.data<uint64_t>(), out.data<uint64_t>()); break;
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[contiguous] Emily's transposed copy has no GPU version");
  }

  const char* name() const override { return "EmilyTransposeCopy"; }
  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }
  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }
};

// An evaluated (rows, cols) view whose strides are (1, rows) over a buffer of exactly
// its elements: the transpose of a row-major (cols, rows) matrix.
bool transposed_matrix(const array& a) {
  if (a.status() == array::Status::unscheduled || a.ndim() != 2 || a.size() < 2) return false;
  auto s = a.strides();
  return s[0] == 1 && s[1] == a.shape(0) && a.data_size() == a.size() && a.itemsize() <= 8;
}

}  // namespace

array contiguous(const array& a, const Stream& s) {
  if (s.device != mx::Device::cpu || !transposed_matrix(a)) return mx::contiguous(a, false, s);
  return array(a.shape(), a.dtype(), std::make_shared<TransposeCopy>(s), {a});
}

}  // namespace emily::kernels
