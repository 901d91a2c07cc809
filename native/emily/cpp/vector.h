// Emily's AVX2 and FMA versions of MLX's CPU formulas (see kernels.cc): exp, sigmoid and
// erf eight lanes at a time, each rounding as MLX's scalar code rounds, softmax rows, and
// bf16 loads and stores.
// Defined on x86-64 Linux only (EMILY_VECTOR_KERNELS), for CPUs that kernels::vector_cpu()
// finds able to run them.
#pragma once

#if defined(__x86_64__) && defined(__linux__)
#define EMILY_VECTOR_KERNELS 1

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

// (MLX's fp8 conversions in unary_ops.h pun pointers; none is used here.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-aliasing"
#include "mlx/backend/cpu/simd/simd.h"
#include "mlx/backend/cpu/unary_ops.h"
#pragma GCC diagnostic pop

#define EMILY_VECTOR __attribute__((target("avx2,fma")))

namespace emily::kernels::vec {
namespace mx = mlx::core;

// f32, or bf16 (its bits, widened to f32 exactly), as f32 lanes.
EMILY_VECTOR inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
EMILY_VECTOR inline __m256 load8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// f32 to bf16, to nearest even; NaN stays NaN.
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// Eight f32 lanes rounded to bf16 as MLX converts them (to nearest even; every NaN
// 0x7FC0, where to_bf16 keeps the NaN's sign and payload): the bits in each lane's low half.
EMILY_VECTOR inline __m256i bf16_bits8(__m256 f) {
  __m256i b = _mm256_castps_si256(f);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
}

// Eight f32 lanes rounded to bf16 (bf16_bits8) and widened back, exactly.
EMILY_VECTOR inline __m256 round_bf16(__m256 f) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(f), 16)); }

// Eight f32 lanes stored at p as bf16 (bf16_bits8).
EMILY_VECTOR inline void store8(uint16_t* p, __m256 f) {
  __m256i bits = bf16_bits8(f);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}


// simd::exp of MLX (cpu/simd/math.h): 2^round(x log2 e) times a polynomial of the rest.
EMILY_VECTOR inline __m256 exp8(__m256 x0) {
  __m256 x = _mm256_mul_ps(x0, _mm256_set1_ps(1.442695f));
  // MLX rounds with floor(x + 0.5) in double, which is exact; in f32, x + 0.5 can round
  // up. floor(x), plus one where x's fraction (exact in f32) is at least a half.
  __m256 fl = _mm256_floor_ps(x);
  __m256 up = _mm256_cmp_ps(_mm256_sub_ps(x, fl), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  __m256 ipart = _mm256_add_ps(fl, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
  __m256 f = _mm256_sub_ps(x, ipart);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
  __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(e), p);
  r = _mm256_blendv_ps(r, x0, _mm256_cmp_ps(x0, x0, _CMP_UNORD_Q));
  r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
  return _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps(x0, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
}

// The sum of the eight lanes.
EMILY_VECTOR inline float sum8(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

EMILY_VECTOR inline __m256 abs8(__m256 x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }

// detail::Sigmoid (cpu/unary_ops.h): y = 1 / (1 + exp(|x|)), y below zero, 1 - y above.
EMILY_VECTOR inline __m256 sigmoid8(__m256 x) {
  __m256 one = _mm256_set1_ps(1.0f);
  __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, exp8(abs8(x))));
  return _mm256_blendv_ps(_mm256_sub_ps(one, y), y, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
}

// simd::erf (cpu/simd/math.h): Abramowitz and Stegun 7.1.26.
EMILY_VECTOR inline __m256 erf8(__m256 x) {
  __m256 one = _mm256_set1_ps(1.0f);
  __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), abs8(x), one));
  __m256 r = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(1.421413741f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(-0.284496736f));
  r = _mm256_fmadd_ps(r, t, _mm256_set1_ps(0.254829592f));
  __m256 neg = _mm256_set1_ps(-0.0f);
  __m256 e = _mm256_xor_ps(exp8(_mm256_mul_ps(_mm256_xor_ps(x, neg), x)), neg);
  __m256 result = _mm256_fmadd_ps(_mm256_mul_ps(e, t), r, one);
  return _mm256_blendv_ps(_mm256_xor_ps(result, neg), result, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
}

// The graph's five ops, each rounded to f32 as MLX's kernels round them.
EMILY_VECTOR inline __m256 gelu8(__m256 x, __m256 c) {
  __m256 e = erf8(_mm256_div_ps(x, c));
  return _mm256_div_ps(_mm256_mul_ps(_mm256_add_ps(e, _mm256_set1_ps(1.0f)), x), _mm256_set1_ps(2.0f));
}

// MLX's softmax of f32 rows (cpu/softmax.cpp, one lane): the row's maximum, the
// exponentials of the differences and their sum taken in order, then each times the
// sum's reciprocal. The maximum and the exponentials go eight at a time (the maximum
// is the same number in any order, and NaN wherever MLX's is); the sum keeps MLX's order.
EMILY_VECTOR inline void softmax_rows(const float* in, float* out, size_t rows, size_t m) {
  for (size_t row = 0; row < rows; row++, in += m, out += m) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();
    size_t j = 0;
    for (; j + 8 <= m; j += 8) {
      __m256 x = _mm256_loadu_ps(in + j);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      vmax = _mm256_max_ps(vmax, x);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmax);
    float maximum = -INFINITY;
    for (float v : lanes) maximum = v > maximum ? v : maximum;
    bool has_nan = _mm256_movemask_ps(nan) != 0;
    for (; j < m; j++) {
      has_nan = has_nan || std::isnan(in[j]);
      maximum = in[j] > maximum ? in[j] : maximum;
    }
    if (has_nan) maximum = NAN;

    __m256 vm = _mm256_set1_ps(maximum);
    for (j = 0; j + 8 <= m; j += 8) _mm256_storeu_ps(out + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(in + j), vm)));
    for (; j < m; j++) out[j] = mx::detail::Exp{}(in[j] - maximum);
    float normalizer = 0.0f;
    for (j = 0; j < m; j++) normalizer += out[j];
    normalizer = 1 / normalizer;
    __m256 vn = _mm256_set1_ps(normalizer);
    for (j = 0; j + 8 <= m; j += 8) _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_loadu_ps(out + j), vn));
    for (; j < m; j++) out[j] *= normalizer;
  }
}

}  // namespace emily::kernels::vec

#endif
