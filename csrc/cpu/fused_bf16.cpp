// Fused bf16 row ops of a Llama layer on the CPU: RMSNorm and SiLU-and-multiply, each one pass
// over a row instead of torch's 6-8 bf16 ops (each dispatching, allocating and converting: 4-40
// us apiece on the 576-1536-wide rows of SmolLM2-135M, ~15 ms of a 32-token bf16 forward).
// Used by the decoding loop's bf16 CPU models (sequoia_kernels/ops/fused_bf16.py); the spec is
// Hugging Face's modules in bf16, reproduced rounding for rounding:
//   rms_norm:  r = 1 / sqrt(f32(sum x^2) / H + eps); out = bf16(w * bf16(x * r))   (fp32 math)
//   silu_mul:  out = bf16(bf16(g / (1 + exp(-g))) * u)                              (fp32 math)
//   rotary:    out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))  (bitwise the module's ops:
//              each product of two bf16 is exact in fp32, so every step is one rounding as in torch)
// with two freedoms the spec leaves: the order of the fp32 sum of squares (fixed here: eight
// lanes over the row's multiples of 8, each a square then an add, never an FMA (a product of
// two bf16 is exact in fp32 only above the subnormal range; contraction is off for it), the lanes summed as (l0+l4 + l2+l6) + (l1+l5 + l3+l7),
// then the tail in order; the scalar path emulates it, so every x86 CPU gives the same bits) and
// exp (csrc/cpu/vec_math.h's polynomial, <= 1 ulp like torch's SLEEF; 16 lanes with AVX-512F, 8 with
// AVX2, std::exp on other CPUs and for lanes below exp's normal range). A row's result never depends on the
// other rows (batch invariance, as packed_linear). The elementwise passes (SiLU-and-multiply,
// RMSNorm's scaling, the rotary) run 16 lanes where the CPU has AVX-512F, 8 with AVX2: the same
// operations per value, so the same bits (the sum of squares keeps its 8 lanes on both).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "cpu/bf16.h"
#include "cpu/rotary.h"
#include "cpu/silu.h"
#include "cpu/vec_math.h"

namespace sequoia_kernels {

namespace {

using cpu::bf16_to_f32;
using cpu::f32_to_bf16;
using cpu::round_bf16;

constexpr float kExpHigh = 88.7228394f;  // above: e^y overflows fp32 (exp8 does not saturate)

// sum of x^2 over a row in the order above (compiled for the baseline ISA: no FMA to contract into)
__attribute__((optimize("fp-contract=off"))) float sum_squares_scalar(const uint16_t* x, int64_t H) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    for (int j = 0; j < 8; ++j) l[j] += bf16_to_f32(x[i + j]) * bf16_to_f32(x[i + j]);
  float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
  for (; i < H; ++i) s += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
  return s;
}

// out = bf16(w * bf16(x * r)) over [i0, H): the module's two roundings
void rms_scale_scalar(const uint16_t* x, const uint16_t* w, int64_t i0, int64_t H, float r, uint16_t* y) {
  for (int64_t i = i0; i < H; ++i)
    y[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

void rms_norm_row_scalar(const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* y) {
  rms_scale_scalar(x, w, 0, H, 1.0f / std::sqrt(sum_squares_scalar(x, H) / static_cast<float>(H) + eps), y);
}

float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

void silu_mul_row_scalar(const uint16_t* g, const uint16_t* u, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i)
    y[i] = f32_to_bf16(round_bf16(silu_scalar(bf16_to_f32(g[i]))) * bf16_to_f32(u[i]));
}

#ifdef SK_X86_AVX2_FMA
using cpu::load_bf16_8;
using cpu::round_bf16_8;
using cpu::store_bf16_8;

// bf16(v) widened back to fp32: v rounded to bf16 and kept in a float register
__attribute__((target("avx2"))) inline __m256 to_bf16_and_back(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16_8(v), 16));
}

// out = bf16(w * bf16(x * r)) over [i0, H) of a row: 8 lanes, then the scalar tail
__attribute__((target("avx2,fma"))) void rms_scale_avx2(const uint16_t* x, const uint16_t* w, int64_t i0, int64_t H,
                                                        float r, uint16_t* y) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t j = i0;
  for (; j + 8 <= H; j += 8)
    store_bf16_8(y + j, _mm256_mul_ps(load_bf16_8(w + j), to_bf16_and_back(_mm256_mul_ps(load_bf16_8(x + j), rv))));
  rms_scale_scalar(x, w, j, H, r, y);
}

// a row's scale pass (rms_scale_avx2, or its 16-lane twin where the CPU has AVX-512F)
using RmsScale = void (*)(const uint16_t* x, const uint16_t* w, int64_t i0, int64_t H, float r, uint16_t* y);

