// packed_linear_bf16: y = x W^T for few rows in bf16 (the decoding loop's M = 1 .. 64 tree
// tokens on a bf16 CPU model), from a weight packed once in bf16 (half the bytes of the fp32
// packed_linear) into panels of 16 output features whose k run in pairs:
// w_packed [P, K2, 16, 2] bf16, P = 4 ceil(N / 64) panels, K2 = 16 ceil(K / 32) pairs, zero
// padded (sequoia_kernels/ops/packed_linear.py: pack_linear_weight_bf16). One k pair of a panel
// is 64 bytes: one AVX-512 register, one row of an AMX B tile (the VNNI layout).
//
// Every output is one fp32 chain over the k pairs in order, each pair adding the odd product then
// the even one (products of two bf16 are exact in fp32, so each step is one rounding: the
// semantics of vdpbf16ps), rounded to bf16 once (round to nearest even). A row's chain does not
// depend on M or on the other rows, so a token's logits are the same in a 1-token step and in a
// tree step (batch invariance), which torch's bf16 GEMM does not promise. The ISA is chosen per
// CPU, never per call: AMX tiles (16 rows x 16 features x 16 pairs per instruction) where the CPU
// and the kernel allow them, else AVX-512-BF16 (vdpbf16ps), else AVX-512F or AVX2+FMA (bf16
// widened in registers: 16 or 8 lanes), else scalar fmaf. The AVX paths and the scalar one are
// that chain bitwise on normal numbers (vdpbf16ps flushes denormals); AMX is not: a tile
// instruction adds its 32 products with one rounding (measured), so AMX agrees with the chain
// within one bf16 rounding and is batch invariant on its own (tests/test_packed_linear_bf16.py
// checks all of it). The AMX code is written on a tile policy (cpu/amx.h): the instructions, or
// software tiles with their rounding (isa "amx_emulated", or SEQUOIA_KERNELS_AMX=emulate), so its
// layout is tested on CPUs without AMX too.
//
// An optional residual [M, N] is added in the output store: y = bf16(bf16(chain) + residual), the
// two roundings of torch's bf16 add of the product and the residual (a decoder layer's residual
// add without its own pass over the rows: sequoia_kernels/ops/lean_layers.py). Two epilogues
// run on each group of 64 columns right after it is stored (its rows still in L1): the rotary
// (a fused q / k projection's) and SiLU-and-multiply (a fused [gate; up] projection's: each group
// is then 32 gate and the same 32 up features, and a second output receives silu_mul of them).
//
// Roofline: bytes = 2 N K (the weight, read once per call) + 2 M (K + N); FLOPs = 2 M N K.
// Measured on SmolLM2-135M's linears (2-core Xeon, bench/packed_linear_cpu.py, which then timed
// packed_linear's Python checks too: ~9 us a call, ~2-3 ms of a forward at M = 1): AMX at M = 1
// ran at ~1.7x the weight-read time; M = 32 costs ~1.05x M = 1 and M = 64 ~1.5x since row blocks
// go in pairs sharing each B tile (B tile loads bound the AMX loop, not the tile products); the
// AVX paths are read-bound up to a few rows and bound by the FMA / dot-product units above (on a
// Zen 4, AVX-512-BF16: the gate-up product at M = 32 at 89% of vdpbf16ps's peak, docs/bf16_cpu.md).
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu/amx.h"  // SK_BF16_WIDE: the compiler builds the AVX-512-BF16 and AMX paths
#include "cpu/bf16.h"
#include "cpu/rotary.h"
#include "cpu/silu.h"
#include "cpu/simd.h"

