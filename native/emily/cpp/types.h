// Type glue (optable/types.ops): Nx's sub-byte integers (u2, u4, s2, s4, and 1-bit) cross
// the boundary as packed bytes; MLX has no such dtypes, so they live in MLX as u8/s8.
//
// Packing follows Nx's bitstrings: elements in order from the most significant bits of
// each byte, e.g. the u4 values [1, 2] pack to the byte 0x12; unused low bits of the last
// byte are zero.
#pragma once

#include "emily.h"

namespace emily {

// The first `count` `bits`-wide values packed in the u8 tensor `packed`, as a flat u8
// tensor (s8, sign-extended, when `is_signed`). `bits` is 1, 2 or 4.
array unpack_bits(const array& packed, int bits, bool is_signed, int64_t count, const Stream& s);

// The values of the integer tensor `a` (row-major, each truncated to its low `bits` bits,
// i.e. two's complement for negatives) packed into a flat u8 tensor.
array pack_bits(const array& a, int bits, const Stream& s);

}  // namespace emily
