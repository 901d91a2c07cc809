// Emily's kernels on MLX's CUDA backend: each is one kernel node, compiled by NVRTC at
// its first use and launched by Emily's own primitive (cuda_launch.h). Each `*_applies`
// says whether its kernel computes what the MLX call it stands for computes and can run
// here; elsewhere (a CPU stream, Metal, other shapes) that call is MLX's.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "emily.h"

namespace emily {

// `mx::matmul(x, b, s)` for x of shape (M, K) with 1 <= M <= 8, or one row of any shape
// (..., K), and b an evaluated row-contiguous (K, N), K and N nonzero, both f32, bf16 or
// f16 (cuda_gemv.cc). The result is shaped as x, its last axis N.
bool cuda_gemv_applies(const array& x, const array& b, const Stream& s);
// Summed in f32 and rounded once.
array cuda_gemv(const array& x, const array& b, const Stream& s);
// x times each of `bs`, where `cuda_gemv_applies` to each: one kernel node for up to three
// weights (a layer's query, key and value projections), each product as `cuda_gemv`'s.
std::vector<array> cuda_gemvs(const array& x, const std::vector<array>& bs, const Stream& s);

// `mx::fast::scaled_dot_product_attention` of up to 8 query rows with an array mask
// (bool or additive), no sinks and head sizes up to 256, all of one floating type
// (cuda_attention.cc).
bool cuda_attention_applies(const array& q, const array& k, const array& v, const std::string& mask_mode,
                            const std::optional<array>& mask, const std::optional<array>& sinks, const Stream& s);
// Scores, softmax and the weighted sum in f32, the result rounded once.
array cuda_attention(const array& q, const array& k, const array& v, float scale, const array& mask,
                     const Stream& s);

// `slice_update_repeated(a, update, starts, axes, axis, repeats)` (index.h) for `a` of
// rank 1 to 8 and an update of its type (1, 2, 4 or 8 bytes, not empty), with an int32
// or int64 vector of starts, one per entry of `axes` (not empty) (cuda_put_slice.cc).
bool cuda_put_slice_applies(const array& a, const array& update, const array& starts, const std::vector<int>& axes,
                            const Stream& s);
// One node, writing in place where `a` may be donated; the starts clamped as Nx clamps
// them.
array cuda_put_slice(const array& a, const array& update, const array& starts, const std::vector<int>& axes, int axis,
                     int repeats, const Stream& s);

}  // namespace emily
