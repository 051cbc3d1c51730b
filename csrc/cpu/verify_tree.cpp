// verify_tree CPU implementation: one task per sequence walking its tree. Vocabulary-wide work
// happens only after a rejection (an accept costs two loads); those passes are SIMD loops with
// fp64 accumulators. Algorithm: csrc/kernels/verify_tree.h and the reference's docstring.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>

#include "kernels/verify_tree.h"
#include "verify_tree_params.h"

namespace sequoia_kernels {

namespace {

int64_t argmax(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

// Inverse CDF of P at u * sum(P), fp64 prefix sums; -1 when P has no positive entry.
int64_t inverse_cdf(const float* P, int64_t V, float u) {
  double S = 0.0;
#pragma omp simd reduction(+ : S)
  for (int64_t i = 0; i < V; ++i) S += static_cast<double>(P[i]);
  const double t = static_cast<double>(u) * S;
  double C = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    C += static_cast<double>(P[i]);
    if (P[i] > 0.f) {
      if (C > t) return i;
      last = i;
    }
  }
  return last;
}

// Sums of D = max(P / sp - Q / sq, 0) and of Q without x, in fp64; when given, D is written to
// outP and Q without x to outQ in the same pass.
void reject_pass(const float* P, const float* Q, float sp, float sq, int64_t x, int64_t V,
                 float* outP, float* outQ, double* zp_out, double* zq_out) {
  double zp = 0.0, zq = 0.0;
  auto run = [&](auto write_p, auto write_q) {
#pragma omp simd reduction(+ : zp, zq)
    for (int64_t i = 0; i < V; ++i) {
      const float d = std::max(P[i] / sp - Q[i] / sq, 0.f);
      const float qi = i == x ? 0.f : Q[i];
      zp += static_cast<double>(d);
      zq += static_cast<double>(qi);
      if constexpr (decltype(write_p)::value) outP[i] = d;
      if constexpr (decltype(write_q)::value) outQ[i] = qi;
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (outP && outQ) run(T{}, T{});
  else if (outP) run(T{}, F{});
  else if (outQ) run(F{}, T{});
  else run(F{}, F{});
  *zp_out = zp;
  *zq_out = zq;
}

void verify_one(const VerifyTreeParams& p, int64_t b) {
  const int64_t T = p.T, V = p.V;
  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  float* wP = p.workspace + b * 2 * V;
  float* wQ = wP + V;
  for (int64_t i = 0; i < T; ++i) path[i] = -1;
  path[0] = 0;
  int64_t cur = 0, n = 1;
  const float* P = p.p + b * p.p_sb;
  const float* Q = p.q + b * p.q_sb;
  float Sp = 1.f, Sq = 1.f;
  int64_t amax = p.greedy ? argmax(P, V) : -1;
  for (int64_t c = 1; c < T; ++c) {
    if (p.parents[c] != cur) continue;
    const int64_t x = tok[c];
    if (x < 0 || x >= V) continue;
    bool accept;
    if (p.greedy) {
      accept = x == amax;
    } else {
      const float qx = Sq > 0.f ? Q[x] / Sq : 0.f;
      const float px = P[x] / Sp;
      if (!(qx > 0.f)) continue;  // (a) outside the remaining draft support
      const float rq = uni[c] * qx;
      accept = rq < px;
      if (!accept) {  // reject x: residual target, remaining draft
        const float sp = Sp, sq = Sq;
        // One fused pass: the fp64 sums, plus D and Q' written straight to the workspace when P
        // and Q are still the input rows (a node's first rejection: nothing to preserve).
        const bool fresh_p = P != wP, fresh_q = Q != wQ;
        double zp = 0.0, zq = 0.0;
        reject_pass(P, Q, sp, sq, x, V, fresh_p ? wP : nullptr, fresh_q ? wQ : nullptr, &zp, &zq);
        if (zp > 0.0) {  // (c) otherwise keep P, Sp
          if (!fresh_p) {  // P is the workspace: overwrite it only now that Zp > 0 is known
#pragma omp simd
            for (int64_t i = 0; i < V; ++i) wP[i] = std::max(P[i] / sp - Q[i] / sq, 0.f);
          }
          P = wP;
          Sp = static_cast<float>(zp);
        }
        wQ[x] = 0.f;  // (already 0 when the pass copied Q)
        Q = wQ;
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
      if (p.greedy) amax = argmax(P, V);
    }
  }
  p.num_accepted[b] = n;
  p.bonus[b] = p.greedy ? amax : inverse_cdf(P, V, uni[0]);
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
    for (int64_t b = begin; b < end; ++b) verify_one(p, b);
  });
}

TORCH_LIBRARY_IMPL(sequoia_kernels, CPU, m) { m.impl("verify_tree", &verify_tree_cpu); }

}  // namespace sequoia_kernels
