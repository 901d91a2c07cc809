// Scaled dot-product attention on a CPU stream. MLX computes it there as a composition
// of ops (mlx/fast.cpp's fallback): q·kᵀ, the mask, softmax, ·v. Emily runs that
// composition with its own softmax (kernels.cc), except for the few query rows of a
// decoding step: there the composition's cost is not arithmetic but copies, since a
// key/value cache laid out [B, L, heads, D] (as Bumblebee keeps it) reaches the products
// transposed and MLX's matmul copies every non-contiguous operand, the whole cache, for
// every layer and step. The decoding kernel reads q, k, v and the mask through their
// strides instead: for each (batch, head, row) the scaled dot products with every key,
// the mask, MLX's softmax, and the weighted sum of the values in key order; in f32 like
// the composition, with its sums in another order. bf16 operands are widened exactly and
// the result rounded once (where MLX's bf16 composition rounds each step). Grouped-query
// heads read their key/value head in place. (On MLX's CUDA backend: cuda_attention.cc.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda_kernels.h"
#include "kernels.h"
#include "pool.h"
#include "vector.h"

#if EMILY_VECTOR_KERNELS
#include <typeinfo>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#endif

namespace emily::kernels {
namespace mx = mlx::core;

#if EMILY_VECTOR_KERNELS
namespace {

using namespace vec;

// Query rows up to which the decoding kernel runs (a step's, or a few speculative ones).
constexpr int kDecodeRows = 8;

// An operand of f32 (float) or bf16 (its bits, uint16_t) read through its strides.
template <typename T>
struct View {
  const T* p;
  int64_t s0, s1, s2, s3;

  static View of(const array& a) {
    auto& st = a.strides();
    return {a.data<T>(), st[0], st[1], st[2], st[3]};
  }
  const T* row(int64_t b, int64_t h, int64_t i) const { return p + b * s0 + h * s1 + i * s2; }
};

template <typename T>
EMILY_VECTOR float dot(const float* a, const T* b, int64_t sb, int n) {
  float sum;
  int i = 0;
  if (sb == 1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (; i + 16 <= n; i += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), a0);
    sum = sum8(_mm256_add_ps(a0, a1));
  } else {
    sum = 0.0f;
  }
  for (; i < n; i++) sum = std::fma(a[i], load1(b + i * sb), sum);
  return sum;
}

// acc[0, n) += w * b[0, n) (b at stride sb).
template <typename T>
EMILY_VECTOR void axpy(float w, const T* b, int64_t sb, float* acc, int n) {
  int i = 0;
  if (sb == 1) {
    __m256 vw = _mm256_set1_ps(w);
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(vw, load8(b + i), _mm256_loadu_ps(acc + i)));
    }
  }
  for (; i < n; i++) acc[i] = std::fma(w, load1(b + i * sb), acc[i]);
}

inline void store(float* o, float v) { *o = v; }
inline void store(uint16_t* o, float v) { *o = to_bf16(v); }

