// AMX on x86-64 Linux (no torch headers): whether the compiler and this process may use the tile
// registers, and the tile configuration. Shared by the CPU kernels that run AMX-BF16 tiles
// (packed_linear_bf16.cpp, tree_attention.cpp).
#pragma once

#include <cstdint>

#include "cpu/simd.h"

// The AVX-512-BF16 and AMX paths need a compiler that knows their intrinsics (GCC 11, Clang 12);
// with an older one only the AVX2 and scalar paths are built (and offered).
#if defined(SK_X86_AVX2_FMA) && ((defined(__clang__) && __clang_major__ >= 12) || \
                                 (!defined(__clang__) && __GNUC__ >= 11))
#define SK_BF16_WIDE 1
#endif

#ifdef SK_BF16_WIDE
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace sequoia_kernels::cpu {

// ldtilecfg's 64-byte operand (palette 1): per tile its rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// CPUID AMX-TILE and AMX-BF16, not capped by ATEN_CPU_CAPABILITY, and Linux lets this process
// use the tiles (asked once: the permission is per process).
inline bool have_amx_bf16() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (isa_cap() < 3 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
#ifdef __linux__
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

}  // namespace sequoia_kernels::cpu
#endif  // SK_BF16_WIDE
