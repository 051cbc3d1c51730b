// tree_attention CPU implementation: each query over the keys it sees, in key order (the
// prefix [0, prefix_len), then the tree keys its mask row holds), with fixed arithmetic per
// (query, key) that does not depend on which other queries or keys share the call:
//   AVX2 path (fp32 / bf16, D a multiple of 8, an AVX2+FMA CPU): 8 queries of one (batch row, KV
//     head) in the 8 fp32 lanes; score_s = (one fp32 FMA chain over d in order) scale, computed
//     for every tree key and masked; e_s = exp8(score_s - max over the seen keys) (cpu::exp8,
//     <= 1 ulp, std::exp below its range), an unseen key's e = +0; z = e summed in key order;
//     out = (sum of e_s v_s over the seen keys in key order, an FMA chain per d) / z.
//   AVX-512 path (fp32 / bf16, D a multiple of 16, an AVX-512F CPU): the AVX2 path's operations
//     on 16 queries in the 16 lanes, lane for lane the same, so the same bits (a test runs both);
//     the prefix's values added for 4 rows at a time (16 independent FMA chains).
//   AMX path (bf16, D a multiple of 32 up to 256, an AMX-BF16 CPU): the AVX-512 path with each
//     block of 16 keys x 16 queries scored by D / 32 tile products (the keys read as the cache's
//     bf16, not widened), then scaled: other roundings than the FMA chain (AMX adds a tile row's
//     32 products at once), but a score still depends on its query and key only. Any AVX-512F
//     CPU takes it on emulated tiles with SEQUOIA_KERNELS_AMX=emulate (cpu/amx.h: EmuTiles).
//   scalar path (fp16, fp64, other D, other CPUs): score_s = the dot product in 16 lanes (lane l
//     sums d = l, l + 16, .. by FMA) added in a fixed tree, std::exp, sums in key order.
// (fp32 accumulation for fp32/bf16/fp16 inputs, fp64 for fp64). A query's result depends only on
// the keys it sees and their order, not on how many queries share the call or where the tree
// starts: a token's attention output is the same bits in a one-token step and in a tree step
// (batch invariance; with packed_linear, a token's logits are), which ATen's blocked attention
// does not promise. A machine and head size always take the same path. Rows that see no key at
// all are zeroed.
//
// Cost: 4 D flops per (query, head, visible key), plus 2 D per (query, unseen tree key) on the
// AVX2 path (its scores are computed and masked). A task is 8 queries (AVX2) or 4 (scalar) of one
// (batch row, KV head); bf16 keys and values are converted to fp32 once per call. AVX2 per (8
// queries, key, d): one broadcast and one FMA for the score, one broadcast-FMA for the output per
// query: no horizontal sums. Measured on a 2-core Xeon (SmolLM2-135M's 9 / 3 heads of 64, a
// 96-key prefix, chain-masked trees, 2 threads, us per layer; the 16-lane-dot kernel before it in
// brackets): bf16 1 query 18 [17], 16 59 [110], 32 122 [244], 64 292 [539]; fp32 11 [16], 48
// [88], 102 [181], 253 [466]. The AVX-512 path on another 2-core Xeon (AVX-512 + AMX; the AVX2
// path in the same session in brackets, bench/tree_attention_cpu.py): bf16 16 [19], 44 [51], 77
// [99], 175 [226]; fp32 10 [9], 31 [39], 61 [86], 152 [211]. bf16 with the AMX scores: 16, 38,
// 61, 136.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/amx.h"
#include "cpu/bf16.h"
#include "cpu/simd.h"
#include "cpu/vec_math.h"
#include "kernels/tree_mask.h"
#include "tree_attention_params.h"

#ifdef SK_X86_AVX2_FMA
#include <immintrin.h>
#endif

