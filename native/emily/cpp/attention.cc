// Scaled dot-product attention on a CPU stream. MLX computes it there as a composition
// of ops (mlx/fast.cpp's fallback): q·kᵀ, the mask, softmax, ·v. A key/value cache or a
// projection laid out [B, L, heads, D] (as Bumblebee keeps them) reaches those products
// transposed, and MLX's matmul copies every operand whose rows are not packed, so the
// composition copies q, k and v, and the output goes back to [B, L, heads, D] in one
// more copy. Emily's two kernels read q, k, v and the mask through their strides:
//
// - a decoding step's few query rows: for each (batch, head, row) the scaled dot
//   products with every key, the mask, MLX's softmax, and the weighted sum of the values
//   in key order; in f32 like the composition, with its sums in another order. bf16
//   operands are widened exactly and the result rounded once (where MLX's bf16
//   composition rounds each step).
// - more rows (a prompt, an encoder), f32: the composition's own steps (q times the
//   scale, sgemm for q·kᵀ, the mask and Emily's softmax in one pass over each row, sgemm
//   for ·v), each product the sgemm call MLX makes, on the operands in place (BLAS takes
//   their row strides), and the output written in [B, L, heads, D] order, so that
//   transposing it back is free. bf16: the same steps on each head's operands widened
//   exactly to f32, the result rounded once, as the decoding kernel's (MLX's bf16
//   composition multiplies on one thread at a few GFLOP/s: a Qwen3-0.6B-shaped model's
//   128-token prompt spent about 1 s of its 2.5 s there).
//
// Grouped-query heads read their key/value head in place. (On MLX's CUDA backend:
// cuda_attention.cc.)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cuda_kernels.h"
#include "kernels.h"
#include "pool.h"
#include "vector.h"

#if EMILY_VECTOR_KERNELS
#include <typeinfo>

#include "blas.h"
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

// Masks row i of (batch b, head h)'s scores over `keys` keys for `rows` query rows:
// causal (keys after the row's position, aligned to the end of the keys as MLX's causal
// mask, set to f32's lowest value; with more queries than keys the first see none, and
// get the mean of the values, as MLX's do), or the mask `m`: bool (kept, or f32's lowest
// value, as the composition's), or added (f32 or bf16). Neither: the row as it is.
void mask_row(float* scores, bool causal, const array* m, int b, int h, int i, int rows, int keys) {
  const float lowest = -std::numeric_limits<float>::max();
  if (causal) {
    for (int j = std::max(0, i + (keys - rows) + 1); j < keys; j++) scores[j] = lowest;
    return;
  }
  if (!m) return;
  auto& st = m->strides();
  int64_t base = b * st[0] + h * st[1] + i * st[2], sk = st[3];
  if (m->dtype() == mx::bool_) {
    const bool* mp = m->data<bool>() + base;
    for (int j = 0; j < keys; j++) scores[j] = mp[j * sk] ? scores[j] : lowest;
  } else if (m->dtype() == mx::bfloat16) {
    const uint16_t* mp = m->data<uint16_t>() + base;
    for (int j = 0; j < keys; j++) scores[j] = scores[j] + load1(mp + j * sk);
  } else {
    const float* mp = m->data<float>() + base;
    for (int j = 0; j < keys; j++) scores[j] = scores[j] + mp[j * sk];
  }
}

// The operands' sizes: q [batch, q_heads, rows, d], k [batch, kv_heads, keys, d], v
// [batch, kv_heads, keys, dv]; each key/value head serves `repeats` query heads.
struct Sizes {
  int batch, q_heads, rows, d, kv_heads, keys, dv, repeats;

  Sizes(const array& q, const array& k, const array& v)
      : batch(q.shape(0)), q_heads(q.shape(1)), rows(q.shape(2)), d(q.shape(3)), kv_heads(k.shape(1)),
        keys(k.shape(2)), dv(v.shape(3)), repeats(q_heads / kv_heads) {}
};

inline void store(float* o, float v) { *o = v; }
inline void store(uint16_t* o, float v) { *o = to_bf16(v); }

