r"""verify_tree reference: exact tree verification (Sequoia's recursive rejection sampling
without replacement), the specification the C++, CUDA and Triton kernels follow.

Inputs (one step, B sequences sharing one tree shape of T nodes, vocabulary V):

* ``target_probs [B, T, V]`` fp32: ``p_u``, the target's next-token distribution at node u
  (already tempered and filtered, e.g. by ``sampling_probs``).
* ``draft_probs [B, T, V]`` fp32: ``q_u``, the distribution u's children were sampled from,
  without replacement, in index order (``sample_children``). Rows of nodes without children
  are never read.
* ``tokens [B, T]`` int64: node u's token (the token sampled for u from its parent's q).
  ``tokens[:, 0]`` (the root: the last accepted token) is ignored. ``-1`` = "no child here"
  (``sample_children`` pads with -1 when a node asked for more children than q has tokens).
* ``parents [T]`` int64: ``parents[0] = -1``, ``0 <= parents[c] < c`` (topological), the
  children of each node consecutive and in sampling order (they are tried in index order).
  Sequoia's planner emits BFS order, which satisfies this; BFS itself is not required. (The
  one-pass loop below is correct for any topological order; the public op checks the
  consecutive-children format, which the compiled kernels use to find a node's children.)
* ``uniforms [B, T]`` fp32 in [0, 1): ``uniforms[b, c]`` (c >= 1) is the r used when child c is
  tried (each node is tried at most once per step, so every decision uses its own number);
  ``uniforms[b, 0]`` drives the bonus draw. Unused in greedy mode.

Outputs: ``path [B, T]`` int64 (accepted nodes from the root, root included, then -1),
``num_accepted [B]`` int64 (length of the path, root included, so >= 1), ``bonus [B]`` int64
(the token drawn after the path). The tokens a step emits are
``tokens[b, path[b, 1:num_accepted[b]]]`` followed by ``bonus[b]``.

Algorithm (the spec; every backend implements exactly this)
------------------------------------------------------------
Numbers: vectors are fp32; every elementwise operation is one IEEE fp32 operation rounded to
nearest (no fused multiply-add: in CUDA ``__fmul_rn`` / ``__fsub_rn``, in Triton
``enable_fp_fusion=False``; the two reciprocals per state are IEEE divisions, ``__frcp_rn`` /
``tl.math.div_rn``, never an approximate reciprocal). Every sum over the
vocabulary is accumulated in **fp64**, in any order: the fp64 sum of <= 2**17 fp32 terms is
within ~1e-11 relative of the exact sum, so once rounded to fp32 (``f32(.)``) all backends get
the same bits except with probability ~1e-7 per sum, and the order (sequential, SIMD lanes,
block tree reduction) is free. The current target and draft of a node are kept unnormalised,
``p = P / Sp`` and ``q = Q / Sq`` (so the draft is the input row with the rejected tokens
zeroed: no rounding compounds over successive rejections), and they are applied by multiplying
with the reciprocals ``ip = rcp(Sp)`` and ``iq = rcp(Sq)`` (0 when Sq = 0), where
``rcp(s) = f32(1 / max(s, FLT_MIN))`` is one IEEE division per state change: the passes over the
vocabulary multiply, they never divide (a GPU's IEEE division costs ~10x a multiplication, and a
pass would otherwise do two per token). Mathematically p = P / Sp either way; the rounding
differs from a division by at most 1 ulp, and every backend rounds identically::

    for each sequence b:
        cur = 0                                   # node whose children are being tried
        P = target_probs[b, 0, :]; Sp = 1         # residual target p = P * rcp(Sp)
        Q = draft_probs[b, 0, :];  Sq = 1         # remaining draft  q = Q * rcp(Sq)
        path = [0]
        for c in 1 .. T-1:                        # one pass in index order
            if parents[c] != cur: continue        # not a child of the current node
            x = tokens[b, c]
            if not (0 <= x < V): continue         # -1 (no child), or garbage with validate=False
            if greedy:
                if x == argmax(target_probs[b, cur]):   # first index of the maximum
                    cur = c; path.append(c)
                continue
            ip = rcp(Sp); iq = rcp(Sq) if Sq > 0 else 0       # (1 when Sp, Sq = 1)
            qx = Q[x] * iq                        # fp32 multiplications
            px = P[x] * ip
            if not (qx > 0): continue             # (a) token outside the remaining draft support:
                                                  #     skipped, nothing changes (also NaN)
            r = uniforms[b, c]
            if f32(r * qx) < px:                  # accept: move to the child
                cur = c; path.append(c)
                P = target_probs[b, c, :]; Sp = 1
                Q = draft_probs[b, c, :];  Sq = 1
            else:                                 # reject: residual target, remaining draft
                D[v] = max(P[v] * ip - Q[v] * iq, 0)    # fp32: two products, subtract, max
                Zp = f32(sum_fp64(D))
                Q[x] = 0                          # (on a copy: inputs are never written)
                Sq = f32(sum_fp64(Q))             # (b) may become 0: then qx = 0 above and every
                                                  #     later sibling is skipped by (a)
                if Zp > 0: P = D; Sp = Zp         # (c) p - q has no positive entry: keep P, Sp
        if greedy:
            bonus = argmax(target_probs[b, cur])  # first index of the maximum
        else:                                     # inverse CDF of p = P / Sp, in fp64, on P
            S = sum_fp64(P)                       # fp64, not rounded; the actual mass of P
            t = fp64(uniforms[b, 0]) * S
            C_j = sum_fp64(P[0..j])               # inclusive prefix sums, fp64
            bonus = min{j : P[j] > 0 and C_j > t}
                    or, if that set is empty (t >= C_{V-1} by rounding), max{j : P[j] > 0}
                    or, if P has no positive entry (only with validate=False), -1
        num_accepted = len(path); path padded with -1

Implementations may organise the passes as they like (the Triton kernel applies a rejection
lazily and fuses it into the next rejection's pass) as long as every value is produced by the
same fp32 operations: e.g. ``D[v]`` recomputed from (P, Sp, Q, Sq) is bitwise the stored one.
The bonus uses the actual mass S of P, also at a node where no child was rejected (an input
row may sum to 1 +- 1e-3), so no mass is shifted onto a fallback token.

How the GPU kernels organise it, with the same values: the CUDA cluster kernel (sm_90) splits the
vocabulary of a sequence over 8 or 16 blocks, keeps P and Q of the current node in their shared
memory, writes ``D`` to a spare buffer in the pass that sums it, and stores ``Q[x] = 0`` in the
next rejection's pass (a try of that token reads q = 0 meanwhile): the same fp32 values as
above. At the first rejection of a node ``Sp = Sq = 1``, so ``ip = iq = 1`` and ``v * 1 == v``
exactly in IEEE arithmetic: the kernels skip those products with bitwise the same ``D``. Its bonus takes
the prefix sums ``C_j`` as (the blocks' totals before the block) + (the thread runs' totals before
the run, by a block scan) + (the run's own running sum), all fp64: another summation order,
which the rule above allows (agreement up to the boundary cases listed below). The Triton
kernel searches the bonus in levels (per-chunk fp64 sums and their prefix, then per-group sums
of one chunk and their prefix, then one group's own prefix), and its 8-CTA cluster build sums
the same terms across the cluster: other summation orders again.
Nothing else changes, so the exactness argument below holds for every backend as written.

Optional end of text (``eos_ids`` in the public op, applied after the walk on every backend):
if an accepted node's token is in ``eos_ids``, the path ends at the first such node and
``bonus = -1`` (nothing follows end of text).

Why the output is exactly the target's distribution
---------------------------------------------------
Lemma (one proposal). p, q distributions, x ~ q, r ~ U[0, 1) independent; accept x iff
``r q(x) < p(x)``. Then P(accept, x = y) = min(p(y), q(y)) and P(reject) = sum max(p - q, 0)
=: Zp. If a rejection is followed by a sample from p' = max(p - q, 0) / Zp, the result is
distributed as min(p, q) + max(p - q, 0) = p.

Claim. At a node with current residual p and remaining draft q, if the untried children are a
without-replacement sample from q (each the next draw from q with the earlier ones removed),
the token emitted next is distributed as p. Induction on the number k of untried children:
k = 0: the bonus is drawn from p. k >= 1: x_1 ~ q; by the Lemma it suffices that after a
rejection the emitted token is ~ p'. Given x_1 = x (and the rejection, which depends on x_1
and on r_1 only), the remaining children are a without-replacement sample from
q_{-x} = normalize(q with x removed), and the state is (p', q_{-x}), so by induction the token
is ~ p'. The point is that p' does not depend on which x was rejected; only q does. The
residual is per node: after accepting child c, the token of c is the emitted token and the
walk continues at c with (p_c, q_c), the target's and draft's distributions at the extended
context, and c's children are a fresh without-replacement sample from q_c, so by induction
on the depth the whole emitted sequence follows the target's chain. Each decision uses its
own uniform (``uniforms[b, c]`` for child c, ``uniforms[b, 0]`` for the bonus), independent of
the draft's sampling and of the other decisions, and every step draws fresh uniforms.

Edge cases, each exact:

(a) ``q(x) = 0`` when child x is tried (x outside the remaining draft support, a -1 child, or
    any child after the remaining mass reached zero): skipped, state unchanged. Sampling
    without replacement from q never proposes such a token, so under the model the event has
    probability 0 and any rule keeps the distribution; skipping is the rule that stays exact
    when such children were put in the tree by something else, independently of the uniforms
    (padding, a fixed extra candidate): the walk is then the walk of the tree without them.
    The literal rule (``r * 0 < p(x)``) would accept such a padded token with probability 1.
(a') **Absent nodes** (the decoding loop's rule, static shapes, no host sync). A node whose
    token is -1 is *absent*: its parent asked for more children than the draft's filtered
    distribution (top-k / top-p, or the vocabulary) has tokens, so ``sample_children`` had none
    to give (-1 pads the ranks past ``|support q|``), or its parent is absent (the loop writes -1
    for every child of an absent node, so the descendants of an absent node are absent). Absent
    nodes keep their slots: the models are fed a placeholder id there, which only the node's own
    descendants can attend to (the tree mask: ancestors only), and they are absent too, so no
    present node's logits change. Verification skips an absent node by (a) without touching P,
    Q, Sp, Sq or any uniform, and never accepts it; its descendants are never tried (their
    parent is never ``cur``). Exactness: the present children of a node are exactly a
    without-replacement sample from q of size min(k, |support q|), in sampling order, followed
    by the absent ones; after the last present child is rejected the remaining mass Sq is 0
    (every support token was removed) and the state (p', q = 0) is the one the Claim below
    reaches after k' = |support q| proposals, so the walk and the bonus are those of the tree
    without the absent nodes, which the Claim covers for any tree.
(b) Remaining draft mass ``Sq = 0`` after a rejection (the draft's support is exhausted): q
    is taken as all zeros instead of 0/0 = NaN, so every later sibling is skipped by (a) (under
    the model there are none: a without-replacement sample has at most |support q| tokens),
    and the bonus is drawn from the residual p', which the Lemma requires.
(c) ``p - q`` has no positive entry (``Zp = 0``): in exact arithmetic p <= q pointwise with
    both summing to 1 means p = q, and then the rejection just made had probability
    sum max(p - q, 0) = 0: any residual is exact. In fp32 this happens only when p and q agree
    up to rounding; p is kept (no 0/0): the target, not the draft, is what the bonus must follow.
(d) End of text accepted inside the tree: the tree below it was drafted past the end.
    Truncating an exactly distributed sequence at the first EOS gives the target's distribution
    of the sequence up to its end (the target stops there too), so stopping the walk there is
    exact; EOS ids are an argument (several per model are common), never hard-coded. Without
    ``eos_ids`` the op is EOS-agnostic (it keeps walking with the target's p below the EOS node,
    equally exact after truncation by the caller).
(e) No NaN can arise from valid inputs: the reciprocals divide by max(Sp, FLT_MIN) (Sp > 0) and
    a guarded max(Sq, FLT_MIN) (Sq > 0; iq = 0 otherwise), so they are finite, and the
    inputs are checked finite and non-negative (``validate=True``). A NaN that slips in with
    ``validate=False`` compares false everywhere: a NaN q(x) is skipped, a NaN p(x) is rejected,
    the bonus picks a token with p > 0 or returns -1; nothing is ever read or written out of
    range, and no token is produced by a NaN standing for "end of text".
(f) Finite-precision uniforms: with the Philox uniforms (23 random bits) every decision's
    probability is off by at most 2**-24; with torch.rand (24 bits) by at most 2**-24.

Backend agreement: with the same uniforms, backends take the same decisions except when a
decision lies within rounding of its boundary: ``|f32(r qx) - px| <= 1e-5 * px`` for an accept
test, or ``t`` within 1e-5 * S of a prefix sum C_j for the bonus. ``verify_tree_reference``
with ``return_margins=True`` reports the smallest relative margin per sequence so tests can
check that every disagreement is such a case (they are rare: ~1e-5 per decision at most).
"""

