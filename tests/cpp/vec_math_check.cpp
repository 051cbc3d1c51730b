// Checks csrc/cpu/vec_math.h (the CPU sampling kernel's exp and division) against the correctly
// rounded results. Built and run by tests/test_sampling.py::test_cpu_vec_math (g++ -O2
// -std=c++20 -I csrc); prints one line per check and exits 1 on a failure.
//
//   vec_math_check STRIDE SEED
//
// exp: every STRIDE-th float y in [-104, 0] (the range sampling_probs feeds it, below -87.3
//      included: the std::exp lanes), against RN(exp(double y)); the largest error in ulps must
//      be <= 1 (a double exp rounded to float is the correctly rounded result except in cases
//      far rarer than this sweep's size).
// div: div8_rn(a, t) == vdivps(a, t) bit for bit, for every STRIDE-th fp32 bit pattern a
//      (NaN, inf, subnormals, zeros included) against several t, and for 2^26 / STRIDE random
//      (a, t) pairs with t a normal float.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

#include "cpu/vec_math.h"

using namespace sequoia_kernels::cpu;

static uint32_t bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
static float from_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
// distance in ulps between two non-negative finite floats
static int64_t ulps(float a, float b) { return std::llabs(static_cast<int64_t>(bits(a)) - static_cast<int64_t>(bits(b))); }

__attribute__((target("avx2,fma"))) static int check_exp(uint32_t stride) {
  // y from -0 (bits 0x80000000) down to -104 (negative floats: larger bits = more negative)
  const uint32_t lo = bits(-0.0f), hi = bits(-104.0f);
  int64_t worst = 0, n = 0;
  float worst_y = 0, buf[8], out[8];
  for (uint64_t b = lo; b <= hi; b += 8ull * stride) {
    for (int j = 0; j < 8; ++j) buf[j] = from_bits(static_cast<uint32_t>(std::min<uint64_t>(b + j * stride, hi)));
    exp_row(buf, out, 8);
    for (int j = 0; j < 8; ++j) {
      const float want = static_cast<float>(std::exp(static_cast<double>(buf[j])));
      const int64_t d = ulps(out[j], want);
      if (d > worst) { worst = d; worst_y = buf[j]; }
      ++n;
    }
  }
  float e[8], x[8] = {-INFINITY, NAN, -1e30f, -87.31f, -87.29f, -0.0f, 0.0f, -1e-30f};
  exp_row(x, e, 8);
  const bool specials = e[0] == 0.f && std::isnan(e[1]) && e[2] == 0.f && e[3] == std::exp(-87.31f) &&
                        e[5] == 1.f && e[6] == 1.f && e[7] == 1.f;
  std::printf("exp: %lld values in [-104, 0], largest error %lld ulp (at y = %.9g); specials %s\n",
              static_cast<long long>(n), static_cast<long long>(worst), worst_y, specials ? "ok" : "WRONG");
  return worst <= 1 && specials ? 0 : 1;
}

__attribute__((target("avx2,fma"))) static int64_t div_mismatches(const float* a, float t, int n8) {
  const __m256 vt = _mm256_set1_ps(t), vr = _mm256_set1_ps(1.0f / t);
  int64_t bad = 0;
  for (int k = 0; k < n8; ++k) {
    const __m256 va = _mm256_loadu_ps(a + 8 * k);
    alignas(32) float x[8], y[8];
    _mm256_store_ps(x, div8_rn(va, vt, vr));
    _mm256_store_ps(y, _mm256_div_ps(va, vt));
    for (int j = 0; j < 8; ++j) bad += bits(x[j]) != bits(y[j]) && !(std::isnan(x[j]) && std::isnan(y[j]));
  }
  return bad;
}

static int check_div(uint32_t stride, uint32_t seed) {
  const float ts[] = {0.7f, 0.3f, 1.3f, 0.1f, 3.0f, 1.0f - 0x1p-24f, 1.0f + 0x1p-23f, 49151.37f, 12345.678f, 2.0f,
                      0x1.fffffep-1f, 0x1.000002p+3f};
  int64_t bad = 0, n = 0;
  float a[8];
  for (const float t : ts) {
    for (uint64_t b = 0; b <= 0xffffffffull; b += 8ull * stride) {
      for (int j = 0; j < 8; ++j) a[j] = from_bits(static_cast<uint32_t>(std::min<uint64_t>(b + j * stride, 0xffffffffull)));
      bad += div_mismatches(a, t, 1);
      n += 8;
    }
  }
  std::mt19937 g(seed);
  std::uniform_int_distribution<uint32_t> any;
  const int64_t pairs = (int64_t{1} << 26) / stride;
  for (int64_t k = 0; k < pairs; ++k) {
    float t;
    do t = std::fabs(from_bits(any(g))); while (!div_rn_ok(t));
    for (int j = 0; j < 8; ++j) a[j] = from_bits(any(g));
    bad += div_mismatches(a, t, 1);
    n += 8;
  }
  std::printf("div: %lld quotients, %lld differ from vdivps\n", static_cast<long long>(n), static_cast<long long>(bad));
  return bad == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    std::printf("SKIP: no AVX2+FMA on this CPU (the kernels use plain C++ here)\n");
    return 0;
  }
  const uint32_t stride = argc > 1 ? static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10)) : 1;
  const uint32_t seed = argc > 2 ? static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10)) : 0;
  return check_exp(stride) | check_div(stride, seed);
}