namespace sequoia_kernels {

namespace {

constexpr int kLanes = 16;  // the dot product's fp32 lanes
constexpr int kRows = 4;    // queries of one KV head attended together (the keys read once for them)
constexpr int kLanes8 = 8;  // the AVX2 path: queries of one KV head in the 8 fp32 lanes
constexpr int kLanes16 = 16;  // the AVX-512 path: in the 16 fp32 lanes

template <typename acc_t>
inline acc_t lane_sum(const acc_t* a) {  // the fixed addition tree over 16 lanes
  acc_t p[8];
  for (int l = 0; l < 8; ++l) p[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) p[l] = p[l] + p[l + 4];
  return (p[0] + p[2]) + (p[1] + p[3]);
}

// The queries of one task: nq <= kRows rows of one (batch row, KV head), each seeing the prefix
// [0, P) and its own tree keys (positions tkeys[r][0 .. tn[r])), in that order.
template <typename scalar_t, typename acc_t>
struct Rows {
  const acc_t* qf;       // [nq, D] fp32 (fp64 for fp64 inputs)
  const scalar_t *kb, *vb;  // this KV head's keys / values, row strides kst / vst
  int64_t kst, vst, P, D, nq;
  const int64_t* tkeys[kRows];
  int64_t tn[kRows];
  acc_t scale;
  int64_t n(int r) const { return P + tn[r]; }
  int64_t key(int r, int64_t i) const { return i < P ? i : tkeys[r][i - P]; }
};

// ---- scalar: the arithmetic itself. score: [nq, stride]; o: [nq, D]; z: [nq]
template <typename scalar_t, typename acc_t>
void attend_scalar(const Rows<scalar_t, acc_t>& w, acc_t* score, int64_t stride, acc_t* o, acc_t* z) {
  for (int r = 0; r < w.nq; ++r) {
    acc_t* sc = score + r * stride;
    acc_t* orow = o + r * w.D;
    const acc_t* q = w.qf + r * w.D;
    acc_t m = -std::numeric_limits<acc_t>::infinity();
    for (int64_t i = 0; i < w.n(r); ++i) {
      const scalar_t* k = w.kb + w.key(r, i) * w.kst;
      acc_t a[kLanes] = {};
      for (int64_t d = 0; d < w.D; ++d) a[d % kLanes] = std::fma(q[d], static_cast<acc_t>(k[d]), a[d % kLanes]);
      sc[i] = lane_sum(a) * w.scale;
      m = std::max(m, sc[i]);
    }
    z[r] = 0;
    for (int64_t d = 0; d < w.D; ++d) orow[d] = 0;
    for (int64_t i = 0; i < w.n(r); ++i) {
      sc[i] = std::exp(sc[i] - m);
      z[r] += sc[i];
      const scalar_t* v = w.vb + w.key(r, i) * w.vst;
      for (int64_t d = 0; d < w.D; ++d) orow[d] = std::fma(sc[i], static_cast<acc_t>(v[d]), orow[d]);
    }
  }
}

#ifdef SK_X86_AVX2_FMA
// ---- AVX2: 8 queries of one (batch row, KV head) in the 8 fp32 lanes. Every score is one fp32
// chain over d in order (fma, lane = query), so a key's score does not depend on which keys or
// queries share the call; keys are read as fp32 rows (bf16 caches converted once per call).
struct Lanes {
  const float* qt;      // [D][L] queries, lane = row (zero lanes past nq); L = 8 (AVX2) or 16 (AVX-512)
  const float *k, *v;   // this KV head's fp32 keys / values, cache row i at k + i kst
  int64_t kst, vst, P, Tk, D, nq;
  const int32_t* vis;   // [Tk][L] lane masks: row r sees tree key j (-1) or not (0)
  const int64_t* tkeys[kLanes16];  // per row: the cache rows of its visible tree keys, in order
  int64_t tn[kLanes16];
  float scale;
};

// One row's output over d [d0, d0 + 8 NC): sum of e_i v_i over its visible keys in key order
// (the prefix, then its tree keys), NC independent chains.
template <int NC>
__attribute__((target("avx2,fma"))) void values_avx2(const Lanes& w, const float* e, int r, int64_t d0, float* o) {
  __m256 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = -w.P; j < w.tn[r]; ++j) {  // j < 0: prefix key P + j; else tree key tkeys[r][j]
    const int64_t i = j < 0 ? w.P + j : w.tkeys[r][j];
    const __m256 ei = _mm256_broadcast_ss(e + i * kLanes8 + r);
    const float* vi = w.v + i * w.vst + d0;
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(ei, _mm256_loadu_ps(vi + 8 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + d0 + 8 * c, acc[c]);
}

__attribute__((target("avx2,fma"))) inline __m256 seen(const int32_t* vis, int64_t j) {  // tree key j's lane mask
  return _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vis + j * kLanes8)));
}

