// A vector-matrix product on the CPU, reading the matrix once.
//
// MLX's CPU matmul hands every product to sgemm. For a single row (each dense layer of a
// decoding step: x is one token's hidden state) OpenBLAS's sgemm first packs the whole
// matrix into its panel layout, reading and writing every weight once more than the
// product needs: 3.4x the time of sgemv on a 1024 x 3072 f32 weight (bench/models.exs
// measures it per decoded token). Such a product is bound by the memory's bandwidth,
// which one core does not reach: on x86-64 with AVX2 and FMA it runs as Emily's own
// kernel, split over the cores (cpp/pool.h) in blocks of whole rows or columns (see
// `chunks`); elsewhere as BLAS's gemv. Only Linux takes this path (Accelerate's
// sgemm has no such cost).
#include "gemv.h"

#if defined(__linux__)
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <typeinfo>
#include <vector>

#include "kernels.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#endif
#if defined(__linux__) && defined(__x86_64__)
#include "vector.h"
#define EMILY_GEMV_KERNEL 1
#endif

namespace emily {
namespace mx = mlx::core;

#if defined(__linux__)
namespace {

// A weight's shape and strides, and whether the kernel reads it by rows or by columns
// (RowGemv::eval_cpu).
struct Layout {
  int k, n;
  int64_t sk, sn;
  bool rows, cols;
};

#if EMILY_GEMV_KERNEL

// Weights are f32 or bf16 (vector.h's loads); x and the sums are f32.
using kernels::vec::load1;
using kernels::vec::load8;
using kernels::vec::to_bf16;

// Whether a core reads one stream of a weight at a time (AMD's) or several (Intel's): each
// output sums its products in the same order either way, so the two give the same bits.
// On a 2-core Zen 4 EPYC, Qwen3-0.6B's decode products (its layers by rows, its tied LM
// head by columns) took 38-42 ms a pass in bf16 one row or column at a time against
// 65-68 ms four at a time, and 66-80 against 75-87 ms in f32; on a 2-core Xeon, four
// columns at a time read the f32 LM head 1.2x faster than one.
bool one_stream() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

// y[0, n) of x (k) times b (k, n), row i of b at b + i * ldb: R rows at a time (R = 4 or
// 1), each output summed over the rows in order.
template <int R, typename W>
EMILY_VECTOR void rows_part(const float* x, const W* b, int64_t ldb, float* y, int k, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_setzero_ps());
  for (; j < n; j++) y[j] = 0.0f;
  int i = 0;
  for (; R == 4 && i + 4 <= k; i += 4) {
    const W *b0 = b + i * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
    __m256 x0 = _mm256_set1_ps(x[i]), x1 = _mm256_set1_ps(x[i + 1]);
    __m256 x2 = _mm256_set1_ps(x[i + 2]), x3 = _mm256_set1_ps(x[i + 3]);
    for (j = 0; j + 8 <= n; j += 8) {
      __m256 acc = _mm256_loadu_ps(y + j);
      acc = _mm256_fmadd_ps(x0, load8(b0 + j), acc);
      acc = _mm256_fmadd_ps(x1, load8(b1 + j), acc);
      acc = _mm256_fmadd_ps(x2, load8(b2 + j), acc);
      acc = _mm256_fmadd_ps(x3, load8(b3 + j), acc);
      _mm256_storeu_ps(y + j, acc);
    }
    for (; j < n; j++) {
      float acc = std::fma(x[i], load1(b0 + j), y[j]);
      acc = std::fma(x[i + 1], load1(b1 + j), acc);
      acc = std::fma(x[i + 2], load1(b2 + j), acc);
      y[j] = std::fma(x[i + 3], load1(b3 + j), acc);
    }
  }
  for (; i < k; i++) {
    const W* bi = b + i * ldb;
    __m256 xi = _mm256_set1_ps(x[i]);
    for (j = 0; j + 8 <= n; j += 8) {
      _mm256_storeu_ps(y + j, _mm256_fmadd_ps(xi, load8(bi + j), _mm256_loadu_ps(y + j)));
    }
    for (; j < n; j++) y[j] = std::fma(x[i], load1(bi + j), y[j]);
  }
}

// y[j0, j1) of x (k) times b (k, n) stored by columns, column j at b + j * ldb (the
// transpose of a row-major (n, k) weight): each output a dot product over k, in four
// accumulators of eight lanes over steps of 32. Columns go C at a time (C = 4, or 1 where
// one_stream), each summed as alone: one load of x serves C columns.
template <int C, typename W>
EMILY_VECTOR void cols_block(const float* x, const W* b, int64_t ldb, float* y, int k, int j) {
  const W* c[C];
  __m256 a[C][4];
  for (int q = 0; q < C; q++) {
    c[q] = b + (j + q) * ldb;
    for (int r = 0; r < 4; r++) a[q][r] = _mm256_setzero_ps();
  }
  int i = 0;
  for (; i + 32 <= k; i += 32) {
    for (int r = 0; r < 4; r++) {
      __m256 xv = _mm256_loadu_ps(x + i + 8 * r);
#pragma GCC unroll 8
      for (int q = 0; q < C; q++) a[q][r] = _mm256_fmadd_ps(load8(c[q] + i + 8 * r), xv, a[q][r]);
    }
  }
  for (; i + 8 <= k; i += 8) {
    __m256 xv = _mm256_loadu_ps(x + i);
    for (int q = 0; q < C; q++) a[q][0] = _mm256_fmadd_ps(load8(c[q] + i), xv, a[q][0]);
  }
  for (int q = 0; q < C; q++) {
    float sum = kernels::vec::sum8(_mm256_add_ps(_mm256_add_ps(a[q][0], a[q][1]), _mm256_add_ps(a[q][2], a[q][3])));
    for (int t = i; t < k; t++) sum = std::fma(load1(c[q] + t), x[t], sum);
    y[j + q] = sum;
  }
}

template <typename W>
EMILY_VECTOR void cols_part(const float* x, const W* b, int64_t ldb, float* y, int k, int j0, int j1) {
  int j = j0;
  const bool four = !one_stream();
  for (; four && j + 4 <= j1; j += 4) cols_block<4>(x, b, ldb, y, k, j);
  for (; j < j1; j++) cols_block<1>(x, b, ldb, y, k, j);
}

// A matrix read by rows is split into blocks of whole rows, each one stretch of memory,
// about 256K weights (1 MB of f32); one read by columns into 512K weights of whole
// columns (a tied LM head of 1024 rows: 512 columns). The cores claim the blocks of all
// of a pass's weights in turn, so a core that starts late or is interrupted takes fewer.
// Against one stretch of columns per core, 1.06x the bandwidth on two cores (Qwen3-0.6B's
// layers in f32: 30.2 against 28.4 GB/s; its LM head with 64-column blocks 30.3 GB/s,
// with 512 32.2).
constexpr int64_t kRowBlock = int64_t{1} << 18;
constexpr int64_t kColumnBlock = int64_t{1} << 19;

// One block of weight `w`: rows or columns [from, to). A block of rows past a weight's
// first sums into `partial`, an offset into the pass's scratch, added to the output in
// the blocks' order after the pass: the sums depend on the weight's shape alone, not on
// the cores or on which of them took a block.
struct Chunk {
  int w, from, to;
  int64_t partial;
};

std::vector<Chunk> chunks(const std::vector<Layout>& layouts, int64_t& scratch) {
  std::vector<Chunk> out;
  scratch = 0;
  for (int w = 0; w < static_cast<int>(layouts.size()); w++) {
    const int k = layouts[w].k, n = layouts[w].n;
    if (layouts[w].rows) {
      int64_t count = std::max<int64_t>(1, (int64_t{k} * n + kRowBlock - 1) / kRowBlock);
      int64_t rows = ((k + count - 1) / count + 3) / 4 * 4;
      for (int64_t from = 0; from < k; from += rows) {
        out.push_back({w, static_cast<int>(from), static_cast<int>(std::min<int64_t>(k, from + rows)),
                       from == 0 ? -1 : scratch});
        if (from > 0) scratch += n;
      }
    } else {
      int64_t columns = std::max<int64_t>(64, (kColumnBlock / std::max(k, 1) + 63) / 64 * 64);
      for (int64_t from = 0; from < n; from += columns)
        out.push_back({w, static_cast<int>(from), static_cast<int>(std::min<int64_t>(n, from + columns)), -1});
    }
  }
  return out;
}

// y[0, n) += p[0, n).
EMILY_VECTOR void add_to(float* y, const float* p, int n) {
  int j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(y + j, _mm256_add_ps(_mm256_loadu_ps(y + j), _mm256_loadu_ps(p + j)));
  for (; j < n; j++) y[j] += p[j];
}
#endif

// x (1, K) times each weight b_i (K, N_i), f32 or (where the kernel runs) bf16: one
// output each, the weights' columns computed in one pass over the pool.
class RowGemv : public mx::Primitive {
 public:
  explicit RowGemv(mx::Stream s) : mx::Primitive(s) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    const array& x = inputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    std::vector<Product> products;
    for (size_t i = 1; i < inputs.size(); i++) {
      const array& b = inputs[i];
      array& out = outputs[i - 1];
      const int k = b.shape(0), n = b.shape(1);
      const auto sk = b.strides(0), sn = b.strides(1);
      // b's element (i, j) at i * sk + j * sn: row-major with leading dimension sk (b
      // itself), or column-major with leading dimension sn (the transpose of a row-major
      // (N, K) weight, as Transformers-layout checkpoints give it); anything else (a
      // broadcast, a strided slice) is read element by element.
      out.set_data(mx::allocator::malloc(out.nbytes()));
      encoder.set_input_array(b);
      encoder.set_output_array(out);
      products.push_back({b.data<void>(), out.data<void>(), {k, n, sk, sn, sn == 1 && sk >= n, sk == 1 && sn >= k}});
    }
#if EMILY_GEMV_KERNEL
    if (x.dtype() == mx::bfloat16) {
      encoder.dispatch([xp = x.data<uint16_t>(), incx = x.strides(1), products = std::move(products)]() {
        bf16(xp, incx, products);
      });
      return;
    }
#endif
    encoder.dispatch([xp = x.data<float>(), incx = x.strides(1), products = std::move(products)]() {
      f32(xp, incx, products);
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[dot] the CPU gemv product has no GPU kernel");
  }

  const char* name() const override { return "EmilyRowGemv"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    std::vector<mx::Shape> shapes;
    for (size_t i = 1; i < inputs.size(); i++) shapes.push_back({1, inputs[i].shape(1)});
    return shapes;
  }

 private:
  struct Product {
    const void* b;
    void* y;
    Layout layout;
  };

  static void f32(const float* xp, int64_t incx, const std::vector<Product>& products) {
    const int k = products[0].layout.k;
    std::vector<float> xs;
    if (incx != 1) {
      // (A broadcast row has stride 0, which BLAS does not take.)
      xs.resize(k);
      for (int i = 0; i < k; i++) xs[i] = xp[i * incx];
      xp = xs.data();
    }
    auto b = [&](int w) { return static_cast<const float*>(products[w].b); };
    auto y = [&](int w) { return static_cast<float*>(products[w].y); };
#if EMILY_GEMV_KERNEL
    if (kernels::vector_cpu()) {
      std::vector<int> kernel, blas;
      for (int w = 0; w < static_cast<int>(products.size()); w++)
        (products[w].layout.rows || products[w].layout.cols ? kernel : blas).push_back(w);
      std::vector<float*> ys;
      for (int w : kernel) ys.push_back(y(w));
      each_chunk<float>(xp, products, kernel, ys);
      for (int w : blas) sgemv(xp, b(w), y(w), products[w].layout);
      return;
    }
#endif
    for (int w = 0; w < static_cast<int>(products.size()); w++) sgemv(xp, b(w), y(w), products[w].layout);
  }

  static void sgemv(const float* xp, const float* bp, float* yp, const Layout& l) {
    const int k = l.k, n = l.n;
    if (l.rows) {
      cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, bp, l.sk, xp, 1, 0.0f, yp, 1);
    } else if (l.cols) {
      cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.0f, bp, l.sn, xp, 1, 0.0f, yp, 1);
    } else {
      std::vector<float> dense(static_cast<size_t>(k) * n);
      for (int i = 0; i < k; i++)
        for (int j = 0; j < n; j++) dense[static_cast<size_t>(i) * n + j] = bp[i * l.sk + j * l.sn];
      cblas_sgemv(CblasRowMajor, CblasTrans, k, n, 1.0f, dense.data(), n, xp, 1, 0.0f, yp, 1);
    }
  }

#if EMILY_GEMV_KERNEL
  // The products `which` of x (f32, k) with weights of type W, into f32 outputs `ys` (one
  // for each of `which`): every block of them in one pool run.
  template <typename W>
  static void each_chunk(const float* x, const std::vector<Product>& products, const std::vector<int>& which,
                         const std::vector<float*>& ys) {
    if (which.empty()) return;
    std::vector<Layout> layouts;
    for (int w : which) layouts.push_back(products[w].layout);
    int64_t size = 0;
    auto list = chunks(layouts, size);
    // (The helpers write into the caller's scratch: its address, not the thread_local.)
    thread_local std::vector<float> scratch;
    if (static_cast<int64_t>(scratch.size()) < size) scratch.resize(size);
    float* partials = scratch.data();
    emily::pool::run(static_cast<int>(list.size()), [&](int c) {
      const Chunk& ch = list[c];
      const Layout& l = layouts[ch.w];
      auto b = static_cast<const W*>(products[which[ch.w]].b);
      if (l.rows) {
        float* out = ch.partial < 0 ? ys[ch.w] : partials + ch.partial;
        auto rows = one_stream() ? rows_part<1, W> : rows_part<4, W>;
        rows(x + ch.from, b + ch.from * l.sk, l.sk, out, ch.to - ch.from, l.n);
      } else {
        cols_part<W>(x, b, l.sn, ys[ch.w], l.k, ch.from, ch.to);
      }
    });
    for (const Chunk& ch : list)
      if (ch.partial >= 0) add_to(ys[ch.w], partials + ch.partial, layouts[ch.w].n);
  }

