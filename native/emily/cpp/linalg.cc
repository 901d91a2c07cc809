// Products composed from MLX ops (see linalg.h).
#include "linalg.h"

#include "addmm.h"
#include "cuda_kernels.h"
#include "gemv.h"

#include <algorithm>
#include <optional>
#include <sstream>
#include <stdexcept>

namespace emily {
namespace mx = mlx::core;

namespace {

std::string axes_str(const std::vector<int>& v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); i++) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

// Normalizes negative axes and rejects out-of-range or repeated ones.
std::vector<int> normalize(const std::vector<int>& axes, int ndim, const char* what) {
  std::vector<int> out;
  std::vector<bool> seen(ndim, false);
  for (int ax : axes) {
    int n = ax < 0 ? ax + ndim : ax;
    if (n < 0 || n >= ndim || seen[n]) {
      throw std::invalid_argument(std::string("[dot] invalid ") + what + " axes " + axes_str(axes) +
                                  " for an array of rank " + std::to_string(ndim));
    }
    seen[n] = true;
    out.push_back(n);
  }
  return out;
}

std::vector<int> free_axes(int ndim, const std::vector<int>& x, const std::vector<int>& y) {
  std::vector<bool> used(ndim, false);
  for (int ax : x) used[ax] = true;
  for (int ax : y) used[ax] = true;
  std::vector<int> out;
  for (int i = 0; i < ndim; i++)
    if (!used[i]) out.push_back(i);
  return out;
}

int dims_product(const array& a, const std::vector<int>& axes) {
  int64_t n = 1;
  for (int ax : axes) n *= a.shape(ax);
  return static_cast<int>(n);
}

// Above this many elements in a (B, M, k, N) product, the integer path sums over the
// contraction in chunks so that memory stays bounded.
constexpr int64_t kIntChunkElems = int64_t(1) << 24;

array int_bmm(const array& a, const array& b, const Stream& s) {
  // a: (B, M, K), b: (B, K, N)
  int64_t bmn = int64_t(a.shape(0)) * a.shape(1) * b.shape(2);
  int k = a.shape(2);
  int64_t chunk = std::max<int64_t>(1, kIntChunkElems / std::max<int64_t>(1, bmn));
  auto partial = [&](int k0, int k1) {
    auto as = mx::slice(a, {0, 0, k0}, {a.shape(0), a.shape(1), k1}, s);
    auto bs = mx::slice(b, {0, k0, 0}, {b.shape(0), k1, b.shape(2)}, s);
    auto prod = mx::multiply(mx::expand_dims(as, 3, s), mx::expand_dims(bs, 1, s), s);
    return mx::sum(prod, 2, false, s);
  };
  if (k <= chunk) return partial(0, k);
  std::optional<array> acc;
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    auto p = partial(static_cast<int>(k0), static_cast<int>(std::min<int64_t>(k, k0 + chunk)));
    acc = acc ? mx::add(*acc, p, s) : p;
  }
  return *acc;
}

// MLX's transpose makes a node even for the identity permutation.
array transpose_if_moved(const array& a, const std::vector<int>& perm, const Stream& s) {
  for (size_t i = 0; i < perm.size(); i++)
    if (perm[i] != static_cast<int>(i)) return mx::transpose(a, perm, s);
  return a;
}

// MLX's CPU matmul of bf16 and f16 has no BLAS: one thread at a few GFLOP/s (a 128-token
// prefill of a 0.6B-parameter model in bf16 took 25 s). Their products on a CPU go through
// f32 (OpenBLAS) instead, rounded once to the type, as MLX's half products round their f32
// sums; the operands' f32 copies are transient.
bool half_on_cpu(mx::Dtype type, const Stream& s) {
  return s.device == mx::Device::cpu && (type == mx::bfloat16 || type == mx::float16);
}

// Whether the floating product of x (M, K) and b (K, N) is MLX's matmul (BLAS on a CPU,
// cuBLAS on a GPU): not a decoding step's rows through Emily's kernels, nor a half type
// on a CPU through f32. dot_general's choice, and where `dense` can add its bias inside.
bool blas_product(const array& x, const array& b, const Stream& s) {
  return !row_gemv_applies(x, b, s) && !cuda_gemv_applies(x, b, s) && !half_on_cpu(x.dtype(), s);
}