// sc: [(P + Tk + 7) / 8 * 8][8] scratch (scores, then weights); o: [nq][D] unnormalised outputs;
// z: [8] the weights' sums.
__attribute__((target("avx2,fma"))) void attend8_avx2(const Lanes& w, float* sc, float* o, float* z) {
  const int64_t n = w.P + w.Tk, D = w.D;
  const __m256 scale = _mm256_set1_ps(w.scale), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i0 = 0; i0 < n; i0 += 8) {  // scores, 8 keys at a time (a short last group repeats a key)
    const float* kp[8];
    for (int u = 0; u < 8; ++u) kp[u] = w.k + std::min<int64_t>(i0 + u, n - 1) * w.kst;
    __m256 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 qd = _mm256_loadu_ps(w.qt + d * kLanes8);
      for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kp[u] + d), a[u]);
    }
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(sc + (i0 + u) * kLanes8, _mm256_mul_ps(a[u], scale));
  }
  // softmax per lane over the keys its row sees; an unseen tree key's weight is +0 (adds nothing)
  __m256 m = ninf;
  for (int64_t i = 0; i < w.P; ++i) m = _mm256_max_ps(m, _mm256_loadu_ps(sc + i * kLanes8));
  for (int64_t j = 0; j < w.Tk; ++j) m = _mm256_max_ps(m, _mm256_blendv_ps(ninf, _mm256_loadu_ps(sc + (w.P + j) * kLanes8), seen(w.vis, j)));
  __m256 zz = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m256 e = cpu::exp8_full(_mm256_sub_ps(_mm256_loadu_ps(sc + i * kLanes8), m));
    if (i >= w.P) e = _mm256_and_ps(e, seen(w.vis, i - w.P));
    _mm256_storeu_ps(sc + i * kLanes8, e);
    zz = _mm256_add_ps(zz, e);
  }
  _mm256_storeu_ps(z, zz);
  for (int r = 0; r < w.nq; ++r)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      float* orow = o + r * D;
      switch (std::min<int64_t>(8, (D - d0) / 8)) {
        case 8: values_avx2<8>(w, sc, r, d0, orow); break;
        case 7: values_avx2<7>(w, sc, r, d0, orow); break;
        case 6: values_avx2<6>(w, sc, r, d0, orow); break;
        case 5: values_avx2<5>(w, sc, r, d0, orow); break;
        case 4: values_avx2<4>(w, sc, r, d0, orow); break;
        case 3: values_avx2<3>(w, sc, r, d0, orow); break;
        case 2: values_avx2<2>(w, sc, r, d0, orow); break;
        default: values_avx2<1>(w, sc, r, d0, orow); break;
      }
    }
}
#endif

#ifdef SK_X86_AVX512
// ---- AVX-512: attend8_avx2's arithmetic on 16 queries (lanes) at a time. Every lane runs the
// same operations in the same order as on the AVX2 path (each score one FMA chain over d, the
// same exp polynomial, the weights summed and the values accumulated in key order per d), so a
// query's output is the same bits on either path: only the instructions per query halve (one
// FMA scores 16 queries; one adds 16 of a value row's d).
// Rows [r0, r0 + NR)' outputs over d [d0, d0 + 16 NC): each row's sum of e_i v_i in key order
// (the prefix, then its own tree keys), one FMA chain per d. The prefix keys, which every row
// sees, are added for the NR rows together (one read of each value row, NR x NC independent
// chains: one row's 4 chains alone would wait on the FMA latency).
template <int NR, int NC>
__attribute__((target("avx512f"))) void values_avx512(const Lanes& w, const float* e, int r0, int64_t d0, float* o) {
  __m512 acc[NR][NC];
  for (int rr = 0; rr < NR; ++rr)
    for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < w.P; ++i) {
    const float* vi = w.v + i * w.vst + d0;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vi + 16 * c);
    for (int rr = 0; rr < NR; ++rr) {
      const __m512 ei = _mm512_set1_ps(e[i * kLanes16 + r0 + rr]);
      for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_fmadd_ps(ei, vv[c], acc[rr][c]);
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    const int r = r0 + rr;
    for (int64_t j = 0; j < w.tn[r]; ++j) {
      const int64_t i = w.tkeys[r][j];
      const __m512 ei = _mm512_set1_ps(e[i * kLanes16 + r]);
      const float* vi = w.v + i * w.vst + d0;
      for (int c = 0; c < NC; ++c) acc[rr][c] = _mm512_fmadd_ps(ei, _mm512_loadu_ps(vi + 16 * c), acc[rr][c]);
    }
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * w.D + d0 + 16 * c, acc[rr][c]);
  }
}

template <int NC>
__attribute__((target("avx512f"))) void values_rows_avx512(const Lanes& w, const float* e, int64_t d0, float* o) {
  int r = 0;
  for (; r + 4 <= w.nq; r += 4) values_avx512<4, NC>(w, e, r, d0, o);
  switch (w.nq - r) {
    case 3: values_avx512<3, NC>(w, e, r, d0, o); break;
    case 2: values_avx512<2, NC>(w, e, r, d0, o); break;
    case 1: values_avx512<1, NC>(w, e, r, d0, o); break;
    default: break;
  }
}

__attribute__((target("avx512f"))) inline __mmask16 seen16(const int32_t* vis, int64_t j) {  // tree key j's lanes
  return _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(vis + j * kLanes16), _mm512_setzero_si512());
}

