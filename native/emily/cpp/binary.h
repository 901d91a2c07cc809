// Binary ops that MLX lacks or that need a guard, composed from MLX ops
// (optable/binary.ops, where the sign conventions are stated).
#pragma once

#include "emily.h"

namespace emily {

// MLX's floor_divide/remainder, except that a signed MIN / -1 (a CPU trap in MLX's
// kernel) gives the wrapped quotient -MIN == MIN and the remainder 0.
array floor_divide_safe(const array& a, const array& b, const Stream& s);
array remainder_safe(const array& a, const array& b, const Stream& s);
// Remainder with the sign of the dividend (C fmod, Elixir rem).
array fmod(const array& a, const array& b, const Stream& s);
// Division rounded toward zero (C /, Elixir div).
array trunc_divide(const array& a, const array& b, const Stream& s);
// Shifts defined for every count: counts >= the bit width (or negative) give 0 for a
// left shift and the sign fill (0 or -1) for a right shift.
array left_shift_safe(const array& a, const array& b, const Stream& s);
array right_shift_safe(const array& a, const array& b, const Stream& s);
// arctan2, composed for complex64 inputs (MLX has no complex kernel): the real angle of
// two real-valued complex numbers, NaN where either has an imaginary part.
array arctan2_any(const array& a, const array& b, const Stream& s);

}  // namespace emily
