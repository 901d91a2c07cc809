// MLX's CPU kernels are written over its Simd<T, N> types, which have one lane outside
// Apple's platforms, and its wheels are built for the x86-64 baseline, without FMA: there
// each `fma` of its exp and erf polynomials is a call into libm's software fma. On an
// f32 array that makes exp 13 ns an element, sigmoid 17 and erf 28 (a {8, 128, 3072}
// activation, BERT-base's GELU at batch 8, takes longer in erf than in the matmul that
// makes it), and softmax, whose exps are the same, follows them.
//
// The kernels here run the same formulas (MLX's exp, erf and sigmoid, in the same order
// of operations), eight lanes at a time with AVX2 and hardware FMA: an fma rounds once,
// in hardware or in libm, so the results are MLX's to the bit. They are chosen per CPU at
// run time and only on x86-64; elsewhere the MLX op runs.
#include "kernels.h"

#include <typeinfo>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

// (MLX's fp8 conversions in unary_ops.h pun pointers; none is used here.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-aliasing"
#include "mlx/backend/common/unary.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/primitives.h"
#pragma GCC diagnostic pop
#define EMILY_VECTOR_KERNELS 1
#endif

namespace emily::kernels {
namespace mx = mlx::core;

namespace {

// gelu_erf as the graph computes it, op by op.
array gelu_ops(const array& x, float c, const Stream& s) {
  auto t = x.dtype();
  auto e = mx::erf(mx::divide(x, array(c, t), s), s);
  return mx::divide(mx::multiply(mx::add(e, array(1.0f, t), s), x, s), array(2.0f, t), s);
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

bool applies(const array& a, const Stream& s) {
  return s.device == mx::Device::cpu && a.dtype() == mx::float32 && vector_cpu();
}

#define VECTOR __attribute__((target("avx2,fma")))

// simd::exp of MLX (cpu/simd/math.h): 2^round(x log2 e) times a polynomial of the rest.
VECTOR inline __m256 exp8(__m256 x0) {
  __m256 x = _mm256_mul_ps(x0, _mm256_set1_ps(1.442695f));
  // MLX rounds with floor(x + 0.5) in double, which is exact; in f32, x + 0.5 can round
  // up. floor(x), plus one where x's fraction (exact in f32) is at least a half.
  __m256 fl = _mm256_floor_ps(x);
  __m256 up = _mm256_cmp_ps(_mm256_sub_ps(x, fl), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  __m256 ipart = _mm256_add_ps(fl, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
  __m256 f = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
  r = _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x0, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

VECTOR inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

// detail::Sigmoid (cpu/unary_ops.h): y = 1 / (1 + exp(|x|)), y below zero, 1 - y above.
VECTOR inline __m256 sigmoid8(__m256 x) {
  __m256 one = _mm256_set1_ps(1.0f);
  __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(abs8(x))));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

// simd::erf (cpu/simd/math.h): Abramowitz and Stegun 7.1.26.
VECTOR inline __m256 erf8(__m256 x) {
  __m256 one = _mm256_set1_ps(1.0f);
  __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), abs8(x), one));
  __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
  __m256 neg = _mm256_set1_ps(-0.0f);
  __m256 e = _mm256_xor_ps(exp8(_mm256_mul_ps(_mm256_xor_ps(x, neg), x)), neg);
  __m256 result = _mm256_fmadd_ps(_mm256_mul_ps(e, t), r, one);
  return _mm256_blendv_ps(_mm256_xor_ps(result, neg), result, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
}

// The graph's five ops, each rounded to f32 as MLX's kernels round them.
VECTOR inline __m256 gelu8(__m256 x, __m256 c) {
  __m256 e = erf8(_mm256_div_ps(x, c));
  return _mm256_div_ps(_mm256_mul_ps(_mm256_add_ps(e, _mm256_set1_ps(1.0f)), x), _mm256_set1_ps(2.0f));
}

enum class Fn { exp, erf, sigmoid, gelu };

// One function over n floats: eight at a time, the rest through MLX's own scalar ops
// (which the tests compare the lanes with). `c` is gelu's divisor.
template <Fn F>
VECTOR void map(const float* in, float* out, size_t n, float c) {
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
      map<F>(in.data<float>(), out.data<float>(), in.data_size(), c);
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

// MLX's softmax of f32 rows (cpu/softmax.cpp, one lane): the row's maximum, the
// exponentials of the differences and their sum taken in order, then each times the
// sum's reciprocal. The maximum and the exponentials go eight at a time (the maximum
// is the same number in any order, and NaN wherever MLX's is); the sum keeps MLX's order.
VECTOR void softmax_rows(const float* in, float* out, size_t rows, size_t m) {
  for (size_t row = 0; row < rows; row++, in += m, out += m) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    size_t j = 0;
    for (; j + 8 <= m; j += 8) {
      __m256 x = _mm256_loadu_ps(in + j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, x);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float maximum = -INFINITY;
    for (float v : lanes) maximum = v > maximum ? v : maximum;
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; j < m; j++) {
      has_nan = has_nan || std::isnan(in[j]);
      maximum = in[j] > maximum ? in[j] : maximum;
    }
    if (has_nan) maximum = NAN;

    __m256 vm = _mm256_set1_ps(maximum);
    for (j = 0; j + 8 <= m; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(in + j), vm)));
    for (; j < m; j++) out[j] = mx::detail::Exp{}(in[j] - maximum);
    float normalizer = 0.0f;
    for (j = 0; j < m; j++) normalizer += out[j];
    normalizer = 1 / normalizer;
    __m256 vn = _mm256_set1_ps(normalizer);
    for (j = 0; j + 8 <= m; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), vn));
    for (; j < m; j++) out[j] *= normalizer;
  }
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
      if (m > 0) softmax_rows(in.data<float>(), out.data<float>(), in.size() / m, m);
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[softmax] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return "EmilySoftmax"; }

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
  return applies(x, s) ? elementwise<Fn::gelu>(x, s, c) : gelu_ops(x, c, s);
}

