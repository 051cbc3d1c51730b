// packed_linear: y = x W^T for few rows (the decoding loop's M = 1 .. 64 tree tokens) on x86-64
// CPUs with AVX2+FMA, from a weight packed once into panels of 16 output features
// (sequoia_kernels/ops/packed_linear.py packs it: w_packed [ceil(N / 16), K, 16] fp32, zero
// padded). Why: a framework GEMM packs its operands on every call, which at M = 2 .. 16 costs
// as much as the multiplication (on a Zen 3 core a 576 x 1536 fp32 product took 306 us at M = 8
// against 82 us at M = 1), so a tree of 8 tokens cost the target ~1.8x one token although it
// reads the weights once either way.
//
// Kernel: output panels in parallel (at::parallel_for); per panel, row tiles of up to 6 rows,
// each a 6 x 16 register tile (12 ymm accumulators, 2 weight vectors, 1 broadcast) over the
// whole K: every weight is read from memory once per call (the panel stays in L1/L2 across row
// tiles; with 2+ rows the first tile prefetches it cpu::kPrefetchBytes ahead), every accumulator
// is one FMA chain in k order. So y[m, n] is the same fp32 value
// whatever M is and wherever row m sits in a tile (batch invariance: a token's logits do not
// depend on the tree it is verified in), which framework GEMMs do not promise.
// With AVX-512F the same chains run 16 lanes wide, 2 panels x 6 rows per tile (12 zmm FMAs per
// k); without AVX2+FMA in scalar code (fmaf): the same values on every path.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu/simd.h"

#ifdef SK_X86_AVX2_FMA
#include <immintrin.h>
#endif

namespace sequoia_kernels {

namespace {

constexpr int kPanel = 16;  // output features per panel
constexpr int kTile = 6;    // rows per register tile

#ifdef SK_X86_AVX2_FMA
// The first ncols (< 16) of a 16-wide row.
__attribute__((target("avx2,fma"), noinline)) void store_partial(float* y, __m256 a0, __m256 a1, int64_t ncols) {
  alignas(32) float t[kPanel];
  _mm256_store_ps(t, a0);
  _mm256_store_ps(t + 8, a1);
  for (int64_t j = 0; j < ncols; ++j) y[j] = t[j];
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t xs, const float* w, int64_t K,
                                                  float* y, int64_t ys, int64_t ncols, bool prefetch) {
  // (every loop over r fully unrolled, so that the accumulators live in registers)
  __m256 a0[R], a1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel), w1 = _mm256_loadu_ps(w + k * kPanel + 8);
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + k * kPanel) + cpu::kPrefetchBytes, _MM_HINT_T0);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(x + r * xs + k);
      a0[r] = _mm256_fmadd_ps(b, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(b, w1, a1[r]);
    }
  }
  if (ncols == kPanel) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(y + r * ys, a0[r]);
      _mm256_storeu_ps(y + r * ys + 8, a1[r]);
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store_partial(y + r * ys, a0[r], a1[r], ncols);
  }
}

__attribute__((target("avx2,fma"))) void panel_avx2(const float* x, int64_t xs, int64_t M, const float* w,
                                                   int64_t K, float* y, int64_t ys, int64_t ncols) {
  int64_t m = 0;  // the first tile of a call of 2+ rows prefetches (cpu::kPrefetchBytes)
  for (; m + kTile <= M; m += kTile) tile_avx2<kTile>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, m == 0);
  const bool pf = m == 0 && M >= 2;  // the remainder tile is the first
  switch (M - m) {
    case 5: tile_avx2<5>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, pf); break;
    case 4: tile_avx2<4>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, pf); break;
    case 3: tile_avx2<3>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, pf); break;
    case 2: tile_avx2<2>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, pf); break;
    case 1: tile_avx2<1>(x + m * xs, xs, w, K, y + m * ys, ys, ncols, pf); break;
    default: break;
  }
}

#ifdef SK_X86_AVX512
// AVX-512F: R <= 6 rows x 2 panels, one zmm accumulator per (row, panel) (12 of the 32 registers,
// 2 weight vectors, the broadcasts): tile_avx2's k-order FMA chains on 16 lanes, the same bits.
// Per k 2 weight loads and R broadcasts feed 2 R FMAs, so the FMA ports bound it from R = 3.
template <int R, int Q>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t xs, const float* w, int64_t K,
                                                    float* y, int64_t ys, int64_t ncols0, int64_t ncols1) {
  __m512 a[R][Q];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < Q; ++q) a[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[Q];
#pragma GCC unroll 2
    for (int q = 0; q < Q; ++q) wv[q] = _mm512_loadu_ps(w + q * K * kPanel + k * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(x[r * xs + k]);
#pragma GCC unroll 2
      for (int q = 0; q < Q; ++q) a[r][q] = _mm512_fmadd_ps(b, wv[q], a[r][q]);
    }
  }
