// verify_tree CPU implementation: one task per sequence, walking its tree; vocabulary-wide
// work only after a rejection (the common accept costs two loads). See
// csrc/kernels/verify_tree.h for the algorithm.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

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

void verify_one(const VerifyTreeParams& p, int64_t b) {
  const int64_t T = p.T, V = p.V;
  const int64_t* tok = p.tokens + b * p.tok_sb;
  const float* uni = p.uniforms + b * p.uni_sb;
  int64_t* path = p.path + b * p.path_sb;
  float* wP = p.workspace + b * 2 * V;
  float* wQ = wP + V;
  for (int64_t i = 0; i < T; ++i) path[i] = -1;
  int64_t u = 0, n = 0;
  path[n++] = 0;
  const float* P = p.p + b * p.p_sb;
  const float* Q = p.q + b * p.q_sb;
  float Sp = 1.f, Sq = 1.f;
  int64_t first = 1;  // children of u lie after u (topological, consecutive)
  while (true) {
    while (first < T && p.parents[first] != u) ++first;
    int64_t next = -1;
    const int64_t amax = p.greedy ? argmax(P, V) : -1;
    for (int64_t c = first; c < T && p.parents[c] == u; ++c) {
      const int64_t x = tok[c];
      if (x < 0 || x >= V) continue;
      if (p.greedy) {
        if (x == amax) { next = c; break; }
        continue;
      }
      const float qx = Q[x] / Sq, px = P[x] / Sp;
      if (!(qx > 0.f)) continue;
      if (uni[c] * qx < px) { next = c; break; }
      // reject x: residual P' = max(P/Sp - Q/Sq, 0), Q' = Q without x
      const float qx_raw = Q[x];
      float sp = 0.f, sq = 0.f;
      for (int64_t i = 0; i < V; ++i) {
        const float r = std::max(P[i] / Sp - Q[i] / Sq, 0.f);
        const float qi = i == x ? 0.f : Q[i];
        wP[i] = r;
        wQ[i] = qi;
        sp += r;
        sq += qi;
      }
      if (!(sp > 0.f)) {  // rounding only: keep the old target (== old q)
        for (int64_t i = 0; i < V; ++i) wP[i] = i == x ? qx_raw : wQ[i];
        sp = Sq;
      }
      P = wP; Q = wQ; Sp = sp; Sq = sq;
    }
    if (next < 0) break;
    u = next;
    path[n++] = u;
    P = p.p + b * p.p_sb + u * p.p_st;
    Q = p.q + b * p.q_sb + u * p.q_st;
    Sp = Sq = 1.f;
    first = u + 1;
  }
  p.num_accepted[b] = n;
  if (p.greedy) {
    p.bonus[b] = argmax(P, V);
    return;
  }
  const float target = uni[0] * Sp;
  float cum = 0.f;
  int64_t pick = -1, last = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (P[i] > 0.f) last = i;
    cum += P[i];
    if (cum > target && P[i] > 0.f) { pick = i; break; }
  }
  p.bonus[b] = pick >= 0 ? pick : last;
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