array softmax(const array& a, const std::vector<int>& axes, bool precise, const Stream& s) {
  // f32 is its own accumulator: `precise` changes nothing for it.
  if (!applies(a, s) || !last_axis(a, axes)) return mx::softmax(a, axes, precise, s);
  auto rows = mx::contiguous(a, false, s);
  return array(a.shape(), mx::float32, std::make_shared<Softmax>(s), {rows});
}

array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  // MLX's call checks the arguments (with its messages) and, on the CPU, builds the
  // composition below; where this one is taken, MLX's graph is dropped unevaluated.
  auto ref = mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, sinks, false, s);
  bool floats = q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32 &&
                (!mask || mask->dtype() == mx::float32 || mask->dtype() == mx::bool_);
  if (!applies(q, s) || !floats || sinks) return ref;

  // MLX's fallback (mlx/fast.cpp), step for step.
  bool causal = mask_mode == "causal";
  bool has_mask = mask.has_value() && !causal;
  int q_heads = q.shape(1), kv_heads = k.shape(1), repeats = q_heads / kv_heads;
  auto qs = mx::multiply(array(scale, mx::float32), q, s);
  auto ks = k, vs = v;
  if (repeats > 1) {
    qs = mx::unflatten(qs, 1, {kv_heads, repeats}, s);
    ks = mx::expand_dims(ks, 2, s);
    vs = mx::expand_dims(vs, 2, s);
  }
  auto scores = mx::matmul(qs, mx::swapaxes(ks, -1, -2, s), s);
  if (has_mask || causal) {
    auto make_mask = [&] {
      if (!causal) {
        auto shape = q.shape();
        shape.back() = k.shape(-2);
        return mx::broadcast_to(*mask, shape, s);
      }
      int kl = ks.shape(-2), ql = qs.shape(-2), offset = kl - ql;
      auto q_idx = mx::expand_dims(mx::arange(offset, ql + offset, s), 1, s);
      auto k_idx = mx::expand_dims(mx::arange(0, kl, s), 0, s);
      return mx::greater_equal(q_idx, k_idx, s);
    };
    auto m = make_mask();
    if (repeats > 1 && m.ndim() >= 3) {
      m = m.shape(-3) == 1 ? mx::expand_dims(m, -3, s) : mx::unflatten(m, -3, {kv_heads, repeats}, s);
    }
    scores = m.dtype() == mx::bool_
                 ? mx::where(m, scores, array(mx::finfo(mx::float32).min, mx::float32), s)
                 : mx::add(scores, m, s);
  }
  scores = softmax(scores, std::vector<int>{-1}, true, s);
  auto out = mx::matmul(scores, vs, s);
  return repeats > 1 ? mx::flatten(out, 1, 2, s) : out;
}

#else

bool vector_cpu() { return false; }
array exp(const array& a, const Stream& s) { return mx::exp(a, s); }
array gelu_erf(const array& x, float c, const Stream& s) { return gelu_ops(x, c, s); }
array erf(const array& a, const Stream& s) { return mx::erf(a, s); }
array sigmoid(const array& a, const Stream& s) { return mx::sigmoid(a, s); }
array softmax(const array& a, const std::vector<int>& axes, bool precise, const Stream& s) {
  return mx::softmax(a, axes, precise, s);
}
array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  return mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, sinks, false, s);
}

#endif

}  // namespace emily::kernels
