// Layer and RMS normalization on a CPU stream. MLX computes them there as a composition
// of ops (mlx/fast.cpp's fallback), five to seven passes over x, the row sums each one
// element after another (its reductions have one lane outside Apple's platforms): a
// BERT-base layer norm at batch 8 takes longer than PyTorch's whole layer's attention
// softmax. Emily's kernel computes the same composition per group of eight rows: the two
// sums in MLX's order, one row in each lane of a vector, then the normalized rows eight
// elements at a time, each operation rounded where the composition rounds it. So its
// results are the composition's to the bit. f32 with f32 (or no) weight and bias, on an
// x86-64 CPU with AVX2 and FMA; anything else is MLX's call.
#include "kernels.h"
#include "pool.h"
#include "vector.h"

#if EMILY_VECTOR_KERNELS
#include <typeinfo>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#endif

namespace emily::kernels {
namespace mx = mlx::core;

#if EMILY_VECTOR_KERNELS
namespace {

using namespace vec;

// The composition, for rows of m floats: mean(x) = sum(x) * (1 / m) (layer norm only),
// xc = x - mean, var = mean(xc * xc), y = xc * (1 / sqrt(var + eps)), then * weight and
// + bias. RMS norm is the same with no mean (xc = x).
struct Rows {
  const float *x, *w, *b;
  float* y;
  size_t m;
  float inv_m, eps;
  bool center;
};

// y's rows [r, r + 8) (or one row, `lanes` 1): each row's statistics, then the row.
template <int Lanes>
EMILY_VECTOR void normalize(const Rows& p, size_t r) {
  const size_t m = p.m;
  const float* x = p.x + r * m;
  float mean[8] = {}, scale[8];
  if constexpr (Lanes == 8) {
    const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(m)));
    const __m256 inv_m = _mm256_set1_ps(p.inv_m);
    __m256 mu = _mm256_setzero_ps();
    if (p.center) {
      __m256 sum = _mm256_setzero_ps();
      for (size_t j = 0; j < m; j++) sum = _mm256_add_ps(sum, _mm256_i32gather_ps(x + j, rows, 4));
      mu = _mm256_mul_ps(sum, inv_m);
    }
    __m256 sq = _mm256_setzero_ps();
    for (size_t j = 0; j < m; j++) {
      __m256 v = _mm256_i32gather_ps(x + j, rows, 4);
      if (p.center) v = _mm256_sub_ps(v, mu);
      sq = _mm256_add_ps(sq, _mm256_mul_ps(v, v));
    }
    __m256 var = _mm256_add_ps(_mm256_mul_ps(sq, inv_m), _mm256_set1_ps(p.eps));
    _mm256_storeu_ps(mean, mu);
    _mm256_storeu_ps(scale, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(var)));
  } else {
    if (p.center) {
      float sum = 0.0f;
      for (size_t j = 0; j < m; j++) sum += x[j];
      mean[0] = sum * p.inv_m;
    }
    float sq = 0.0f;
    for (size_t j = 0; j < m; j++) {
      float v = p.center ? x[j] - mean[0] : x[j];
      sq += v * v;
    }
    scale[0] = 1.0f / std::sqrt(sq * p.inv_m + p.eps);
  }

  for (int l = 0; l < Lanes; l++) {
    const float* xr = x + l * m;
    float* yr = p.y + (r + l) * m;
    __m256 mu = _mm256_set1_ps(mean[l]), k = _mm256_set1_ps(scale[l]);
    size_t j = 0;
    for (; j + 8 <= m; j += 8) {
      __m256 v = _mm256_loadu_ps(xr + j);
      if (p.center) v = _mm256_sub_ps(v, mu);
      v = _mm256_mul_ps(v, k);
      if (p.w) v = _mm256_mul_ps(v, _mm256_loadu_ps(p.w + j));
      if (p.b) v = _mm256_add_ps(v, _mm256_loadu_ps(p.b + j));
      _mm256_storeu_ps(yr + j, v);
    }
    for (; j < m; j++) {
      float v = (p.center ? xr[j] - mean[l] : xr[j]) * scale[l];
      if (p.w) v = v * p.w[j];
      if (p.b) v = v + p.b[j];
      yr[j] = v;
    }
  }
}

