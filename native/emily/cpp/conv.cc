// Convolutions composed from MLX ops (see conv.h).
#include "conv.h"

#include <stdexcept>
#include <string>

namespace emily {
namespace mx = mlx::core;

namespace {

std::vector<int> or_fill(std::vector<int> v, size_t n, int fill, const char* what) {
  if (v.empty()) return std::vector<int>(n, fill);
  if (v.size() != n) {
    throw std::invalid_argument(std::string("[conv] ") + what + " has " + std::to_string(v.size()) +
                                " entries for " + std::to_string(n) + " spatial axes");
  }
  return v;
}

// Zeros between the elements of `axis`: n elements become (n - 1) * d + 1.
array dilate(const array& x, int axis, int d, const Stream& s) {
  int n = x.shape(axis);
  if (d == 1 || n == 0) return x;
  auto y = mx::expand_dims(x, axis + 1, s);
  std::vector<std::pair<int, int>> pads(y.ndim(), {0, 0});
  pads[axis + 1] = {0, d - 1};
  y = mx::pad(y, pads, mx::array(0, x.dtype()), "constant", s);
  auto shape = x.shape();
  shape[axis] = n * d;
  y = mx::reshape(y, shape, s);
  mx::Shape start(y.ndim(), 0);
  auto stop = y.shape();
  stop[axis] = (n - 1) * d + 1;
  return mx::slice(y, start, stop, s);
}

void check_permutation(const std::vector<int>& perm, int rank, const char* what) {
  std::vector<bool> seen(rank, false);
  bool ok = perm.size() == static_cast<size_t>(rank);
  for (size_t i = 0; ok && i < perm.size(); i++) {
    ok = perm[i] >= 0 && perm[i] < rank && !seen[perm[i]];
    if (ok) seen[perm[i]] = true;
  }
  if (!ok) {
    throw std::invalid_argument(std::string("[conv] ") + what +
                                " is not a permutation of the axes of a rank " + std::to_string(rank) +
                                " tensor");
  }
}

std::vector<int> inverse(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); i++) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

}  // namespace

array conv_general(const array& input, const array& weight, std::vector<int> stride,
                   std::vector<int> padding_lo, std::vector<int> padding_hi,
                   std::vector<int> kernel_dilation, std::vector<int> input_dilation, int groups,
                   bool flip, const Stream& s) {
  if (input.ndim() < 3) {
    throw std::invalid_argument("[conv] input must have rank >= 3 ([N, spatial..., C]), got rank " +
                                std::to_string(input.ndim()));
  }
  // MLX divides the channels by the group count unchecked (groups 0 traps).
  if (groups < 1) throw std::invalid_argument("[conv] groups must be >= 1, got " + std::to_string(groups));
  size_t sp = input.ndim() - 2;
  stride = or_fill(stride, sp, 1, "stride");
  padding_lo = or_fill(padding_lo, sp, 0, "padding_lo");
  padding_hi = or_fill(padding_hi, sp, 0, "padding_hi");
  kernel_dilation = or_fill(kernel_dilation, sp, 1, "kernel_dilation");
  input_dilation = or_fill(input_dilation, sp, 1, "input_dilation");

  array x = input;
  for (size_t i = 0; i < sp; i++) {
    int lo = padding_lo[i], hi = padding_hi[i];
    if (lo >= 0 && hi >= 0) continue;
    int axis = static_cast<int>(i) + 1;
    if (input_dilation[i] < 1) throw std::invalid_argument("[conv] input dilation must be >= 1");
    x = dilate(x, axis, input_dilation[i], s);
    input_dilation[i] = 1;
    int len = x.shape(axis);
    int start = lo < 0 ? -lo : 0;
    int stop = hi < 0 ? len + hi : len;
    if (stop < start) stop = start;
    mx::Shape b(x.ndim(), 0);
    auto e = x.shape();
    b[axis] = std::min(start, len);
    e[axis] = std::min(stop, len);
    x = mx::slice(x, b, e, s);
    std::vector<std::pair<int, int>> pads(x.ndim(), {0, 0});
    pads[axis] = {std::max(lo, 0), std::max(hi, 0)};
    x = mx::pad(x, pads, mx::array(0, x.dtype()), "constant", s);
    padding_lo[i] = 0;
    padding_hi[i] = 0;
  }

  // No input channels: MLX's kernels divide by the channel count (a trap). Each output
  // is then an empty sum, 0: one zero channel per group on both sides computes exactly
  // that, and keeps MLX's channel and group checks meaningful.
  if (x.shape(-1) == 0 && weight.ndim() == x.ndim() && weight.shape(-1) == 0) {
    std::vector<std::pair<int, int>> px(x.ndim(), {0, 0}), pw(weight.ndim(), {0, 0});
    px.back() = {0, groups};
    pw.back() = {0, 1};
    array w = mx::pad(weight, pw, mx::array(0, weight.dtype()), "constant", s);
    return conv_general(mx::pad(x, px, mx::array(0, x.dtype()), "constant", s), w, stride, padding_lo, padding_hi,
                        kernel_dilation, input_dilation, groups, flip, s);
  }

  if (groups > 1 && sp == 3) {
    int c = x.shape(-1), o = weight.shape(0);
    if (c % groups != 0 || o % groups != 0) {
      throw std::invalid_argument("[conv] " + std::to_string(groups) + " groups do not divide " +
                                  std::to_string(c) + " input and " + std::to_string(o) +
                                  " output channels");
    }
    auto xs = mx::split(x, groups, -1, s);
    auto ws = mx::split(weight, groups, 0, s);
    std::vector<array> outs;
    for (int g = 0; g < groups; g++) {
      outs.push_back(mx::conv_general(xs[g], ws[g], stride, padding_lo, padding_hi, kernel_dilation,
                                      input_dilation, 1, flip, s));
    }
    return mx::concatenate(outs, -1, s);
  }
  return mx::conv_general(x, weight, stride, padding_lo, padding_hi, kernel_dilation, input_dilation,
                          groups, flip, s);
}

