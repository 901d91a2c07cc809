// MLX's CPU kernels are written over its Simd<T, N> types, which have one lane outside
// Apple's platforms, and its wheels are built for the x86-64 baseline, without FMA: there
// each `fma` of its exp and erf polynomials is a call into libm's software fma. On an
// f32 array that makes exp 13 ns an element, sigmoid 17 and erf 28 (a {8, 128, 3072}
// activation, BERT-base's GELU at batch 8, takes longer in erf than in the matmul that
// makes it), and softmax, whose exps are the same, follows them.
//
// The kernels here run the same formulas (MLX's exp, erf and sigmoid, in the same order
// of operations), eight lanes at a time with AVX2 and hardware FMA: an fma rounds once,
// in hardware or in libm, so the results are MLX's to the bit; a large array's pass is
// split over the cores (pool.h), where MLX's runs on one. They are chosen per CPU at run
// time and only on x86-64; elsewhere the MLX op runs.
#include "kernels.h"

#include <typeinfo>

#include "pool.h"
#include "vector.h"

#if EMILY_VECTOR_KERNELS
#include "mlx/backend/common/unary.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#endif

namespace emily::kernels {
namespace mx = mlx::core;

namespace {

// gelu_erf as the graph computes it, op by op; `c` is the divisor in x's type.
array gelu_ops(const array& x, const array& c, const Stream& s) {
  auto t = x.dtype();
  auto e = mx::erf(mx::divide(x, c, s), s);
  return mx::divide(mx::multiply(mx::add(e, array(1.0f, t), s), x, s), array(2.0f, t), s);
}

array gelu_ops(const array& x, float c, const Stream& s) { return gelu_ops(x, array(c, x.dtype()), s); }

// silu as the graph computes it, op by op: sigmoid(x) * x, then `by` times that.
array silu_ops(const array& x, const std::optional<array>& by, const Stream& s) {
  auto t = mx::multiply(sigmoid(x, s), x, s);
  return by ? mx::multiply(*by, t, s) : t;
}

// On a GPU, the same ops through MLX's compiler: it fuses them into one kernel of the
// same per-element functions. The compiled function records the streams its trace ran
// on, so it is used on a thread's default GPU stream only (Emily's streams are those),
// where each thread traces it once per shape and type (MLX's compile cache is per thread).
array silu_gpu(const array& x, const std::optional<array>& by, const Stream& s) {
  static const auto gated = mx::compile([](const std::vector<array>& in) {
    return std::vector<array>{silu_ops(in[0], in[1], mx::default_stream(mx::Device::gpu))};
  });
  static const auto plain = mx::compile([](const std::vector<array>& in) {
    return std::vector<array>{silu_ops(in[0], std::nullopt, mx::default_stream(mx::Device::gpu))};
  });
  if (!(s == mx::default_stream(mx::Device::gpu))) return silu_ops(x, by, s);
  return by ? gated({x, *by})[0] : plain({x})[0];
}

// gelu_erf likewise (five kernels become one). The divisor is an input of the compiled
// function, not a constant of its trace, so one trace serves every divisor.
array gelu_gpu(const array& x, float c, const Stream& s) {
  static const auto fused = mx::compile([](const std::vector<array>& in) {
    return std::vector<array>{gelu_ops(in[0], in[1], mx::default_stream(mx::Device::gpu))};
  });
  if (!(s == mx::default_stream(mx::Device::gpu))) return gelu_ops(x, c, s);
  return fused({x, array(c, x.dtype())})[0];
}

array gelu_any(const array& x, float c, const Stream& s) {
  return s.device == mx::Device::gpu ? gelu_gpu(x, c, s) : gelu_ops(x, c, s);
}

}  // namespace

#if EMILY_VECTOR_KERNELS
bool vector_cpu() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

namespace {

using namespace vec;

bool applies(const array& a, const Stream& s) {
  return s.device == mx::Device::cpu && a.dtype() == mx::float32 && vector_cpu();
}

enum class Fn { exp, erf, sigmoid, gelu };

// One function over n floats: eight at a time, the rest through MLX's own scalar ops
// (which the tests compare the lanes with). `c` is gelu's divisor.
template <Fn F>
EMILY_VECTOR void map(const float* in, float* out, size_t n, float c) {
  size_t i = 0;
  __m256 vc = _mm256_set1_ps(c);
  for (; i + 8 <= n; i += 8) {
    __m256 x = _mm256_loadu_ps(in + i);
    __m256 y = F == Fn::exp ? exp8(x) : F == Fn::erf ? erf8(x) : F == Fn::sigmoid ? sigmoid8(x) : gelu8(x, vc);
    _mm256_storeu_ps(out + i, y);
  }
  for (; i < n; i++) {
    if constexpr (F == Fn::exp) out[i] = mx::detail::Exp{}(in[i]);
    if constexpr (F == Fn::erf) out[i] = mx::detail::Erf{}(in[i]);
    if constexpr (F == Fn::sigmoid) out[i] = mx::detail::Sigmoid{}(in[i]);
    if constexpr (F == Fn::gelu) out[i] = ((mx::detail::Erf{}(in[i] / c) + 1.0f) * in[i]) / 2.0f;
  }
}

template <Fn F>
class Elementwise : public mx::UnaryPrimitive {
 public:
  explicit Elementwise(mx::Stream s, float c = 0.0f) : mx::UnaryPrimitive(s), c_(c) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& in = inputs[0];
    if (!in.flags().contiguous) throw std::runtime_error(std::string("[") + op() + "] Emily's kernel takes contiguous input");
    mx::set_unary_output_data(in, out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([in = array::unsafe_weak_copy(in), out = array::unsafe_weak_copy(out), c = c_]() mutable {
      const float* x = in.data<float>();
      float* y = out.data<float>();
      pool::ranges(in.data_size(), 1, 8, [&](size_t a, size_t b) { map<F>(x + a, y + a, b - a, c); });
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error(std::string("[") + op() + "] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override {
    return F == Fn::exp ? "EmilyExp" : F == Fn::erf ? "EmilyErf" : F == Fn::sigmoid ? "EmilySigmoid" : "EmilyGelu";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return typeid(other) == typeid(*this) && static_cast<const Elementwise&>(other).c_ == c_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }

 private:
  static const char* op() {
    return F == Fn::exp ? "exp" : F == Fn::erf ? "erf" : F == Fn::sigmoid ? "sigmoid" : "gelu_erf";
  }

  float c_;
};

// Over a contiguous input, row- or column-major (the graph copies any other first, as
// MLX's own strided loop would read it).
template <Fn F>
array elementwise(const array& a, const Stream& s, float c = 0.0f) {
  return array(a.shape(), mx::float32, std::make_shared<Elementwise<F>>(s, c), {mx::contiguous(a, true, s)});
}

// Over the last axis of a row-contiguous input (the graph makes it so).
class Softmax : public mx::UnaryPrimitive {
 public:
  explicit Softmax(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& in = inputs[0];
    if (!in.flags().row_contiguous) throw std::runtime_error("[softmax] Emily's kernel takes row-contiguous input");
    if (mx::is_donatable(in, out)) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    size_t m = in.shape().back();
    encoder.dispatch([in = array::unsafe_weak_copy(in), out = array::unsafe_weak_copy(out), m]() mutable {
      if (m == 0) return;
      const float* x = in.data<float>();
      float* y = out.data<float>();
      pool::ranges(in.size() / m, m, 1,
                   [&](size_t a, size_t b) { softmax_rows(x + a * m, y + a * m, b - a, m); });
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[softmax] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return "EmilySoftmax"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }
};

// sigmoid(x) * x (times `by`), each product rounded to f32 as MLX's multiply rounds it.
EMILY_VECTOR void silu_map(const float* x, const float* by, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 t = _mm256_mul_ps(sigmoid8(v), v);
    _mm256_storeu_ps(out + i, by ? _mm256_mul_ps(_mm256_loadu_ps(by + i), t) : t);
  }
  for (; i < n; i++) {
    float t = mx::detail::Sigmoid{}(x[i]) * x[i];
    out[i] = by ? by[i] * t : t;
  }
}

// silu_map in bf16, as MLX's bf16 ops compute it: sigmoid from exp(|x|) rounded to bf16,
// then 1 / (1 + e) and its complement in f32, rounded once (detail::Sigmoid on bf16);
// each product of two bf16 values (exact in f32) rounded to bf16.
EMILY_VECTOR void silu_map(const uint16_t* x, const uint16_t* by, uint16_t* out, size_t n) {
  __m256 one = _mm256_set1_ps(1.0f);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = load8(x + i);
    __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, round_bf16(exp8(abs8(v)))));
    __m256 below = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 sig = round_bf16(_mm256_blendv_ps(_mm256_sub_ps(one, y), y, below));
    __m256 t = _mm256_mul_ps(sig, v);
    if (by) t = _mm256_mul_ps(load8(by + i), round_bf16(t));
    store8(out + i, t);
  }
  for (; i < n; i++) {
    mx::bfloat16_t v = load1(x + i);
    mx::bfloat16_t t = mx::detail::Sigmoid{}(v) * v;
    if (by) t = mx::bfloat16_t(load1(by + i)) * t;
    out[i] = t.bits_;
  }
}

class Silu : public mx::Primitive {
 public:
  explicit Silu(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    array& out = outputs[0];
    for (auto& in : inputs)
      if (!in.flags().row_contiguous) throw std::runtime_error("[silu] Emily's kernel takes row-contiguous input");
    if (mx::is_donatable(inputs[0], out)) {
      out.copy_shared_buffer(inputs[0]);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    auto x = array::unsafe_weak_copy(inputs[0]);
    auto by = inputs.size() > 1 ? std::optional<array>(array::unsafe_weak_copy(inputs[1])) : std::nullopt;
    encoder.dispatch([x, by, out = array::unsafe_weak_copy(out)]() mutable {
      if (x.dtype() == mx::bfloat16) {
        const uint16_t* xp = x.data<uint16_t>();
        const uint16_t* bp = by ? by->data<uint16_t>() : nullptr;
        uint16_t* y = out.data<uint16_t>();
        pool::ranges(x.size(), 1, 8,
                     [&](size_t a, size_t b) { silu_map(xp + a, bp ? bp + a : nullptr, y + a, b - a); });
        return;
      }
      const float* xp = x.data<float>();
      const float* bp = by ? by->data<float>() : nullptr;
      float* y = out.data<float>();
      pool::ranges(x.size(), 1, 8,
                   [&](size_t a, size_t b) { silu_map(xp + a, bp ? bp + a : nullptr, y + a, b - a); });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[silu] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return "EmilySilu"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override { return {inputs[0].shape()}; }
};

bool last_axis(const array& a, const std::vector<int>& axes) {
  int nd = static_cast<int>(a.ndim());
  return nd > 0 && axes.size() == 1 && (axes[0] == nd - 1 || axes[0] == -1);
}

}  // namespace

array exp(const array& a, const Stream& s) { return applies(a, s) ? elementwise<Fn::exp>(a, s) : mx::exp(a, s); }

array erf(const array& a, const Stream& s) { return applies(a, s) ? elementwise<Fn::erf>(a, s) : mx::erf(a, s); }

array sigmoid(const array& a, const Stream& s) {
  return applies(a, s) ? elementwise<Fn::sigmoid>(a, s) : mx::sigmoid(a, s);
}

array gelu_erf(const array& x, float c, const Stream& s) {
  return applies(x, s) ? elementwise<Fn::gelu>(x, s, c) : gelu_any(x, c, s);
}

static array silu_cpu(const array& x, const std::optional<array>& by, const Stream& s) {
  bool bf16 = s.device == mx::Device::cpu && x.dtype() == mx::bfloat16 && vector_cpu();
  if (!applies(x, s) && !bf16) return silu_ops(x, by, s);
  // Both read in one order: row-major (a gated unit's two products are).
  std::vector<array> in{mx::contiguous(x, false, s)};
  if (by) in.push_back(mx::contiguous(*by, false, s));
  return array(x.shape(), x.dtype(), std::make_shared<Silu>(s), std::move(in));
}

array softmax(const array& a, const std::vector<int>& axes, bool precise, const Stream& s) {
  // f32 is its own accumulator: `precise` changes nothing for it.
  if (!applies(a, s) || !last_axis(a, axes)) return mx::softmax(a, axes, precise, s);
  auto rows = mx::contiguous(a, false, s);
  return array(a.shape(), mx::float32, std::make_shared<Softmax>(s), {rows});
}

#else

bool vector_cpu() { return false; }
array exp(const array& a, const Stream& s) { return mx::exp(a, s); }
array gelu_erf(const array& x, float c, const Stream& s) { return gelu_any(x, c, s); }
array erf(const array& a, const Stream& s) { return mx::erf(a, s); }
array sigmoid(const array& a, const Stream& s) { return mx::sigmoid(a, s); }
array softmax(const array& a, const std::vector<int>& axes, bool precise, const Stream& s) {
  return mx::softmax(a, axes, precise, s);
}
static array silu_cpu(const array& x, const std::optional<array>& by, const Stream& s) { return silu_ops(x, by, s); }
#endif

array silu(const array& x, const std::optional<array>& by, const Stream& s) {
  if (by && (by->shape() != x.shape() || by->dtype() != x.dtype()))
    throw std::invalid_argument("[silu] the factor must have x's shape and type");
  if (s.device == mx::Device::gpu) return silu_gpu(x, by, s);
  return silu_cpu(x, by, s);
}

}  // namespace emily::kernels
