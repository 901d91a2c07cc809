// bias + x · w on a CPU stream without MLX's strided fill (addmm.cc).
#pragma once

#include "emily.h"

namespace emily {

// mx::addmm(bias, x, w, 1, 1): x (M, K), w (K, N), bias (N), one floating type. In f32 on
// a CPU stream under Linux, the same sgemm call on an output filled with the bias by rows.
array add_bias_mm(const array& bias, const array& x, const array& w, const Stream& s);

}  // namespace emily
