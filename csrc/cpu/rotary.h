// The rotary embedding on bf16 rows (no torch headers), shared by the rotary op
// (fused_bf16.cpp) and packed_linear_bf16's rotary epilogue (packed_linear_bf16.cpp): Hugging
// Face's apply_rotary_pos_emb in bf16, rounding for rounding,
//   out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
// (each product of two bf16 is exact in fp32, so every step is one rounding, as in torch), on 16
// lanes where the CPU has AVX-512F (half a row a multiple of 16), 8 with AVX2 (a multiple of 8),
// else scalar: the same operations per value on every path, so the same bits.
#pragma once

#include <cstdint>

#include "cpu/bf16.h"
#include "cpu/simd.h"

namespace sequoia_kernels::cpu {

// n rows of D (even) values: row t at x + t xs, its cos and sin at c + t cs, sn + t ss, its
// output at y + t ys (y may be x: each value pair is read before it is written). The first half
// pairs with -x[i + D/2], the second with x[i - D/2].
struct RotaryRows {
  const uint16_t *x, *c, *sn;
  int64_t xs, cs, ss, D, n;
  uint16_t* y;
  int64_t ys;
};

inline void rotary_rows_scalar(const RotaryRows& r) {
  const int64_t h = r.D / 2;
  for (int64_t t = 0; t < r.n; ++t) {
    const uint16_t *x = r.x + t * r.xs, *c = r.c + t * r.cs, *sn = r.sn + t * r.ss;
    uint16_t* y = r.y + t * r.ys;
    for (int64_t i = 0; i < h; ++i) {  // both halves of a pair from the values as read
      const float lo = bf16_to_f32(x[i]), hi = bf16_to_f32(x[i + h]);
      const float a0 = round_bf16(lo * bf16_to_f32(c[i])), b0 = round_bf16(-hi * bf16_to_f32(sn[i]));
      const float a1 = round_bf16(hi * bf16_to_f32(c[i + h])), b1 = round_bf16(lo * bf16_to_f32(sn[i + h]));
      y[i] = f32_to_bf16(a0 + b0);
      y[i + h] = f32_to_bf16(a1 + b1);
    }
  }
}

#ifdef SK_X86_AVX2_FMA
__attribute__((target("avx2"))) inline __m256 rotary_round8(__m256 v) {  // v rounded to bf16, kept as fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_8(v), 16));
}

__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) inline void rotary_rows_avx2(const RotaryRows& r) {
  const int64_t h = r.D / 2;
  if (h % 8 != 0) return rotary_rows_scalar(r);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t t = 0; t < r.n; ++t) {
    const uint16_t *x = r.x + t * r.xs, *c = r.c + t * r.cs, *sn = r.sn + t * r.ss;
    uint16_t* y = r.y + t * r.ys;
    for (int64_t i = 0; i < h; i += 8) {
      const __m256 lo = load_bf16_8(x + i), hi = load_bf16_8(x + h + i);
      const __m256 a0 = rotary_round8(_mm256_mul_ps(lo, load_bf16_8(c + i)));
      const __m256 b0 = rotary_round8(_mm256_mul_ps(_mm256_xor_ps(hi, sign), load_bf16_8(sn + i)));
      const __m256 a1 = rotary_round8(_mm256_mul_ps(hi, load_bf16_8(c + h + i)));
      const __m256 b1 = rotary_round8(_mm256_mul_ps(lo, load_bf16_8(sn + h + i)));
      store_bf16_8(y + i, _mm256_add_ps(a0, b0));
      store_bf16_8(y + h + i, _mm256_add_ps(a1, b1));
    }
  }
}
#endif

#ifdef SK_X86_AVX512
__attribute__((target("avx512f"))) inline __m512 rotary_round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_16(v), 16));
}

// rotary_rows_avx2 on 16 lanes (half a row a multiple of 16)
__attribute__((target("avx512f"), optimize("fp-contract=off"))) inline void rotary_rows_avx512(const RotaryRows& r) {
  const int64_t h = r.D / 2;
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (int64_t t = 0; t < r.n; ++t) {
    const uint16_t *x = r.x + t * r.xs, *c = r.c + t * r.cs, *sn = r.sn + t * r.ss;
    uint16_t* y = r.y + t * r.ys;
    for (int64_t i = 0; i < h; i += 16) {
      const __m512 lo = load_bf16_16(x + i), hi = load_bf16_16(x + h + i);
      const __m512 neg_hi = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(hi), sign));
      const __m512 a0 = rotary_round16(_mm512_mul_ps(lo, load_bf16_16(c + i)));
      const __m512 b0 = rotary_round16(_mm512_mul_ps(neg_hi, load_bf16_16(sn + i)));
      const __m512 a1 = rotary_round16(_mm512_mul_ps(hi, load_bf16_16(c + h + i)));
      const __m512 b1 = rotary_round16(_mm512_mul_ps(lo, load_bf16_16(sn + h + i)));
      store_bf16_16(y + i, _mm512_add_ps(a0, b0));
      store_bf16_16(y + h + i, _mm512_add_ps(a1, b1));
    }
  }
}
#endif

using RotaryRowsFn = void (*)(const RotaryRows&);

// The rows' kernel for head size D on this CPU: 16 lanes (D a multiple of 32), 8 lanes, or scalar.
inline RotaryRowsFn rotary_rows_fn(int64_t D) {
#ifdef SK_X86_AVX512
  if (D % 32 == 0 && have_avx512f()) return rotary_rows_avx512;
#endif
#ifdef SK_X86_AVX2_FMA
  if (have_avx2_fma()) return rotary_rows_avx2;
#endif
  (void)D;
  return rotary_rows_scalar;
}

}  // namespace sequoia_kernels::cpu
