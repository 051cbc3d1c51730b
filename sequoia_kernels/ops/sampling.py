"""sampling_probs (logits -> fp32 sampling distribution: temperature, top-k, top-p) and
sample_children (a node's children, sampled without replacement from the draft's q).
Specs: ``sequoia_kernels/reference/sampling.py``.

Compiled kernels, when added to csrc/ops.cpp, are picked up automatically (and their fake
implementations registered) under these schemas (inputs flattened to rows by this module):

    sampling_probs(Tensor logits, float temperature, int top_k, float top_p, Tensor(a!) out) -> ()
        logits [R, V] fp16/bf16/fp32/fp64 (rows contiguous), out [R, V] fp32
    sample_children(Tensor draft_probs, Tensor num_children, Tensor uniforms, Tensor(a!) out) -> ()
        draft_probs [R, V] fp32, num_children [R] int32/int64, uniforms [R, V] fp32, out [R, K] int64
"""

from __future__ import annotations

import math
import numbers

import torch

from ..random import check_random_source, counters_used, draw_uniforms
from ..reference.sampling import overlap_rows_reference, sample_children_reference, sampling_probs_reference
from .._backend import compiled_op_available, resolve_op_backend

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


if compiled_op_available(None, "sampling_probs"):

    @torch.library.register_fake("sequoia_kernels::sampling_probs")
    def _sampling_probs_fake(logits, temperature, top_k, top_p, out) -> None:
        return None


if compiled_op_available(None, "sample_children"):

    @torch.library.register_fake("sequoia_kernels::sample_children")
    def _sample_children_fake(draft_probs, num_children, uniforms, out) -> None:
        return None


if compiled_op_available(None, "overlap_rows"):

    @torch.library.register_fake("sequoia_kernels::overlap_rows")
    def _overlap_rows_fake(p, q, rows, out) -> None:
        return None