#pragma GCC unroll 2
  for (int q = 0; q < Q; ++q) {
    const __mmask16 keep = static_cast<__mmask16>((1u << (q == 0 ? ncols0 : ncols1)) - 1u);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ys + q * kPanel, keep, a[r][q]);
  }
}

// Q (1 or 2) panels from w (the first ncols0, ncols1 features of each) against all M rows.
template <int Q>
__attribute__((target("avx512f"))) void panels_avx512(const float* x, int64_t xs, int64_t M, const float* w,
                                                     int64_t K, float* y, int64_t ys, int64_t ncols0, int64_t ncols1) {
  int64_t m = 0;
  for (; m + kTile <= M; m += kTile) tile_avx512<kTile, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1);
  switch (M - m) {
    case 5: tile_avx512<5, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1); break;
    case 4: tile_avx512<4, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1); break;
    case 3: tile_avx512<3, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1); break;
    case 2: tile_avx512<2, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1); break;
    case 1: tile_avx512<1, Q>(x + m * xs, xs, w, K, y + m * ys, ys, ncols0, ncols1); break;
    default: break;
  }
}
#endif  // SK_X86_AVX512
#endif

// The same k-order FMA chains, one output at a time.
void panel_scalar(const float* x, int64_t xs, int64_t M, const float* w, int64_t K, float* y, int64_t ys,
                  int64_t ncols) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < ncols; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * xs + k], w[k * kPanel + j], acc);
      y[m * ys + j] = acc;
    }
}

void packed_linear_cpu(const at::Tensor& x, const at::Tensor& w_packed, int64_t out_features, at::Tensor& out) {
  TORCH_CHECK(x.device().is_cpu() && w_packed.device().is_cpu() && out.device().is_cpu(),
              "packed_linear (cpu): tensors must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w_packed.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "packed_linear: x, w_packed and out must be float32");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "packed_linear: x must be [M, K] with contiguous rows, got ", x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const int64_t P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(N >= 1 && w_packed.dim() == 3 && w_packed.size(0) == P && w_packed.size(1) == K &&
                  w_packed.size(2) == kPanel && w_packed.is_contiguous(),
              "packed_linear: w_packed must be a contiguous [ceil(N / 16), K, 16] = [", P, ", ", K,
              ", 16] from pack_linear_weight, got ", w_packed.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N && (N == 1 || out.stride(1) == 1),
              "packed_linear: out must be [M, N] = [", M, ", ", N, "] with contiguous rows");
  if (M == 0) return;
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w_packed.const_data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = out.stride(0);
#ifdef SK_X86_AVX2_FMA
  const bool avx2 = cpu::have_avx2_fma();
#endif
#ifdef SK_X86_AVX512
  const bool avx512 = cpu::have_avx512f();
#endif
  // grain: ~64 KB of weights per task
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K * kPanel, 1) * 4);
  at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
#ifdef SK_X86_AVX512
    if (avx512) {  // panels in pairs (the task's last one alone when it has an odd count)
      for (int64_t p = p0; p < p1; p += 2) {
        const int64_t n0 = std::min<int64_t>(kPanel, N - p * kPanel);
        const int64_t n1 = std::max<int64_t>(0, std::min<int64_t>(kPanel, N - (p + 1) * kPanel));
        if (p + 1 < p1) {
          panels_avx512<2>(xp, xs, M, wp + p * K * kPanel, K, yp + p * kPanel, ys, n0, n1);
        } else {
          panels_avx512<1>(xp, xs, M, wp + p * K * kPanel, K, yp + p * kPanel, ys, n0, 0);
        }
      }
      return;
    }
#endif
    for (int64_t p = p0; p < p1; ++p) {
      const float* w = wp + p * K * kPanel;
      float* y = yp + p * kPanel;
      const int64_t ncols = std::min<int64_t>(kPanel, N - p * kPanel);
#ifdef SK_X86_AVX2_FMA
      if (avx2) {
        panel_avx2(xp, xs, M, w, K, y, ys, ncols);
        continue;
      }
#endif
      panel_scalar(xp, xs, M, w, K, y, ys, ncols);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("packed_linear", &packed_linear_cpu); }

}  // namespace sequoia_kernels
