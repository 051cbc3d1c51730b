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
#include <strings.h>  // strcasecmp

#include <cstdlib>
namespace sequoia_kernels::cpu {
// The widest vector path our kernels may take, capped like torch's own CPU kernels by
// ATEN_CPU_CAPABILITY (read once): "default" -> 0 (scalar), "avx2" -> 1 (AVX2+FMA), "avx512" ->
// 2 (AVX-512, AVX-512-BF16; no AMX), unset or anything else -> 3 (all the CPU has). So one knob
// runs torch and these kernels as on an AVX2-only CPU, e.g. to measure that CPU's paths here.
inline int isa_cap() {
  static const int cap = [] {
    const char* v = std::getenv("ATEN_CPU_CAPABILITY");
    if (v == nullptr) return 3;
    if (!strcasecmp(v, "default")) return 0;
    if (!strcasecmp(v, "avx2")) return 1;
    if (!strcasecmp(v, "avx512")) return 2;
    return 3;
  }();
  return cap;
}
inline bool have_avx2_fma() {
  static const bool ok = isa_cap() >= 1 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
// The AVX2 packed linears' first row tile of a call with M >= 2 prefetches its weights this far
// ahead (32 k pairs of a bf16 panel, 32 k of an fp32 one): past a row or two the tile's FMAs
// take long enough that the hardware prefetcher alone left the weight stream stalling them
// (a 2-core AMD EPYC Zen 4 capped to AVX2: M = 4 / 8 / 16 -20 / -27 / -19% in bf16, -21 / -20 /
// -16% in fp32; at M = 1 it cost 3-6%, and on the AVX-512 paths 3-10%: not taken there).
constexpr int kPrefetchBytes = 2048;
}  // namespace sequoia_kernels::cpu
// The AVX-512F paths (16 fp32 lanes) need a compiler that knows their intrinsics (GCC 8, Clang).
#if defined(__clang__) || __GNUC__ >= 8
#define SK_X86_AVX512 1
namespace sequoia_kernels::cpu {
inline bool have_avx512f() {  // capped by ATEN_CPU_CAPABILITY as above ("avx512" and up)
  static const bool ok = isa_cap() >= 2 && __builtin_cpu_supports("avx512f");
  return ok;
}
}  // namespace sequoia_kernels::cpu
#endif
#endif
