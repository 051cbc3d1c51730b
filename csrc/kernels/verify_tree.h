// verify_tree: the exact algorithm shared by the C++ CPU and CUDA kernels (no torch headers).
// The pure-PyTorch reference (sequoia_kernels/reference/verify_tree.py) follows the same steps.
//
// Per sequence b, starting at the root u = 0, with state (P, Sp, Q, Sq) = (p_u, 1, q_u, 1)
// where P, Q are unnormalised fp32 vectors and Sp, Sq their normalisers:
//   for each child c of u in sampling order, x = tokens[b, c]:
//     qx = Q[x] / Sq, px = P[x] / Sp                       (x < 0 or x >= V: skip c)
//     if qx == 0: skip c (x cannot have been sampled from the remaining q; nothing changes)
//     if uniforms[b, c] * qx < px: accept c: u = c, state = (p_c, 1, q_c, 1), next level
//     else reject (one fused pass over the vocabulary):
//       P'[i] = max(P[i] / Sp - Q[i] / Sq, 0), Sp' = sum P'
//       Q'[i] = Q[i] (i != x), Q'[x] = 0,       Sq' = sum Q'
//       if Sp' == 0 (p <= q everywhere: in exact arithmetic p == q and x would have been
//       accepted, so only rounding gets here): P' = the old Q (x included), Sp' = old Sq
//   no child accepted (all rejected, skipped, or u is a leaf): stop.
// Bonus: the first token t with cumsum(P)[t] > uniforms[b, 0] * Sp (inverse CDF in fp32, in
// token order); if rounding leaves none, the last token with P[t] > 0.
// Greedy: accept the first child whose token is argmax p_u (lowest index on ties); the bonus is
// argmax p at the last accepted node.
// Outputs: path[b, :n] = accepted nodes from the root (root included), -1 after; num_accepted[b]
// = n; bonus[b].
#pragma once
#include <cstdint>

namespace sequoia_kernels {

struct VerifyTreeParams {
  const float* p;      // [B, T, V] target probabilities, rows contiguous
  const float* q;      // [B, T, V] draft probabilities
  const int64_t* tokens;   // [B, T]
  const int64_t* parents;  // [T]
  const float* uniforms;   // [B, T]
  int64_t* path;           // [B, T]
  int64_t* num_accepted;   // [B]
  int64_t* bonus;          // [B]
  float* workspace;        // [B, 2, V]: residual P and remaining Q after a rejection
  int64_t B, T, V;
  int64_t p_sb, p_st, q_sb, q_st;  // strides in elements (vocab stride 1)
  int64_t tok_sb, uni_sb, path_sb;
  bool greedy;
};

}  // namespace sequoia_kernels