// The softmax down the 16 lanes of the scores sc [P + Tk][16] (scaled), an unseen tree key's
// weight +0, and the outputs o [nq][D] (unnormalised; z: the weights' sums): attend8_avx2's.
__attribute__((target("avx512f"))) void softmax_values16(const Lanes& w, float* sc, float* o, float* z);

// As attend8_avx2 on 16 lanes: sc [(P + Tk + 15) / 16 * 16][16]; o [nq][D] (D a multiple of 16).
__attribute__((target("avx512f"))) void attend16_avx512(const Lanes& w, float* sc, float* o, float* z) {
  const int64_t n = w.P + w.Tk, D = w.D;
  const __m512 scale = _mm512_set1_ps(w.scale);
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const float* kp[8];
    for (int u = 0; u < 8; ++u) kp[u] = w.k + std::min<int64_t>(i0 + u, n - 1) * w.kst;
    __m512 a[8];
    for (int u = 0; u < 8; ++u) a[u] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qd = _mm512_loadu_ps(w.qt + d * kLanes16);
      for (int u = 0; u < 8; ++u) a[u] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kp[u][d]), a[u]);
    }
    for (int u = 0; u < 8; ++u) _mm512_storeu_ps(sc + (i0 + u) * kLanes16, _mm512_mul_ps(a[u], scale));
  }
  softmax_values16(w, sc, o, z);
}

__attribute__((target("avx512f"))) void softmax_values16(const Lanes& w, float* sc, float* o, float* z) {
  const int64_t n = w.P + w.Tk, D = w.D;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m = ninf;
  for (int64_t i = 0; i < w.P; ++i) m = _mm512_max_ps(m, _mm512_loadu_ps(sc + i * kLanes16));
  for (int64_t j = 0; j < w.Tk; ++j)
    m = _mm512_max_ps(m, _mm512_mask_blend_ps(seen16(w.vis, j), ninf, _mm512_loadu_ps(sc + (w.P + j) * kLanes16)));
  __m512 zz = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 e = cpu::exp16_full(_mm512_sub_ps(_mm512_loadu_ps(sc + i * kLanes16), m));
    if (i >= w.P) e = _mm512_maskz_mov_ps(seen16(w.vis, i - w.P), e);
    _mm512_storeu_ps(sc + i * kLanes16, e);
    zz = _mm512_add_ps(zz, e);
  }
  _mm512_storeu_ps(z, zz);
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(4, (D - d0) / 16)) {
      case 4: values_rows_avx512<4>(w, sc, d0, o); break;
      case 3: values_rows_avx512<3>(w, sc, d0, o); break;
      case 2: values_rows_avx512<2>(w, sc, d0, o); break;
      default: values_rows_avx512<1>(w, sc, d0, o); break;
    }
  }
}
#endif

#if defined(SK_X86_AVX512) && defined(SK_BF16_WIDE)
// ---- AMX (bf16 caches, D a multiple of 32, <= 256): the scores of 16 queries by tile products,
// the rest as the AVX-512 path. C [16 keys x 16 queries] += K block [16 keys x 32 d] times the
// queries' [16 d pairs x 16 queries] tile (qp: [D / 2][16][2], lane = query): one tile store is
// sc's [16 keys][16 lanes] as the lanes layout has it. A score is the tile products' sum over d
// in blocks of 32 (their own roundings: AMX adds a tile row's 32 products at once), then times
// the scale: it depends on its query and key only, so a query's output is the same bits alone
// and in a tree (batch invariance) on this path, as on the others, whose bits it does not share.
// Per 16 keys and 16 queries: D / 32 tile products instead of 8 D / 8 x 16-lane FMAs.
// The keys' tiles of up to 4 key blocks (a[b], row stride as[b]) against the queries' d block
// d0 (B tile KB), into C tiles 4 .. 3 + nb: A tiles alternate between tmm0 and tmm1, so a block's
// key load waits only for the product two blocks back, and the 4 products pipeline. (A macro: as
// a function GCC compiles scores_amx otherwise, unswitching its loop on nb.)
#define SK_SCORE_BLOCKS(T, KB, nb, a, as, d0, qp)      \
  do {                                                 \
    T::template load<KB>((qp) + (d0) * 16, 64);        \
    T::template load<0>((a)[0] + (d0), (as)[0] * 2);   \
    T::template dpbf16<4, 0, KB>();                    \
    if ((nb) > 1) {                                    \
      T::template load<1>((a)[1] + (d0), (as)[1] * 2); \
      T::template dpbf16<5, 1, KB>();                  \
    }                                                  \
    if ((nb) > 2) {                                    \
      T::template load<0>((a)[2] + (d0), (as)[2] * 2); \
      T::template dpbf16<6, 0, KB>();                  \
    }                                                  \
    if ((nb) > 3) {                                    \
      T::template load<1>((a)[3] + (d0), (as)[3] * 2); \
      T::template dpbf16<7, 1, KB>();                  \
    }                                                  \
  } while (0)

