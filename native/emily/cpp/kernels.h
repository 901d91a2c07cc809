// Emily's own CPU kernels for MLX ops whose x86-64 Linux build is slow (see kernels.cc).
// Each computes exactly what the MLX op computes, bit for bit; where a kernel does not
// apply (another device or dtype, a CPU without AVX2 and FMA) it is the MLX op itself.
#pragma once

#include <vector>

#include "emily.h"

namespace emily::kernels {

// Whether this CPU runs the vector kernels: x86-64 with AVX2 and FMA.
bool vector_cpu();

// mx::exp, mx::erf and mx::sigmoid.
array exp(const array& a, const Stream& s);
array erf(const array& a, const Stream& s);
array sigmoid(const array& a, const Stream& s);

// ((erf(x / c) + 1) * x) / 2, as those five MLX ops compute it in x's type (Axon's gelu,
// c = sqrt(2)): on a CPU, f32 in one pass over x; on a GPU, MLX's compiled form of the
// same ops (one fused kernel, not five).
array gelu_erf(const array& x, float c, const Stream& s);

// sigmoid(x) * x, times `by` where given (Axon's silu; a gated unit's silu(gate) * up,
// `by` of x's shape and type), as those MLX ops compute it in x's type. On a CPU, f32 and
// bf16 in one pass; on a GPU, MLX's compiled form of the same ops (one fused kernel, not
// three).
array silu(const array& x, const std::optional<array>& by, const Stream& s);

// mx::fast::layer_norm and mx::fast::rms_norm, which on a CPU stream MLX computes as a
// composition of ops: in f32, that composition in one kernel (norm.cc).
array layer_norm(const array& x, const std::optional<array>& weight, const std::optional<array>& bias, float eps,
                 const Stream& s);
array rms_norm(const array& x, const std::optional<array>& weight, float eps, const Stream& s);

// mx::contiguous(a, false, s) for an evaluated array: on a CPU, the transpose of a
// row-major matrix (a 2-D view with strides (1, rows)) copied in tiles over the pool
// (transpose.cc). Any other array, and other devices, MLX's copy.
array contiguous(const array& a, const Stream& s);

// mx::softmax.
array softmax(const array& a, const std::vector<int>& axes, bool precise, const Stream& s);

// mx::fast::scaled_dot_product_attention without sinks on a CPU stream, which MLX
// computes as a composition of ops around a softmax: the same composition with `softmax`
// above. On MLX's CUDA backend a decoding step with an array mask is `cuda_attention`
// (cuda_kernels.h). Any other call is MLX's.
array attention(const array& q, const array& k, const array& v, float scale, const std::string& mask_mode,
                const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s);

}  // namespace emily::kernels
