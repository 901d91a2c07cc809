// A decoding step's attention on MLX's CUDA backend when it carries an array mask.
//
// MLX's fused attention kernels on CUDA take no array mask for a decoding step (its
// vector kernel takes none or causal; cuDNN's decoding path none), and Bumblebee masks
// the unfilled tail of its fixed-length key/value cache with one. MLX then computes the
// composition of mlx/fast.cpp: a scale, q·kᵀ and ·v through cuBLAS (each a captured
// graph of its own), the mask, softmax, and copies of the cache, which reaches the
// products transposed ([B, L, heads, D] read as [B, heads, L, D]): about ten kernel
// nodes a layer. This kernel is one, shaped as MLX's own vector kernel: a block of 32
// warps per (batch, head, query row). Each warp takes every 32nd key, its lanes holding
// consecutive elements of the head, and keeps a running softmax over its keys (the
// largest score, the sum of exponentials and the weighted values, in f32); the block
// then rescales the warps' parts to the row's largest score and sums them. q, k, v and
// the mask are read through their strides (the mask's as broadcast to the scores, so
// that no layer needs a broadcast node of its own), grouped-query heads read their
// key/value head in place, and the mask applies as the composition applies it (false:
// f32's lowest value; additive: added).
#include <algorithm>
#include <bit>
#include <cstdint>

#include "cuda_kernels.h"

#include <mlx/backend/cuda/cuda.h>

#include "cuda_launch.h"

namespace emily {
namespace mx = mlx::core;

namespace {

constexpr int kMaxRows = 8;
constexpr int kMaxHead = 256;
constexpr int kWarps = 32;

// T: the operands' type, MaskT the mask's. MASK: 1 a bool mask, 2 an additive one.
// SCALE: the scale's f32 bits. HEAD: the larger head size (q·k's or v's) rounded up to
// the warp's 32 lanes. WARPS: the block's warps. The shapes and strides are the arrays'
// own (the cache is read where it lies).
constexpr const char* kSource = R"(
#define NEG_INF __int_as_float(0xff800000)
extern "C" __global__ void __launch_bounds__(WARPS * 32) emily_decode_attention(
    const T* q, const T* k, const T* v, const MaskT* mask, T* out,
    int q1, int q2, int q3, int k1, int k2, int v3,
    long long qs0, long long qs1, long long qs2, long long qs3,
    long long ks0, long long ks1, long long ks2, long long ks3,
    long long vs0, long long vs1, long long vs2, long long vs3,
    long long ms0, long long ms1, long long ms2, long long ms3) {
  constexpr int E = HEAD / 32;  // a lane's elements of the head
  __shared__ float parts[WARPS][HEAD];
  __shared__ float maxes[WARPS], sums[WARPS];
  const int Hq = q1, Lq = q2, D = q3, Hkv = k1, Lk = k2, Dv = v3;
  const int row = blockIdx.x;
  const int i = row % Lq, h = (row / Lq) % Hq, b = row / (Lq * Hq);
  const int hk = h / (Hq / Hkv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int d0 = lane * E;
  const float scale = __int_as_float(SCALE);

  float qv[E], acc[E];
  const T* qp = q + b * qs0 + h * qs1 + i * qs2;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    qv[e] = d0 + e < D ? to_float(qp[(d0 + e) * qs3]) * scale : 0.f;
    acc[e] = 0.f;
  }

  // The warp's running softmax. A score of -inf adds nothing, and while every score so
  // far is -inf nothing is rescaled, so a row whose scores are all -inf ends with a zero
  // sum and gives NaN, as the composition's softmax does.
  float m = NEG_INF, sum = 0.f;
  const T* kb = k + b * ks0 + hk * ks1;
  const T* vb = v + b * vs0 + hk * vs1;
  const MaskT* mb = mask + b * ms0 + h * ms1 + i * ms2;
  for (int j = warp; j < Lk; j += WARPS) {
    const T* kp = kb + j * ks2;
    const T* vp = vb + j * vs2;
    float kv[E], vv[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kv[e] = d0 + e < D ? to_float(kp[(d0 + e) * ks3]) : 0.f;
      vv[e] = d0 + e < Dv ? to_float(vp[(d0 + e) * vs3]) : 0.f;
    }
    const MaskT mj = mb[j * ms3];
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) s += qv[e] * kv[e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
#if MASK == 1
    if (!mj) s = -3.40282347e+38f;
#else
    s += to_float(mj);
#endif
    const float mn = fmaxf(m, s);
    const float c = m == mn ? 1.f : expf(m - mn);
    const float p = s == NEG_INF ? 0.f : expf(s - mn);
    sum = sum * c + p;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = acc[e] * c + p * vv[e];
    m = mn;
  }

#pragma unroll
  for (int e = 0; e < E; ++e) parts[warp][d0 + e] = acc[e];
  if (lane == 0) {
    maxes[warp] = m;
    sums[warp] = sum;
  }
  __syncthreads();

  // A warp that saw no key holds -inf, 0 and zeros: its factor is 0.
  const int d = threadIdx.x;
  if (d >= Dv) return;
  float top = NEG_INF;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, maxes[w]);
  float total = 0.f, o = 0.f;
  for (int w = 0; w < WARPS; ++w) {
    const float f = expf(maxes[w] - top);
    total += sums[w] * f;
    o += parts[w][d] * f;
  }
  out[((size_t)(b * Hq + h) * Lq + i) * Dv + d] = from_float<T>(o / total);
}
)";