template <class T>  // cpu::HwTiles, or cpu::EmuTiles (SEQUOIA_KERNELS_AMX=emulate)
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void scores_amx(const Lanes& w, const uint16_t* kb, int64_t kst,
                                                                  const uint16_t* qp, float* sc) {
  const int64_t n = w.P + w.Tk, D = w.D;
  cpu::TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // A keys (0, 1), B query pairs (2, 3), C scores
  T::config(cfg);
  alignas(64) uint16_t pad[16 * 256];  // a last block of fewer than 16 keys, zero rows below
  for (int64_t i0 = 0; i0 < n; i0 += 64) {  // 4 blocks of 16 keys at a time, each its own C tile
    const int nb = static_cast<int>(std::min<int64_t>(4, (n - i0 + 15) / 16));
    const uint16_t* a[4];
    int64_t as[4];
    for (int b = 0; b < nb; ++b) {
      const int64_t k0 = i0 + 16 * b;
      a[b] = kb + k0 * kst, as[b] = kst;
      if (k0 + 16 > n) {
        for (int64_t i = 0; i < 16; ++i)
          for (int64_t d = 0; d < D; ++d) pad[i * D + d] = k0 + i < n ? a[b][i * kst + d] : 0;
        a[b] = pad, as[b] = D;
      }
    }
    T::template zero<4>();
    T::template zero<5>();
    T::template zero<6>();
    T::template zero<7>();
    for (int64_t d0 = 0; d0 < D; d0 += 64) {  // d blocks in order: each C tile's sum as one block at a time
      SK_SCORE_BLOCKS(T, 2, nb, a, as, d0, qp);
      if (d0 + 32 < D) SK_SCORE_BLOCKS(T, 3, nb, a, as, d0 + 32, qp);
    }
    float* c = sc + i0 * kLanes16;
    T::template store<4>(c, 64);
    if (nb > 1) T::template store<5>(c + 16 * kLanes16, 64);
    if (nb > 2) T::template store<6>(c + 32 * kLanes16, 64);
    if (nb > 3) T::template store<7>(c + 48 * kLanes16, 64);
  }
  T::release();
  const __m512 scale = _mm512_set1_ps(w.scale);
  for (int64_t i = 0; i < n; ++i)
    _mm512_storeu_ps(sc + i * kLanes16, _mm512_mul_ps(_mm512_loadu_ps(sc + i * kLanes16), scale));
}
#endif

template <typename scalar_t>
struct Attend {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  static constexpr bool kVector = std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>;

  const scalar_t *q, *k, *v;
  scalar_t* out;
  const int64_t* plen;
  const int32_t* bits;
  TreeAttentionShape s;
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of b, h, t (the last dimension is contiguous)
  acc_t scale;
  int vec;                  // the lanes of the vector path: 16 (AVX-512F, D a multiple of 16), 8
                            // (AVX2+FMA, D a multiple of 8), 0 (scalar); fp32 / bf16 only
  bool amx;                 // bf16 on the AVX-512 path, D % 32 == 0, D <= 256, an AMX-BF16 CPU: tile scores
  const float* kvf;         // bf16 on a vector path: fp32 keys and values, [B, Hkv, 2, rows, D]
  int64_t kvf_rows;         // max prefix + Tk

  int64_t rows_per_task() const { return vec ? vec : kRows; }
  int64_t chunks() const {  // per (b, KV head)
    return (s.Hq / s.Hkv * s.T + rows_per_task() - 1) / rows_per_task();
  }
  int64_t score_stride() const { return (s.S + 7) / 8 * 8; }  // a query's scores, padded for exp8

  struct Scratch {
    std::vector<acc_t> qf, score, o;
    std::vector<int64_t> keys;
    std::vector<int32_t> vis;
    std::vector<uint16_t> qp;  // the AMX path: the queries' bf16 pairs [D / 2][16][2]
  };

  // Row r0 + r of (batch row b, KV head hk): query head and position; its mask row.
  void row_of(int64_t b, int64_t hk, int64_t row, int64_t& h, int64_t& t, const int32_t*& mrow) const {
    const int64_t G = s.Hq / s.Hkv;
    h = hk * G + row / s.T, t = row % s.T;
    mrow = bits + ((s.Bm == 1 ? 0 : b) * s.T + t) * s.W;
  }