#ifdef SK_X86_AVX2_FMA
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sequoia_kernels {

namespace {

using cpu::bf16_to_f32;
using cpu::f32_to_bf16;
#ifdef SK_X86_AVX2_FMA
using cpu::round_bf16_8;
#endif

constexpr int kPanel = 16;  // output features per panel
constexpr int kGroup = 4;   // panels per task step (one AMX C tile each); P is a multiple of it
constexpr int kBlock = 16;  // k pairs per AMX B tile
constexpr int kAhead = 4;   // AMX: B tiles prefetched this many k blocks ahead

// kAmxEmulated: the AMX path's code on software tiles (cpu::EmuTiles), for tests; never chosen by kAuto
enum Isa : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512Bf16 = 3, kAmx = 4, kAvx512 = 5, kAmxEmulated = 6 };

// The packed weight's [P, K2] of an [N, K] weight: P = 4 ceil(N / 64) panels, K2 = 16 ceil(K / 32) pairs.
inline int64_t packed_panels(int64_t N) { return (N + kGroup * kPanel - 1) / (kGroup * kPanel) * kGroup; }
inline int64_t packed_pairs(int64_t K) { return (K + 2 * kBlock - 1) / (2 * kBlock) * kBlock; }

struct Problem {
  const uint16_t* x;  // [M, K], row stride xs
  const uint16_t* w;  // [P, K2, 16, 2]
  uint16_t* y;        // [M, N], row stride ys
  int64_t M, K, N, K2, xs, ys;
  const uint16_t* res = nullptr;  // [M, N], row stride rs: added to y (each rounded to bf16 first), or none
  int64_t rs = 0;
  // The rotary epilogue (rope_cols > 0): y's first rope_cols columns are heads of rope_d values,
  // rotated in place once their group is stored; row m = (b, t) (T rows a batch row) reads cos /
  // sin at rc + b cb + t ct (rsn likewise), cb = 0 for one [1, T, D] table for all batch rows.
  int64_t rope_cols = 0, rope_d = 0, rope_t = 1, cb = 0, ct = 0;
  const uint16_t *rc = nullptr, *rsn = nullptr;
  cpu::RotaryRowsFn rope_rows = nullptr;  // the rotary rows' kernel for rope_d on this CPU
  // The SiLU-and-multiply epilogue (su set): w is a gate and an up projection stacked, [gate; up]
  // (N = 2 I, I a multiple of 32). Group g is then gate panels 2g, 2g + 1 and up panels
  // I / 16 + 2g, + 1 (the same features' gate and up), and once it is stored, su[m, 32 g + j] =
  // silu_mul(y[m, 32 g + j], y[m, I + 32 g + j]) for j < 32 (row stride sus; cpu/silu.h's kernel).
  uint16_t* su = nullptr;
  int64_t sus = 0;
  cpu::SiluMulRowFn silu = nullptr;
  // x's pair j as two floats (the pair past an odd K's end reads 0)
  float xe(int64_t m, int64_t j) const { return 2 * j < K ? bf16_to_f32(x[m * xs + 2 * j]) : 0.f; }
  float xo(int64_t m, int64_t j) const { return 2 * j + 1 < K ? bf16_to_f32(x[m * xs + 2 * j + 1]) : 0.f; }
  int64_t ncols(int64_t p) const { return std::max<int64_t>(0, std::min<int64_t>(kPanel, N - p * kPanel)); }
  // Group g's panel c (c < kGroup): 4 g + c, or with the SiLU epilogue gate, gate, up, up (above).
  int64_t panel(int64_t g, int c) const {
    return su == nullptr ? g * kGroup + c : (c < 2 ? 0 : N / (2 * kPanel)) + 2 * g + (c & 1);
  }
};

// One panel's rows [0, R) from fp32 accumulators acc[r * 16 + j] to bf16 y (row stride ys), the
// first ncols; with a residual res (row stride rs) each then + res, rounded again (torch's add).
struct Rows {
  uint16_t* y;
  int64_t ys;
  const uint16_t* res;
  int64_t rs, ncols;
};

// Panel p's rows from m0 of pb's output (and residual).
inline Rows rows_of(const Problem& pb, int64_t m0, int64_t p) {
  return {pb.y + m0 * pb.ys + p * kPanel, pb.ys, pb.res ? pb.res + m0 * pb.rs + p * kPanel : nullptr, pb.rs,
          pb.ncols(p)};
}

// The rotary epilogue on group g's 64 columns (whole heads: 64 % rope_d == 0), in place, after
// the group's products are stored: the rotary op's arithmetic (cpu/rotary.h), on rows still in L1.
inline void rope_group(const Problem& pb, int64_t g) {
  const int64_t c0 = g * kGroup * kPanel;
  if (c0 >= pb.rope_cols) return;
  for (int64_t col = c0; col < c0 + kGroup * kPanel; col += pb.rope_d)
    for (int64_t m0 = 0; m0 < pb.M; m0 += pb.rope_t) {  // one batch row's T rows per call
      uint16_t* y = pb.y + m0 * pb.ys + col;
      const int64_t b = m0 / pb.rope_t;
      pb.rope_rows({y, pb.rc + b * pb.cb, pb.rsn + b * pb.cb, pb.ys, pb.ct, pb.ct, pb.rope_d, pb.rope_t, y, pb.ys});
    }
}

// The SiLU epilogue on group g's gate and up columns, just stored (rows still in L1).
inline void silu_group(const Problem& pb, int64_t g) {
  const int64_t c0 = g * 2 * kPanel, I = pb.N / 2;
  for (int64_t m = 0; m < pb.M; ++m) {
    const uint16_t* y = pb.y + m * pb.ys + c0;
    pb.silu(y, y + I, 2 * kPanel, pb.su + m * pb.sus + c0);
  }
}

// What follows group g's store: the rotary or the SiLU epilogue, where asked for.
inline void epilogue(const Problem& pb, int64_t g) {
  if (pb.rope_cols > 0) rope_group(pb, g);
  if (pb.su != nullptr) silu_group(pb, g);
}

inline void store_rows(const float* acc, int R, const Rows& o) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < o.ncols; ++j) {
      uint16_t v = f32_to_bf16(acc[r * kPanel + j]);
      if (o.res) v = f32_to_bf16(bf16_to_f32(v) + bf16_to_f32(o.res[r * o.rs + j]));
      o.y[r * o.ys + j] = v;
    }
}

#ifdef SK_X86_AVX2_FMA
__attribute__((target("avx2"))) inline __m256i add_residual_8(__m256i rounded, const uint16_t* res) {
  const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(rounded, 16));
  return round_bf16_8(_mm256_add_ps(v, cpu::load_bf16_8(res)));
}

__attribute__((target("avx2"))) void store_rows_avx2(const float* acc, int R, const Rows& o) {
  if (o.ncols < kPanel) return store_rows(acc, R, o);
  for (int r = 0; r < R; ++r) {
    __m256i lo = round_bf16_8(_mm256_loadu_ps(acc + r * kPanel));
    __m256i hi = round_bf16_8(_mm256_loadu_ps(acc + r * kPanel + 8));
    if (o.res) lo = add_residual_8(lo, o.res + r * o.rs), hi = add_residual_8(hi, o.res + r * o.rs + 8);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.y + r * o.ys), packed);
  }
}
#endif

#ifdef SK_X86_AVX512
// store_rows_avx2 on 16 lanes (a panel's row in one register; the same roundings, the same bits)
__attribute__((target("avx512f"))) void store_rows_avx512(const float* acc, int R, const Rows& o) {
  if (o.ncols < kPanel) return store_rows(acc, R, o);
  for (int r = 0; r < R; ++r) {
    __m512 v = _mm512_loadu_ps(acc + r * kPanel);
    if (o.res) {
      v = _mm512_castsi512_ps(_mm512_slli_epi32(cpu::round_bf16_16(v), 16));
      v = _mm512_add_ps(v, cpu::load_bf16_16(o.res + r * o.rs));
    }
    cpu::store_bf16_16(o.y + r * o.ys, v);
  }
}
#endif

