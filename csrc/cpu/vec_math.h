// exp and division over fp32 rows for the CPU sampling kernel (no torch headers): AVX2+FMA code
// selected at run time, plain C++ elsewhere.
//
// Why not torch.exp: on an AVX2 CPU (Zen 3) torch's exp (SLEEF, 1.0 ulp) costs ~1 ns per element
// on one core, more than everything else sampling_probs does to a row together, and it cannot
// be fused into the pass that scales the logits and sums the result. This one is the Cephes
// expf scheme: n = round(y log2 e), r = y - n ln 2 in two FMA steps (Cody-Waite), a degree-7
// polynomial for e^r on |r| <= ln2 / 2, times 2^n built in the exponent bits. Measured
// exhaustively over every fp32 y in [-87.3, 0] against the correctly rounded exp (csrc/cpu/
// vec_exp_check.cpp documents the run): at most 1 ulp off, so probabilities agree with the
// reference's (SLEEF) to 2 ulp. Lanes with y < -87.3 (results below the normal range, -inf: 0)
// or NaN take std::exp, so subnormals, 0 and NaN are exact.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu/simd.h"

#ifdef SK_X86_AVX2_FMA
#include <immintrin.h>
#endif

namespace sequoia_kernels::cpu {

constexpr float kExpLow = -87.3f;  // below: 2^n leaves the normal range; std::exp per lane
// exp's scheme: n = round(y log2 e) (to nearest even, in one FMA: adding kExpMagic = 1.5 * 2^23
// leaves n in the low mantissa bits, which build 2^n without a conversion), r = y - n ln 2 with
// ln 2 = kExpLn2Hi + kExpLn2Lo (the first exact in 9 bits), e^r = 1 + r + r^2 P(r) with P's
// coefficients from the highest degree down (Horner), times 2^n.
constexpr float kExpMagic = 12582912.0f, kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#ifdef SK_X86_AVX2_FMA
// e^y for 8 lanes with y >= kExpLow (other lanes are garbage: the callers patch them).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 y) {
  const __m256 nb = _mm256_fmadd_ps(y, _mm256_set1_ps(kExpLog2e), _mm256_set1_ps(kExpMagic));
  const __m256 n = _mm256_sub_ps(nb, _mm256_set1_ps(kExpMagic));
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kExpLn2Hi), y));
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[k]));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_castps_si256(nb), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// a / t rounded to nearest, bitwise IEEE division, without a division instruction (vdivps
// holds ~0.27 ns per element on Zen 3, as long as the rest of the pass): q = RN(a * rt) with
// rt = RN(1 / t) is within 1 ulp of a / t, the remainder a - q t is exact (fma), and
// RN(q + (a - q t) rt) is then the correctly rounded quotient (Markstein's theorem, the IA-64
// division; the exhaustive and random checks in tests/cpp/vec_math_check.cpp compare it with
// vdivps). The theorem needs the remainder exact and no overflow: lanes with |a| or |q| below
// 2^-100 (but zeros), |q| above 2^100, or a non-finite q take vdivps. t must pass div_rn_ok.
// The corrected quotient of div8_rn (valid on the lanes div8_ok accepts).
__attribute__((target("avx2,fma"))) inline __m256 div8_fast(__m256 a, __m256 t, __m256 rt) {
  const __m256 q = _mm256_mul_ps(a, rt);
  const __m256 r = _mm256_fnmadd_ps(q, t, a);
  // (| the sign of q: a = -0 gives r = +0 and a corrected +0, the quotient is -0)
  return _mm256_or_ps(_mm256_fmadd_ps(r, rt, q), _mm256_and_ps(q, _mm256_set1_ps(-0.0f)));
}

// Lanes where div8_fast(a, t, rt) is the IEEE quotient: a = +-0, or |a| and |q| = |RN(a rt)|
// within [2^-100, 2^100] (NaN and inf fail).
__attribute__((target("avx2,fma"))) inline __m256 div8_ok(__m256 a, __m256 rt) {
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(0x1p-100f);
  const __m256 aq = _mm256_andnot_ps(sign, _mm256_mul_ps(a, rt)), aa = _mm256_andnot_ps(sign, a);
  return _mm256_or_ps(_mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(aa, lo, _CMP_GE_OQ), _mm256_cmp_ps(aq, lo, _CMP_GE_OQ)),
                                    _mm256_cmp_ps(aq, _mm256_set1_ps(0x1p+100f), _CMP_LE_OQ)),
                      _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ));
}