// NR rows (row r at x + r H, y + r H) together: each row's sum of squares the one-row chain (8
// lanes, a square then an add, the lanes summed in the fixed tree, the tail in order), the NR
// chains interleaved so that none waits on the add latency alone (one row's chain did: ~4 cycles
// per 8 values); then each row scaled.
template <int NR>
__attribute__((target("avx2,fma"), optimize("fp-contract=off"))) void rms_norm_rows_avx2(
    const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* y, RmsScale scale) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8)
    for (int r = 0; r < NR; ++r) {
      const __m256 v = load_bf16_8(x + r * H + i);
      acc[r] = _mm256_add_ps(acc[r], _mm256_mul_ps(v, v));
    }
  const int64_t full = i;
  for (int r = 0; r < NR; ++r) {
    const uint16_t* xr = x + r * H;
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));  // l_j + l_j+4
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                           // + l_j+2 (+6)
    float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
    for (int64_t t = full; t < H; ++t) s += bf16_to_f32(xr[t]) * bf16_to_f32(xr[t]);
    scale(xr, w, 0, H, 1.0f / std::sqrt(s / static_cast<float>(H) + eps), y + r * H);
  }
}

// Rows [r0, r1) of a contiguous [R, H], 4 at a time.
__attribute__((target("avx2,fma"))) void rms_norm_block_avx2(const uint16_t* x, const uint16_t* w, int64_t H,
                                                             float eps, uint16_t* y, int64_t r0, int64_t r1,
                                                             RmsScale scale) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) rms_norm_rows_avx2<4>(x + r * H, w, H, eps, y + r * H, scale);
  switch (r1 - r) {
    case 3: rms_norm_rows_avx2<3>(x + r * H, w, H, eps, y + r * H, scale); break;
    case 2: rms_norm_rows_avx2<2>(x + r * H, w, H, eps, y + r * H, scale); break;
    case 1: rms_norm_rows_avx2<1>(x + r * H, w, H, eps, y + r * H, scale); break;
    default: break;
  }
}

// g / (1 + e^-g) on 8 lanes: exp8_full below the overflow point, +inf above (then -0 or +0 as torch)
__attribute__((target("avx2,fma"))) inline __m256 silu8(__m256 g) {
  const __m256 y = _mm256_sub_ps(_mm256_setzero_ps(), g);
  const __m256 big = _mm256_cmp_ps(y, _mm256_set1_ps(kExpHigh), _CMP_GT_OQ);
  const __m256 e = _mm256_blendv_ps(cpu::exp8_full(_mm256_min_ps(y, _mm256_set1_ps(kExpHigh))),
                                    _mm256_set1_ps(INFINITY), big);
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const uint16_t* g, const uint16_t* u, int64_t n,
                                                           uint16_t* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    store_bf16_8(y + i, _mm256_mul_ps(to_bf16_and_back(silu8(load_bf16_8(g + i))), load_bf16_8(u + i)));
  silu_mul_row_scalar(g + i, u + i, n - i, y + i);
}
#endif

#ifdef SK_X86_AVX512
#define SK_FUSED_AVX512 1
// The same silu_mul on 16 lanes where the CPU has AVX-512F (torch's own bf16 SiLU runs 16 lanes
// there: the 8-lane path lost to its silu + mul by ~1.4x): exp8's polynomial on 16 lanes
// (cpu::exp16_full, as silu8 takes exp8_full), the same bits lane for lane (the same operations in the same order).
using cpu::have_avx512f;
using cpu::load_bf16_16;
using cpu::round_bf16_16;
using cpu::store_bf16_16;

__attribute__((target("avx512f"))) inline __m512 to_bf16_and_back16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(round_bf16_16(v), 16));
}

__attribute__((target("avx512f"))) inline __m512 silu16(__m512 g) {  // silu8 on 16 lanes
  const __m512 y = _mm512_sub_ps(_mm512_setzero_ps(), g);
  const __mmask16 big = _mm512_cmp_ps_mask(y, _mm512_set1_ps(kExpHigh), _CMP_GT_OQ);
  const __m512 e = _mm512_mask_blend_ps(big, cpu::exp16_full(_mm512_min_ps(y, _mm512_set1_ps(kExpHigh))),
                                        _mm512_set1_ps(INFINITY));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

__attribute__((target("avx512f"))) void silu_mul_row_avx512(const uint16_t* g, const uint16_t* u, int64_t n,
                                                            uint16_t* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store_bf16_16(y + i, _mm512_mul_ps(to_bf16_and_back16(silu16(load_bf16_16(g + i))), load_bf16_16(u + i)));
  }
  silu_mul_row_avx2(g + i, u + i, n - i, y + i);
}

