// tree_attention CPU implementation: one query at a time over the keys it sees, in key order
// (the prefix [0, prefix_len), then the tree keys its mask row holds), with fixed arithmetic:
//   score_s = (q . k_s) scale, the dot product in 16 fp32 lanes (lane l sums d = l, l + 16, ..
//             by FMA, in d order) added in a fixed tree;
//   e_s = exp(score_s - max), z = sum of e_s in key order;  out = (sum of e_s v_s in key order) / z
// (fp32 accumulation for fp32/bf16/fp16 inputs, fp64 for fp64). A query's result depends only on
// the keys it sees and their order, not on how many queries share the call or where the tree
// starts: a token's attention output is the same bits in a one-token step and in a tree step
// (batch invariance; with packed_linear, a token's logits are), which ATen's blocked attention
// does not promise. The AVX2 path (D a multiple of 16) computes the scalar path's lanes and sums;
// its exp is cpu::exp8 (<= 1 ulp from std::exp), the same function for every score. A machine
// and head size always take the same path. Rows that see no key at all are zeroed.
//
// Cost: 4 D flops per (query, head, visible key); a task is 4 queries of one (batch row, KV
// head), which read each prefix key and value once. Measured on a 2-core Xeon (SmolLM2-135M's
// 9 / 3 heads of 64, 160 keys, fp32; bench/bench_tree_attention.py): 36 us per layer for one
// query against 63 us for SDPA with a dense mask, 167 us for a 16-node tree against 104 us: the
// per-key horizontal sums and scalar softmax steps are what a GEMM formulation would save.
#include <ATen/core/Tensor.h>  // not ATen/ATen.h: every op header, ~3 s more per compile
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

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
template <typename raw>
__attribute__((target("avx2,fma"))) inline __m256 load8(const raw* p) {
  if constexpr (std::is_same_v<raw, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bf16: the bits shifted into an fp32's high half (exact)
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// lane_sum's addition tree on lanes a0 (0-7) and a1 (8-15), in registers
__attribute__((target("avx2,fma"))) inline float lane_sum_avx2(__m256 a0, __m256 a1) {
  const __m256 t = _mm256_add_ps(a0, a1);                                               // l + (l + 8)
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // + (l + 4)
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));                                  // 0 + 2, 1 + 3
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, 1)));
}

// One key's 16-lane dot products with NQ queries (fp32 rows of qf), the scalar path's lanes.
template <typename raw, int NQ>
__attribute__((target("avx2,fma"))) inline void dots_avx2(const float* qf, int64_t D, const raw* k, float scale,
                                                          float* out, int64_t ostride) {
  __m256 a0[NQ], a1[NQ];
  #pragma GCC unroll 4
  for (int r = 0; r < NQ; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += kLanes) {
    const __m256 k0 = load8(k + d), k1 = load8(k + d + 8);
    #pragma GCC unroll 4
    for (int r = 0; r < NQ; ++r) {
      a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d), k0, a0[r]);
      a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d + 8), k1, a1[r]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < NQ; ++r) out[r * ostride] = lane_sum_avx2(a0[r], a1[r]) * scale;
}