__attribute__((target("avx2,fma"))) inline __m256 div8_rn(__m256 a, __m256 t, __m256 rt) {
  const __m256 qq = div8_fast(a, t, rt), ok = div8_ok(a, rt);
  if (_mm256_movemask_ps(ok) == 0xff) return qq;
  return _mm256_blendv_ps(_mm256_div_ps(a, t), qq, ok);
}

// Whether div8_rn may divide by t (a finite normal float whose reciprocal is normal too).
inline bool div_rn_ok(float t) {
  const float a = std::fabs(t);
  return a >= 0x1p-120f && a <= 0x1p+120f;
}

// Lanes of y that exp8 does not cover (y < kExpLow or NaN): a bit mask.
__attribute__((target("avx2,fma"))) inline int exp8_outside(__m256 y) {
  return _mm256_movemask_ps(_mm256_cmp_ps(y, _mm256_set1_ps(kExpLow), _CMP_NGE_UQ));
}

// e^y on every lane: exp8, and std::exp on the lanes it does not cover (exp8_outside).
__attribute__((target("avx2,fma"))) inline __m256 exp8_full(__m256 y) {
  __m256 v = exp8(y);
  if (const int k = exp8_outside(y)) {
    alignas(32) float yb[8], vb[8];
    _mm256_store_ps(yb, y);
    _mm256_store_ps(vb, v);
    for (int j = 0; j < 8; ++j)
      if (k >> j & 1) vb[j] = std::exp(yb[j]);
    v = _mm256_load_ps(vb);
  }
  return v;
}

#ifdef SK_X86_AVX512
// exp8 on 16 lanes: the same operations in the same order, so the same bits lane for lane.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 y) {
  const __m512 nb = _mm512_fmadd_ps(y, _mm512_set1_ps(kExpLog2e), _mm512_set1_ps(kExpMagic));
  const __m512 n = _mm512_sub_ps(nb, _mm512_set1_ps(kExpMagic));
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), y));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int k = 1; k < 6; ++k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[k]));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_castps_si512(nb), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// exp8_full on 16 lanes: exp16, std::exp on the lanes below kExpLow or NaN (the same bits).
__attribute__((target("avx512f"))) inline __m512 exp16_full(__m512 y) {
  __m512 v = exp16(y);
  if (const __mmask16 k = _mm512_cmp_ps_mask(y, _mm512_set1_ps(kExpLow), _CMP_NGE_UQ)) {
    alignas(64) float yb[16], vb[16];
    _mm512_store_ps(yb, y);
    _mm512_store_ps(vb, v);
    for (int j = 0; j < 16; ++j)
      if (k >> j & 1) vb[j] = std::exp(yb[j]);
    v = _mm512_load_ps(vb);
  }
  return v;
}
#endif

// e may be y (in place).
__attribute__((target("avx2,fma"))) inline void exp_row_avx2(const float* y, float* e, int64_t V) {
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(e + i, exp8_full(_mm256_loadu_ps(y + i)));
  for (; i < V; ++i) e[i] = std::exp(y[i]);
}

// e = exp((x - m) / t) (IEEE subtract and divide; no division when t == 1) and the fp64 sum
// of e, in one pass. Returns the sum.
// The end of a scale_exp_sum pass: the four fp64 lanes of acc summed, plus the tokens [i, V)
// the vector loop left, in scalar code.
__attribute__((target("avx2,fma"))) inline double scale_exp_sum_tail(const float* x, int64_t i, int64_t V, float m,
                                                                        float t, float* e, __m256d acc) {
  alignas(32) double sb[4];
  _mm256_store_pd(sb, acc);
  double s = (sb[0] + sb[1]) + (sb[2] + sb[3]);
  for (; i < V; ++i) {
    const float y = t != 1.f ? (x[i] - m) / t : x[i] - m;
    e[i] = std::exp(y);
    s += static_cast<double>(e[i]);
  }
  return s;
}

__attribute__((target("avx2,fma"))) inline double scale_exp_sum_careful(const float* x, int64_t V, float m, float t,
                                                                           float* e) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t), vr = _mm256_set1_ps(1.0f / t);
  const bool div = t != 1.f, fast = div_rn_ok(t);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    __m256 y = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm);
    if (div) y = fast ? div8_rn(y, vt, vr) : _mm256_div_ps(y, vt);
    const __m256 v = exp8_full(y);
    _mm256_storeu_ps(e + i, v);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  return scale_exp_sum_tail(x, i, V, m, t, e, _mm256_add_pd(s0, s1));
}