// SiLU by lookup (Intel CPUs with AVX-512F, nothing capped): bf16(silu(g)) depends on the bf16
// g alone, so silu16's results for all 65,536 bf16 values, computed once and rounded as
// silu_mul_row_avx512 rounds them, are its bits for every g (NaN payloads included) and
// silu_mul is one gather and a product per 16 values. The division and the exp polynomial cost
// ~27 cycles per 16 values on the AMX Xeon (the divider bound them); the gathers read the few
// KB of the table that activations hit. AMD's 16-lane gathers are slower: computed there.
__attribute__((target("avx512f"))) void fill_silu_table(uint16_t* t) {  // t: 65,536 + 16 entries
  alignas(64) uint16_t g[16];
  for (int32_t i = 0; i < 65536; i += 16) {
    for (int j = 0; j < 16; ++j) g[j] = static_cast<uint16_t>(i + j);
    store_bf16_16(t + i, silu16(load_bf16_16(g)));
  }
  for (int j = 0; j < 16; ++j) t[65536 + j] = 0;  // a 32-bit gather of entry 65535 reads one past it
}

const uint16_t* silu_table() {
  static const uint16_t* table = [] {
    auto* t = new uint16_t[65536 + 16];
    fill_silu_table(t);
    return t;
  }();
  return table;
}

bool silu_by_table() {
  static const bool ok = cpu::isa_cap() >= 3 && have_avx512f() && __builtin_cpu_is("intel");
  return ok;
}

__attribute__((target("avx512f"))) void silu_mul_row_table(const uint16_t* g, const uint16_t* u, int64_t n,
                                                           uint16_t* y, const uint16_t* table) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i gi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i)));
    const __m512i s = _mm512_slli_epi32(_mm512_i32gather_epi32(gi, table, 2), 16);  // the entry in the high half
    store_bf16_16(y + i, _mm512_mul_ps(_mm512_castsi512_ps(s), load_bf16_16(u + i)));
  }
  silu_mul_row_avx2(g + i, u + i, n - i, y + i);
}

// rms_scale_avx2 on 16 lanes (the same bits: each value's own two roundings)
__attribute__((target("avx512f"))) void rms_scale_avx512(const uint16_t* x, const uint16_t* w, int64_t i0, int64_t H,
                                                         float r, uint16_t* y) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t j = i0;
  for (; j + 16 <= H; j += 16)
    store_bf16_16(y + j, _mm512_mul_ps(load_bf16_16(w + j), to_bf16_and_back16(_mm512_mul_ps(load_bf16_16(x + j), rv))));
  rms_scale_avx2(x, w, j, H, r, y);
}
#endif

// rows per task: ~32k elements (a few tens of microseconds) before a second thread pays
int64_t grain(int64_t H) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(H, 1)); }

// x [B, H, T, D] (any strides but a contiguous last dim), cos / sin [B or 1, T, D] (likewise),
// out [B, H, T, D] contiguous.
void rotary_bf16_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &cos, &sin, &out})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16, "rotary_bf16: bfloat16 CPU tensors only");
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() && out.sizes() == x.sizes(),
              "rotary_bf16: x and out must be [B, H, T, D] and cos, sin [B or 1, T, D], got ", x.sizes(), ", ",
              cos.sizes(), ", ", sin.sizes(), ", ", out.sizes());
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(D % 2 == 0 && (cos.size(0) == B || cos.size(0) == 1) && cos.size(1) == T && cos.size(2) == D,
              "rotary_bf16: cos and sin must be [B or 1, T, D] with D even, for x ", x.sizes());
  TORCH_CHECK(out.is_contiguous() && (D <= 1 || (x.stride(3) == 1 && cos.stride(2) == 1 && sin.stride(2) == 1)),
              "rotary_bf16: out must be contiguous and the last dims of x, cos, sin contiguous");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.const_data_ptr());
  const auto* sp = reinterpret_cast<const uint16_t*>(sin.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t cb = cos.size(0) == 1 ? 0 : cos.stride(0), sb = sin.size(0) == 1 ? 0 : sin.stride(0);
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), cs = cos.stride(1), ss = sin.stride(1);
  const cpu::RotaryRowsFn rows = cpu::rotary_rows_fn(D);  // 16 lanes, 8 or scalar, chosen once
  at::parallel_for(0, B * H * T, grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1;) {  // row r = (b, hh, t); one call per run of t in one (b, hh)
      const int64_t t = r % T, hh = r / T % H, b = r / (T * H), n = std::min(T - t, r1 - r);
      rows({xp + b * xs0 + hh * xs1 + t * xs2, cp + b * cb + t * cs, sp + b * sb + t * ss, xs2, cs, ss, D, n,
            yp + r * D, D});
      r += n;
    }
  });
}

