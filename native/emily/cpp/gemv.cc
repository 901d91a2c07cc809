// A vector-matrix product on the CPU as one BLAS gemv call.
//
// MLX's CPU matmul hands every product to sgemm. For a single row (each dense layer of a
// decoding step: x is one token's hidden state) OpenBLAS's sgemm first packs the whole
// matrix into its panel layout, reading and writing every weight once more than the
// product needs: 3.4x the time of sgemv on a 1024 x 3072 f32 weight (bench/models.exs
// measures it per decoded token). gemv reads the weight once, in either layout, with
// OpenBLAS's threads. Only Linux takes this path (Accelerate's sgemm has no such cost).
#include "gemv.h"

#if defined(__linux__)
#include <cblas.h>

#include <typeinfo>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#endif

namespace emily {
namespace mx = mlx::core;

#if defined(__linux__)
namespace {

class RowGemv : public mx::UnaryPrimitive {
 public:
  explicit RowGemv(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& x = inputs[0];
    const array& b = inputs[1];
    const int k = b.shape(0), n = b.shape(1);
    const auto sk = b.strides(0), sn = b.strides(1);
    // b's element (i, j) at i * sk + j * sn: row-major with leading dimension sk (b
    // itself), or column-major with leading dimension sn (the transpose of a row-major
    // (N, K) weight, as Transformers-layout checkpoints give it); anything else (a
    // broadcast, a strided slice) is copied to row-major first.
    const bool rows = sn == 1 && sk >= n;
    const bool cols = sk == 1 && sn >= k;
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(b);
    encoder.set_output_array(out);
    encoder.dispatch([xp = x.data<float>(), incx = x.strides(1), bp = b.data<float>(), yp = out.data<float>(),
                                      k, n, sk, sn, rows, cols]() mutable {
      std::vector<float> xs;
      if (incx != 1) {
        // (A broadcast row has stride 0, which BLAS does not take.)
        xs.resize(k);
        for (int i = 0; i < k; i++) xs[i] = xp[i * incx];
        xp = xs.data();
        incx = 1;
      }
      if (rows) {
        cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, bp, sk, xp, incx, 0.0f, yp, 1);
      } else if (cols) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, bp, sn, xp, incx, 0.0f, yp, 1);
      } else {
        std::vector<float> dense(static_cast<size_t>(k) * n);
        for (int i = 0; i < k; i++)
          for (int j = 0; j < n; j++) dense[static_cast<size_t>(i) * n + j] = bp[i * sk + j * sn];
        cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, dense.data(), n, xp, incx, 0.0f, yp, 1);
      }
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[dot] the CPU gemv product has no GPU kernel");
  }

  const char* name() const override { return "EmilyRowGemv"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{1, inputs[1].shape(1)}};
  }
};

}  // namespace

bool row_gemv_applies(const array& x, const array& b, const Stream& s) {
  return s.device == mx::Device::cpu && x.dtype() == mx::float32 && b.dtype() == mx::float32 && x.ndim() == 2 &&
         b.ndim() == 2 && x.shape(0) == 1 && x.shape(1) == b.shape(0) && x.shape(1) > 0 && b.shape(1) > 0;
}

array row_gemv(const array& x, const array& b, const Stream& s) {
  return array({1, b.shape(1)}, mx::float32, std::make_shared<RowGemv>(s), {x, b});
}
#else
bool row_gemv_applies(const array&, const array&, const Stream&) { return false; }
array row_gemv(const array& x, const array& b, const Stream& s) { return mx::matmul(x, b, s); }
#endif

}  // namespace emily