class Normalize : public mx::Primitive {
 public:
  Normalize(mx::Stream s, bool center, float eps, bool weight, bool bias)
      : mx::Primitive(s), center_(center), eps_(eps), weight_(weight), bias_(bias) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array& x = inputs[0];
    array& out = outputs[0];
    // Each group of rows is read whole before it is written: x's buffer can be the output's.
    if (mx::is_donatable(x, out)) {
      out.copy_shared_buffer(x);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    std::vector<array> in;
    for (auto& a : inputs) in.push_back(array::unsafe_weak_copy(a));
    encoder.dispatch([in = std::move(in), out = array::unsafe_weak_copy(out), center = center_, eps = eps_,
                      weight = weight_, bias = bias_]() mutable {
      const size_t m = in[0].shape().back(), rows = in[0].size() / m;
      Rows p{in[0].data<float>(),
             weight ? in[1].data<float>() : nullptr,
             bias ? in[weight ? 2 : 1].data<float>() : nullptr,
             out.data<float>(),
             m,
             static_cast<float>(1.0 / static_cast<double>(m)),
             eps,
             center};
      pool::ranges(rows, m, 8, [&](size_t a, size_t b) {
        for (; a + 8 <= b; a += 8) normalize<8>(p, a);
        for (; a < b; a++) normalize<1>(p, a);
      });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error(std::string("[") + op() + "] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return center_ ? "EmilyLayerNorm" : "EmilyRMSNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    if (typeid(other) != typeid(*this)) return false;
    auto& o = static_cast<const Normalize&>(other);
    return o.center_ == center_ && o.eps_ == eps_ && o.weight_ == weight_ && o.bias_ == bias_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  const char* op() const { return center_ ? "layer_norm" : "rms_norm"; }

  bool center_;
  float eps_;
  bool weight_, bias_;
};

// Whether the kernel computes `x`'s normalization with these operands on `s`. (The gather
// indexes eight rows by 32-bit offsets: rows of up to 2^28 elements.)
bool applies(const array& x, const std::vector<const std::optional<array>*>& operands, const Stream& s) {
  if (s.device != mx::Device::cpu || !vector_cpu() || x.dtype() != mx::float32 || x.size() == 0) return false;
  if (x.shape().back() >= (1 << 28)) return false;
  for (auto* a : operands)
    if (*a && (*a)->dtype() != mx::float32) return false;
  return true;
}

array normalized(const array& x, const std::optional<array>& weight, const std::optional<array>& bias, bool center,
                 float eps, const Stream& s) {
  std::vector<array> inputs{mx::contiguous(x, false, s)};
  if (weight) inputs.push_back(mx::contiguous(*weight, false, s));
  if (bias) inputs.push_back(mx::contiguous(*bias, false, s));
  auto kernel = std::make_shared<Normalize>(s, center, eps, weight.has_value(), bias.has_value());
  return array(x.shape(), mx::float32, std::move(kernel), std::move(inputs));
}

}  // namespace

// MLX's call checks the arguments (with its messages); where the kernel is taken, the
// composition it built is dropped unevaluated.
array layer_norm(const array& x, const std::optional<array>& weight, const std::optional<array>& bias, float eps,
                 const Stream& s) {
  auto ref = mx::fast::layer_norm(x, weight, bias, eps, s);
  return applies(x, {&weight, &bias}, s) ? normalized(x, weight, bias, true, eps, s) : ref;
}

array rms_norm(const array& x, const std::optional<array>& weight, float eps, const Stream& s) {
  auto ref = mx::fast::rms_norm(x, weight, eps, s);
  return applies(x, {&weight}, s) ? normalized(x, weight, std::nullopt, false, eps, s) : ref;
}

#else

array layer_norm(const array& x, const std::optional<array>& weight, const std::optional<array>& bias, float eps,
                 const Stream& s) {
  return mx::fast::layer_norm(x, weight, bias, eps, s);
}

array rms_norm(const array& x, const std::optional<array>& weight, float eps, const Stream& s) {
  return mx::fast::rms_norm(x, weight, eps, s);
}

#endif

}  // namespace emily::kernels
