// A vector-matrix product on the CPU, reading the matrix once.
//
// MLX's CPU matmul hands every product to sgemm. For a single row (each dense layer of a
// decoding step: x is one token's hidden state) OpenBLAS's sgemm first packs the whole
// matrix into its panel layout, reading and writing every weight once more than the
// product needs: 3.4x the time of sgemv on a 1024 x 3072 f32 weight (bench/models.exs
// measures it per decoded token). Such a product is bound by the memory's bandwidth,
// which one core does not reach: on x86-64 with AVX2 and FMA it runs as Emily's own
// kernel, split over the cores (cpp/pool.h) by output columns, each column summed in
// order over the rows; elsewhere as BLAS's gemv. Only Linux takes this path (Accelerate's
// sgemm has no such cost).
#include "gemv.h"

#if defined(__linux__)
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
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

#if EMILY_GEMV_KERNEL

// Weights are f32 or bf16 (vector.h's loads); x and the sums are f32.
using kernels::vec::load1;
using kernels::vec::load8;
using kernels::vec::to_bf16;

// y[j0, j1) of x (k) times b (k, n), row i of b at b + i * ldb: four rows at a time, each
// output summed over the rows in order.
template <typename W>
EMILY_VECTOR void rows_part(const float* x, const W* b, int64_t ldb, float* y, int k, int j0, int j1) {
  int j = j0;
  for (; j + 8 <= j1; j += 8) _mm256_storeu_ps(y + j, _mm256_setzero_ps());
  for (; j < j1; j++) y[j] = 0.0f;
  int i = 0;
  for (; i + 4 <= k; i += 4) {
    const W *b0 = b + i * ldb, *b1 = b0 + ldb, *b2 = b1 + ldb, *b3 = b2 + ldb;
    __m256 x0 = _mm256_set1_ps(x[i]), x1 = _mm256_set1_ps(x[i + 1]);
    __m256 x2 = _mm256_set1_ps(x[i + 2]), x3 = _mm256_set1_ps(x[i + 3]);
    for (j = j0; j + 8 <= j1; j += 8) {
      __m256 acc = _mm256_loadu_ps(y + j);
      acc = _mm256_fmadd_ps(x0, load8(b0 + j), acc);
      acc = _mm256_fmadd_ps(x1, load8(b1 + j), acc);
      acc = _mm256_fmadd_ps(x2, load8(b2 + j), acc);
      acc = _mm256_fmadd_ps(x3, load8(b3 + j), acc);
      _mm256_storeu_ps(y + j, acc);
    }
    for (; j < j1; j++) {
      float acc = std::fma(x[i], load1(b0 + j), y[j]);
      acc = std::fma(x[i + 1], load1(b1 + j), acc);
      acc = std::fma(x[i + 2], load1(b2 + j), acc);
      y[j] = std::fma(x[i + 3], load1(b3 + j), acc);
    }
  }
  for (; i < k; i++) {
    const W* bi = b + i * ldb;
    __m256 xi = _mm256_set1_ps(x[i]);
    for (j = j0; j + 8 <= j1; j += 8) {
      _mm256_storeu_ps(y + j, _mm256_fmadd_ps(xi, load8(bi + j), _mm256_loadu_ps(y + j)));
    }
    for (; j < j1; j++) y[j] = std::fma(x[i], load1(bi + j), y[j]);
  }
}