array via_f32(const array& a, const array& b, mx::Dtype type, const Stream& s) {
  return mx::astype(mx::matmul(mx::astype(a, mx::float32, s), mx::astype(b, mx::float32, s), s), type, s);
}

}  // namespace

array dot_general(const array& a, const std::vector<int>& contract_a, const std::vector<int>& batch_a,
                  const array& b, const std::vector<int>& contract_b, const std::vector<int>& batch_b,
                  const Stream& s) {
  auto ca = normalize(contract_a, a.ndim(), "contraction");
  auto ba = normalize(batch_a, a.ndim(), "batch");
  auto cb = normalize(contract_b, b.ndim(), "contraction");
  auto bb = normalize(batch_b, b.ndim(), "batch");
  if (ca.size() != cb.size() || ba.size() != bb.size()) {
    throw std::invalid_argument("[dot] contraction axes " + axes_str(contract_a) + " / " +
                                axes_str(contract_b) + " and batch axes " + axes_str(batch_a) + " / " +
                                axes_str(batch_b) + " must pair up");
  }
  for (size_t i = 0; i < ca.size(); i++) {
    if (a.shape(ca[i]) != b.shape(cb[i])) {
      throw std::invalid_argument("[dot] contraction axis " + std::to_string(ca[i]) + " of size " +
                                  std::to_string(a.shape(ca[i])) + " does not match axis " +
                                  std::to_string(cb[i]) + " of size " + std::to_string(b.shape(cb[i])));
    }
  }
  for (size_t i = 0; i < ba.size(); i++) {
    if (a.shape(ba[i]) != b.shape(bb[i])) {
      throw std::invalid_argument("[dot] batch axis " + std::to_string(ba[i]) + " of size " +
                                  std::to_string(a.shape(ba[i])) + " does not match axis " +
                                  std::to_string(bb[i]) + " of size " + std::to_string(b.shape(bb[i])));
    }
  }
  for (int ax : ca)
    for (int bx : ba)
      if (ax == bx) throw std::invalid_argument("[dot] an axis of a is both contracted and batched");
  for (int ax : cb)
    for (int bx : bb)
      if (ax == bx) throw std::invalid_argument("[dot] an axis of b is both contracted and batched");

  auto fa = free_axes(a.ndim(), ca, ba);
  auto fb = free_axes(b.ndim(), cb, bb);

  std::vector<int> perm_a(ba);
  perm_a.insert(perm_a.end(), fa.begin(), fa.end());
  perm_a.insert(perm_a.end(), ca.begin(), ca.end());
  std::vector<int> perm_b(bb);
  perm_b.insert(perm_b.end(), cb.begin(), cb.end());
  perm_b.insert(perm_b.end(), fb.begin(), fb.end());

  auto type = mx::promote_types(a.dtype(), b.dtype());
  bool inexact = mx::issubdtype(type, mx::inexact);

  // Floating products keep the batch axes as they are, for matmul to broadcast over; the
  // integer path wants one batch axis. Every step is skipped where it would not change
  // the array, so that the common products (x·W, batched q·kᵀ) are one matmul node: each
  // node costs a hand-off to the stream's thread when the graph is evaluated.
  mx::Shape batch;
  if (inexact) {
    for (int ax : ba) batch.push_back(a.shape(ax));
  } else {
    batch.push_back(dims_product(a, ba));
  }
  int m = dims_product(a, fa), k = dims_product(a, ca), n = dims_product(b, fb);
  mx::Shape shape_a(batch), shape_b(batch);
  shape_a.insert(shape_a.end(), {m, k});
  shape_b.insert(shape_b.end(), {k, n});
  // One row that Emily's CUDA kernel multiplies goes to it as it is shaped: a decoding
  // step's x (B, 1, K) and result (B, 1, N) would be two more nodes as a matrix.
  // (cuda_gemv_applies takes floating types only.)
  if (batch.empty() && m == 1 && ca.size() == 1 && ca[0] == static_cast<int>(a.ndim()) - 1 && b.ndim() == 2 &&
      cb[0] == 0 && cuda_gemv_applies(a, b, s))
    return cuda_gemv(a, b, s);
  auto at = mx::reshape(transpose_if_moved(a, perm_a, s), shape_a, s);
  auto bt = mx::reshape(transpose_if_moved(b, perm_b, s), shape_b, s);

  // MLX sums small integers into a wider type; the cast back keeps Nx's result type, and
  // the wrapped result is the same since products and sums wrap modulo the same 2^n.
  auto out = !inexact                          ? mx::astype(int_bmm(at, bt, s), type, s)
             : batch.empty() && row_gemv_applies(at, bt, s) ? row_gemv(at, bt, s)
             : batch.empty() && cuda_gemv_applies(at, bt, s) ? cuda_gemv(at, bt, s)
             : half_on_cpu(type, s)                         ? via_f32(at, bt, type, s)
                                                          : mx::matmul(at, bt, s);

  mx::Shape shape;
  for (int ax : ba) shape.push_back(a.shape(ax));
  for (int ax : fa) shape.push_back(a.shape(ax));
  for (int ax : fb) shape.push_back(b.shape(ax));
  return mx::reshape(out, shape, s);
}

