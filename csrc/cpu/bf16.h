// bf16 <-> fp32 on the CPU (no torch headers): the conversions the bf16 kernels share
// (packed_linear_bf16.cpp, fused_bf16.cpp). Rounding is to nearest even with NaN kept NaN
// (0x7FC0), bit for bit as c10::BFloat16 and torch's vectorised conversion.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#ifdef SK_X86_AVX2_FMA
#include <immintrin.h>
#endif

namespace sequoia_kernels::cpu {

inline float bf16_to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }  // f rounded to bf16, as fp32

#ifdef SK_X86_AVX2_FMA
// f32_to_bf16 on 8 floats, the same bits (integer rounding to nearest even, NaN -> 0x7FC0)
__attribute__((target("avx2"))) inline __m256i round_bf16_8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 bf16 (16-byte load) widened to fp32 (exact)
__attribute__((target("avx2"))) inline __m256 load_bf16_8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// round_bf16_8's 8 results (in the low half of each 32-bit lane) stored as 8 bf16
__attribute__((target("avx2"))) inline void store_bf16_8(uint16_t* p, __m256 v) {
  const __m256i r = round_bf16_8(v);  // [a0..a3 | a4..a7] as 32-bit lanes
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

#ifdef SK_X86_AVX512
// The same three on 16 floats (AVX-512F), the same bits lane for lane.
__attribute__((target("avx512f"))) inline __m512i round_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
}

__attribute__((target("avx512f"))) inline __m512 load_bf16_16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx512f"))) inline void store_bf16_16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(round_bf16_16(v)));
}
#endif
#endif

}  // namespace sequoia_kernels::cpu