  // The tree keys mask row `mrow` sees, as cache positions P + j in key order, into keys; returns
  // how many. With vis (a vector path's lane masks), also marks each in lane r: vis[j * vec + r] = -1.
  int64_t seen_keys(const int32_t* mrow, int64_t P, int64_t* keys, int32_t* vis = nullptr, int r = 0) const {
    int64_t n = 0;
    for (int64_t j0 = 0; j0 < s.Tk; j0 += 32) {  // the set bits of each mask word, lowest first
      for (uint32_t word = tree_mask_word(mrow, j0, s.Tk); word != 0; word &= word - 1) {
        const int64_t j = j0 + __builtin_ctz(word);
        keys[n++] = P + j;
        if (vis != nullptr) vis[j * vec + r] = -1;
      }
    }
    return n;
  }

  // Task c: rows [R c', R c' + R) of (batch row b, KV head hk), R = rows_per_task(), a row being
  // (query head in the group, query t).
  void task(int64_t c, Scratch& sc) const {
    const int64_t per = chunks(), R = rows_per_task(), b = c / (s.Hkv * per), hk = (c / per) % s.Hkv;
    const int64_t r0 = (c % per) * R, G = s.Hq / s.Hkv;
    const int nq = static_cast<int>(std::min<int64_t>(R, G * s.T - r0));
#ifdef SK_X86_AVX2_FMA
    if constexpr (kVector) {
      if (vec) return task_vec(b, hk, r0, nq, sc);
    }
#endif
    Rows<scalar_t, acc_t> w{sc.qf.data(), k + b * ks[0] + hk * ks[1], v + b * vs[0] + hk * vs[1], ks[2], vs[2],
                            plen[b], s.D, nq, {}, {}, scale};
    int64_t h[kRows], t[kRows];
    for (int r = 0; r < nq; ++r) {
      const int32_t* mrow;
      row_of(b, hk, r0 + r, h[r], t[r], mrow);
      const scalar_t* qr = q + b * qs[0] + h[r] * qs[1] + t[r] * qs[2];
      for (int64_t d = 0; d < s.D; ++d) sc.qf[r * s.D + d] = static_cast<acc_t>(qr[d]);
      int64_t* keys = sc.keys.data() + r * s.Tk;
      w.tkeys[r] = keys, w.tn[r] = seen_keys(mrow, w.P, keys);
    }
    acc_t z[kRows];
    attend_scalar(w, sc.score.data(), score_stride(), sc.o.data(), z);
    store(b, h, t, nq, w.P, w.tn, sc.o.data(), z);
  }

  void store(int64_t b, const int64_t* h, const int64_t* t, int nq, int64_t P, const int64_t* tn, const acc_t* o,
             const acc_t* z) const {
    for (int r = 0; r < nq; ++r) {
      scalar_t* dst = out + b * os[0] + h[r] * os[1] + t[r] * os[2];
      for (int64_t d = 0; d < s.D; ++d)  // a row that sees no key: zeros
        dst[d] = P + tn[r] == 0 ? scalar_t(0) : static_cast<scalar_t>(o[r * s.D + d] / z[r]);
    }
  }

#ifdef SK_X86_AVX2_FMA
  void task_vec(int64_t b, int64_t hk, int64_t r0, int nq, Scratch& sc) const {
    const int64_t P = plen[b], D = s.D;
    const float *kf, *vf;
    int64_t kst, vst;
    if constexpr (std::is_same_v<scalar_t, float>) {
      kf = k + b * ks[0] + hk * ks[1], vf = v + b * vs[0] + hk * vs[1], kst = ks[2], vst = vs[2];
    } else {
      kf = kvf + ((b * s.Hkv + hk) * 2) * kvf_rows * D, vf = kf + kvf_rows * D, kst = vst = D;
    }
    Lanes w{sc.qf.data(), kf, vf, kst, vst, P, s.Tk, D, nq, sc.vis.data(), {}, {}, static_cast<float>(scale)};
    if (amx) {
      std::fill_n(sc.qp.begin(), D * kLanes16, uint16_t{0});
    } else {
      std::fill_n(sc.qf.begin(), D * vec, 0.f);
    }
    std::fill_n(sc.vis.begin(), s.Tk * vec, 0);
    int64_t h[kLanes16], t[kLanes16];
    for (int r = 0; r < nq; ++r) {
      const int32_t* mrow;
      row_of(b, hk, r0 + r, h[r], t[r], mrow);
      const scalar_t* qr = q + b * qs[0] + h[r] * qs[1] + t[r] * qs[2];
      if (amx) {  // pair j = d / 2 of lane r: qp's 32-bit word j * 16 + r
        for (int64_t j = 0; j < D / 2; ++j) std::memcpy(&sc.qp[j * 32 + r * 2], qr + 2 * j, 4);
      } else {
        for (int64_t d = 0; d < D; ++d) sc.qf[d * vec + r] = static_cast<float>(qr[d]);
      }
      int64_t* keys = sc.keys.data() + r * s.Tk;
      w.tkeys[r] = keys, w.tn[r] = seen_keys(mrow, P, keys, sc.vis.data(), r);
    }
    float z[kLanes16];
#if defined(SK_X86_AVX512) && defined(SK_BF16_WIDE)
    if (amx) {
      const auto* kb = reinterpret_cast<const uint16_t*>(k + b * ks[0] + hk * ks[1]);
      if (cpu::amx_emulated()) {
        scores_amx<cpu::EmuTiles>(w, kb, ks[2], sc.qp.data(), sc.score.data());
      } else {
        scores_amx<cpu::HwTiles>(w, kb, ks[2], sc.qp.data(), sc.score.data());
      }
      softmax_values16(w, sc.score.data(), sc.o.data(), z);
      return store_vec(b, h, t, nq, P, w.tn, sc.o.data(), z);
    }
#endif
#ifdef SK_X86_AVX512
    if (vec == kLanes16) {
      attend16_avx512(w, sc.score.data(), sc.o.data(), z);
      return store_vec(b, h, t, nq, P, w.tn, sc.o.data(), z);
    }
#endif
    attend8_avx2(w, sc.score.data(), sc.o.data(), z);
    store_vec(b, h, t, nq, P, w.tn, sc.o.data(), z);
  }

