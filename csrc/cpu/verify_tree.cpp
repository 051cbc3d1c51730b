// verify_tree CPU implementation: sequences in parallel (at::parallel_for over B), each walking
// its tree. An accept costs two loads; a rejection costs ONE pass over the vocabulary that reads
// the current residual P and the node's input draft row Q and writes the new residual D into the
// other half of the sequence's workspace (double buffer: the old residual survives when the spec
// keeps it, case (c)). The draft is never copied: q = Q / Sq with the node's rejected tokens
// zeroed is represented by the input row plus the (sorted, short) list of rejected tokens, which
// the pass treats as scalar gaps between SIMD segments. The pass multiplies by the reciprocals
// ip = rcp(Sp), iq = rcp(Sq) (the spec's: one IEEE division each per state), and skips the
// products when they are 1 (x * 1 == x exactly), i.e. on a node's first rejection. fp64 sums
// are SIMD reductions. The bonus draw sums P per
// 1024-token block in one SIMD pass, then scans one block. Algorithm: csrc/kernels/verify_tree.h
// and the reference's docstring.
//
// The hot loops are compiled twice (target_clones: AVX2 and the baseline x86-64 SSE2), chosen
// once at load time; without "fma" in the target the compiler cannot contract a * b + c, as the
// spec requires (IEEE fp32 operations one by one).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <vector>

#include "cpu/simd.h"
#include "kernels/verify_tree.h"
#include "verify_tree_params.h"