class DecodeAttention : public mx::Primitive {
 public:
  DecodeAttention(mx::Stream s, float scale, bool causal) : mx::Primitive(s), scale_(scale), causal_(causal) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array &q = inputs[0], &k = inputs[1], &v = inputs[2];
    array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    bool has_mask = inputs.size() > 3;
    bool bf16 = q.dtype() == mx::bfloat16;
    encoder.dispatch([q = array::unsafe_weak_copy(q), k = array::unsafe_weak_copy(k), v = array::unsafe_weak_copy(v),
                      m = has_mask ? array::unsafe_weak_copy(inputs[3]) : array(0.0f),
                      out = array::unsafe_weak_copy(out), has_mask, bf16, scale = scale_,
                      causal = causal_]() mutable {
      const array* mask = has_mask ? &m : nullptr;
      bf16 ? run<uint16_t>(q, k, v, mask, scale, causal, out) : run<float>(q, k, v, mask, scale, causal, out);
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[scaled_dot_product_attention] Emily's CPU kernel has no GPU version");
  }

  const char* name() const override { return "EmilyDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    if (typeid(other) != typeid(*this)) return false;
    auto& o = static_cast<const DecodeAttention&>(other);
    return o.scale_ == scale_ && o.causal_ == causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(-1);
    return {shape};
  }

 private:
  // Applies the mask's row at `base` to `scores`: bool (kept, or f32's lowest value, as
  // the composition's), or added (f32 or bf16).
  static void masked(float* scores, const array& m, int64_t base, int keys) {
    const float lowest = -std::numeric_limits<float>::max();
    int64_t st = m.strides()[3];
    if (m.dtype() == mx::bool_) {
      const bool* mp = m.data<bool>() + base;
      for (int j = 0; j < keys; j++) scores[j] = mp[j * st] ? scores[j] : lowest;
    } else if (m.dtype() == mx::bfloat16) {
      const uint16_t* mp = m.data<uint16_t>() + base;
      for (int j = 0; j < keys; j++) scores[j] = scores[j] + load1(mp + j * st);
    } else {
      const float* mp = m.data<float>() + base;
      for (int j = 0; j < keys; j++) scores[j] = scores[j] + mp[j * st];
    }
  }

  template <typename T>
  static void run(const array& q, const array& k, const array& v, const array* m, float scale, bool causal,
                  array& out) {
    const int batch = q.shape(0), q_heads = q.shape(1), rows = q.shape(2), d = q.shape(3);
    const int kv_heads = k.shape(1), keys = k.shape(2), dv = v.shape(3);
    const int repeats = q_heads / kv_heads;
    auto qv = View<T>::of(q), kv = View<T>::of(k), vv = View<T>::of(v);
    const float lowest = -std::numeric_limits<float>::max();
    T* o = out.data<T>();
    int pairs = batch * q_heads;
    // One part per (batch, head), or one in all where the cache is small.
    int parts = static_cast<int64_t>(pairs) * keys * (d + dv) < (1 << 15) ? 1 : pairs;

    pool::run(parts, [&](int part) {
      std::vector<float> qs(d), scores(keys), acc(dv);
      for (int pair = pairs * part / parts; pair < pairs * (part + 1) / parts; pair++) {
        int b = pair / q_heads, h = pair % q_heads, kh = h / repeats;
        for (int i = 0; i < rows; i++) {
          // The composition scales q first (one rounding), then takes the products.
          const T* qr = qv.row(b, h, i);
          for (int c = 0; c < d; c++) qs[c] = scale * load1(qr + c * qv.s3);
          for (int j = 0; j < keys; j++) scores[j] = dot(qs.data(), kv.row(b, kh, j), kv.s3, d);
          if (causal) {
            // Aligned to the end of the keys, as MLX's causal mask (with more queries than
            // keys, the first see none, and get the mean of the values, as MLX's do).
            for (int j = std::max(0, i + (keys - rows) + 1); j < keys; j++) scores[j] = lowest;
          } else if (m) {
            auto& st = m->strides();
            masked(scores.data(), *m, b * st[0] + h * st[1] + i * st[2], keys);
          }
          softmax_rows(scores.data(), scores.data(), 1, keys);
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int j = 0; j < keys; j++) axpy(scores[j], vv.row(b, kh, j), vv.s3, acc.data(), dv);
          T* orow = o + ((static_cast<int64_t>(b) * q_heads + h) * rows + i) * dv;
          for (int c = 0; c < dv; c++) store(orow + c, acc[c]);
        }
      }
    });
  }

  float scale_;
  bool causal_;
};

}  // namespace

array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  // MLX's call checks the arguments (with its messages) and, on the CPU, builds the
  // composition below; where this one is taken, MLX's graph is dropped unevaluated.
  auto ref = mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, sinks, false, s);
  if (cuda_attention_applies(q, k, v, mask_mode, mask, sinks, s)) return cuda_attention(q, k, v, scale, *mask, s);
  // f32 throughout, or bf16 operands (a decoding step only) with a bool, f32 or bf16 mask.
  auto t = q.dtype();
  bool typed = (t == mx::float32 || t == mx::bfloat16) && k.dtype() == t && v.dtype() == t;
  bool mask_typed = !mask || mask->dtype() == mx::bool_ || mask->dtype() == mx::float32 || mask->dtype() == t;
  if (s.device != mx::Device::cpu || !vector_cpu() || !typed || !mask_typed || sinks) return ref;
  bool causal = mask_mode == "causal";
  if (q.shape(2) <= kDecodeRows) {
    std::vector<array> inputs = {q, k, v};
    if (mask && !causal) {
      auto shape = q.shape();
      shape.back() = k.shape(-2);
      inputs.push_back(mx::broadcast_to(*mask, shape, s));
    }
    auto shape = q.shape();
    shape.back() = v.shape(-1);
    return array(shape, t, std::make_shared<DecodeAttention>(s, scale, causal), inputs);
  }
  if (t != mx::float32) return ref;

  // MLX's fallback (mlx/fast.cpp), step for step.
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
  scores = kernels::softmax(scores, std::vector<int>{-1}, true, s);
  auto out = mx::matmul(scores, vs, s);
  return repeats > 1 ? mx::flatten(out, 1, 2, s) : out;
}

#else

array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  auto ref = mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, sinks, false, s);
  if (cuda_attention_applies(q, k, v, mask_mode, mask, sinks, s)) return cuda_attention(q, k, v, scale, *mask, s);
  return ref;
}

#endif

}  // namespace emily::kernels