  // store's arithmetic (out = o / z, one IEEE division, rounded to the dtype as c10 rounds) on 8
  // lanes; D a multiple of 8.
  __attribute__((target("avx2,fma"))) void store_vec(int64_t b, const int64_t* h, const int64_t* t, int nq, int64_t P,
                                                     const int64_t* tn, const float* o, const float* z) const {
#ifdef SK_X86_AVX512
    if (vec == kLanes16) return store_vec16(b, h, t, nq, P, tn, o, z);
#endif
    for (int r = 0; r < nq; ++r) {
      scalar_t* dst = out + b * os[0] + h[r] * os[1] + t[r] * os[2];
      const bool none = P + tn[r] == 0;  // a row that sees no key: zeros
      const __m256 zr = _mm256_set1_ps(z[r]);
      for (int64_t d = 0; d < s.D; d += 8) {
        const __m256 y = none ? _mm256_setzero_ps() : _mm256_div_ps(_mm256_loadu_ps(o + r * s.D + d), zr);
        if constexpr (std::is_same_v<scalar_t, float>) {
          _mm256_storeu_ps(dst + d, y);
        } else {
          cpu::store_bf16_8(reinterpret_cast<uint16_t*>(dst + d), y);
        }
      }
    }
  }
#ifdef SK_X86_AVX512
  // store_vec on 16 lanes (D a multiple of 16): the same division and rounding per value
  __attribute__((target("avx512f"))) void store_vec16(int64_t b, const int64_t* h, const int64_t* t, int nq, int64_t P,
                                                      const int64_t* tn, const float* o, const float* z) const {
    for (int r = 0; r < nq; ++r) {
      scalar_t* dst = out + b * os[0] + h[r] * os[1] + t[r] * os[2];
      const bool none = P + tn[r] == 0;
      const __m512 zr = _mm512_set1_ps(z[r]);
      for (int64_t d = 0; d < s.D; d += 16) {
        const __m512 y = none ? _mm512_setzero_ps() : _mm512_div_ps(_mm512_loadu_ps(o + r * s.D + d), zr);
        if constexpr (std::is_same_v<scalar_t, float>) {
          _mm512_storeu_ps(dst + d, y);
        } else {
          cpu::store_bf16_16(reinterpret_cast<uint16_t*>(dst + d), y);
        }
      }
    }
  }
#endif
#endif
};