array conv_nx(const array& input, const array& kernel, const std::vector<int>& strides,
              const std::vector<int>& padding_lo, const std::vector<int>& padding_hi,
              const std::vector<int>& input_dilation, const std::vector<int>& kernel_dilation,
              int feature_groups, int batch_groups, const std::vector<int>& input_permutation,
              const std::vector<int>& kernel_permutation, const std::vector<int>& output_permutation,
              const Stream& s) {
  if (feature_groups < 1 || batch_groups < 1) {
    throw std::invalid_argument("[conv] feature and batch group sizes must be >= 1");
  }
  if (feature_groups > 1 && batch_groups > 1) {
    throw std::invalid_argument("[conv] feature groups and batch groups cannot both be > 1");
  }
  if (!input_permutation.empty()) check_permutation(input_permutation, input.ndim(), "input permutation");
  if (!kernel_permutation.empty()) check_permutation(kernel_permutation, kernel.ndim(), "kernel permutation");
  if (!output_permutation.empty()) check_permutation(output_permutation, input.ndim(), "output permutation");
  array x = input_permutation.empty() ? input : mx::transpose(input, input_permutation, s);
  array w = kernel_permutation.empty() ? kernel : mx::transpose(kernel, kernel_permutation, s);
  if (x.ndim() < 3 || w.ndim() != x.ndim()) {
    throw std::invalid_argument("[conv] input and kernel must have the same rank >= 3");
  }
  int rank = x.ndim();
  int groups = feature_groups;
  if (batch_groups > 1) {
    int n = x.shape(0);
    if (n % batch_groups != 0) {
      throw std::invalid_argument("[conv] batch group size " + std::to_string(batch_groups) +
                                  " does not divide the batch size " + std::to_string(n));
    }
    // [N, C, S...] -> [G, N/G, C, S...] -> [N/G, G, C, S...] -> [N/G, G*C, S...]
    auto shape = x.shape();
    mx::Shape split_shape{batch_groups, n / batch_groups};
    split_shape.insert(split_shape.end(), shape.begin() + 1, shape.end());
    x = mx::reshape(x, split_shape, s);
    std::vector<int> swap(rank + 1);
    for (int i = 0; i <= rank; i++) swap[i] = i;
    std::swap(swap[0], swap[1]);
    x = mx::transpose(x, swap, s);
    x = mx::flatten(x, 1, 2, s);
    groups = batch_groups;
  }

  // Channels last for MLX: [N, C, S...] -> [N, S..., C]; likewise the kernel.
  std::vector<int> to_last{0};
  for (int i = 2; i < rank; i++) to_last.push_back(i);
  to_last.push_back(1);
  x = mx::transpose(x, to_last, s);
  w = mx::transpose(w, to_last, s);

  auto y = conv_general(x, w, strides, padding_lo, padding_hi, kernel_dilation, input_dilation, groups,
                        false, s);

  // Back to [N, O, S...], then Nx's output layout.
  y = mx::transpose(y, inverse(to_last), s);
  if (!output_permutation.empty()) y = mx::transpose(y, inverse(output_permutation), s);
  return y;
}

}  // namespace emily