// y[j0, j1) of x (k) times b (k, n) stored by columns, column j at b + j * ldb (the
// transpose of a row-major (n, k) weight): each output a dot product over k.
template <typename W>
EMILY_VECTOR void cols_part(const float* x, const W* b, int64_t ldb, float* y, int k, int j0, int j1) {
  for (int j = j0; j < j1; j++) {
    const W* c = b + j * ldb;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= k; i += 32) {
      a0 = _mm256_fmadd_ps(load8(c + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load8(c + i + 8), _mm256_loadu_ps(x + i + 8), a1);
      a2 = _mm256_fmadd_ps(load8(c + i + 16), _mm256_loadu_ps(x + i + 16), a2);
      a3 = _mm256_fmadd_ps(load8(c + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(load8(c + i), _mm256_loadu_ps(x + i), a0);
    float sum = kernels::vec::sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; i++) sum = std::fma(load1(c + i), x[i], sum);
    y[j] = sum;
  }
}

// Splits the n outputs over the pool in chunks of at least 64K weights: for a matrix read
// by rows, of at least 512 columns (each row's share long enough to stream), and for one
// read by columns, whole columns; both whole cache lines of y. A small matrix is one chunk.
void split(int k, int n, bool by_rows, const std::function<void(int, int)>& part) {
  int64_t columns = std::max<int64_t>(by_rows ? 512 : 64, ((65536 / std::max(k, 1)) + 63) / 64 * 64);
  int chunks = emily::pool::parts() == 1 ? 1 : static_cast<int>((n + columns - 1) / columns);
  emily::pool::run(chunks, [&](int c) {
    int64_t from = c * columns, to = chunks == 1 ? n : std::min<int64_t>(n, from + columns);
    part(static_cast<int>(from), static_cast<int>(to));
  });
}
#endif

// x (1, K) times b (K, N), f32 or (where the kernel runs) bf16.
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
    // broadcast, a strided slice) is read element by element.
    const Layout layout{k, n, sk, sn, sn == 1 && sk >= n, sk == 1 && sn >= k};
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(b);
    encoder.set_output_array(out);
#if EMILY_GEMV_KERNEL
    if (x.dtype() == mx::bfloat16) {
      encoder.dispatch([xp = x.data<uint16_t>(), incx = x.strides(1), bp = b.data<uint16_t>(),
                        yp = out.data<uint16_t>(), layout]() { bf16(xp, incx, bp, yp, layout); });
      return;
    }
#endif
    encoder.dispatch([xp = x.data<float>(), incx = x.strides(1), bp = b.data<float>(), yp = out.data<float>(),
                      layout]() { f32(xp, incx, bp, yp, layout); });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[dot] the CPU gemv product has no GPU kernel");
  }

  const char* name() const override { return "EmilyRowGemv"; }

  bool is_equivalent(const mx::Primitive& other) const override { return typeid(other) == typeid(*this); }

  std::vector<mx::Shape> output_shapes(const std::vector<array>& inputs) override {
    return {{1, inputs[1].shape(1)}};
  }

 private:
  struct Layout {
    int k, n;
    int64_t sk, sn;
    bool rows, cols;
  };

  static void f32(const float* xp, int64_t incx, const float* bp, float* yp, const Layout& l) {
    const int k = l.k, n = l.n;
    std::vector<float> xs;
    if (incx != 1) {
      // (A broadcast row has stride 0, which BLAS does not take.)
      xs.resize(k);
      for (int i = 0; i < k; i++) xs[i] = xp[i * incx];
      xp = xs.data();
    }
#if EMILY_GEMV_KERNEL
    if ((l.rows || l.cols) && kernels::vector_cpu()) {
      auto part = l.rows ? rows_part<float> : cols_part<float>;
      split(k, n, l.rows, [&](int j0, int j1) { part(xp, bp, l.rows ? l.sk : l.sn, yp, k, j0, j1); });
      return;
    }
#endif
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
  // bf16 operands (MLX's CPU bf16 matmul, which has no BLAS, runs on one thread at a few
  // GFLOP/s): x widened to f32, the sums in f32 and rounded to bf16 at the end, as MLX's
  // own bf16 products round.
  static void bf16(const uint16_t* xp, int64_t incx, const uint16_t* bp, uint16_t* yp, const Layout& l) {
    const int k = l.k, n = l.n;
    std::vector<float> xs(k), ys(n);
    for (int i = 0; i < k; i++) xs[i] = load1(xp + i * incx);
    if (l.rows || l.cols) {
      auto part = l.rows ? rows_part<uint16_t> : cols_part<uint16_t>;
      split(k, n, l.rows, [&](int j0, int j1) { part(xs.data(), bp, l.rows ? l.sk : l.sn, ys.data(), k, j0, j1); });
    } else {
      for (int j = 0; j < n; j++) {
        float sum = 0.0f;
        for (int i = 0; i < k; i++) sum = std::fma(xs[i], load1(bp + i * l.sk + j * l.sn), sum);
        ys[j] = sum;
      }
    }
    for (int j = 0; j < n; j++) yp[j] = to_bf16(ys[j]);
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

array row_gemv(const array& x, const array& b, const Stream& s) {
  return array({1, b.shape(1)}, x.dtype(), std::make_shared<RowGemv>(s), {x, b});
}
#else
bool row_gemv_applies(const array&, const array&, const Stream&) { return false; }
array row_gemv(const array& x, const array& b, const Stream& s) { return mx::matmul(x, b, s); }
#endif

}  // namespace emily