// Shapes [..., H] (any leading dims: the rows), bf16 on the CPU, contiguous (t's rows may be
// strided where the op reads them so: `contiguous` false; the op then checks them itself).
void check_rows(const at::Tensor& t, const at::Tensor& out, const char* op, const char* name, bool contiguous = true) {
  TORCH_CHECK(t.device().is_cpu() && out.device().is_cpu(), op, ": CPU tensors only");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, op, ": ", name,
              " and out must be bfloat16");
  TORCH_CHECK(t.dim() >= 1 && t.sizes() == out.sizes(), op, ": ", name, " and out must have one shape [..., H], got ",
              t.sizes(), " and ", out.sizes());
  TORCH_CHECK(!contiguous || (t.is_contiguous() && out.is_contiguous()), op, ": ", name, " and out must be contiguous");
}

void rms_norm_bf16_cpu(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, out, "rms_norm_bf16", "x");
  const int64_t H = x.size(-1), R = H > 0 ? x.numel() / H : 0;
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 1 &&
                  weight.size(0) == H && (H <= 1 || weight.stride(0) == 1),
              "rms_norm_bf16: weight must be a contiguous bfloat16 [H] (H = ", H, ") on the CPU");
  TORCH_CHECK(H >= 1, "rms_norm_bf16: need H >= 1");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float e = static_cast<float>(eps);
  at::parallel_for(0, R, grain(H), [&](int64_t r0, int64_t r1) {
#ifdef SK_X86_AVX2_FMA
#ifdef SK_FUSED_AVX512
    if (have_avx512f()) return rms_norm_block_avx2(xp, wp, H, e, yp, r0, r1, rms_scale_avx512);
#endif
    if (cpu::have_avx2_fma()) return rms_norm_block_avx2(xp, wp, H, e, yp, r0, r1, rms_scale_avx2);
#endif
    for (int64_t r = r0; r < r1; ++r) rms_norm_row_scalar(xp + r * H, wp, H, e, yp + r * H);  // row r at r * H
  });
}

// The stride between t's rows (its last dimension contiguous, its leading dimensions one uniform
// run of rows, as a split of a wider [..., 2 I] tensor's last dimension is), or -1.
int64_t row_stride(const at::Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0 || (t.size(-1) > 1 && t.stride(-1) != 1)) return -1;
  int64_t rs = -1, run = 0;  // the innermost leading dim of size > 1: its stride; the rows it spans so far
  for (int64_t d = nd - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (rs == -1) {
      if (t.stride(d) < t.size(-1)) return -1;
      rs = t.stride(d), run = t.size(d);
    } else {
      if (t.stride(d) != rs * run) return -1;
      run *= t.size(d);
    }
  }
  return rs == -1 ? t.size(-1) : rs;
}

#ifdef SK_FUSED_AVX512
__attribute__((target("avx512f"))) void silu_mul_row_by_table(const uint16_t* g, const uint16_t* u, int64_t n,
                                                              uint16_t* y) {
  silu_mul_row_table(g, u, n, y, silu_table());
}
#endif

cpu::SiluMulRowFn choose_silu_mul_row() {
#ifdef SK_FUSED_AVX512
  if (silu_by_table()) {
    silu_table();  // built here, once, not inside a parallel region
    return silu_mul_row_by_table;
  }
  if (have_avx512f()) return silu_mul_row_avx512;
#endif
#ifdef SK_X86_AVX2_FMA
  if (cpu::have_avx2_fma()) return silu_mul_row_avx2;
#endif
  return silu_mul_row_scalar;
}

// gate and up: [..., I] with contiguous rows at one stride each (a split of the fused gate-up
// projection's [..., 2 I] output needs no copy); out contiguous.
void silu_mul_bf16_cpu(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_rows(gate, out, "silu_mul_bf16", "gate", false);
  check_rows(up, out, "silu_mul_bf16", "up", false);
  const int64_t gs = row_stride(gate), us = row_stride(up);
  TORCH_CHECK(out.is_contiguous() && gs >= 0 && us >= 0,
              "silu_mul_bf16: out must be contiguous, gate and up rows contiguous at one stride each");
  const int64_t n = gate.size(-1), R = n > 0 ? gate.numel() / n : 0;
  const auto* gp = reinterpret_cast<const uint16_t*>(gate.const_data_ptr());
  const auto* up_ = reinterpret_cast<const uint16_t*>(up.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const cpu::SiluMulRowFn row = cpu::silu_mul_row_fn();
  at::parallel_for(0, R, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(gp + r * gs, up_ + r * us, n, yp + r * n);  // gate at r gs, up at r us
  });
}

}  // namespace

cpu::SiluMulRowFn cpu::silu_mul_row_fn() {
  static const SiluMulRowFn fn = choose_silu_mul_row();
  return fn;
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) {
  m.impl("rms_norm_bf16", &rms_norm_bf16_cpu);
  m.impl("silu_mul_bf16", &silu_mul_bf16_cpu);
  m.impl("rotary_bf16", &rotary_bf16_cpu);
}

}  // namespace sequoia_kernels