// ---- scalar: the chain itself, one output at a time
void panel_scalar(const Problem& pb, int64_t p) {
  const int64_t nc = pb.ncols(p), kp = (pb.K + 1) / 2;
  const uint16_t* w = pb.w + p * pb.K2 * 2 * kPanel;
  for (int64_t m = 0; m < pb.M; ++m) {
    float t[kPanel];
    for (int64_t n = 0; n < nc; ++n) {
      float acc = 0.f;
      for (int64_t j = 0; j < kp; ++j) {
        acc = std::fma(pb.xo(m, j), bf16_to_f32(w[(j * kPanel + n) * 2 + 1]), acc);
        acc = std::fma(pb.xe(m, j), bf16_to_f32(w[(j * kPanel + n) * 2]), acc);
      }
      t[n] = acc;
    }
    store_rows(t, 1, rows_of(pb, m, p));
  }
}

#ifdef SK_X86_AVX2_FMA
// ---- AVX2+FMA: R <= 6 rows x 1 panel, 2 ymm accumulators per row (8 features each). Per pair,
// the odd halves of the panel's 64 bytes are widened (two shifts) into 2 registers for every row's
// first FMA, then the even halves (a shift) for the second: 12 accumulators + 2 weights + 1
// broadcast of the 16 registers. x arrives widened to fp32 once per call (xf: [M, 2 K2], zero
// padded past K), so a row's two factors are broadcast loads, not scalar conversions. With 2+
// rows the first tile of a panel prefetches it cpu::kPrefetchBytes ahead (csrc/cpu/simd.h).
template <int R>
__attribute__((target("avx2,fma"))) void tile_bf16_avx2(const Problem& pb, const float* xf, int64_t m0, int64_t p,
                                                       bool prefetch) {
  const int64_t kp = (pb.K + 1) / 2, xs = 2 * pb.K2;
  const uint16_t* w = pb.w + p * pb.K2 * 2 * kPanel;
  const float* x = xf + m0 * xs;
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t j = 0; j < kp; ++j, w += 2 * kPanel) {
    const __m256i* v = reinterpret_cast<const __m256i*>(w);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w) + cpu::kPrefetchBytes, _MM_HINT_T0);
    // the odd halves by two shifts, not a mask: a mask takes the 16th ymm, and GCC then kept accumulators
    // on the stack (test_machine_code_uses_amx_and_vdpbf16ps); the shifts cost nothing measurable here
    __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(v), 16), 16));
    __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(_mm256_loadu_si256(v + 1), 16), 16));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xo = _mm256_broadcast_ss(x + r * xs + 2 * j + 1);
      acc[r][0] = _mm256_fmadd_ps(xo, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xo, b, acc[r][1]);
    }
    a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(v), 16));
    b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(v + 1), 16));
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * xs + 2 * j);
      acc[r][0] = _mm256_fmadd_ps(xe, a, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xe, b, acc[r][1]);
    }
  }
  alignas(32) float t[R * kPanel];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(t + r * kPanel, acc[r][0]);
    _mm256_store_ps(t + r * kPanel + 8, acc[r][1]);
  }
  store_rows_avx2(t, R, rows_of(pb, m0, p));
}

__attribute__((target("avx2,fma"))) void group_bf16_avx2(const Problem& pb, const float* xf, int64_t g) {
  for (int c = 0; c < kGroup && pb.ncols(pb.panel(g, c)) > 0; ++c) {  // a panel's weights stay in L1/L2 over its rows
    const int64_t q = pb.panel(g, c);
    int64_t m = 0;  // the first tile of a call of 2+ rows prefetches (cpu::kPrefetchBytes)
    for (; m + 6 <= pb.M; m += 6) tile_bf16_avx2<6>(pb, xf, m, q, m == 0);
    const bool pf = m == 0 && pb.M >= 2;  // the remainder tile is the first
    switch (pb.M - m) {
      case 5: tile_bf16_avx2<5>(pb, xf, m, q, pf); break;
      case 4: tile_bf16_avx2<4>(pb, xf, m, q, pf); break;
      case 3: tile_bf16_avx2<3>(pb, xf, m, q, pf); break;
      case 2: tile_bf16_avx2<2>(pb, xf, m, q, pf); break;
      case 1: tile_bf16_avx2<1>(pb, xf, m, q, pf); break;
      default: break;
    }
  }
}

// x widened to fp32 for the AVX2 path: [M, 2 K2], zero padded past K (exact: bf16 -> fp32).
std::vector<float> widen_x(const Problem& pb) {
  std::vector<float> xf(static_cast<size_t>(pb.M * 2 * pb.K2), 0.f);
  for (int64_t m = 0; m < pb.M; ++m)
    for (int64_t k = 0; k < pb.K; ++k) xf[m * 2 * pb.K2 + k] = bf16_to_f32(pb.x[m * pb.xs + k]);
  return xf;
}

#ifdef SK_X86_AVX512
// ---- AVX-512F (no BF16: Skylake-SP .. Ice Lake): R <= 4 rows x 4 panels, one zmm accumulator
// per (row, panel): 16 of the 32 registers, 4 for the panels' weights, 4 for the rows' broadcast
// factors (6 rows spilled accumulators: GCC keeps every broadcast in a register). Per pair the
// odd halves of each panel's 64 bytes are widened (a mask) for every row's first FMA, then the
// even halves (a shift) for the second: the AVX2 path's chain on 16 lanes, the same bits. x
// arrives widened (xf, as for AVX2). One call runs pairs [j0, j1) on the accumulators in acc
// ([4 panels][kChunk rows][16], this tile's rows from r0; zeros when j0 = 0): the fp32 values go
// out and come back unchanged, so splitting k changes no bit.
constexpr int kChunk = 32;   // rows whose accumulators a group keeps while it walks k
constexpr int64_t kSpan = 32;  // k pairs per walk step: 4 panels x 32 pairs = 8 KB of weights, in L1