// The products of one x by several weights, each as dot_general computes it. Where a
// decoding step's rows go through Emily's kernels, all of them are one node (the host
// builds and a GPU launches one kernel instead of one per weight, and a CPU wakes its
// helpers once); elsewhere they are the products dot_general makes.
std::vector<array> dots(const array& x, int axis, const std::vector<array>& ws, const Stream& s) {
  auto each = [&] {
    std::vector<array> out;
    for (const auto& w : ws) out.push_back(dot_general(x, {axis}, {}, w, {0}, {}, s));
    return out;
  };
  int last = static_cast<int>(x.ndim()) - 1;
  if (x.ndim() < 1 || (axis != last && axis != -1) || x.shape(-1) == 0) return each();
  for (const auto& w : ws)
    if (w.ndim() != 2 || w.shape(0) != x.shape(-1) || w.dtype() != x.dtype()) return each();
  int k = x.shape(-1);
  auto all = [&](const array& rows, auto applies) {
    return std::all_of(ws.begin(), ws.end(), [&](const array& w) { return applies(rows, w, s); });
  };
  // (One row goes to the CUDA kernel as it is shaped, as in dot_general.)
  if (x.size() == static_cast<size_t>(k) && all(x, cuda_gemv_applies)) return cuda_gemvs(x, ws, s);
  auto x2 = mx::reshape(x, {static_cast<int>(x.size() / k), k}, s);
  std::vector<array> out;
  if (all(x2, row_gemv_applies)) {
    out = row_gemvs(x2, ws, s);
  } else if (all(x2, cuda_gemv_applies)) {
    out = cuda_gemvs(x2, ws, s);
  } else {
    return each();
  }
  for (auto& o : out) {
    mx::Shape shape(x.shape().begin(), x.shape().end() - 1);
    shape.push_back(o.shape(1));
    o = mx::reshape(o, shape, s);
  }
  return out;
}

// Axon's dense layer on x's last axis: where MLX would multiply the rows as a matrix
// product, one addmm, in which BLAS adds the product to the bias it was given as output
// (the separate sum is another pass over the result, and another kernel on a GPU); on a
// CPU in f32, Emily's (addmm.h). Elsewhere (no rows, a decoding step's rows through
// Emily's kernels, half types on a CPU through f32) the product and the sum as the graph
// has them.
array dense(const array& x, const array& w, const array& bias, const Stream& s) {
  if (x.ndim() < 1 || w.ndim() != 2 || bias.ndim() != 1 || x.shape(-1) != w.shape(0) || bias.shape(0) != w.shape(1) ||
      x.dtype() != w.dtype() || bias.dtype() != w.dtype() || !mx::issubdtype(w.dtype(), mx::floating)) {
    throw std::invalid_argument(
        "[dense] want x (..., K), a weight (K, N) and a bias (N), of one floating type");
  }
  auto unfused = [&] { return mx::add(dot_general(x, {static_cast<int>(x.ndim()) - 1}, {}, w, {0}, {}, s), bias, s); };
  if (x.size() == 0) return unfused();
  int k = w.shape(0), n = w.shape(1);
  auto rows = mx::reshape(x, {static_cast<int>(x.size() / k), k}, s);
  if (!blas_product(rows, w, s)) return unfused();
  mx::Shape shape = x.shape();
  shape.back() = n;
  return mx::reshape(add_bias_mm(bias, rows, w, s), shape, s);
}

}  // namespace emily
