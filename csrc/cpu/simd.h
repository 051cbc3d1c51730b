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