// What the two kernels share: q, k, v and the mask as inputs, [B, heads, L, Dv] out.
class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream s, float scale, bool causal) : mx::Primitive(s), scale_(scale), causal_(causal) {}

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[scaled_dot_product_attention] Emily's CPU kernel has no GPU version");
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    if (typeid(other) != typeid(*this)) return false;
    auto& o = static_cast<const Attention&>(other);
    return o.scale_ == scale_ && o.causal_ == causal_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[2].shape(-1);
    return {shape};
  }

 protected:
  float scale_;
  bool causal_;
};

class DecodeAttention : public Attention {
 public:
  using Attention::Attention;

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

  const char* name() const override { return "EmilyDecodeAttention"; }

 private:
  template <typename T>
  static void run(const array& q, const array& k, const array& v, const array* m, float scale, bool causal,
                  array& out) {
    const auto [batch, q_heads, rows, d, kv_heads, keys, dv, repeats] = Sizes(q, k, v);
    auto qv = View<T>::of(q), kv = View<T>::of(k), vv = View<T>::of(v);
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
          mask_row(scores.data(), causal, m, b, h, i, rows, keys);
          softmax_rows(scores.data(), scores.data(), 1, keys);
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int j = 0; j < keys; j++) axpy(scores[j], vv.row(b, kh, j), vv.s3, acc.data(), dv);
          T* orow = o + ((static_cast<int64_t>(b) * q_heads + h) * rows + i) * dv;
          for (int c = 0; c < dv; c++) store(orow + c, acc[c]);
        }
      }
    });
  }
};

// f32 or bf16 [B, heads, L, D] operands, more query rows than a decoding step's; the
// output [B, heads, L, Dv] laid out [B, L, heads, Dv].
class PrefillAttention : public Attention {
 public:
  using Attention::Attention;

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array &q = inputs[0], &v = inputs[2];
    array& out = outputs[0];
    const int64_t heads = q.shape(1), rows = q.shape(2), dv = v.shape(3);
    mx::array::Flags flags{true, heads == 1 || rows == 1, false};
    out.set_data(mx::allocator::malloc(out.nbytes()), out.size(), {rows * heads * dv, dv, heads * dv, 1}, flags);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    bool has_mask = inputs.size() > 3;
    bool bf16 = q.dtype() == mx::bfloat16;
    encoder.dispatch([q = array::unsafe_weak_copy(q), k = array::unsafe_weak_copy(inputs[1]),
                      v = array::unsafe_weak_copy(v), m = has_mask ? array::unsafe_weak_copy(inputs[3]) : array(0.0f),
                      out = array::unsafe_weak_copy(out), has_mask, bf16, scale = scale_, causal = causal_]() mutable {
      const array* mask = has_mask ? &m : nullptr;
      bf16 ? run<uint16_t>(q, k, v, mask, scale, causal, out) : run<float>(q, k, v, mask, scale, causal, out);
    });
  }

  const char* name() const override { return "EmilyPrefillAttention"; }

 private:
  // A (batch, head)'s rows x cols operand at p as sgemm reads it: in place for f32, else
  // widened into `wide`, packed.
  template <typename T>
  static blas::Matrix matrix(const T* p, int64_t rows, int64_t cols, int64_t sr, int64_t sc, std::vector<float>& wide) {
    if constexpr (std::is_same_v<T, float>) {
      return blas::Matrix(p, rows, cols, sr, sc);
    } else {
      wide.resize(rows * cols);
      for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) wide[i * cols + j] = load1(p + i * sr + j * sc);
      return blas::Matrix(wide.data(), rows, cols, cols, 1);
    }
  }

  template <typename T>
  static void run(const array& q, const array& k, const array& v, const array* m, float scale, bool causal,
                  array& out) {
    const auto [batch, q_heads, rows, d, kv_heads, keys, dv, repeats] = Sizes(q, k, v);
    auto qv = View<T>::of(q), kv = View<T>::of(k), vv = View<T>::of(v);
    const int64_t pairs = static_cast<int64_t>(batch) * q_heads, block = static_cast<int64_t>(rows) * keys;
    std::vector<float> scores(pairs * block), qs(static_cast<int64_t>(rows) * d), wide;
    T* o = out.data<T>();
    // bf16's output, one (batch, head) at a time, in f32 until it is rounded.
    constexpr bool f32 = std::is_same_v<T, float>;
    std::vector<float> sums(f32 ? 0 : static_cast<int64_t>(rows) * dv);

    // q·kᵀ, q scaled first (one rounding, as the composition's multiply).
    for (int64_t pair = 0; pair < pairs; pair++) {
      int b = pair / q_heads, h = pair % q_heads, kh = h / repeats;
      for (int i = 0; i < rows; i++) {
        const T* qr = qv.row(b, h, i);
        for (int c = 0; c < d; c++) qs[i * d + c] = scale * load1(qr + c * qv.s3);
      }
      auto km = matrix(kv.row(b, kh, 0), keys, d, kv.s2, kv.s3, wide);
      auto kt = km.trans == CblasNoTrans ? CblasTrans : CblasNoTrans;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, kt, rows, keys, d, 1.0f, qs.data(), d, km.p, km.ld, 0.0f,
                  scores.data() + pair * block, keys);
    }

    // The mask and the softmax, row by row, the rows split over the pool.
    pool::ranges(pairs * rows, keys, 1, [&](size_t from, size_t to) {
      for (size_t r = from; r < to; r++) {
        float* row = scores.data() + r * keys;
        int64_t pair = r / rows;
        int b = pair / q_heads, h = pair % q_heads, i = r % rows;
        mask_row(row, causal, m, b, h, i, rows, keys);
        softmax_rows(row, row, 1, keys);
      }
    });

    // ·v, each (batch, head) written at its place in [B, L, heads, Dv].
    for (int64_t pair = 0; pair < pairs; pair++) {
      int b = pair / q_heads, h = pair % q_heads, kh = h / repeats;
      const int64_t at = (static_cast<int64_t>(b) * rows * q_heads + h) * dv, ld = static_cast<int64_t>(q_heads) * dv;
      auto vm = matrix(vv.row(b, kh, 0), keys, dv, vv.s2, vv.s3, wide);
      float* orow = f32 ? reinterpret_cast<float*>(o + at) : sums.data();
      cblas_sgemm(CblasRowMajor, CblasNoTrans, vm.trans, rows, dv, keys, 1.0f, scores.data() + pair * block, keys,
                  vm.p, vm.ld, 0.0f, orow, f32 ? ld : dv);
      if constexpr (!f32)
        for (int i = 0; i < rows; i++)
          for (int c = 0; c < dv; c++) store(o + at + i * ld + c, sums[static_cast<int64_t>(i) * dv + c]);
    }
  }
};

}  // namespace

