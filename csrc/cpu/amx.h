// AMX on x86-64 Linux (no torch headers): whether the compiler and this process may use the tile
// registers, the tile configuration, and the tile operations as a policy: the instructions
// (HwTiles) or software tiles (EmuTiles). Shared by the CPU kernels that run AMX-BF16 tiles
// (packed_linear_bf16.cpp, tree_attention.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu/bf16.h"
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

// SEQUOIA_KERNELS_AMX=emulate (read once): the AMX paths are taken as on an AMX CPU (within
// ATEN_CPU_CAPABILITY's cap), their tiles emulated in software (EmuTiles below): every AMX kernel's
// layout and rounding run on CPUs without AMX, a whole model included (slowly: for tests).
inline bool amx_emulated() {
  static const bool on = [] {
    const char* v = std::getenv("SEQUOIA_KERNELS_AMX");
    return v != nullptr && std::strcmp(v, "emulate") == 0;
  }();
  return on;
}

// CPUID AMX-TILE and AMX-BF16 and Linux lets this process use the tiles (asked once: the
// permission is per process), or the emulated tiles where asked for; never under an
// ATEN_CPU_CAPABILITY cap (avx512 and below).
inline bool have_amx_bf16() {
  static const bool ok = [] {
    if (isa_cap() < 3) return false;
    if (amx_emulated()) return true;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
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

// The tile operations an AMX kernel is written in, as a policy (template argument): HwTiles issues
// the instructions; EmuTiles runs them in software on any x86-64 CPU, so the kernels' tile layout
// (configurations, strides, padding, the order of loads and products) is tested where no AMX is
// (the "amx_emulated" paths). Tile registers are template arguments: the instructions take them
// as literals.
#define SK_AMX_INLINE __attribute__((target("amx-tile"), always_inline)) static inline
#define SK_AMX_BF16_INLINE __attribute__((target("amx-tile,amx-bf16"), always_inline)) static inline

struct HwTiles {
  static constexpr bool kHardware = true;
  SK_AMX_INLINE void config(const TileConfig& c) { _tile_loadconfig(&c); }
  SK_AMX_INLINE void release() { _tile_release(); }
#ifdef __clang__  // the intrinsics take the register as a constant expression
  template <int T>
  SK_AMX_INLINE void zero() { _tile_zero(T); }
  template <int T>
  SK_AMX_INLINE void load(const void* p, int64_t stride) { _tile_loadd(T, p, stride); }
  template <int T>
  SK_AMX_INLINE void store(void* p, int64_t stride) { _tile_stored(T, p, stride); }
  template <int C, int A, int B>
  SK_AMX_BF16_INLINE void dpbf16() { _tile_dpbf16ps(C, A, B); }
#else  // GCC's intrinsics paste the register's digits into their asm: the same asm, the register an operand
  template <int T>
  SK_AMX_INLINE void zero() { __asm__ volatile("tilezero\t%%tmm%c0" ::"i"(T)); }
  template <int T>
  SK_AMX_INLINE void load(const void* p, int64_t stride) {
    __asm__ volatile("{tileloadd\t(%0,%1,1), %%tmm%c2|tileloadd\t%%tmm%c2, [%0+%1*1]}" ::"r"(p),
                     "r"(static_cast<long>(stride)), "i"(T));
  }
  template <int T>
  SK_AMX_INLINE void store(void* p, int64_t stride) {
    __asm__ volatile("{tilestored\t%%tmm%c2, (%0,%1,1)|tilestored\t[%0+%1*1], %%tmm%c2}" ::"r"(p),
                     "r"(static_cast<long>(stride)), "i"(T)
                     : "memory");
  }
  template <int C, int A, int B>
  SK_AMX_BF16_INLINE void dpbf16() {
    __asm__ volatile("{tdpbf16ps\t%%tmm%c2, %%tmm%c1, %%tmm%c0|tdpbf16ps\t%%tmm%c0, %%tmm%c1, %%tmm%c2}" ::"i"(C),
                     "i"(A), "i"(B));
  }
#endif
};

// tdpbf16ps's arithmetic as AMX CPUs compute it: each instruction adds its products (2 colsb(A) /
// 4 per output) to the accumulator with one rounding to nearest even (measured on SmolLM2's
// shapes: docs/bf16_cpu.md; the SDM's pseudo-code adds them one at a time), bf16 denormals read
// as zero and denormal results flushed to zero (the SDM). The sum is taken in fp64, exact when
// the accumulator's and the products' exponents span less than ~29 bits (any data the tests
// draw). Tiles are per thread, as the registers; a load zeroes the rows and bytes past the
// configured ones, as the instruction. A configuration the hardware would fault on throws.
struct EmuTiles {
  static constexpr bool kHardware = false;
  struct State {
    TileConfig cfg;
    alignas(64) unsigned char t[8][16][64];
  };
  static State& state() {
    static thread_local State s;
    return s;
  }
  static void config(const TileConfig& c) {
    for (int t = 0; t < 8; ++t)
      if (c.rows[t] > 16 || c.colsb[t] > 64 || c.colsb[t] % 4 != 0)
        throw std::runtime_error("emulated AMX: tile " + std::to_string(t) + " configured past 16 rows x 64 bytes");
    state().cfg = c;
    std::memset(state().t, 0, sizeof(state().t));
  }
  static void release() { state().cfg = TileConfig{}; }
  template <int T>
  static void zero() {
    std::memset(state().t[T], 0, sizeof(state().t[T]));
  }
  template <int T>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r)
      std::memcpy(s.t[T][r], static_cast<const char*>(p) + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* p, int64_t stride) {
    const State& s = state();
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }
  static double bf16_daz(const unsigned char* p) {  // a bf16 as fp64, a denormal as zero
    uint16_t h;
    std::memcpy(&h, p, 2);
    return bf16_to_f32(static_cast<uint16_t>((h & 0x7F80) == 0 ? h & 0x8000 : h));
  }
  template <int C, int A, int B>
  static void dpbf16() {
    State& s = state();
    const int rows = s.cfg.rows[C], n = s.cfg.colsb[C] / 4, kp = s.cfg.colsb[A] / 4;
    if (s.cfg.rows[A] != rows || s.cfg.rows[B] != kp || s.cfg.colsb[B] != s.cfg.colsb[C])
      throw std::runtime_error("emulated AMX: tdpbf16ps on tiles of mismatched shapes");
    for (int m = 0; m < rows; ++m)
      for (int j = 0; j < n; ++j) {
        float acc;
        std::memcpy(&acc, s.t[C][m] + 4 * j, 4);
        double sum = acc;
        for (int k = 0; k < kp; ++k)
          sum += bf16_daz(s.t[A][m] + 4 * k) * bf16_daz(s.t[B][k] + 4 * j) +
                 bf16_daz(s.t[A][m] + 4 * k + 2) * bf16_daz(s.t[B][k] + 4 * j + 2);
        float r = static_cast<float>(sum);
        if (r != 0.f && std::fabs(r) < 1.17549435e-38f) r = std::copysign(0.f, r);  // FTZ
        std::memcpy(s.t[C][m] + 4 * j, &r, 4);
      }
  }
};

}  // namespace sequoia_kernels::cpu
#endif  // SK_BF16_WIDE