cuda::Kernel attention_kernel(mx::Dtype t, mx::Dtype mask, float scale, int head, unsigned blocks) {
  auto num = [](auto v) { return std::to_string(v); };
  std::string src = cuda::kTypes;
  src += "using T = " + std::string(cuda::type_name(t)) + ";\nusing MaskT = " + cuda::type_name(mask) + ";\n";
  src += "#define MASK " + num(mask == mx::bool_ ? 1 : 2) + "\n#define SCALE " + num(std::bit_cast<int>(scale)) +
         "\n#define HEAD " + num(head) + "\n#define WARPS " + num(kWarps) + "\n";
  src += kSource;
  using P = cuda::Param;
  std::vector<P> params{{P::Input, 0}, {P::Input, 1}, {P::Input, 2}, {P::Input, 3}, {P::Output, 0},
                        {P::Dim, 0, 1},  {P::Dim, 0, 2},  {P::Dim, 0, 3},  {P::Dim, 1, 1},  {P::Dim, 1, 2},
                        {P::Dim, 2, 3}};
  for (int in = 0; in < 3; in++)
    for (int axis = 0; axis < 4; axis++) params.push_back({P::Stride, in, axis});
  // The mask as broadcast to the scores' shape, read where it lies (no broadcast node).
  for (int axis = 0; axis < 4; axis++) params.push_back({P::BroadcastStride, 3, axis, 4});
  return {"emily_decode_attention", std::move(src), std::move(params), {blocks, 1, 1}, {kWarps * 32, 1, 1}};
}

bool floating(mx::Dtype t) { return t == mx::float32 || t == mx::bfloat16 || t == mx::float16; }

}  // namespace

bool cuda_attention_applies(const array& q, const array& k, const array& v, const std::string& mask_mode,
                            const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s) {
  static const bool cuda = mx::cu::is_available();
  if (!cuda || s.device != mx::Device::gpu || !cuda::available() || sinks || !mask || mask_mode == "causal") return false;
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || mask->ndim() > 4) return false;
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || !floating(q.dtype())) return false;
  if (mask->dtype() != mx::bool_ && !floating(mask->dtype())) return false;
  int rows = q.shape(2), head = q.shape(3), keys = k.shape(2), q_heads = q.shape(1), kv_heads = k.shape(1);
  // The kernel reads the mask as broadcast to the scores [B, heads, rows, keys]: each of
  // its axes (aligned at the end) must be 1 or the scores'.
  int scores[4] = {q.shape(0), q_heads, rows, keys};
  for (int i = 0; i < static_cast<int>(mask->ndim()); i++) {
    int dim = mask->shape(i), want = scores[4 - mask->ndim() + i];
    if (dim != 1 && dim != want) return false;
  }
  return rows >= 1 && rows <= kMaxRows && head >= 1 && head <= kMaxHead && v.shape(3) >= 1 &&
         v.shape(3) <= kMaxHead && keys >= 1 && kv_heads >= 1 && q_heads % kv_heads == 0;
}

array cuda_attention(const array& q, const array& k, const array& v, float scale, const array& mask,
                     const Stream& s) {
  auto out = q.shape();
  out.back() = v.shape(3);
  unsigned blocks = q.shape(0) * q.shape(1) * q.shape(2);
  int head = (std::max(q.shape(3), v.shape(3)) + 31) / 32 * 32;
  auto num = [](auto x) { return std::to_string(x); };
  std::string key = "attention " + num(static_cast<int>(q.dtype().val())) + " " +
                    num(static_cast<int>(mask.dtype().val())) + " " + num(std::bit_cast<int>(scale)) + " " +
                    num(head) + " " + num(blocks);
  auto& kernel = cuda::instance(key, [&] { return attention_kernel(q.dtype(), mask.dtype(), scale, head, blocks); });
  return cuda::launch(kernel, {q, k, v, mask}, {out}, {q.dtype()}, s)[0];
}

}  // namespace emily