from __future__ import annotations

import torch


def _rcp(s: torch.Tensor) -> torch.Tensor:
    """rcp(s) = f32(1 / max(s, FLT_MIN)), an IEEE fp32 division (torch.div of fp32 tensors)."""
    return torch.div(torch.ones_like(s), s.clamp(min=torch.finfo(torch.float32).tiny))


def _argmax_first(x: torch.Tensor) -> torch.Tensor:
    """First index of the maximum along the last dimension (torch.argmax documents this)."""
    return x.argmax(dim=-1)


def _bonus_inverse_cdf(p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF draw from rows of (unnormalised) P [n, V] fp32 with uniforms u [n], fp64
    accumulation. Returns (tokens [n] int64, relative margin [n] fp64)."""
    n, V = p.shape
    p64 = p.double()
    S = p64.sum(-1)  # [n]
    t = u.double() * S  # [n]
    C = p64.cumsum(-1)  # [n, V]
    pos = p > 0
    cond = pos & (C > t[:, None])
    any_cond = cond.any(-1)
    first = cond.to(torch.int8).argmax(-1)  # first True (0 when none)
    last_pos = (V - 1) - pos.flip(-1).to(torch.int8).argmax(-1)
    tok = torch.where(any_cond, first, torch.where(pos.any(-1), last_pos, torch.full_like(first, -1)))
    # margin: distance of t to the nearest prefix-sum boundary, relative to S
    j = tok.clamp(min=0)
    hi = C.gather(1, j[:, None])[:, 0]
    lo = torch.where(j > 0, C.gather(1, (j - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(hi))
    margin = torch.minimum((hi - t).abs(), (t - lo).abs()) / S.clamp(min=1e-300)
    return tok, margin


def verify_tree_reference(
    target_probs: torch.Tensor,  # [B, T, V] fp32
    draft_probs: torch.Tensor,  # [B, T, V] fp32
    tokens: torch.Tensor,  # [B, T] int64
    parents: torch.Tensor,  # [T] int64
    uniforms: torch.Tensor | None,  # [B, T] fp32 (unused when greedy)
    greedy: bool,
    path: torch.Tensor,  # [B, T] int64, written
    num_accepted: torch.Tensor,  # [B] int64, written
    bonus: torch.Tensor,  # [B] int64, written
    *,
    return_margins: bool = False,
) -> torch.Tensor | None:
    """The algorithm of the module docstring, vectorised over the batch (one pass over the
    nodes; per node only the sequences that try it do vocabulary work). Writes path,
    num_accepted and bonus. With ``return_margins`` returns, per sequence, the smallest
    relative distance of any decision it took to that decision's boundary (fp64 [B]; +inf in
    greedy mode), used by the tests to excuse rounding-level disagreements between backends."""
    B, T, V = target_probs.shape
    device = target_probs.device
    margin = torch.full((B,), float("inf"), dtype=torch.float64, device=device)
    path_ = torch.full((B, T), -1, dtype=torch.int64, device=device)
    if B == 0:
        path.copy_(path_), num_accepted.zero_(), bonus.zero_()
        return margin if return_margins else None
    path_[:, 0] = 0
    par = parents.tolist()
    tok = tokens.to(torch.int64)
    cur = torch.zeros(B, dtype=torch.int64, device=device)
    n = torch.ones(B, dtype=torch.int64, device=device)
    P = target_probs[:, 0].clone()  # [B, V] residual target, unnormalised: p = P / Sp
    Q = draft_probs[:, 0].clone()  # [B, V] remaining draft, unnormalised: q = Q / Sq
    one = torch.ones(B, dtype=torch.float32, device=device)
    Sp, Sq = one.clone(), one.clone()
    am = _argmax_first(target_probs[:, 0]) if greedy else None  # [B] argmax at cur
    for c in range(1, T):
        x = tok[:, c]
        tried = (cur == par[c]) & (x >= 0) & (x < V)
        rows = tried.nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        xr = x[rows]
        if greedy:
            acc_rows = rows[xr == am[rows]]
        else:
            ip, iq = _rcp(Sp), torch.where(Sq > 0, _rcp(Sq), 0.0)  # [B] (1 where Sp, Sq = 1)
            qx = Q[rows, xr] * iq[rows]
            px = P[rows, xr] * ip[rows]
            live = qx > 0  # (a): q(x) = 0 (or NaN) -> skipped
            rows, xr, px, qx = rows[live], xr[live], px[live], qx[live]
            r = uniforms[rows, c]
            prod = r * qx  # fp32
            accept = prod < px
            if return_margins and rows.numel():
                rel = ((prod.double() - px.double()).abs() / torch.maximum(px, prod).double().clamp(min=1e-300))
                margin[rows] = torch.minimum(margin[rows], rel)
            rej, xj = rows[~accept], xr[~accept]
            if rej.numel():
                D = (P[rej] * ip[rej, None] - Q[rej] * iq[rej, None]).clamp_min(0.0)  # [n, V]
                Zp = D.double().sum(-1).float()  # f32(sum_fp64)
                Qr = Q[rej]
                Qr[torch.arange(rej.numel(), device=device), xj] = 0.0
                Q[rej] = Qr
                Sq[rej] = Qr.double().sum(-1).float()
                keep = Zp > 0  # (c): otherwise P, Sp stay
                P[rej[keep]] = D[keep]
                Sp[rej[keep]] = Zp[keep]
            acc_rows = rows[accept]
        if acc_rows.numel():
            path_[acc_rows, n[acc_rows]] = c
            n[acc_rows] += 1
            cur[acc_rows] = c
            if greedy:
                am[acc_rows] = _argmax_first(target_probs[acc_rows, c])
            else:
                P[acc_rows] = target_probs[acc_rows, c]
                Q[acc_rows] = draft_probs[acc_rows, c]
                Sp[acc_rows] = 1.0
                Sq[acc_rows] = 1.0
    if greedy:
        bon = am
    else:
        bon, m = _bonus_inverse_cdf(P, uniforms[:, 0])
        margin = torch.minimum(margin, m)
    path.copy_(path_)
    num_accepted.copy_(n)
    bonus.copy_(bon)
    return margin if return_margins else None