#ifdef SK_X86_AVX2_FMA
// n bf16 rows of D (a multiple of 8; row stride st) widened to fp32 rows of D at o (exact).
__attribute__((target("avx2"))) void widen_rows(const uint16_t* src, int64_t st, int64_t n, int64_t D, float* o) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + i * D + d, cpu::load_bf16_8(src + i * st + d));
}
#endif

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* plen,
         const at::Tensor& bits, const TreeAttentionShape& s, double scale, at::Tensor& out) {
  using A = Attend<scalar_t>;
  A a{q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
      out.data_ptr<scalar_t>(), plen, bits.const_data_ptr<int32_t>(), s,
      {}, {}, {}, {}, static_cast<typename A::acc_t>(scale), 0, false, nullptr, 0};
  for (int i = 0; i < 3; ++i)
    a.qs[i] = q.stride(i), a.ks[i] = k.stride(i), a.vs[i] = v.stride(i), a.os[i] = out.stride(i);
#ifdef SK_X86_AVX2_FMA
  if (A::kVector && s.D % 8 == 0 && cpu::have_avx2_fma()) a.vec = kLanes8;
#ifdef SK_X86_AVX512
  if (a.vec && s.D % 16 == 0 && cpu::have_avx512f()) a.vec = kLanes16;
#endif
#if defined(SK_X86_AVX512) && defined(SK_BF16_WIDE)
  a.amx = std::is_same_v<scalar_t, c10::BFloat16> && a.vec == kLanes16 && s.D % 32 == 0 && s.D <= 256 &&
          cpu::have_amx_bf16();
#endif
  thread_local std::vector<float> kvf;  // reused across calls (a model's layers): no allocation per call
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (a.vec) {  // bf16 keys and values of the visited rows as fp32, once per call
      int64_t pmax = 0;
      for (int64_t b = 0; b < s.B; ++b) pmax = std::max(pmax, a.plen[b]);
      a.kvf_rows = pmax + s.Tk;
      const size_t need = static_cast<size_t>(s.B * s.Hkv * 2 * a.kvf_rows * s.D);
      if (kvf.size() < need) kvf.resize(need);
      float* dst = kvf.data();
      at::parallel_for(0, s.B * s.Hkv * 2, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          if (a.amx && c % 2 == 0) continue;  // keys: the tiles read the cache's bf16
          const int64_t b = c / (2 * s.Hkv), hk = (c / 2) % s.Hkv, n = a.plen[b] + s.Tk;
          const scalar_t* src = c % 2 == 0 ? a.k + b * a.ks[0] + hk * a.ks[1] : a.v + b * a.vs[0] + hk * a.vs[1];
          const int64_t st = c % 2 == 0 ? a.ks[2] : a.vs[2];
          widen_rows(reinterpret_cast<const uint16_t*>(src), st, n, s.D, dst + c * a.kvf_rows * s.D);
        }
      });
      a.kvf = kvf.data();
    }
  }
#endif
  const int64_t R = a.rows_per_task();
  at::parallel_for(0, s.B * s.Hkv * a.chunks(), 1, [&](int64_t c0, int64_t c1) {
    using acc_t = typename A::acc_t;
    const int64_t sc_len = a.vec ? (s.S + 16) / 16 * 16 * a.vec : kRows * a.score_stride();
    typename A::Scratch sc{std::vector<acc_t>(R * s.D), std::vector<acc_t>(sc_len), std::vector<acc_t>(R * s.D),
                           std::vector<int64_t>(R * s.Tk), std::vector<int32_t>(a.vec ? s.Tk * a.vec : 0),
                           std::vector<uint16_t>(a.amx ? s.D * kLanes16 : 0)};
    for (int64_t c = c0; c < c1; ++c) a.task(c, sc);
  });
}

}  // namespace

void tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& prefix_len, const at::Tensor& mask_bits, int64_t tree_len,
                        double scale, at::Tensor& out, at::Tensor& partial_out,
                        at::Tensor& partial_lse) {
  TORCH_CHECK(q.device().is_cpu(), "tree_attention (cpu): tensors must be on the CPU");
  const TreeAttentionShape s = tree_attention_check(q, k_cache, v_cache, prefix_len, mask_bits,
                                                    tree_len, out, partial_out, partial_lse);
  std::vector<int64_t> plen(s.B);  // int32 or int64, read in place (a tensor conversion cost ~1.5 us a call)
  for (int64_t b = 0; b < s.B; ++b)
    plen[b] = prefix_len.scalar_type() == at::kInt ? prefix_len.const_data_ptr<int32_t>()[b * prefix_len.stride(0)]
                                                   : prefix_len.const_data_ptr<int64_t>()[b * prefix_len.stride(0)];
  const int64_t* plen_p = plen.data();
  for (int64_t b = 0; b < s.B; ++b)
    TORCH_CHECK(plen_p[b] >= 0 && plen_p[b] + s.Tk <= s.S, "tree_attention: prefix_len[", b, "] = ", plen_p[b],
                " out of range for tree_len = ", s.Tk, " and cache length S = ", s.S);
  const at::Tensor bits = mask_bits.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cpu", [&] {
    run<scalar_t>(q, k_cache, v_cache, plen_p, bits, s, scale, out);
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace sequoia_kernels
