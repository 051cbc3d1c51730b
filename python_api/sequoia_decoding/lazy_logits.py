"""Verification that computes the target's logits only at the nodes it reads.

Verification reads the target's distribution p at the root and at every node it accepts (its
children are tested against it, or the bonus token drawn from it), never at a rejected node: a
step reads ``tokens per step`` of a tree's ``n`` rows of logits (about 2-3 of 64). The LM head
over all n rows and their softmax (temperature, top-k, top-p) cost in proportion to n: on a CPU
at n = 64 for SmolLM2-135M (49152 x 576 head, bf16, 2 cores) ~16 ms of the head and 3-7 ms of
filtered probabilities in a ~130 ms forward. :func:`verify_reading` takes the final hidden states
instead and runs the LM head and the filter on demand:

1. the rows of the root and its first-child chain (the path when every first child is taken);
2. ``verify_tree`` over the tree with those rows (every other row of p a uniform placeholder);
3. if the path it returns reads a row not computed yet, the first such row per batch row and its
   first-child chain are computed and step 2 runs again *with the same random numbers*.

Exact: a verification reads p only along the path it accepts, and a pass whose path reads only
computed rows decided every test and the bonus on the target's true p with the step's uniforms:
the same path, length and bonus the full logits give (``tests/test_lazy_logits.py`` checks it
bitwise against ``verify_tree`` on full logits, and statistically). At most depth + 1 passes; on
the trees the planner picks one or two. The rows' head products go through the same (packed,
batch-invariant) linear as the full forward's, followed by what the model's forward does after
its head (``target_head.TargetHead``: Cohere's, Granite's scalings, Gemma's soft-capping), so a
row's logits are the same bits.

The NaN / +inf check and ``min_new_tokens``' EOS blocking apply to the rows computed: a row never
read cannot change the output.

The rows not computed are placeholders verification never decides on: any distributions do, so a
generator keeps one buffer across a call's steps (``step_buffers.KeptRows``: 1 / V at first, then
whatever real p an earlier step wrote there).
"""

from __future__ import annotations

import torch

from sequoia_kernels.ops.verify_tree import verify_tree

from .drafters import filtered_probs
from .step_buffers import KeptRows

__all__ = ["LAZY_MIN_NODES", "lazy_from", "verify_reading"]

# the automatic choice (``SequoiaGenerator(lazy_logits=None)``, a CPU): trees of at least this
# many nodes; below, the few-row LM head is memory-bound and one call over all rows is as cheap
# as the passes (measured on SmolLM2-135M, bf16, Ice Lake: the head 2.0 / 3.1 / 4.6 / 8.5 / 15.9 ms
# at 1 / 6 / 16 / 32 / 64 rows; filtered probabilities 0.5 / 2.7 ms at 6 / 64 rows, 6.6 with top-p)
LAZY_MIN_NODES = 32


def _chains(start: torch.Tensor, first: torch.Tensor, T: int) -> torch.Tensor:  # [B] -> [B, T] bool
    """The nodes of ``start`` (-1: none) and its first-child chain, per batch row."""
    want = torch.zeros(start.shape[0], T, dtype=torch.bool, device=start.device)
    cur = start
    while bool((cur >= 0).any()):
        rows = (cur >= 0).nonzero().squeeze(1)
        want[rows, cur[rows]] = True
        cur = torch.where(cur >= 0, first[cur.clamp(min=0)], cur)
    return want


@torch.no_grad()
def verify_reading(lm_head, hidden: torch.Tensor, q: torch.Tensor | None, tokens: torch.Tensor, parents: torch.Tensor,
                   first: torch.Tensor, depth: torch.Tensor, sampling, uniforms: torch.Tensor | None,
                   backend: str | None, eos=None, stop_on_bad: bool = True,
                   placeholders: KeptRows | None = None):
    """``verify_tree`` of the tree (``tokens`` [B, T], ``parents`` / ``first`` (``TreeSpec.first_child``)
    / ``depth`` [T], q [B, T, V] or None: the draft was deterministic) on the target's p from
    ``hidden`` [B, T, H] (the final normed states the head ``lm_head`` reads: a ``TargetHead``),
    computing p only where the verification reads it. ``eos``: ``min_new_tokens``' (ids [E], new
    tokens each row must still make [B]) or None. Returns ``(path, num, bonus, p, bad)``: p [B, T, V] real at the
    rows read (the path's), ``bad`` [] whether a computed row held NaN / +inf or no finite logit;
    with ``stop_on_bad`` the passes stop at the first such row (path, num, bonus None).
    ``placeholders``: where p's rows come from (``KeptRows()``: its rows not computed may hold any
    distribution); None: a fresh buffer of 1 / V."""
    B, T, _ = hidden.shape
    V = lm_head.weight.shape[0]
    p = (placeholders or KeptRows()).rows(B, T, V, hidden.device)  # rows not computed: distributions
    have = torch.zeros(B, T, dtype=torch.bool, device=hidden.device)
    bad = torch.zeros((), dtype=torch.bool, device=hidden.device)
    start = torch.zeros(B, dtype=torch.int64, device=hidden.device)  # the root's chain first
    while True:
        b, t = (_chains(start, first, T) & ~have).nonzero(as_tuple=True)
        logits = lm_head(hidden[b, t])  # [k, V]
        bad = bad | ~torch.isfinite(logits.amax(-1)).all()  # as ``drafters.nonfinite``
        if stop_on_bad and bool(bad.any()):
            return None, None, None, p, bad
        if eos is not None:
            ids, remaining = eos
            blocked = depth[t] < remaining[b]  # [k]
            logits[:, ids] = logits[:, ids].masked_fill(blocked[:, None], float("-inf"))
        p[b, t] = filtered_probs(logits[None], sampling, backend)[0]
        have[b, t] = True
        path, num, bonus = verify_tree(p, q if q is not None else p, tokens, parents, greedy=sampling.greedy,
                                       uniforms=uniforms, backend=backend, validate=False)
        read = torch.arange(T, device=p.device)[None, :] < num[:, None]  # [B, T]: the path's entries
        missing = read & ~have.gather(1, path.clamp(min=0))
        if not bool(missing.any()):
            return path, num, bonus, p, bad
        # per batch row, the first path node not computed (-1: none)
        col = torch.where(missing.any(1), missing.int().argmax(1), 0)
        start = torch.where(missing.any(1), path.gather(1, col[:, None]).squeeze(1), -1)


def lazy_from(lazy_logits: bool | None, device: torch.device, tp, cuda_graphs: bool) -> int:
    """The least tree size whose steps verify with :func:`verify_reading` (``SequoiaGenerator``'s
    ``lazy_logits``: True every tree, False none, None: ``LAZY_MIN_NODES`` on a CPU without
    tensor parallelism; a CUDA graph cannot hold the passes' host reads)."""
    if lazy_logits not in (None, True, False):
        raise ValueError(f"lazy_logits must be None, True or False, got {lazy_logits!r}")
    if lazy_logits and cuda_graphs:
        raise ValueError("lazy_logits=True reads the path on the host between passes: not inside a CUDA graph")
    never = 1 << 62
    if lazy_logits is None:
        return LAZY_MIN_NODES if device.type == "cpu" and tp is None and not cuda_graphs else never
    return 2 if lazy_logits else never