template <int R>
__attribute__((target("avx512f"), noinline)) void tile_bf16_avx512f(const Problem& pb, const float* xf, int64_t m0,
                                                                  int64_t g, int64_t j0, int64_t j1, float* acc_out,
                                                                  int r0) {
  const int64_t xs = 2 * pb.K2, stride = pb.K2 * 2 * kPanel;
  const uint16_t* w0 = pb.w + pb.panel(g, 0) * stride;
  const uint16_t* w2 = pb.w + pb.panel(g, 2) * stride;  // panels 2, 3: w0 + 2 stride but with the SiLU epilogue
  const float* x = xf + (m0 + r0) * xs;
  const __m512i odd = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const bool pf = r0 == 0;  // the first tile prefetches the next span (5-10% at M = 4 .. 8 here)
  __m512 acc[R][kGroup];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kGroup; ++c)
      acc[r][c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(acc_out + (c * kChunk + r0 + r) * kPanel);
  for (int64_t j = j0; j < j1; ++j) {
    __m512i v[kGroup];
    __m512 w[kGroup];
#pragma GCC unroll 4
    for (int c = 0; c < kGroup; ++c) {
      const uint16_t* line = (c < 2 ? w0 : w2) + (c & 1) * stride + j * 2 * kPanel;
      v[c] = _mm512_loadu_si512(line);
      w[c] = _mm512_castsi512_ps(_mm512_and_si512(v[c], odd));
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(line + kSpan * 2 * kPanel), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xo = _mm512_set1_ps(x[r * xs + 2 * j + 1]);
#pragma GCC unroll 4
      for (int c = 0; c < kGroup; ++c) acc[r][c] = _mm512_fmadd_ps(xo, w[c], acc[r][c]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < kGroup; ++c) w[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v[c], 16));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x[r * xs + 2 * j]);
#pragma GCC unroll 4
      for (int c = 0; c < kGroup; ++c) acc[r][c] = _mm512_fmadd_ps(xe, w[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kGroup; ++c) _mm512_store_ps(acc_out + (c * kChunk + r0 + r) * kPanel, acc[r][c]);
}

// Group g on rows [m0, m0 + rows), rows <= kChunk: k walked kSpan pairs at a time, each step
// through every 4-row tile, so a span's weights come from memory once and serve all rows from L1
// (the first tile prefetching the next span). (Widening a span to fp32 once for all tiles, to
// spare the FMA ports the mask and shift, measured no better: docs/bf16_cpu.md.)
__attribute__((target("avx512f"))) void chunk_bf16_avx512f(const Problem& pb, const float* xf, int64_t g, int64_t m0,
                                                         int rows) {
  alignas(64) float acc[kGroup * kChunk * kPanel];
  const int64_t kp = (pb.K + 1) / 2;
  for (int64_t j0 = 0; j0 < kp; j0 += kSpan) {
    const int64_t j1 = std::min(kp, j0 + kSpan);
    int r = 0;
    for (; r + 4 <= rows; r += 4) tile_bf16_avx512f<4>(pb, xf, m0, g, j0, j1, acc, r);
    switch (rows - r) {
      case 3: tile_bf16_avx512f<3>(pb, xf, m0, g, j0, j1, acc, r); break;
      case 2: tile_bf16_avx512f<2>(pb, xf, m0, g, j0, j1, acc, r); break;
      case 1: tile_bf16_avx512f<1>(pb, xf, m0, g, j0, j1, acc, r); break;
      default: break;
    }
  }
  for (int c = 0; c < kGroup; ++c) store_rows_avx512(acc + c * kChunk * kPanel, rows, rows_of(pb, m0, pb.panel(g, c)));
}

__attribute__((target("avx512f"))) void group_bf16_avx512f(const Problem& pb, const float* xf, int64_t g) {
  for (int64_t m0 = 0; m0 < pb.M; m0 += kChunk)
    chunk_bf16_avx512f(pb, xf, g, m0, static_cast<int>(std::min<int64_t>(kChunk, pb.M - m0)));
}
#endif  // SK_X86_AVX512

#ifdef SK_BF16_WIDE
// ---- AVX-512-BF16: R <= 4 rows x 4 panels, one zmm accumulator per (row, panel): 16 of the 32
// registers (6 rows spilled)
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void tile_bf16_avx512(const Problem& pb, int64_t m0, int64_t g) {
  const int64_t kp = (pb.K + 1) / 2, stride = pb.K2 * 2 * kPanel;
  const uint16_t* w0 = pb.w + pb.panel(g, 0) * stride;
  const uint16_t* w2 = pb.w + pb.panel(g, 2) * stride;  // panels 2, 3: w0 + 2 stride but with the SiLU epilogue
  __m512 acc[R][kGroup];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kGroup; ++c) acc[r][c] = _mm512_setzero_ps();
  const bool odd_tail = pb.K % 2 == 1;
  for (int64_t j = 0; j < kp; ++j) {
    __m512bh w[kGroup];
#pragma GCC unroll 4
    for (int c = 0; c < kGroup; ++c)
      w[c] = (__m512bh)_mm512_loadu_si512((c < 2 ? w0 : w2) + (c & 1) * stride + j * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      if (odd_tail && j == kp - 1) {
        pair = pb.x[(m0 + r) * pb.xs + 2 * j];  // the missing odd half reads 0
      } else {
        std::memcpy(&pair, pb.x + (m0 + r) * pb.xs + 2 * j, 4);
      }
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int c = 0; c < kGroup; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, w[c]);
    }
  }
  alignas(64) float t[R * kPanel];
  for (int c = 0; c < kGroup; ++c) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_store_ps(t + r * kPanel, acc[r][c]);
    store_rows_avx512(t, R, rows_of(pb, m0, pb.panel(g, c)));
  }
}