namespace sequoia_kernels {

namespace {

constexpr int64_t kBlock = 1024;  // bonus draw: tokens per block sum

// The spec's reciprocal rcp(s) = f32(1 / max(s, FLT_MIN)): one IEEE division.
inline float rcp(float s) { return 1.f / std::max(s, FLT_MIN); }

int64_t argmax(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

// D[i] = max(P[i] * ip - Q[i] * iq, 0) for i in [lo, hi); adds sum D to *zp and sum Q to *zq
// (fp64). mul_p / mul_q false: ip / iq are 1 and the product (an identity) is skipped.
SK_SIMD_CLONES
void reject_segment(const float* __restrict P, const float* __restrict Q, float ip, float iq,
                    bool mul_p, bool mul_q, int64_t lo, int64_t hi, float* __restrict D,
                    double* zp_io, double* zq_io) {
  double zp = 0.0, zq = 0.0;
  if (mul_p && mul_q) {
#pragma omp simd reduction(+ : zp, zq)
    for (int64_t i = lo; i < hi; ++i) {
      const float t = P[i] * ip - Q[i] * iq;
      const float d = t < 0.f ? 0.f : t;  // std::max(t, 0): NaN stays NaN
      D[i] = d;
      zp += static_cast<double>(d);
      zq += static_cast<double>(Q[i]);
    }
  } else if (mul_p) {
#pragma omp simd reduction(+ : zp, zq)
    for (int64_t i = lo; i < hi; ++i) {
      const float t = P[i] * ip - Q[i];
      const float d = t < 0.f ? 0.f : t;
      D[i] = d;
      zp += static_cast<double>(d);
      zq += static_cast<double>(Q[i]);
    }
  } else if (mul_q) {
#pragma omp simd reduction(+ : zp, zq)
    for (int64_t i = lo; i < hi; ++i) {
      const float t = P[i] - Q[i] * iq;
      const float d = t < 0.f ? 0.f : t;
      D[i] = d;
      zp += static_cast<double>(d);
      zq += static_cast<double>(Q[i]);
    }
  } else {
#pragma omp simd reduction(+ : zp, zq)
    for (int64_t i = lo; i < hi; ++i) {
      const float t = P[i] - Q[i];
      const float d = t < 0.f ? 0.f : t;
      D[i] = d;
      zp += static_cast<double>(d);
      zq += static_cast<double>(Q[i]);
    }
  }
  *zp_io += zp;
  *zq_io += zq;
}

// fp64 sum of P per block of kBlock tokens into bs[0 .. ceil(V / kBlock)); returns the total.
SK_SIMD_CLONES
double block_sums(const float* __restrict P, int64_t V, double* __restrict bs) {
  double S = 0.0;
  for (int64_t lo = 0, k = 0; lo < V; lo += kBlock, ++k) {
    const int64_t hi = std::min(lo + kBlock, V);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) s += static_cast<double>(P[i]);
    bs[k] = s;
    S += s;
  }
  return S;
}

// Inverse CDF of P at u * sum(P) with fp64 prefix sums (block sums, then one block scanned);
// -1 when P has no positive entry. bs: scratch of ceil(V / kBlock) doubles.
int64_t inverse_cdf(const float* P, int64_t V, float u, double* bs) {
  const double S = block_sums(P, V, bs);
  const double t = static_cast<double>(u) * S;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double C = 0.0;
  int64_t k = 0;
  while (k < nb - 1 && !(C + bs[k] > t)) C += bs[k++];  // first block whose end passes t
  for (int64_t i = k * kBlock; i < V; ++i) {  // (rounding may push the crossing a block later)
    C += static_cast<double>(P[i]);
    if (P[i] > 0.f && C > t) return i;
  }
  for (int64_t i = V - 1; i >= 0; --i)  // t >= every prefix sum (rounding): the last positive
    if (P[i] > 0.f) return i;
  return -1;
}

struct Scratch {
  std::vector<int64_t> rejected;  // tokens rejected at the current node, sorted, unique
  std::vector<double> block;      // bonus draw block sums
};

void verify_one(const VerifyTreeParams& p, int64_t b, Scratch& s) {
  const int64_t T = p.T, V = p.V;
  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  float* const wbuf[2] = {p.workspace + b * 2 * V, p.workspace + b * 2 * V + V};
  for (int64_t i = 0; i < T; ++i) path[i] = -1;
  path[0] = 0;
  int64_t cur = 0, n = 1;
  const float* P = p.p + b * p.p_sb;  // current residual target: an input row or a wbuf
  const float* Q = p.q + b * p.q_sb;  // the node's input draft row (rejected tokens: see below)
  float Sp = 1.f, Sq = 1.f;
  auto& rej = s.rejected;
  rej.clear();
  auto is_rejected = [&](int64_t x) { return std::binary_search(rej.begin(), rej.end(), x); };
  int64_t amax = p.greedy ? argmax(P, V) : -1;
  for (int64_t c = 1; c < T; ++c) {
    if (p.parents[c] != cur) continue;
    const int64_t x = tok[c];
    if (x < 0 || x >= V) continue;
    bool accept;
    if (p.greedy) {
      accept = x == amax;
    } else {
      const float Qx = is_rejected(x) ? 0.f : Q[x];
      const float ip = rcp(Sp), iq = Sq > 0.f ? rcp(Sq) : 0.f;  // the spec's reciprocals
      const float qx = Qx * iq;
      const float px = P[x] * ip;
      if (!(qx > 0.f)) continue;  // (a) outside the remaining draft support
      const float rq = uni[c] * qx;
      accept = rq < px;
      if (!accept) {
        // Reject x: D = max(P * ip - Q' * iq, 0) with Q' = Q without the earlier rejections,
        // Zp = sum D, Sq' = sum (Q' without x). Segments between the rejected tokens are SIMD;
        // a rejected token r contributes max(P[r] * ip - 0, 0) to D and 0 to Sq'.
        float* D = (P == wbuf[0]) ? wbuf[1] : wbuf[0];
        const bool mul_p = ip != 1.f, mul_q = iq != 1.f;
        double zp = 0.0, zq = 0.0;
        int64_t lo = 0;
        auto gap = [&](int64_t r, bool zero_q) {  // token r handled alone
          reject_segment(P, Q, ip, iq, mul_p, mul_q, lo, r, D, &zp, &zq);
          const float pr = mul_p ? P[r] * ip : P[r];
          const float qr = zero_q ? 0.f : (mul_q ? Q[r] * iq : Q[r]);
          const float d = std::max(pr - qr, 0.f);
          D[r] = d;
          zp += static_cast<double>(d);
          lo = r + 1;
        };
        bool x_done = false;
        for (const int64_t r : rej) {
          if (!x_done && x < r) {
            gap(x, false);
            x_done = true;
          }
          gap(r, true);
        }
        if (!x_done) gap(x, false);
        reject_segment(P, Q, ip, iq, mul_p, mul_q, lo, V, D, &zp, &zq);
        if (zp > 0.0) {  // (c) otherwise keep P, Sp (still intact in the other buffer / input)
          P = D;
          Sp = static_cast<float>(zp);
        }
        rej.insert(std::upper_bound(rej.begin(), rej.end(), x), x);
        Sq = static_cast<float>(zq);  // (b) may be 0: later siblings are skipped by (a)
        continue;
      }
    }
    if (accept) {
      cur = c;
      path[n++] = c;
      P = p.p + b * p.p_sb + c * p.p_st;
      Q = p.q + b * p.q_sb + c * p.q_st;
      Sp = Sq = 1.f;
      rej.clear();
      if (p.greedy) amax = argmax(P, V);
    }
  }
  p.num_accepted[b] = n;
  if (p.greedy) {
    p.bonus[b] = amax;
  } else {
    s.block.resize((V + kBlock - 1) / kBlock);
    p.bonus[b] = inverse_cdf(P, V, uni[0], s.block.data());
  }
}

}  // namespace

void verify_tree_cpu(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                     const at::Tensor& tokens, const at::Tensor& parents,
                     const at::Tensor& uniforms, bool greedy, at::Tensor& path,
                     at::Tensor& num_accepted, at::Tensor& bonus, at::Tensor& workspace) {
  TORCH_CHECK(target_probs.device().is_cpu(), "verify_tree (cpu): tensors must be on the CPU");
  const VerifyTreeParams p = verify_tree_params(target_probs, draft_probs, tokens, parents,
                                                uniforms, greedy, path, num_accepted, bonus,
                                                workspace);
  at::parallel_for(0, p.B, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t b = begin; b < end; ++b) verify_one(p, b, s);
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("verify_tree", &verify_tree_cpu); }

}  // namespace sequoia_kernels