def check_sampling_params(temperature, top_k, top_p, where: str = "sampling") -> None:
    """The one check of sampling parameters (the op, the decoding loop's SamplingParams and the
    command line use it): temperature a finite number >= 0 (0 = greedy), top_k an int >= 0
    (0 = off), top_p in (0, 1] (1 = off)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"{where}: temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"{where}: top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"{where}: top_p must be in (0, 1] (1 = off), got {top_p!r}")


# ----------------------------------------------------------------------------- sampling_probs


def sampling_probs(
    logits: torch.Tensor,  # [..., V] fp16 / bf16 / fp32 / fp64
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    backend: str | None = None,
    out: torch.Tensor | None = None,  # [..., V] fp32
    validate: bool = True,
) -> torch.Tensor:  # [..., V] fp32
    """The distribution a token is sampled from: ``softmax(logits / temperature)`` restricted
    to the top-k tokens, then to the top-p nucleus of those (HF's warper order: temperature,
    top-k, top-p), renormalised, in fp32.

    ``temperature = 0``: one-hot at the argmax (first index of the maximum; top-k/top-p
    ignored). ``top_k = 0`` (or >= V): off; ties with the k-th largest value are all kept.
    ``top_p = 1``: off; otherwise a token is kept iff the mass of the (top-k) tokens strictly
    more likely than it is < top_p, so tokens tied at the boundary are kept or dropped
    together. Exact rules: ``sequoia_kernels.reference.sampling``.

    ``validate=True`` (one host sync) raises ``ValueError`` on NaN or +inf logits or a row
    without a finite logit, before anything is written. ``backend``: "reference", "triton"
    (one program per row, threshold search, no sort), "cpu"/"cuda" when compiled; default:
    compiled kernel, else Triton on CUDA, else the reference.
    """
    op = "sampling_probs"
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{op}: logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{op}: logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{op}: logits must be a float tensor, got {logits.dtype}")
    check_sampling_params(temperature, top_k, top_p, op)
    V = logits.shape[-1]
    dev = logits.device
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != logits.shape or out.dtype != torch.float32 \
                or out.device != dev:
            raise ValueError(f"{op}: out must be a float32 tensor of shape {tuple(logits.shape)} on {dev}")
    backend = resolve_op_backend(op, backend, dev)
    if validate and logits.numel():
        hi = logits.amax(-1)  # [...]: NaN propagates
        bad = torch.stack([torch.isnan(hi).any(), (hi == float("inf")).any(), (hi == float("-inf")).any()]).tolist()
        if bad[0]:
            raise ValueError(f"{op}: logits have NaN entries; nothing was written")
        if bad[1]:
            raise ValueError(f"{op}: logits have +inf entries; nothing was written")
        if bad[2]:
            raise ValueError(f"{op}: a row of logits has no finite entry; nothing was written")
    if out is None:
        out = torch.empty(logits.shape, dtype=torch.float32, device=dev)
    if logits.numel() == 0:
        return out
    temperature, top_k, top_p = float(temperature), int(top_k), float(top_p)
    if backend == "reference":
        out.copy_(sampling_probs_reference(logits, temperature, top_k, top_p))
        return out
    x2 = logits.reshape(-1, V)
    if V > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, V) if out.is_contiguous() else torch.empty(x2.shape, dtype=torch.float32, device=dev)
    if backend == "triton":
        from ..triton_kernels.sampling import sampling_probs_triton

        sampling_probs_triton(x2, o2, temperature, top_k, top_p)
    else:
        torch.ops.sequoia_kernels.sampling_probs(x2, temperature, top_k, top_p, o2)
    if o2.data_ptr() != out.data_ptr() or not out.is_contiguous():
        out.copy_(o2.view(out.shape))
    return out


# ---------------------------------------------------------------------------- sample_children


def _children_counts(op: str, draft_probs, num_children, max_children) -> tuple[torch.Tensor, int]:
    """``sample_children``'s q checked for its layout, and its per-row child counts [R] with the
    output width K (``num_children.max()`` when not given: a host sync)."""
    if not isinstance(draft_probs, torch.Tensor):
        raise TypeError(f"{op}: draft_probs must be a torch.Tensor, got {type(draft_probs).__name__}")
    if draft_probs.dim() != 2 or draft_probs.shape[1] < 1:
        raise ValueError(f"{op}: draft_probs must be [R, V] with V >= 1, got shape {tuple(draft_probs.shape)}")
    if draft_probs.dtype != torch.float32:
        raise ValueError(f"{op}: draft_probs must be float32, got {draft_probs.dtype}")
    if draft_probs.shape[1] > 1 and draft_probs.stride(-1) != 1:
        raise ValueError(f"{op}: the vocabulary (last) dimension of draft_probs must be contiguous")
    R, dev = draft_probs.shape[0], draft_probs.device
    if isinstance(num_children, torch.Tensor):
        if num_children.shape != (R,) or num_children.dtype not in (torch.int32, torch.int64) \
                or num_children.device != dev:
            raise ValueError(f"{op}: num_children must be an int or an int32/int64 [R] = [{R}] tensor on {dev}")
        counts = num_children
        if max_children is None:
            max_children = int(num_children.max()) if R else 0
    elif isinstance(num_children, int) and not isinstance(num_children, bool):
        if num_children < 0:
            raise ValueError(f"{op}: num_children must be >= 0, got {num_children}")
        if max_children is None:
            max_children = num_children
        counts = torch.full((R,), num_children, dtype=torch.int64, device=dev)
    else:
        raise ValueError(f"{op}: num_children must be an int or an int tensor, got {type(num_children).__name__}")
    if isinstance(max_children, bool) or not isinstance(max_children, int) or max_children < 0:
        raise ValueError(f"{op}: max_children must be an int >= 0, got {max_children!r}")
    return counts, max_children


def _check_children_values(op: str, draft_probs, counts, K: int, uniforms) -> None:
    """One host read: q finite and >= 0, counts within [0, K], uniforms within [0, 1]."""
    lo, hi = draft_probs.amin(-1), draft_probs.amax(-1)
    flags = [torch.isnan(lo).any() | torch.isinf(hi).any(), (lo < 0).any(), ((counts < 0) | (counts > K)).any()]
    msgs = ["draft_probs has NaN or infinite entries", "draft_probs has negative entries",
            f"num_children must lie in [0, max_children = {K}]"]
    if uniforms is not None:
        flags.append(~((uniforms >= 0) & (uniforms <= 1)).all())
        msgs.append("uniforms must lie in [0, 1]")
    for flag, msg in zip(torch.stack(flags).tolist(), msgs):
        if flag:
            raise ValueError(f"{op}: {msg}; nothing was written")


def sample_children(
    draft_probs: torch.Tensor,  # [R, V] fp32: q of every node expanded at this level
    num_children: int | torch.Tensor,  # int, or [R] int tensor: children to sample per row
    *,
    max_children: int | None = None,
    uniforms: torch.Tensor | None = None,  # [R, V] fp32 in (0, 1]
    seed: torch.Tensor | None = None,  # one-element int64 device tensor (Philox key)
    offset: torch.Tensor | None = None,  # one-element int64 device tensor, advanced in place
    backend: str | None = None,
    out: torch.Tensor | None = None,  # [R, max_children] int64
    validate: bool = True,
) -> torch.Tensor:  # [R, max_children] int64
    """Sample each row's children WITHOUT replacement, in sampling order (the exponential
    race / Gumbel top-k: keys -log(u)/q, the smallest first; exact, see the reference).

    Returns ``[R, K]`` int64 with ``K = num_children`` (int) or ``max_children`` (defaults to
    ``num_children.max()``, a host sync: pass it explicitly inside CUDA graphs). Entry
    ``[r, i]`` is -1 when ``i >= num_children[r]`` or when row r has fewer than ``i + 1``
    tokens with q > 0 (tokens with q = 0 are never sampled); ``verify_tree`` skips -1 children.
    Rows of q need not be normalised.

    Random numbers: ``uniforms`` ``[R, V]`` (one per token); or ``seed``/``offset`` (Philox,
    the numbers of ``philox_uniforms(seed, offset, (R, V))``; ``offset`` is advanced in place
    by ``ceil(R * V / 4)``; the Triton kernel makes them in registers); or neither: ``1 -
    torch.rand`` from torch's default generator.
    """
    op = "sample_children"
    counts, K = _children_counts(op, draft_probs, num_children, max_children)
    R, V = draft_probs.shape
    dev = draft_probs.device
    check_random_source(uniforms, seed, offset, dev, op)
    if uniforms is not None:
        if not isinstance(uniforms, torch.Tensor) or uniforms.shape != (R, V) or uniforms.dtype != torch.float32 \
                or uniforms.device != dev or (V > 1 and uniforms.stride(-1) != 1):
            raise ValueError(f"{op}: uniforms must be a float32 [R, V] = {[R, V]} tensor on {dev} "
                             f"with a contiguous last dimension")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != (R, K) or out.dtype != torch.int64 or out.device != dev:
            raise ValueError(f"{op}: out must be an int64 [R, K] = {[R, K]} tensor on {dev}")
    backend = resolve_op_backend(op, backend, dev)
    if validate and R:
        _check_children_values(op, draft_probs, counts, K, uniforms)
    if out is None:
        out = torch.empty((R, K), dtype=torch.int64, device=dev)
    if R == 0 or K == 0:
        if seed is not None:
            offset.add_(counters_used(R * V))
        return out
    if backend == "triton" and uniforms is None and seed is not None:
        from ..triton_kernels.sampling import sample_children_triton

        sample_children_triton(draft_probs, counts, out, seed=seed.reshape(()), offset=offset.reshape(()))
        offset.add_(counters_used(R * V))
        return out
    if uniforms is None:
        uniforms = draw_uniforms((R, V), dev, seed=seed, offset=offset, open_low=True)  # (0, 1]
    if backend == "reference":
        out.copy_(sample_children_reference(draft_probs, counts, K, uniforms))
    elif backend == "triton":
        from ..triton_kernels.sampling import sample_children_triton

        sample_children_triton(draft_probs, counts, out, uniforms=uniforms)
    else:
        torch.ops.sequoia_kernels.sample_children(draft_probs, counts, uniforms, out)
    return out


# ----------------------------------------------------------------------------- overlap_rows


def overlap_rows(
    p: torch.Tensor,  # [R, V] fp32: target distributions
    q: torch.Tensor,  # [R, V] fp32: draft distributions
    rows: torch.Tensor,  # [N] int64 in [0, R)
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,  # [N] fp32
) -> torch.Tensor:  # [N] fp32
    """``out[i] = sum_v min(p[rows[i], v], q[rows[i], v])``: the probability that a child drawn
    from q at node ``rows[i]`` is accepted against p (the adaptive loop's first-child acceptance
    at each node of an accepted path). ``backend``: "cpu" (the compiled kernel: one pass over the
    rows read, fp64 sums; the default on CPU tensors when built) or "reference" (torch's gather,
    minimum and sum, on any device: the default elsewhere)."""
    op = "overlap_rows"
    if not all(isinstance(t, torch.Tensor) for t in (p, q, rows)) or p.dim() != 2 or q.shape != p.shape \
            or p.dtype != torch.float32 or q.dtype != torch.float32 or q.device != p.device:
        raise ValueError(f"{op}: p and q must be float32 [R, V] tensors of one shape and device")
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.device != p.device:
        raise ValueError(f"{op}: rows must be an int64 [N] tensor on {p.device}")
    N = rows.numel()
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != (N,) or out.dtype != torch.float32
                            or out.device != p.device):
        raise ValueError(f"{op}: out must be a float32 [N] = [{N}] tensor on {p.device}")
    if backend not in (None, "cpu", "reference"):
        raise ValueError(f"{op}: backend must be 'cpu' or 'reference', got {backend!r}")
    compiled = p.device.type == "cpu" and compiled_op_available(p.device, op)
    if backend == "cpu" and not compiled:
        raise ValueError(f"{op}: backend 'cpu' needs CPU tensors and torch.ops.sequoia_kernels.{op} in this build")
    out = torch.empty(N, dtype=torch.float32, device=p.device) if out is None else out
    if backend != "reference" and compiled and N:
        if p.shape[1] > 1 and (p.stride(1) != 1 or q.stride(1) != 1):
            p, q = p.contiguous(), q.contiguous()
        try:
            torch.ops.sequoia_kernels.overlap_rows(p, q, rows, out)
        except RuntimeError as e:  # the kernel's checks (rows out of range): the reference's error type
            raise ValueError(str(e).splitlines()[0]) from None
    elif N:
        if bool(((rows < 0) | (rows >= p.shape[0])).any()):
            raise ValueError(f"{op}: rows must be in [0, {p.shape[0]})")
        out.copy_(overlap_rows_reference(p, q, rows))
    return out
