// A dense layer's product plus bias on a CPU stream, f32, Linux (OpenBLAS).
//
// MLX's addmm fills its output with the bias before sgemm adds the product into it
// (beta 1), and fills it through its general strided copy, element by element with an
// index computed for each: for a bias broadcast over the rows, a pass slower than the
// product's own packing (a BERT-base layer at batch 8 fills 7M floats so). This is the
// same sgemm product on a buffer filled row by row with memcpy (its operands in place
// wherever BLAS can read them so, blas.h): MLX's results, to the bit.
#include "addmm.h"

#if defined(__linux__)
#include <cstring>
#include <typeinfo>
#include <vector>

#include "blas.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#endif

namespace emily {
namespace mx = mlx::core;

#if defined(__linux__)
namespace {

class AddBiasMM : public mx::Primitive {
 public:
  explicit AddBiasMM(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([x = array::unsafe_weak_copy(inputs[0]), w = array::unsafe_weak_copy(inputs[1]),
                      bias = array::unsafe_weak_copy(inputs[2]), out = array::unsafe_weak_copy(out)]() mutable {
      const int m = x.shape(0), k = x.shape(1), n = w.shape(1);
      float* y = out.data<float>();
      const float* c = bias.data<float>();
      if (m == 0 || n == 0) return;
      for (int i = 0; i < m; i++) std::memcpy(y + static_cast<size_t>(i) * n, c, sizeof(float) * n);
      if (k == 0) return;
      blas::Matrix a(x.data<float>(), m, k, x.strides(0), x.strides(1));
      blas::Matrix b(w.data<float>(), k, n, w.strides(0), w.strides(1));
      cblas_sgemm(CblasRowMajor, a.trans, b.trans, m, n, k, 1.0f, a.p, a.ld, b.p, b.ld, 1.0f, y, n);
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dense] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return "EmilyAddBiasMM"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{inputs[0].shape(0), inputs[1].shape(1)}};
  }
};

}  // namespace

array add_bias_mm(const array& bias, const array& x, const array& w, const Stream& s) {
  bool cpu_f32 = s.device == mx::Device::cpu && x.dtype() == mx::float32;
  if (!cpu_f32) return mx::addmm(bias, x, w, 1.0f, 1.0f, s);
  // The bias is read as one dense row.
  return array({x.shape(0), w.shape(1)}, mx::float32, std::make_shared<AddBiasMM>(s),
               {x, w, mx::contiguous(bias, false, s)});
}

#else

array add_bias_mm(const array& bias, const array& x, const array& w, const Stream& s) {
  return mx::addmm(bias, x, w, 1.0f, 1.0f, s);
}

#endif

}  // namespace emily