__attribute__((target("avx512f,avx512bf16"))) void group_bf16_avx512(const Problem& pb, int64_t g) {
  int64_t m = 0;
  for (; m + 4 <= pb.M; m += 4) tile_bf16_avx512<4>(pb, m, g);
  switch (pb.M - m) {
    case 3: tile_bf16_avx512<3>(pb, m, g); break;
    case 2: tile_bf16_avx512<2>(pb, m, g); break;
    case 1: tile_bf16_avx512<1>(pb, m, g); break;
    default: break;
  }
}

// ---- AMX: per 16-row block, C tiles tmm4..7 (4 panels), A tile tmm0, B tiles tmm1..3. Written
// in a tile policy T (cpu/amx.h): cpu::HwTiles on an AMX CPU, cpu::EmuTiles for the emulated path
// ("amx_emulated": the same code on software tiles, on any x86-64 CPU).
using cpu::TileConfig;

// A tile's stored rows to y: AVX-512F beside the hardware tiles, the scalar stores (the same bits)
// beside the emulated ones, which run where AVX-512F may not.
template <class T>
inline void store_tile_rows(const float* acc, int R, const Rows& o) {
  if constexpr (T::kHardware) {
    store_rows_avx512(acc, R, o);
  } else {
    store_rows(acc, R, o);
  }
}

template <class T>
__attribute__((target("amx-tile"))) void amx_configure(int rows) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(rows);  // A: rows x 16 pairs
  cfg.colsb[0] = 64;
  for (int t = 1; t <= 3; ++t) cfg.rows[t] = kBlock, cfg.colsb[t] = 64;  // B: 16 pairs x 16 features
  for (int t = 4; t <= 7; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;  // C
  T::config(cfg);
}

// The B tiles of `panels` panels (from w) kAhead k blocks past kb, into L1: tile loads do not
// train the hardware prefetchers. (On the AMX Xeon of docs/bf16_cpu.md an in-process A/B found
// this, prefetching on into the next pass, and no software prefetch at all within noise of each
// other at M = 1 .. 32: the hardware keeps up there. Kept for CPUs where it does not.)
__attribute__((target("amx-tile"))) inline void prefetch_b_tiles(const Problem& pb, const uint16_t* w, int64_t kb,
                                                               int panels) {
  if (kb + kAhead * kBlock >= pb.K2) return;
  const char* ahead = reinterpret_cast<const char*>(w + (kb + kAhead * kBlock) * 2 * kPanel);
  for (int q = 0; q < panels; ++q)
    for (int line = 0; line < kBlock; ++line) _mm_prefetch(ahead + q * pb.K2 * 2 * kPanel * 2 + line * 64, _MM_HINT_T0);
}

// x rows [m0, m0 + rows) times panels [p, p + 4). a: this block of x (the configured rows
// readable), row stride as (bf16), K2 column pairs readable (zero padded past K).
template <class T>
__attribute__((target("amx-tile,amx-bf16"))) void block_bf16_amx(const Problem& pb, const uint16_t* a, int64_t as,
                                                             int64_t m0, int rows, int64_t g) {
  const int64_t stride = pb.K2 * 2 * kPanel;
  const uint16_t* w = pb.w + pb.panel(g, 0) * stride;
  const uint16_t* w2 = pb.w + pb.panel(g, 2) * stride;  // w + 2 stride but with the SiLU epilogue
  T::template zero<4>();
  T::template zero<5>();
  T::template zero<6>();
  T::template zero<7>();
  for (int64_t kb = 0; kb < pb.K2; kb += kBlock) {
    prefetch_b_tiles(pb, w, kb, 2);
    prefetch_b_tiles(pb, w2, kb, 2);
    T::template load<0>(a + 2 * kb, as * 2);
    T::template load<1>(w + kb * 2 * kPanel, 64);
    T::template dpbf16<4, 0, 1>();
    T::template load<2>(w + stride + kb * 2 * kPanel, 64);
    T::template dpbf16<5, 0, 2>();
    T::template load<3>(w2 + kb * 2 * kPanel, 64);
    T::template dpbf16<6, 0, 3>();
    T::template load<1>(w2 + stride + kb * 2 * kPanel, 64);
    T::template dpbf16<7, 0, 1>();
  }
  alignas(64) float t[kBlock * kPanel];
  T::template store<4>(t, 64);
  store_tile_rows<T>(t, rows, rows_of(pb, m0, pb.panel(g, 0)));
  T::template store<5>(t, 64);
  store_tile_rows<T>(t, rows, rows_of(pb, m0, pb.panel(g, 1)));
  T::template store<6>(t, 64);
  store_tile_rows<T>(t, rows, rows_of(pb, m0, pb.panel(g, 2)));
  T::template store<7>(t, 64);
  store_tile_rows<T>(t, rows, rows_of(pb, m0, pb.panel(g, 3)));
}

// Two row blocks at once (rows0 + rows1 <= 32): A tiles tmm0 / tmm1, B tiles tmm2 / tmm3 (2
// panels), C tiles tmm4 / tmm5 (block 0) and tmm6 / tmm7 (block 1).
template <class T>
__attribute__((target("amx-tile"))) void amx_configure_pair(int rows0, int rows1) {
  TileConfig cfg;
  cfg.rows[0] = static_cast<uint8_t>(rows0), cfg.rows[1] = static_cast<uint8_t>(rows1);
  for (int t = 2; t <= 3; ++t) cfg.rows[t] = kBlock;
  cfg.rows[4] = cfg.rows[5] = static_cast<uint8_t>(rows0);
  cfg.rows[6] = cfg.rows[7] = static_cast<uint8_t>(rows1);
  for (int t = 0; t <= 7; ++t) cfg.colsb[t] = 64;
  T::config(cfg);
}