// The same in a branch-free loop: lanes that need the careful path (y below exp's normal range,
// -inf, NaN) are only flagged, and a row with any flag is redone by scale_exp_sum_careful (rows
// of ordinary logits never are). No div8_ok here: a = x - m <= 0, and a lane div8_ok would
// refuse has |a| > 2^100 t (then y < kExpLow or NaN: flagged) or 0 < |a| < 2^-100 max(1, t),
// where any nearly right tiny y gives exp(y) = 1 exactly, the result of the exact y (y is not
// stored). Likewise the sign of a zero y.
__attribute__((target("avx2,fma"))) inline double scale_exp_sum_avx2(const float* x, int64_t V, float m, float t,
                                                                        float* e) {
  if (t != 1.f && !div_rn_ok(t)) return scale_exp_sum_careful(x, V, m, t, e);
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(t), vr = _mm256_set1_ps(1.0f / t);
  const __m256 low = _mm256_set1_ps(kExpLow), all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  const bool div = t != 1.f;
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  __m256 good = all;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {  // two vectors per round: four independent fp64 sum chains
    __m256 y = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm), z = _mm256_sub_ps(_mm256_loadu_ps(x + i + 8), vm);
    if (div) {
      const __m256 qy = _mm256_mul_ps(y, vr), qz = _mm256_mul_ps(z, vr);
      y = _mm256_fmadd_ps(_mm256_fnmadd_ps(qy, vt, y), vr, qy);
      z = _mm256_fmadd_ps(_mm256_fnmadd_ps(qz, vt, z), vr, qz);
    }
    good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(y, low, _CMP_GE_OQ), _mm256_cmp_ps(z, low, _CMP_GE_OQ)));
    const __m256 a = exp8(y), b = exp8(z);
    _mm256_storeu_ps(e + i, a);
    _mm256_storeu_ps(e + i + 8, b);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    s2 = _mm256_add_pd(s2, _mm256_cvtps_pd(_mm256_castps256_ps128(b)));
    s3 = _mm256_add_pd(s3, _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)));
  }
  s0 = _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3));
  if (_mm256_movemask_ps(good) != 0xff) return scale_exp_sum_careful(x, V, m, t, e);
  return scale_exp_sum_tail(x, i, V, m, t, e, s0);
}

// out = e / z (IEEE division), out written with non-temporal stores (it is written once and
// not read again by this thread: no read-for-ownership). out must be 4-byte aligned.
__attribute__((target("avx2,fma"))) inline void divide_stream_avx2(const float* e, int64_t V, float z, float* out) {
  int64_t i = 0;
  for (; i < V && (reinterpret_cast<uintptr_t>(out + i) & 31u) != 0; ++i) out[i] = e[i] / z;
  const __m256 vz = _mm256_set1_ps(z), vr = _mm256_set1_ps(1.0f / z);
  const bool fast = div_rn_ok(z);
  for (; i + 8 <= V; i += 8) {
    const __m256 a = _mm256_loadu_ps(e + i);
    _mm256_stream_ps(out + i, fast ? div8_rn(a, vz, vr) : _mm256_div_ps(a, vz));
  }
  for (; i < V; ++i) out[i] = e[i] / z;
  _mm_sfence();
}
#endif

// e[i] = exp(y[i]).
inline void exp_row(const float* y, float* e, int64_t V) {
#ifdef SK_X86_AVX2_FMA
  if (have_avx2_fma()) return exp_row_avx2(y, e, V);
#endif
  for (int64_t i = 0; i < V; ++i) e[i] = std::exp(y[i]);
}

// out[i] = e[i] / z (IEEE division); out is not read back soon (streamed where possible).
inline void divide_row_to(const float* e, int64_t V, float z, float* out) {
#ifdef SK_X86_AVX2_FMA
  if (have_avx2_fma() && (reinterpret_cast<uintptr_t>(out) & 3u) == 0) return divide_stream_avx2(e, V, z, out);
#endif
  for (int64_t i = 0; i < V; ++i) out[i] = e[i] / z;
}

// e[i] = exp((x[i] - m) / t); returns the fp64 sum of e.
inline double scale_exp_sum(const float* x, int64_t V, float m, float t, float* e) {
#ifdef SK_X86_AVX2_FMA
  if (have_avx2_fma()) return scale_exp_sum_avx2(x, V, m, t, e);
#endif
  double s = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    const float y = t != 1.f ? (x[i] - m) / t : x[i] - m;
    e[i] = std::exp(y);
    s += static_cast<double>(e[i]);
  }
  return s;
}

}  // namespace sequoia_kernels::cpu
