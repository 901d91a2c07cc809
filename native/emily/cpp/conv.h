// Glue for optable/conv.ops: convolutions composed from MLX's conv_general.
#pragma once

#include <vector>

#include "emily.h"

namespace emily {

// MLX's conv_general (input [N, spatial..., C], weight [O, spatial..., C / groups]),
// extended by composition where MLX 0.32 falls short:
//   * negative padding (cropping) is applied by slicing the (explicitly dilated) input,
//     since MLX mis-crops when negative padding meets input dilation;
//   * feature groups with 3 spatial axes (MLX groups only 1-D and 2-D convolutions) run
//     as one convolution per group, concatenated along the output channels.
// Empty stride/padding/dilation lists mean MLX's defaults (1, 0, 1).
array conv_general(const array& input, const array& weight, std::vector<int> stride,
                   std::vector<int> padding_lo, std::vector<int> padding_hi,
                   std::vector<int> kernel_dilation, std::vector<int> input_dilation, int groups,
                   bool flip, const Stream& s);

// Nx's conv/4 on Nx layouts: input [N, C, spatial...] and kernel [O, C / groups, spatial...]
// after `input_permutation` / `kernel_permutation` (empty = identity); the result is
// [N / batch_groups, O, spatial...] laid out by `output_permutation`. Batch groups are
// folded into feature groups: batch group g of the input becomes channel group g.
array conv_nx(const array& input, const array& kernel, const std::vector<int>& strides,
              const std::vector<int>& padding_lo, const std::vector<int>& padding_hi,
              const std::vector<int>& input_dilation, const std::vector<int>& kernel_dilation,
              int feature_groups, int batch_groups, const std::vector<int>& input_permutation,
              const std::vector<int>& kernel_permutation, const std::vector<int>& output_permutation,
              const Stream& s);

}  // namespace emily
