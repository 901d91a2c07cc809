// A decoding step's attention on MLX's CUDA backend when it carries an array mask.
//
// MLX's fused attention kernels on CUDA take no array mask for a decoding step (its
// vector kernel takes none or causal; cuDNN's decoding path none), and Bumblebee masks
// the unfilled tail of its fixed-length key/value cache with one. MLX then computes the
// composition of mlx/fast.cpp: a scale, q·kᵀ and ·v through cuBLAS (each a captured
// graph of its own), the mask, softmax, and copies of the cache, which reaches the
// products transposed ([B, L, heads, D] read as [B, heads, L, D]): about ten kernel
// nodes a layer for the host to encode. This kernel is one: a block per (batch, head,
// query row) reads q, k, v and the mask through their strides, grouped-query heads
// their key/value head in place, and computes the scores, the mask as the composition
// applies it (false: f32's lowest value; additive: added), the softmax and the weighted
// sum of the values in f32.
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
constexpr int kMaxKeys = 4096;  // the scores of a row stay in shared memory
constexpr int kThreads = 128;

// T: the operands' type, MaskT the mask's. MASK: 1 a bool mask, 2 an additive one.
// SCALE: the scale's f32 bits. The shapes and strides are the arrays' own (the cache is
// read where it lies).
constexpr const char* kSource = R"(
extern "C" __global__ void emily_decode_attention(
    const T* q, const T* k, const T* v, const MaskT* mask, T* out,
    int q1, int q2, int q3, int k1, int k2, int v3,
    long long qs0, long long qs1, long long qs2, long long qs3,
    long long ks0, long long ks1, long long ks2, long long ks3,
    long long vs0, long long vs1, long long vs2, long long vs3,
    long long ms0, long long ms1, long long ms2, long long ms3) {
  const int q_shape[4] = {0, q1, q2, q3}, k_shape[4] = {0, k1, k2, 0}, v_shape[4] = {0, 0, 0, v3};
  const long long q_strides[4] = {qs0, qs1, qs2, qs3}, k_strides[4] = {ks0, ks1, ks2, ks3};
  const long long v_strides[4] = {vs0, vs1, vs2, vs3}, mask_strides[4] = {ms0, ms1, ms2, ms3};
  __shared__ float qs[MAX_HEAD];
  __shared__ float sc[MAX_KEYS];
  __shared__ float red[32];
  const int Hq = q_shape[1], Lq = q_shape[2], D = q_shape[3];
  const int Hkv = k_shape[1], Lk = k_shape[2], Dv = v_shape[3];
  const int row = blockIdx.x;
  const int i = row % Lq, h = (row / Lq) % Hq, b = row / (Lq * Hq);
  const int hk = h / (Hq / Hkv);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
  const float scale = __int_as_float(SCALE);

  const T* qp = q + b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
  for (int d = tid; d < D; d += blockDim.x) qs[d] = to_float(qp[d * q_strides[3]]) * scale;
  __syncthreads();

  // One warp per key: its lanes split the head's elements.
  const T* kb = k + b * k_strides[0] + hk * k_strides[1];
  const MaskT* mb = mask + b * mask_strides[0] + h * mask_strides[1] + i * mask_strides[2];
  for (int j = warp; j < Lk; j += warps) {
    const T* kp = kb + j * k_strides[2];
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s += qs[d] * to_float(kp[d * k_strides[3]]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) {
#if MASK == 1
      if (!mb[j * mask_strides[3]]) s = -3.40282347e+38f;
#else
      s += to_float(mb[j * mask_strides[3]]);
#endif
      sc[j] = s;
    }
  }
  __syncthreads();

  float m = __int_as_float(0xff800000);
  for (int j = tid; j < Lk; j += blockDim.x) m = fmaxf(m, sc[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < warps; ++w) m = fmaxf(m, red[w]);
  __syncthreads();

  float sum = 0.f;
  for (int j = tid; j < Lk; j += blockDim.x) {
    const float e = expf(sc[j] - m);
    sc[j] = e;
    sum += e;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
  if (lane == 0) red[warp] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < warps; ++w) sum += red[w];

  const T* vb = v + b * v_strides[0] + hk * v_strides[1];
  T* op = out + ((size_t)(b * Hq + h) * Lq + i) * Dv;
  for (int d = tid; d < Dv; d += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < Lk; ++j) acc += sc[j] * to_float(vb[j * v_strides[2] + d * v_strides[3]]);
    op[d] = from_float<T>(acc / sum);
  }
}
)";

cuda::Kernel attention_kernel(mx::Dtype t, mx::Dtype mask, float scale, unsigned blocks) {
  auto num = [](auto v) { return std::to_string(v); };
  std::string src = cuda::kTypes;
  src += "using T = " + std::string(cuda::type_name(t)) + ";\nusing MaskT = " + cuda::type_name(mask) + ";\n";
  src += "#define MASK " + num(mask == mx::bool_ ? 1 : 2) + "\n#define SCALE " + num(std::bit_cast<int>(scale)) +
         "\n#define MAX_HEAD " + num(kMaxHead) + "\n#define MAX_KEYS " + num(kMaxKeys) + "\n";
  src += kSource;
  using P = cuda::Param;
  std::vector<P> params{{P::Input, 0}, {P::Input, 1}, {P::Input, 2}, {P::Input, 3}, {P::Output, 0},
                        {P::Dim, 0, 1},  {P::Dim, 0, 2},  {P::Dim, 0, 3},  {P::Dim, 1, 1},  {P::Dim, 1, 2},
                        {P::Dim, 2, 3}};
  for (int in = 0; in < 4; in++)
    for (int axis = 0; axis < 4; axis++) params.push_back({P::Stride, in, axis});
  return {"emily_decode_attention", std::move(src), std::move(params), {blocks, 1, 1}, {kThreads, 1, 1}};
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
  return rows >= 1 && rows <= kMaxRows && head <= kMaxHead && v.shape(3) <= kMaxHead && keys >= 1 &&
         keys <= kMaxKeys && kv_heads >= 1 && q_heads % kv_heads == 0;
}

array cuda_attention(const array& q, const array& k, const array& v, float scale, const array& mask,
                     const Stream& s) {
  auto scores = q.shape();
  scores.back() = k.shape(2);
  auto out = q.shape();
  out.back() = v.shape(3);
  unsigned blocks = q.shape(0) * q.shape(1) * q.shape(2);
  std::string key = "attention " + std::to_string(static_cast<int>(q.dtype().val())) + " " + std::to_string(static_cast<int>(mask.dtype().val())) + " " +
                    std::to_string(std::bit_cast<int>(scale)) + " " + std::to_string(blocks);
  auto& kernel = cuda::instance(key, [&] { return attention_kernel(q.dtype(), mask.dtype(), scale, blocks); });
  return cuda::launch(kernel, {q, k, v, mx::broadcast_to(mask, scores, s)}, {out}, {q.dtype()}, s)[0];
}

}  // namespace emily
