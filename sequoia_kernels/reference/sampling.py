r"""References for the two sampling ops: ``sampling_probs`` (logits -> the fp32 distribution
that is sampled from) and ``sample_children`` (the draft side: a node's children sampled
without replacement). Readable PyTorch; the specs the Triton (and any later C++/CUDA) kernels
follow.

sampling_probs(logits [..., V], temperature, top_k, top_p) -> probs [..., V] fp32
---------------------------------------------------------------------------------
All arithmetic in fp32 on ``x = float32(logits)``; sums over the vocabulary accumulated in fp64
(any order) and rounded to fp32 where a fp32 value is needed::

    if temperature == 0:  probs = one_hot(argmax(x))            # first index of the maximum
    else:
        m = max(x)
        y = (x - m) / float32(temperature)    # IEEE fp32 subtract then divide; y <= 0, y = 0 at the max
        keep = all tokens
        if 0 < top_k < V:                     # top-k (HF TopKLogitsWarper)
            tau = the top_k-th largest y (counted with multiplicity)
            keep = y >= tau                   # ties at the boundary are all kept: may keep > top_k
        e = keep ? exp(y) : 0                 # fp32 exp
        if top_p < 1:                         # top-p on the top-k survivors (HF TopPLogitsWarper)
            Z = sum_fp64(e)
            above(v) = sum_fp64 of e_w over kept w with y_w > y_v     # mass strictly more likely
            keep = keep and above(v) < top_p * Z                       # fp64 compare
        probs = keep ? e / float32(sum_fp64(keep ? e : 0)) : 0         # IEEE fp32 division

Top-p keeps the smallest set of most likely tokens whose mass reaches ``top_p``, and with ties
at the boundary it keeps every token tied with the last one needed (the decision depends only
on the mass strictly above a token, never on how a sort orders equal values). This is what HF
does when there are no ties (HF keeps a token iff ``1 - cumsum_ascending <= ...`` fails, i.e.
iff the mass sorted after it is < top_p; with ties HF's choice depends on ``torch.sort``'s
order of equal values). The most likely token is always kept (its ``above`` is 0 < top_p * Z).
``y`` is computed as ``(x - m) / T`` rather than HF's ``x / T`` so that no temperature can
overflow it to inf; in exact arithmetic the two rank tokens identically. -inf logits get
probability 0. ``top_k = 0`` or ``>= V``: off; ``top_p = 1``: off.

sample_children(draft_probs [R, V], num_children, uniforms [R, V]) -> tokens [R, K]
---------------------------------------------------------------------------------
Exponential race (equivalently Gumbel top-k): token v of row r gets the key

    key[r, v] = min(-log(u[r, v]) / q[r, v], FLT_MAX)   for q > 0   (fp32 log, negate, divide)
              = +inf, and v is not eligible,             for q <= 0 (or NaN)

and the row's children are the eligible tokens in increasing (key, index) order (ties broken
by the lower index), the first ``num_children[r]`` of them; positions past ``num_children[r]``
or past the number of eligible tokens (tokens with q > 0) are -1. Exactness: -log(u) ~ Exp(1),
so key[v] ~ Exp(rate q[v]) independently, and the order in which independent exponential
clocks ring is exactly sequential sampling without replacement with probabilities
proportional to q (the first to ring is v with probability q[v] / sum q, and by memorylessness
the rest race afresh among the others). q need not be normalised.
"""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max


def sampling_probs_reference(
    logits: torch.Tensor,  # [..., V] any float dtype
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., V] fp32
    x = logits.float()
    V = x.shape[-1]
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), V).to(torch.float32)
    m = x.amax(-1, keepdim=True)
    temp = torch.tensor(temperature, dtype=torch.float32, device=x.device)  # a device tensor: true division
    y = (x - m) / temp  # [..., V], <= 0
    keep = torch.ones_like(y, dtype=torch.bool)
    if 0 < top_k < V:
        tau = y.topk(top_k, dim=-1).values[..., -1:]  # k-th largest, with multiplicity
        keep = y >= tau
    e = torch.where(keep, torch.exp(y), torch.zeros_like(y))
    if top_p < 1.0:
        Z = e.double().sum(-1, keepdim=True)
        ys, order = y.sort(-1, descending=True)
        es = e.gather(-1, order).double()
        excl = es.cumsum(-1) - es  # mass before each sorted position (fp64)
        first = torch.searchsorted(-ys.contiguous(), -ys.contiguous(), right=False)  # first index of each tie group
        above_sorted = excl.gather(-1, first)  # mass strictly above
        above = torch.empty_like(above_sorted).scatter_(-1, order, above_sorted)
        keep = keep & (above < top_p * Z)
        e = torch.where(keep, e, torch.zeros_like(e))
    Zf = e.double().sum(-1, keepdim=True).float()
    return e / Zf


def child_keys(draft_probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Exponential-race keys [R, V] fp32: min(-log(u) / q, FLT_MAX) where q > 0, else +inf."""
    q = draft_probs
    eligible = q > 0
    k = -torch.log(uniforms) / torch.where(eligible, q, torch.ones_like(q))
    k = k.clamp(max=FLT_MAX)
    return torch.where(eligible, k, torch.full_like(k, float("inf")))


def sample_children_reference(
    draft_probs: torch.Tensor,  # [R, V] fp32
    num_children: torch.Tensor,  # [R] int64
    max_children: int,
    uniforms: torch.Tensor,  # [R, V] fp32 in (0, 1]
) -> torch.Tensor:  # [R, max_children] int64
    R, V = draft_probs.shape
    K = int(max_children)
    keys = child_keys(draft_probs, uniforms)
    _, order = keys.sort(dim=-1, stable=True)  # ties: lower index first
    if K > V:
        order = torch.cat([order, order.new_zeros(R, K - V)], dim=1)
    out = order[:, :K].clone()
    col = torch.arange(K, device=out.device)
    n_elig = (draft_probs > 0).sum(-1)
    live = (col[None, :] < num_children.to(torch.int64)[:, None]) & (col[None, :] < n_elig[:, None])
    return torch.where(live, out, torch.full_like(out, -1))


def overlap_rows_reference(
    p: torch.Tensor,  # [R, V]
    q: torch.Tensor,  # [R, V]
    rows: torch.Tensor,  # [N] int64 in [0, R)
) -> torch.Tensor:  # [N], p's dtype
    """out[i] = sum_v min(p[rows[i], v], q[rows[i], v]): the probability that a token drawn from
    q is accepted against p (accepted with probability min(1, p(x) / q(x)))."""
    return torch.minimum(p.index_select(0, rows), q.index_select(0, rows)).sum(-1)