  // bf16 operands (MLX's CPU bf16 matmul, which has no BLAS, runs on one thread at a few
  // GFLOP/s): x widened to f32, the sums in f32 and rounded to bf16 at the end, as MLX's
  // own bf16 products round.
  static void bf16(const uint16_t* xp, int64_t incx, const std::vector<Product>& products) {
    const int k = products[0].layout.k;
    std::vector<float> xs(k);
    for (int i = 0; i < k; i++) xs[i] = load1(xp + i * incx);
    std::vector<std::vector<float>> ys;
    std::vector<int> kernel;
    for (int w = 0; w < static_cast<int>(products.size()); w++) {
      const Layout& l = products[w].layout;
      ys.emplace_back(l.n);
      if (l.rows || l.cols) {
        kernel.push_back(w);
        continue;
      }
      auto bp = static_cast<const uint16_t*>(products[w].b);
      for (int j = 0; j < l.n; j++) {
        float sum = 0.0f;
        for (int i = 0; i < k; i++) sum = std::fma(xs[i], load1(bp + i * l.sk + j * l.sn), sum);
        ys[w][j] = sum;
      }
    }
    std::vector<float*> outs;
    for (int w : kernel) outs.push_back(ys[w].data());
    each_chunk<uint16_t>(xs.data(), products, kernel, outs);
    for (size_t w = 0; w < products.size(); w++) {
      auto yp = static_cast<uint16_t*>(products[w].y);
      for (int j = 0; j < products[w].layout.n; j++) yp[j] = to_bf16(ys[w][j]);
    }
  }
#endif
};

}  // namespace

