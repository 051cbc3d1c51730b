// SK_SIMD_CLONES: compile a hot loop twice, for AVX2 and for the baseline x86-64, and pick the
// clone at load time (GCC/Clang target_clones). No FMA: the specs require plain IEEE fp32 ops.
// "no-trapping-math" lets GCC if-convert a max(., 0) next to a division (only FP exception
// flags, never values, may differ).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(_WIN32)
#define SK_SIMD_CLONES __attribute__((target_clones("avx2", "default"), optimize("no-trapping-math")))
#elif defined(__x86_64__) && defined(__clang__) && !defined(_WIN32)
#define SK_SIMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SK_SIMD_CLONES
#endif

// Whether this CPU runs the hand-written AVX2+FMA paths (csrc/cpu/vec_math.h, packed_linear.cpp);
// checked once. Those paths are compiled where SK_X86_AVX2_FMA is defined (x86-64, GCC/Clang).
#if defined(__x86_64__) && defined(__GNUC__)
#define SK_X86_AVX2_FMA 1
namespace sequoia_kernels::cpu {
inline bool have_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
}  // namespace sequoia_kernels::cpu
#endif
