"""verify_tree: accept a path of a Sequoia speculation tree and draw the bonus token, so that
the emitted tokens are distributed exactly as the target model's (the algorithm, its edge
cases and the argument for exactness: ``sequoia_kernels/reference/verify_tree.py``)."""

from __future__ import annotations

import torch

from .._backend import resolve_op_backend
from ..random import check_random_source, draw_uniforms
from ..reference.verify_tree import verify_tree_reference

_OP = "verify_tree"
_SUM_TOL = 1e-3  # |sum(row) - 1| allowed for probability rows in the value check


@torch.library.register_fake("sequoia_kernels::verify_tree")  # for torch.compile / opcheck
def _verify_tree_fake(*args, **kwargs) -> None:  # writes its out arguments only
    return None


def _check_layout(target_probs, draft_probs, tokens, parents, uniforms, out, workspace, eos_ids) -> tuple[int, int, int]:
    """Shapes, dtypes, devices: no host sync."""
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs), ("tokens", tokens),
                    ("parents", parents)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if target_probs.dim() != 3:
        raise ValueError(f"{_OP}: target_probs must be [B, T, V], got shape {tuple(target_probs.shape)}")
    B, T, V = target_probs.shape
    if T < 1 or V < 1:
        raise ValueError(f"{_OP}: need at least the root (T >= 1) and one token (V >= 1), got T = {T}, V = {V}")
    if draft_probs.shape != target_probs.shape:
        raise ValueError(f"{_OP}: draft_probs must have the shape of target_probs {tuple(target_probs.shape)} "
                         f"(same batch, tree and vocabulary), got {tuple(draft_probs.shape)}")
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if t.dtype != torch.float32:
            raise ValueError(f"{_OP}: {name} must be float32 (sampling math in fp32; see sampling_probs), got {t.dtype}")
        if V > 1 and t.stride(-1) != 1:
            raise ValueError(f"{_OP}: the vocabulary (last) dimension of {name} must be contiguous")
    if tokens.shape != (B, T):
        raise ValueError(f"{_OP}: tokens must be [B, T] = {[B, T]}, got {tuple(tokens.shape)}")
    if parents.shape != (T,):
        raise ValueError(f"{_OP}: parents must be [T] = [{T}] (one tree shared by the batch), got {tuple(parents.shape)}")
    for name, t in (("tokens", tokens), ("parents", parents)):
        if t.dtype != torch.int64:
            raise ValueError(f"{_OP}: {name} must be int64, got {t.dtype}")
    dev = target_probs.device
    for name, t in (("draft_probs", draft_probs), ("tokens", tokens), ("parents", parents)):
        if t.device != dev:
            raise ValueError(f"{_OP}: {name} is on {t.device} but target_probs is on {dev}")
    if uniforms is not None:
        if not isinstance(uniforms, torch.Tensor):
            raise TypeError(f"{_OP}: uniforms must be a torch.Tensor, got {type(uniforms).__name__}")
        if uniforms.shape != (B, T) or uniforms.dtype != torch.float32 or uniforms.device != dev:
            raise ValueError(f"{_OP}: uniforms must be a float32 [B, T] = {[B, T]} tensor on {dev}, got "
                             f"{uniforms.dtype} {tuple(uniforms.shape)} on {uniforms.device}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError(f"{_OP}: out must be a tuple (path, num_accepted, bonus)")
        for name, t, shape in (("path", out[0], (B, T)), ("num_accepted", out[1], (B,)), ("bonus", out[2], (B,))):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != torch.int64 or t.device != dev:
                raise ValueError(f"{_OP}: out {name} must be an int64 tensor of shape {list(shape)} on {dev}")
    if workspace is not None:
        if (not isinstance(workspace, torch.Tensor) or workspace.shape != (B, 2, V)
                or workspace.dtype != torch.float32 or workspace.device != dev
                or (V > 1 and workspace.stride(-1) != 1)):
            raise ValueError(f"{_OP}: workspace must be a float32 [B, 2, V] = {[B, 2, V]} tensor on {dev} "
                             f"with a contiguous last dimension")
    if eos_ids is not None:
        if not isinstance(eos_ids, torch.Tensor) or eos_ids.dim() != 1 or eos_ids.dtype != torch.int64 \
                or eos_ids.device != dev:
            raise ValueError(f"{_OP}: eos_ids must be a 1-D int64 tensor on {dev}")
    return B, T, V


def _check_values(target_probs, draft_probs, tokens, parents, uniforms, greedy) -> None:
    """Value checks (one host sync); raise ValueError before anything is written."""
    B, T, V = target_probs.shape
    par = parents.tolist()
    if par[0] != -1:
        raise ValueError(f"{_OP}: parents[0] must be -1 (node 0 is the root), got {par[0]}")
    seen = set()
    for c in range(1, T):
        if not 0 <= par[c] < c:
            raise ValueError(f"{_OP}: parents must be topological (0 <= parents[c] < c): parents[{c}] = {par[c]}")
        if par[c] != par[c - 1] and par[c] in seen:
            raise ValueError(f"{_OP}: the children of a node must be consecutive (in sampling order): "
                             f"node {c} is a child of {par[c]}, whose earlier children end before node {c - 1}")
        seen.add(par[c])
    if B == 0:
        return
    has_children = torch.zeros(T, dtype=torch.bool)
    if T > 1:
        has_children[torch.tensor(par[1:])] = True
    checks = []
    msgs = []

    def add(flag, msg):
        checks.append(flag)
        msgs.append(msg)

    # Two passes over each tensor, per-row results only (no [B, T, V] temporaries): a row sum is
    # finite iff every entry is (sums of values that passed the other checks cannot overflow).
    for name, probs, rows in (("target_probs", target_probs, None),
                              ("draft_probs", draft_probs, has_children.to(draft_probs.device))):
        if name == "draft_probs" and (greedy or not bool(has_children.any())):
            continue
        where = "" if rows is None else " (rows of nodes with children)"
        s = probs.sum(-1)  # [B, T] fp32
        lo = probs.amin(-1)  # [B, T]
        if rows is not None:
            s, lo = s[:, rows], lo[:, rows]
        add(~torch.isfinite(s).all(), f"{name} has NaN or infinite entries{where}")
        add((lo < 0).any(), f"{name} has negative entries{where}")
        add(((s - 1).abs() > _SUM_TOL).any(), f"{name} rows must sum to 1 (within {_SUM_TOL}){where}")
    if T > 1:
        tk = tokens[:, 1:]
        add(((tk < -1) | (tk >= V)).any(), f"tokens[:, 1:] must lie in [0, V = {V}) or be -1 (no child)")
    if uniforms is not None and not greedy:
        add(~((uniforms >= 0) & (uniforms < 1)).all(), "uniforms must lie in [0, 1)")
    flags = torch.stack([torch.as_tensor(f).reshape(()) for f in checks]).tolist()
    for flag, msg in zip(flags, msgs):
        if flag:
            raise ValueError(f"{_OP}: {msg}; nothing was written")


def _truncate_at_eos(tokens, path, num_accepted, bonus, eos_ids) -> None:
    """Stop every path at its first accepted end-of-text node (root excluded); bonus = -1 there.
    Device ops only (no sync, CUDA-graph safe)."""
    B, T = path.shape
    if T < 2 or eos_ids.numel() == 0:
        return
    nodes = path[:, 1:]  # [B, T-1]
    valid = nodes >= 0
    tok = tokens.gather(1, nodes.clamp(min=0))
    hit = valid & torch.isin(tok, eos_ids)
    seen = hit.cumsum(1)  # [B, T-1]
    after = (seen - hit.to(seen.dtype)) > 0  # strictly after the first EOS
    path[:, 1:].masked_fill_(after, -1)
    any_hit = seen[:, -1] > 0
    first = hit.to(torch.int8).argmax(1)  # index in path[:, 1:] of the first EOS
    num_accepted.copy_(torch.where(any_hit, first + 2, num_accepted))
    bonus.masked_fill_(any_hit, -1)


def verify_tree(
    target_probs: torch.Tensor,  # [B, T, V] fp32: p_u for every node u (tempered, filtered)
    draft_probs: torch.Tensor,  # [B, T, V] fp32: q_u, what u's children were sampled from
    tokens: torch.Tensor,  # [B, T] int64: node tokens (column 0, the root, ignored; -1 = no child)
    parents: torch.Tensor,  # [T] int64: parents[0] = -1, 0 <= parents[c] < c, siblings consecutive
    *,
    greedy: bool = False,
    backend: str | None = None,
    uniforms: torch.Tensor | None = None,  # [B, T] fp32 in [0, 1)
    seed: torch.Tensor | None = None,  # one-element int64 device tensor (Philox key)
    offset: torch.Tensor | None = None,  # one-element int64 device tensor (Philox counter), advanced in place
    eos_ids: torch.Tensor | None = None,  # [E] int64: end-of-text tokens; the walk stops at the first accepted one
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # preallocated (path, num_accepted, bonus)
    workspace: torch.Tensor | None = None,  # [B, 2, V] fp32 scratch (Triton / compiled kernels)
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verify a speculation tree: returns ``(path [B, T], num_accepted [B], bonus [B])``, int64.

    ``path[b]`` lists the accepted nodes from the root (node 0 included) then -1;
    ``num_accepted[b]`` is its length (>= 1); ``bonus[b]`` the token drawn after the path. The
    step emits ``tokens[b, path[b, 1:num_accepted[b]]]`` then ``bonus[b]``, distributed exactly
    as the target's tokens (Sequoia's rejection sampling without replacement; spec, edge cases
    and proof in ``sequoia_kernels.reference.verify_tree``).

    Greedy (``greedy=True``, temperature 0): at each node the child whose token is the argmax of
    p_u (first index of the maximum) is accepted; the bonus is the argmax at the last accepted
    node. No random numbers are used and ``draft_probs`` is not read.

    Random numbers: ``uniforms`` ``[B, T]`` (``uniforms[b, c]`` for child c, ``uniforms[b, 0]``
    for the bonus); or ``seed`` and ``offset`` (Philox4x32-10, ``sequoia_kernels.random``:
    ``philox_uniforms(seed, offset, (B, T))``, then ``offset`` is advanced in place, so a
    captured CUDA graph draws fresh numbers every replay); or neither: ``torch.rand`` from
    torch's default generator (``torch.manual_seed`` makes it reproducible).

    ``eos_ids``: when an accepted node's token is one of them, the path stops there and
    ``bonus = -1`` (nothing follows end of text). Without it the op ignores EOS.

    ``validate=True`` checks values first (one host sync: probabilities finite, >= 0, rows
    summing to 1 within 1e-3 (draft rows only for nodes with children), tokens in [0, V) or
    -1, parents topological with each node's children consecutive, uniforms in [0, 1)) and raises ``ValueError`` with nothing
    written. A captured loop passes ``validate=False``: nothing is then read or written out of
    range whatever the values (see the spec's edge case (e)).

    ``backend``: "reference", "cpu", "triton" or "cuda"; default: the compiled kernel for the
    device when built, else Triton on CUDA, else the reference.
    """
    B, T, V = _check_layout(target_probs, draft_probs, tokens, parents, uniforms, out, workspace, eos_ids)
    dev = target_probs.device
    check_random_source(uniforms, seed, offset, dev, _OP)
    backend = resolve_op_backend(_OP, backend, dev)
    if validate:
        _check_values(target_probs, draft_probs, tokens, parents, uniforms, greedy)
    if greedy:
        u = uniforms if uniforms is not None else torch.empty((B, T), dtype=torch.float32, device=dev)
    else:
        u = uniforms if uniforms is not None else draw_uniforms((B, T), dev, seed=seed, offset=offset)
    if out is None:
        path = torch.empty((B, T), dtype=torch.int64, device=dev)
        num_accepted = torch.empty((B,), dtype=torch.int64, device=dev)
        bonus = torch.empty((B,), dtype=torch.int64, device=dev)
    else:
        path, num_accepted, bonus = out
    if backend == "reference":
        verify_tree_reference(target_probs, draft_probs, tokens, parents, u, greedy, path, num_accepted, bonus)
    elif backend == "triton":
        from ..triton_kernels.verify_tree import verify_tree_triton

        verify_tree_triton(target_probs, draft_probs, tokens, parents, u, greedy, path, num_accepted, bonus,
                           workspace=workspace)
    else:  # "cpu" and "cuda": the two dispatch keys of the compiled op
        if workspace is None:
            workspace = torch.empty((B, 2, V), dtype=torch.float32, device=dev)
        elif not workspace.is_contiguous():
            raise ValueError(f"{_OP}: workspace must be contiguous")
        torch.ops.sequoia_kernels.verify_tree(target_probs, draft_probs, tokens, parents, u, bool(greedy),
                                              path, num_accepted, bonus, workspace)
    if eos_ids is not None:
        _truncate_at_eos(tokens, path, num_accepted, bonus, eos_ids)
    return path, num_accepted, bonus