// x rows [m0, m0 + rows0 + rows1) times panels [p, p + 2): each B tile loaded once for both row
// blocks (the B tile loads, not the tile products, bound a block: one B load per product instead
// of one per product per block halves them at M = 17 .. 32). Each row's chain is block_bf16_amx's:
// the same products added in the same k order (a row's bits do not depend on M).
template <class T>
__attribute__((target("amx-tile,amx-bf16"))) void pair_bf16_amx(const Problem& pb, const uint16_t* a, int64_t as,
                                                            int64_t m0, int rows0, int rows1, int64_t p,
                                                            bool prefetch) {
  const int64_t stride = pb.K2 * 2 * kPanel;
  const uint16_t* w = pb.w + p * stride;
  const uint16_t* a1 = a + kBlock * as;
  T::template zero<4>();
  T::template zero<5>();
  T::template zero<6>();
  T::template zero<7>();
  // each tile loaded as soon as the product before it has read its register (tile registers are
  // not renamed: a load waits for the last reader of its register), the next k block's A and B
  // loads issued between this block's products
  T::template load<0>(a, as * 2);
  T::template load<2>(w, 64);
  for (int64_t kb = 0; kb < pb.K2; kb += kBlock) {
    if (prefetch) prefetch_b_tiles(pb, w, kb, 2);  // first pass over the weights: from memory
    const bool more = kb + kBlock < pb.K2;
    T::template dpbf16<4, 0, 2>();
    T::template load<1>(a1 + 2 * kb, as * 2);
    T::template load<3>(w + stride + kb * 2 * kPanel, 64);
    T::template dpbf16<6, 1, 2>();
    if (more) T::template load<2>(w + (kb + kBlock) * 2 * kPanel, 64);
    T::template dpbf16<5, 0, 3>();
    if (more) T::template load<0>(a + 2 * (kb + kBlock), as * 2);
    T::template dpbf16<7, 1, 3>();
  }
  alignas(64) float t[kBlock * kPanel];
  T::template store<4>(t, 64);
  store_tile_rows<T>(t, rows0, rows_of(pb, m0, p));
  T::template store<5>(t, 64);
  store_tile_rows<T>(t, rows0, rows_of(pb, m0, p + 1));
  T::template store<6>(t, 64);
  store_tile_rows<T>(t, rows1, rows_of(pb, m0 + kBlock, p));
  T::template store<7>(t, 64);
  store_tile_rows<T>(t, rows1, rows_of(pb, m0 + kBlock, p + 1));
}

// Groups [g0, g1), each against every row block of x in turn (the group's weights stay in L2
// across the blocks; reading them once per block from memory cost 1.5x at M = 32). M <= 16: one
// 16-row block per tile (block_bf16_amx, M rows configured); M = 17 .. 32: one pair of blocks
// (pair_bf16_amx, 16 + M - 16 rows); M > 32: pairs of 16 + 16 rows, x copied to a zero-padded
// buffer when M is not a multiple of 32 (or K of 32, for any M).
template <class T>
__attribute__((target("amx-tile,amx-bf16"))) void groups_bf16_amx(const Problem& pb, int64_t g0, int64_t g1) {
  const int64_t padded_m = pb.M <= 2 * kBlock ? pb.M : (pb.M + 2 * kBlock - 1) / (2 * kBlock) * (2 * kBlock);
  const uint16_t* a = pb.x;
  int64_t as = pb.xs;
  thread_local std::vector<uint16_t> buf;
  if (pb.K != 2 * pb.K2 || padded_m != pb.M) {  // zeros add nothing to a chain and fill unused rows
    as = 2 * pb.K2;
    if (buf.size() < static_cast<size_t>(padded_m * as)) buf.resize(padded_m * as);
    for (int64_t m = 0; m < padded_m; ++m) {
      uint16_t* row = buf.data() + m * as;
      const int64_t copied = m < pb.M ? pb.K : 0;
      if (copied) std::memcpy(row, pb.x + m * pb.xs, 2 * copied);
      std::memset(row + copied, 0, 2 * (as - copied));
    }
    a = buf.data();
  }
  if (pb.M <= kBlock) {
    amx_configure<T>(static_cast<int>(pb.M));
    for (int64_t g = g0; g < g1; ++g) {
      block_bf16_amx<T>(pb, a, as, 0, static_cast<int>(pb.M), g);
      epilogue(pb, g);
    }
  } else {
    const int rows1 = static_cast<int>(std::min<int64_t>(kBlock, padded_m - kBlock));  // M > 32: 16
    amx_configure_pair<T>(kBlock, rows1);
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t m0 = 0; m0 < pb.M; m0 += 2 * kBlock) {
        const int r0 = static_cast<int>(std::min<int64_t>(kBlock, pb.M - m0));
        const int r1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(kBlock, pb.M - m0 - kBlock)));
        for (int h = 0; h < kGroup; h += 2) pair_bf16_amx<T>(pb, a + m0 * as, as, m0, r0, r1, pb.panel(g, h), m0 == 0);
      }
      epilogue(pb, g);
    }
  }
  T::release();
}

bool have_avx512_bf16() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return cpu::isa_cap() >= 2 && (a & (1u << 5)) && __builtin_cpu_supports("avx512f");
  }();
  return ok;
}

using cpu::have_amx_bf16;
#endif  // SK_BF16_WIDE
#endif  // SK_X86_AVX2_FMA