// The scalar path's arithmetic for NQ queries, D a multiple of 16; the prefix's keys and values
// are read once for all NQ. exp is cpu::exp8 (<= 1 ulp from std::exp) on every score, whatever
// its position (the score rows are padded to a multiple of 8).
template <typename raw, int NQ>
__attribute__((target("avx2,fma"))) void attend_avx2(const Rows<raw, float>& w, float* score, int64_t stride, float* o,
                                                     float* z) {
  const int64_t D = w.D;
  for (int64_t i = 0; i < w.P; ++i) dots_avx2<raw, NQ>(w.qf, D, w.kb + i * w.kst, w.scale, score + i, stride);
  #pragma GCC unroll 4
  for (int r = 0; r < NQ; ++r)
    for (int64_t j = 0; j < w.tn[r]; ++j)
      dots_avx2<raw, 1>(w.qf + r * D, D, w.kb + w.tkeys[r][j] * w.kst, w.scale, score + r * stride + w.P + j, 0);
  #pragma GCC unroll 4
  for (int r = 0; r < NQ; ++r) {
    float* sc = score + r * stride;
    const int64_t n = w.n(r), padded = (n + 7) / 8 * 8;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sc[i]);
    for (int64_t i = 0; i < n; ++i) sc[i] -= m;
    for (int64_t i = n; i < padded; ++i) sc[i] = 0.f;
    cpu::exp_row_avx2(sc, sc, padded);  // padded: every score takes the vector body, none the tail
    z[r] = 0.f;
    for (int64_t i = 0; i < n; ++i) z[r] += sc[i];
  }
  for (int64_t d = 0; d < D; d += kLanes) {  // 16 outputs per query in registers, keys in order
    __m256 o0[NQ], o1[NQ];
    #pragma GCC unroll 4
    for (int r = 0; r < NQ; ++r) o0[r] = o1[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < w.P; ++i) {
      const raw* v = w.vb + i * w.vst + d;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
      #pragma GCC unroll 4
      for (int r = 0; r < NQ; ++r) {
        const __m256 e = _mm256_set1_ps(score[r * stride + i]);
        o0[r] = _mm256_fmadd_ps(e, v0, o0[r]);
        o1[r] = _mm256_fmadd_ps(e, v1, o1[r]);
      }
    }
    #pragma GCC unroll 4
    for (int r = 0; r < NQ; ++r) {
      for (int64_t j = 0; j < w.tn[r]; ++j) {
        const raw* v = w.vb + w.tkeys[r][j] * w.vst + d;
        const __m256 e = _mm256_set1_ps(score[r * stride + w.P + j]);
        o0[r] = _mm256_fmadd_ps(e, load8(v), o0[r]);
        o1[r] = _mm256_fmadd_ps(e, load8(v + 8), o1[r]);
      }
      _mm256_storeu_ps(o + r * D + d, o0[r]);
      _mm256_storeu_ps(o + r * D + d + 8, o1[r]);
    }
  }
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
  bool avx2;

  int64_t chunks() const { return (s.Hq / s.Hkv * s.T + kRows - 1) / kRows; }  // per (b, KV head)
  int64_t score_stride() const { return (s.S + 7) / 8 * 8; }  // a query's scores, padded for exp8

  struct Scratch {
    std::vector<acc_t> qf, score, o;
    std::vector<int64_t> keys;
  };

  // Task c: rows [kRows c', kRows c' + kRows) of (batch row b, KV head hk), a row being (query
  // head in the group, query t).
  void task(int64_t c, Scratch& sc) const {
    const int64_t per = chunks(), b = c / (s.Hkv * per), hk = (c / per) % s.Hkv, r0 = (c % per) * kRows;
    const int64_t G = s.Hq / s.Hkv, stride = score_stride();
    const int nq = static_cast<int>(std::min<int64_t>(kRows, G * s.T - r0));
    Rows<scalar_t, acc_t> w{sc.qf.data(), k + b * ks[0] + hk * ks[1], v + b * vs[0] + hk * vs[1], ks[2], vs[2],
                            plen[b], s.D, nq, {}, {}, scale};
    int64_t h[kRows], t[kRows];
    for (int r = 0; r < nq; ++r) {
      h[r] = hk * G + (r0 + r) / s.T, t[r] = (r0 + r) % s.T;
      const scalar_t* qr = q + b * qs[0] + h[r] * qs[1] + t[r] * qs[2];
      for (int64_t d = 0; d < s.D; ++d) sc.qf[r * s.D + d] = static_cast<acc_t>(qr[d]);
      const int32_t* mrow = bits + ((s.Bm == 1 ? 0 : b) * s.T + t[r]) * s.W;
      int64_t* keys = sc.keys.data() + r * s.Tk;
      w.tkeys[r] = keys, w.tn[r] = 0;
      for (int64_t j = 0; j < s.Tk; ++j)
        if (tree_mask_bit(mrow, j)) keys[w.tn[r]++] = w.P + j;
    }
    acc_t z[kRows];
    attend(w, sc.score.data(), stride, sc.o.data(), z);
    for (int r = 0; r < nq; ++r) {
      scalar_t* dst = out + b * os[0] + h[r] * os[1] + t[r] * os[2];
      for (int64_t d = 0; d < s.D; ++d)  // a row that sees no key: zeros
        dst[d] = w.n(r) == 0 ? scalar_t(0) : static_cast<scalar_t>(sc.o[r * s.D + d] / z[r]);
    }
  }

  void attend(const Rows<scalar_t, acc_t>& w, acc_t* score, int64_t stride, acc_t* o, acc_t* z) const {
#ifdef SK_X86_AVX2_FMA
    if constexpr (kVector) {
      using raw = std::conditional_t<std::is_same_v<scalar_t, float>, float, c10::BFloat16>;
      if (avx2 && s.D % kLanes == 0) {
        const auto& wr = reinterpret_cast<const Rows<raw, float>&>(w);
        switch (w.nq) {
          case 4: return attend_avx2<raw, 4>(wr, score, stride, o, z);
          case 3: return attend_avx2<raw, 3>(wr, score, stride, o, z);
          case 2: return attend_avx2<raw, 2>(wr, score, stride, o, z);
          default: return attend_avx2<raw, 1>(wr, score, stride, o, z);
        }
      }
    }
#endif
    attend_scalar(w, score, stride, o, z);
  }
};

template <typename scalar_t>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& plen,
         const at::Tensor& bits, const TreeAttentionShape& s, double scale, at::Tensor& out) {
  using A = Attend<scalar_t>;
  A a{q.const_data_ptr<scalar_t>(), k.const_data_ptr<scalar_t>(), v.const_data_ptr<scalar_t>(),
      out.data_ptr<scalar_t>(), plen.const_data_ptr<int64_t>(), bits.const_data_ptr<int32_t>(), s,
      {}, {}, {}, {}, static_cast<typename A::acc_t>(scale), false};
  for (int i = 0; i < 3; ++i)
    a.qs[i] = q.stride(i), a.ks[i] = k.stride(i), a.vs[i] = v.stride(i), a.os[i] = out.stride(i);
#ifdef SK_X86_AVX2_FMA
  a.avx2 = cpu::have_avx2_fma();
#endif
  at::parallel_for(0, s.B * s.Hkv * a.chunks(), 1, [&](int64_t c0, int64_t c1) {
    using acc_t = typename A::acc_t;
    typename A::Scratch sc{std::vector<acc_t>(kRows * s.D), std::vector<acc_t>(kRows * a.score_stride()),
                           std::vector<acc_t>(kRows * s.D), std::vector<int64_t>(kRows * s.Tk)};
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
  const at::Tensor plen = prefix_len.to(at::kLong);
  const int64_t* plen_p = plen.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < s.B; ++b)
    TORCH_CHECK(plen_p[b] >= 0 && plen_p[b] + s.Tk <= s.S, "tree_attention: prefix_len[", b, "] = ", plen_p[b],
                " out of range for tree_len = ", s.Tk, " and cache length S = ", s.S);
  const at::Tensor bits = mask_bits.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tree_attention_cpu", [&] {
    run<scalar_t>(q, k_cache, v_cache, plen, bits, s, scale, out);
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("tree_attention", &tree_attention_cpu); }

}  // namespace sequoia_kernels