bool row_gemv_applies(const array& x, const array& b, const Stream& s) {
  bool shapes = x.ndim() == 2 && b.ndim() == 2 && x.shape(0) == 1 && x.shape(1) == b.shape(0) && x.shape(1) > 0 &&
                b.shape(1) > 0;
  bool f32 = x.dtype() == mx::float32 && b.dtype() == mx::float32;
#if EMILY_GEMV_KERNEL
  bool bf16 = x.dtype() == mx::bfloat16 && b.dtype() == mx::bfloat16 && kernels::vector_cpu();
#else
  bool bf16 = false;
#endif
  return s.device == mx::Device::cpu && shapes && (f32 || bf16);
}

array row_gemv(const array& x, const array& b, const Stream& s) { return row_gemvs(x, {b}, s)[0]; }

std::vector<array> row_gemvs(const array& x, const std::vector<array>& bs, const Stream& s) {
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> types;
  std::vector<array> inputs{x};
  for (const auto& b : bs) {
    shapes.push_back({1, b.shape(1)});
    types.push_back(x.dtype());
    inputs.push_back(b);
  }
  return array::make_arrays(std::move(shapes), types, std::make_shared<RowGemv>(s), inputs);
}
#else
bool row_gemv_applies(const array&, const array&, const Stream&) { return false; }
array row_gemv(const array& x, const array& b, const Stream& s) { return mx::matmul(x, b, s); }
std::vector<array> row_gemvs(const array& x, const std::vector<array>& bs, const Stream& s) {
  std::vector<array> out;
  for (const auto& b : bs) out.push_back(mx::matmul(x, b, s));
  return out;
}
#endif

}  // namespace emily