bool isa_available(int64_t isa) {
  switch (isa) {
    case kScalar: return true;
#ifdef SK_X86_AVX2_FMA
    case kAvx2: return cpu::have_avx2_fma();
#endif
#ifdef SK_X86_AVX512
    case kAvx512: return cpu::have_avx512f();
#endif
#ifdef SK_BF16_WIDE
    case kAvx512Bf16: return have_avx512_bf16();
    case kAmx: return have_amx_bf16();
    case kAmxEmulated: return true;
#endif
    default: return false;
  }
}

int64_t best_isa() {
  static const int64_t best = [] {
    for (int64_t isa : {kAmx, kAvx512Bf16, kAvx512, kAvx2})
      if (isa_available(isa)) return isa;
    return static_cast<int64_t>(kScalar);
  }();
  return best;
}

// Group g's 4 panels on the AVX-512-BF16, AVX-512F, AVX2 or scalar path (xf: x widened, for
// AVX-512F and AVX2).
void group_vector_or_scalar(const Problem& pb, int64_t isa, const float* xf, int64_t g) {
#ifdef SK_BF16_WIDE
  if (isa == kAvx512Bf16) return group_bf16_avx512(pb, g);
#endif
#ifdef SK_X86_AVX512
  if (isa == kAvx512) return group_bf16_avx512f(pb, xf, g);
#endif
#ifdef SK_X86_AVX2_FMA
  if (isa == kAvx2) return group_bf16_avx2(pb, xf, g);
#endif
  (void)isa, (void)xf;
  for (int c = 0; c < kGroup; ++c) panel_scalar(pb, pb.panel(g, c));
}

// The rotary epilogue's arguments checked, into pb (module comment at Problem).
void check_rope(const at::Tensor& x, int64_t N, bool residual, const std::optional<at::Tensor>& cos,
                const std::optional<at::Tensor>& sin, int64_t cols, Problem& pb) {
  if (cols == 0 && !cos && !sin) return;
  TORCH_CHECK(cols > 0 && cos && sin, "packed_linear_bf16: the rotary epilogue needs rope_cos, rope_sin and rope_cols > 0");
  TORCH_CHECK(!residual, "packed_linear_bf16: a residual and the rotary epilogue cannot be combined");
  const at::Tensor &c = *cos, &sn = *sin;
  TORCH_CHECK(c.device().is_cpu() && sn.device().is_cpu() && c.scalar_type() == at::kBFloat16 &&
                  sn.scalar_type() == at::kBFloat16 && c.dim() == 3 && sn.sizes() == c.sizes() &&
                  c.strides() == sn.strides() && c.stride(2) == 1,
              "packed_linear_bf16: rope_cos and rope_sin must be bfloat16 CPU [B or 1, T, D] of one shape and "
              "strides with contiguous rows, got ", c.sizes(), " and ", sn.sizes());
  const int64_t M = x.size(0), T = c.size(1), D = c.size(2);
  TORCH_CHECK(T >= 1 && M % T == 0 && (c.size(0) == 1 || c.size(0) == M / T),
              "packed_linear_bf16: rope_cos [", c.size(0), ", ", T, ", ", D, "] does not fit x's ", M,
              " rows (B x T with B = 1 or its first dimension)");
  TORCH_CHECK(D >= 2 && D % 2 == 0 && (kGroup * kPanel) % D == 0 && cols % (kGroup * kPanel) == 0 && cols <= N,
              "packed_linear_bf16: the rotary epilogue needs an even head size dividing 64 (got ", D,
              ") and rope_cols a multiple of 64 up to out_features (got ", cols, " of ", N, ")");
  pb.rope_cols = cols, pb.rope_d = D, pb.rope_t = T, pb.cb = c.size(0) == 1 ? 0 : c.stride(0), pb.ct = c.stride(1);
  pb.rc = reinterpret_cast<const uint16_t*>(c.const_data_ptr());
  pb.rsn = reinterpret_cast<const uint16_t*>(sn.const_data_ptr());
  pb.rope_rows = cpu::rotary_rows_fn(D);
}

// The SiLU epilogue's argument checked, into pb (module comment at Problem): silu_out [M, N / 2]
// bf16, contiguous rows, not overlapping out; N a multiple of 64; neither a residual nor the rotary.
void check_silu(const at::Tensor& x, int64_t N, const at::Tensor& out, bool other_epilogue,
                const std::optional<at::Tensor>& silu_out, Problem& pb) {
  if (!silu_out) return;
  const at::Tensor& so = *silu_out;
  TORCH_CHECK(!other_epilogue,
              "packed_linear_bf16: the SiLU epilogue cannot be combined with a residual or the rotary");
  TORCH_CHECK(N % 64 == 0,
              "packed_linear_bf16: the SiLU epilogue needs out_features = 2 I with I a multiple of 32, got ", N);
  TORCH_CHECK(so.device().is_cpu() && so.scalar_type() == at::kBFloat16 && so.dim() == 2 && so.size(0) == x.size(0) &&
                  so.size(1) == N / 2 && so.stride(1) == 1,
              "packed_linear_bf16: silu_out must be a bfloat16 CPU [M, out_features / 2] = [", x.size(0), ", ", N / 2,
              "] with contiguous rows, got ", so.sizes());
  const auto* a0 = static_cast<const char*>(so.const_data_ptr());
  const auto* b0 = static_cast<const char*>(out.const_data_ptr());
  const char* a1 = a0 + 2 * ((so.size(0) - 1) * so.stride(0) + so.size(1));
  const char* b1 = b0 + 2 * ((out.size(0) - 1) * out.stride(0) + out.size(1));
  TORCH_CHECK(so.numel() == 0 || a1 <= b0 || b1 <= a0, "packed_linear_bf16: silu_out must not overlap out");
  pb.su = reinterpret_cast<uint16_t*>(so.data_ptr()), pb.sus = so.stride(0), pb.silu = cpu::silu_mul_row_fn();
}