array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  // MLX's call checks the arguments (with its messages) and, on the CPU, builds the
  // composition below; where this one is taken, MLX's graph is dropped unevaluated.
  auto ref = mx::fast::scaled_dot_product_attention(q, k, v, scale, mask_mode, mask, sinks, false, s);
  if (cuda_attention_applies(q, k, v, mask_mode, mask, sinks, s)) return cuda_attention(q, k, v, scale, *mask, s);
  // f32 or bf16 operands with a bool, f32 or the operands' type of mask.
  auto t = q.dtype();
  bool typed = (t == mx::float32 || t == mx::bfloat16) && k.dtype() == t && v.dtype() == t;
  bool mask_typed = !mask || mask->dtype() == mx::bool_ || mask->dtype() == mx::float32 || mask->dtype() == t;
  if (s.device != mx::Device::cpu || !vector_cpu() || !typed || !mask_typed || sinks) return ref;
  bool causal = mask_mode == "causal";
  bool decode = q.shape(2) <= kDecodeRows;
  if (!decode && (q.size() == 0 || k.size() == 0 || v.size() == 0)) return ref;
  std::vector<array> inputs = {q, k, v};
  if (mask && !causal) {
    auto shape = q.shape();
    shape.back() = k.shape(-2);
    inputs.push_back(mx::broadcast_to(*mask, shape, s));
  }
  auto shape = q.shape();
  shape.back() = v.shape(-1);
  std::shared_ptr<mx::Primitive> kernel;
  if (decode) {
    kernel = std::make_shared<DecodeAttention>(s, scale, causal);
  } else {
    kernel = std::make_shared<PrefillAttention>(s, scale, causal);
  }
  return array(shape, t, std::move(kernel), inputs);
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