void packed_linear_bf16_cpu(const at::Tensor& x, const at::Tensor& w_packed, int64_t out_features,
                            at::Tensor& out, int64_t isa, const std::optional<at::Tensor>& residual,
                            const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                            int64_t rope_cols, const std::optional<at::Tensor>& silu_out) {
  TORCH_CHECK(x.device().is_cpu() && w_packed.device().is_cpu() && out.device().is_cpu(),
              "packed_linear_bf16 (cpu): tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w_packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "packed_linear_bf16: x, w_packed and out must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "packed_linear_bf16: x must be [M, K] with contiguous rows, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t P = packed_panels(N), K2 = packed_pairs(K);
  TORCH_CHECK(N >= 1 && K >= 1 && w_packed.dim() == 4 && w_packed.size(0) == P && w_packed.size(1) == K2 &&
                  w_packed.size(2) == kPanel && w_packed.size(3) == 2 && w_packed.is_contiguous(),
              "packed_linear_bf16: w_packed must be a contiguous [4 ceil(N / 64), 16 ceil(K / 32), 16, 2] = [", P,
              ", ", K2, ", 16, 2] from pack_linear_weight_bf16, got ", w_packed.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && (N == 1 || out.stride(1) == 1),
              "packed_linear_bf16: out must be [M, N] = [", M, ", ", N, "] with contiguous rows");
  if (residual) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == at::kBFloat16 && r.dim() == 2 && r.size(0) == M &&
                    r.size(1) == N && (N == 1 || r.stride(1) == 1),
                "packed_linear_bf16: residual must be a bfloat16 CPU [M, N] = [", M, ", ", N,
                "] with contiguous rows, got ", r.sizes());
  }
  if (isa == kAuto) isa = best_isa();
  TORCH_CHECK(isa_available(isa), "packed_linear_bf16: instruction set ", isa, " is not available on this CPU");
  Problem pb{reinterpret_cast<const uint16_t*>(x.const_data_ptr()),
             reinterpret_cast<const uint16_t*>(w_packed.const_data_ptr()),
             reinterpret_cast<uint16_t*>(out.data_ptr()), M, K, N, K2, x.stride(0), out.stride(0),
             residual ? reinterpret_cast<const uint16_t*>(residual->const_data_ptr()) : nullptr,
             residual ? residual->stride(0) : 0};
  check_rope(x, N, residual.has_value(), rope_cos, rope_sin, rope_cols, pb);
  check_silu(x, N, out, residual.has_value() || pb.rope_cols > 0, silu_out, pb);
  if (M == 0) return;
  const int64_t G = P / kGroup;
  // grain: ~128 KB of weights per task
  const int64_t grain = std::max<int64_t>(1, 131072 / std::max<int64_t>(K2 * 2 * kPanel * 2 * kGroup, 1));
  std::vector<float> xf;
#ifdef SK_X86_AVX2_FMA
  if (isa == kAvx2 || isa == kAvx512) xf = widen_x(pb);
#endif
  at::parallel_for(0, G, grain, [&](int64_t g0, int64_t g1) {
#ifdef SK_BF16_WIDE
    if (isa == kAmxEmulated || (isa == kAmx && cpu::amx_emulated()))  // or SEQUOIA_KERNELS_AMX=emulate
      return groups_bf16_amx<cpu::EmuTiles>(pb, g0, g1);
    if (isa == kAmx) return groups_bf16_amx<cpu::HwTiles>(pb, g0, g1);
#endif
    for (int64_t g = g0; g < g1; ++g) {
      group_vector_or_scalar(pb, isa, xf.data(), g);
      epilogue(pb, g);
    }
  });
}

}  // namespace

int64_t packed_linear_bf16_isa(int64_t isa) {  // the ISA a call with `isa` runs (0: the best), or -1
  if (isa == kAuto) return best_isa();
  return isa_available(isa) ? isa : -1;
}

// out[p, j, f, e] = w[16 p + f, 2 j + e] (0 past N and K): one read of w, one write of out, a
// task per panel group (16 rows of w read side by side, the panel written in order).
void pack_linear_weight_bf16_cpu(const at::Tensor& w, at::Tensor& out) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.stride(1) == 1,
              "pack_linear_weight_bf16: w must be a CPU bf16 [N, K] with contiguous rows");
  const int64_t N = w.size(0), K = w.size(1), P = packed_panels(N), K2 = packed_pairs(K);
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.dim() == 4 &&
                  out.size(0) == P && out.size(1) == K2 && out.size(2) == kPanel && out.size(3) == 2,
              "pack_linear_weight_bf16: out must be a contiguous bf16 [", P, ", ", K2, ", 16, 2], got ", out.sizes());
  const auto* src = reinterpret_cast<const uint16_t*>(w.const_data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t ws = w.stride(0);
  at::parallel_for(0, P, kGroup, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* panel = dst + p * K2 * kPanel * 2;
      const uint16_t* rows[kPanel];
      for (int f = 0; f < kPanel; ++f) rows[f] = p * kPanel + f < N ? src + (p * kPanel + f) * ws : nullptr;
      for (int64_t j = 0; j < K2; ++j)  // pair j of the 16 rows: 64 bytes written in order
        for (int f = 0; f < kPanel; ++f) {
          uint16_t* o = panel + (j * kPanel + f) * 2;
          if (rows[f] != nullptr && 2 * j + 1 < K) {
            std::memcpy(o, rows[f] + 2 * j, 4);
          } else {
            o[0] = rows[f] != nullptr && 2 * j < K ? rows[f][2 * j] : 0;
            o[1] = 0;
          }
        }
    }
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) {
  m.impl("packed_linear_bf16", &packed_linear_bf16_cpu);
  m.impl("pack_linear_weight_bf16", &pack_linear_weight_bf16_cpu);
}

}  // namespace sequoia_kernels
