"""tree_attention: attention of T tree nodes over a row's prefix plus the tree (Sequoia verification).

The tree mask is given once per tree, as a bool ``[T, T]`` / ``[B, T, T]`` mask or already
packed (``pack_tree_mask``: int32 ``[Bm, T, W]``, W = ceil(T / 32), bit ``j % 32`` of word
``j // 32`` of row i set iff node i sees node j). Pack it once per tree and pass the packed
form to every layer: a bool mask is packed on every call.

Queries may also be only the newest ``T`` of ``tree_len`` tree nodes (a draft growing the tree
level by level): then the mask is ``[T, tree_len]`` (packed: ``[Bm, T, ceil(tree_len / 32)]``)
and the keys of all ``tree_len`` nodes are at ``prefix_len[b] ..``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch

from .._backend import resolve_op_backend
from ..reference.tree_attention import mask_words, pack_tree_mask, tree_attention_reference, unpack_tree_mask

__all__ = [
    "tree_attention",
    "tree_attention_workspace",
    "TreeAttentionWorkspace",
    "pack_tree_mask",
    "unpack_tree_mask",
]

_OP = "tree_attention"
_DTYPES = {
    "reference": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "cpu": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "triton": (torch.float16, torch.bfloat16, torch.float32),
    "cuda": (torch.float16, torch.bfloat16, torch.float32),
}
# Head dims each backend supports (None: any).
_HEAD_DIMS = {
    "reference": None,
    "cpu": None,  # ATen fused CPU attention: any head dim
    "triton": tuple(range(16, 257)),
    "cuda": tuple(range(16, 257)),  # 64 and 128 on tensor cores; the others run the Triton kernel
}
_MAX_SPLITS = 128  # the merge kernels read all splits of one output row at once


@torch.library.register_fake(f"sequoia_kernels::{_OP}")  # for torch.compile / opcheck
def _tree_attention_fake(q, k_cache, v_cache, prefix_len, mask_bits, tree_len, scale, out, partial_out,
                         partial_lse) -> None:
    return None


class TreeAttentionWorkspace(NamedTuple):
    """Preallocated fp32 split buffers, flat so that any B, Hq, T, num_splits within the
    capacity view them contiguously (views allocate nothing and are CUDA-graph safe)."""

    partial_out: torch.Tensor  # [capacity * D] fp32 (capacity = B * Hq * T * max_splits)
    partial_lse: torch.Tensor  # [capacity] fp32
    max_splits: int


def tree_attention_workspace(B: int, Hq: int, T: int, D: int, max_splits: int, device) -> TreeAttentionWorkspace:
    """Split buffers for tree_attention calls with at most B rows, Hq query heads, T nodes,
    head dim D and max_splits KV splits. One workspace can serve every layer of a forward."""
    if max_splits < 1 or max_splits > _MAX_SPLITS:
        raise ValueError(f"tree_attention_workspace: max_splits must lie in [1, {_MAX_SPLITS}], got {max_splits}")
    n = B * Hq * T * max_splits
    return TreeAttentionWorkspace(
        torch.empty(n * D, dtype=torch.float32, device=device),
        torch.empty(n, dtype=torch.float32, device=device),
        int(max_splits),
    )


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cuda_block_m(M: int) -> int:
    """Packed rows per block of the CUDA kernel (csrc/cuda/tree_attention.cu launch_dim)."""
    return 64 if M <= 64 else 128


def default_num_splits(B: int, Hq: int, Hkv: int, T: int, D: int, S: int, device: torch.device, backend: str,
                       dtype: torch.dtype = torch.float16) -> int:
    """KV splits. CPU backends: 1 (the Triton interpreter: a few, to exercise the merge). CUDA
    kernel: one block per SM at most (8 warps, ~223 registers), so split only when the blocks of
    one split would leave SMs idle, each split >= 512 positions of the cache capacity S, <= 16
    (the fp32 partials stay small next to the K/V read). Triton: its own rule
    (triton_kernels.tree_attention.default_num_splits)."""
    if backend in ("reference", "cpu") or device.type != "cuda":
        return 1 if backend != "triton" else max(1, min(4, -(-S // 256)))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if backend == "cuda":
        M = (Hq // Hkv) * T
        blocks = B * Hkv * -(-M // _cuda_block_m(M))
        if blocks >= sms:
            return 1
        return int(max(1, min(-(-sms // blocks), -(-S // 512), 16)))
    from ..triton_kernels.tree_attention import default_num_splits as triton_splits

    return triton_splits(B, Hq, Hkv, T, D, S, dtype, sms)


_warned: set = set()


def _cuda_fallback_reason(q, k_cache, v_cache, out) -> str | None:
    """Why the CUDA tensor-core kernel cannot take these tensors (None: it can)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the tensor-core kernel takes fp16/bf16)"
    if q.shape[-1] not in (64, 128):
        return f"head dim {q.shape[-1]} (the tensor-core kernel takes 64 and 128)"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.data_ptr() % 16 or any(t.stride(d) % 8 for d in range(3) if t.shape[d] > 1):
            return f"{name} is not 16-byte aligned in every dimension (cp.async copies)"
    return None


def _check_layout(q, k_cache, v_cache, prefix_len, tree_mask, tree_len, out, backend):
    """Shape, dtype and device checks: no host sync."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("prefix_len", prefix_len),
                    ("tree_mask", tree_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dim() != 4:
        raise ValueError(f"{_OP}: q must be [B, Hq, T, D], got shape {tuple(q.shape)}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{_OP}: {name} must be [B, Hkv, S, D], got shape {tuple(t.shape)}")
    B, Hq, T, D = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{_OP}: k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B or Dk != D:
        raise ValueError(f"{_OP}: k_cache/v_cache [B, Hkv, S, D] = {tuple(k_cache.shape)} do not match "
                         f"q [B, Hq, T, D] = {tuple(q.shape)} in B or D")
    if T < 1:
        raise ValueError(f"{_OP}: the tree needs at least one node (T = q.shape[2] = 0)")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"{_OP}: the number of query heads ({Hq}) must be a multiple of the number of kv heads ({Hkv})")
    if not (T <= tree_len <= S):
        raise ValueError(f"{_OP}: tree_len = {tree_len} must lie in [T = {T}, S = {S}] (the tree's keys must "
                         "fit in the cache)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("prefix_len", prefix_len), ("tree_mask", tree_mask)):
        if t.device != q.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but q is on {q.device}")
    if q.dtype not in _DTYPES[backend]:
        raise ValueError(f"{_OP}: dtype {q.dtype} is not supported by backend {backend!r} "
                         f"(supported: {_DTYPES[backend]})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise ValueError(f"{_OP}: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if D > 1 and t.stride(-1) != 1:
            raise ValueError(f"{_OP}: the last (head) dimension of {name} must be contiguous")
    dims = _HEAD_DIMS[backend]
    if dims is not None and D not in dims:
        shown = "16..256" if backend == "triton" else dims
        raise ValueError(f"{_OP}: head dim {D} is not supported by backend {backend!r} (supported: {shown})")
    if prefix_len.dim() != 1 or prefix_len.shape[0] != B:
        raise ValueError(f"{_OP}: prefix_len must be [B] with B = {B}, got shape {tuple(prefix_len.shape)}")
    if prefix_len.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{_OP}: prefix_len must be int32 (or int64), got {prefix_len.dtype}")
    W = mask_words(tree_len)
    if tree_mask.dtype == torch.bool:
        if tree_mask.shape[-2:] != (T, tree_len) or tree_mask.dim() not in (2, 3):
            raise ValueError(f"{_OP}: a bool tree_mask must be [T, tree_len] or [B, T, tree_len] with T = {T}, "
                             f"tree_len = {tree_len}, got shape {tuple(tree_mask.shape)}")
    elif tree_mask.dtype == torch.int32:
        if tree_mask.dim() not in (2, 3) or tree_mask.shape[-2:] != (T, W):
            raise ValueError(f"{_OP}: a packed (int32) tree_mask must be [Bm, T, W] with T = {T}, "
                             f"W = ceil(tree_len / 32) = {W}, got shape {tuple(tree_mask.shape)}")
    else:
        raise ValueError(f"{_OP}: tree_mask must be bool [T, T] / [B, T, T] or packed int32 [Bm, T, W], "
                         f"got {tree_mask.dtype}")
    if tree_mask.dim() == 3 and tree_mask.shape[0] not in (1, B):
        raise ValueError(f"{_OP}: tree_mask batch size must be 1 or B = {B}, got {tree_mask.shape[0]}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{_OP}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"{_OP}: out must be {tuple(q.shape)} {q.dtype} on {q.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        if D > 1 and out.stride(-1) != 1:
            raise ValueError(f"{_OP}: the last dimension of out must be contiguous")


def _check_values(prefix_len: torch.Tensor, T: int, S: int) -> None:
    """prefix_len range: one host sync."""
    p = prefix_len.long()
    bad_neg, bad_end = torch.stack([(p < 0).any(), (p + T > S).any()]).tolist()
    if bad_neg:
        raise ValueError(f"{_OP}: prefix_len values must be >= 0")
    if bad_end:
        raise ValueError(f"{_OP}: prefix_len[b] + T must be <= S = {S} for every row (T = {T}): "
                         "the tree's keys must fit in the cache")


def _split_buffers(workspace, B, Hq, T, D, num_splits, device):
    """(partial_out [B, Hq, T, ns, D], partial_lse [B, Hq, T, ns]) fp32 views or fresh tensors."""
    if workspace is None:
        return (torch.empty(B, Hq, T, num_splits, D, dtype=torch.float32, device=device),
                torch.empty(B, Hq, T, num_splits, dtype=torch.float32, device=device))
    po, pl = workspace[0], workspace[1]
    for name, t in (("partial_out", po), ("partial_lse", pl)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{_OP}: workspace {name} must be an fp32 tensor on {device}")
    if po.dim() == 5 and pl.dim() == 4:  # exact shapes: num_splits is theirs
        if po.shape[:3] != (B, Hq, T) or po.shape[4] != D or pl.shape != po.shape[:4]:
            raise ValueError(f"{_OP}: workspace tensors must be [B, Hq, T, num_splits, D] and [B, Hq, T, num_splits] "
                             f"with B, Hq, T, D = {B}, {Hq}, {T}, {D}; got {tuple(po.shape)}, {tuple(pl.shape)}")
        if not (po.is_contiguous() and pl.is_contiguous()):
            raise ValueError(f"{_OP}: workspace tensors must be contiguous")
        return po, pl
    n = B * Hq * T * num_splits
    if po.dim() != 1 or pl.dim() != 1 or po.numel() < n * D or pl.numel() < n:
        raise ValueError(f"{_OP}: workspace too small for B={B}, Hq={Hq}, T={T}, D={D}, num_splits={num_splits}: "
                         f"use tree_attention_workspace(B, Hq, T, D, max_splits, device)")
    return po[: n * D].view(B, Hq, T, num_splits, D), pl[:n].view(B, Hq, T, num_splits)


class CpuLaunch(NamedTuple):
    """What a checked :func:`tree_attention` call on the compiled CPU kernel resolved besides the
    per-layer tensors: a model's other layers, whose queries, caches and mask have the same
    shapes, strides and dtypes, can launch the kernel with it directly (``sequoia_kernels.hf``)."""

    mask_bits: torch.Tensor  # packed int32 [Bm, T, W], contiguous
    tree_len: int
    scale: float
    partial_out: torch.Tensor  # fp32 [B, Hq, T, 1, D] (scratch)
    partial_lse: torch.Tensor  # fp32 [B, Hq, T, 1] (scratch)

    def run(self, q, k_cache, v_cache, prefix_len, out) -> torch.Tensor:
        torch.ops.sequoia_kernels.tree_attention(q if q.stride(-1) == 1 else q.contiguous(), k_cache, v_cache,
                                                 prefix_len, self.mask_bits, self.tree_len, self.scale, out,
                                                 self.partial_out, self.partial_lse)
        return out


def tree_attention(
    q: torch.Tensor,  # [B, Hq, T, D]: the tree nodes' queries (T = 1: plain decoding)
    k_cache: torch.Tensor,  # [B, Hkv, S, D]: keys, tree keys at prefix_len[b] .. prefix_len[b] + T - 1
    v_cache: torch.Tensor,  # [B, Hkv, S, D]: values, same layout
    prefix_len: torch.Tensor,  # [B] int32 (int64 also accepted) on q's device
    tree_mask: torch.Tensor,  # bool [T, T] / [B, T, T], or packed int32 [Bm, T, ceil(T / 32)] (Tk = tree_len columns)
    scale: float | None = None,
    backend: str | None = None,
    *,
    out: torch.Tensor | None = None,  # [B, Hq, T, D] q's dtype, written and returned
    workspace: TreeAttentionWorkspace | tuple | None = None,
    num_splits: int | None = None,
    validate: bool = True,
    tree_len: int | None = None,  # Tk >= T: the queries are the last T of Tk tree nodes (default T)
) -> torch.Tensor:  # [B, Hq, T, D], q's dtype
    """Attention of each tree node over its row's prefix and the tree nodes its mask allows.

    Node i of row b attends to cache positions ``s < prefix_len[b]`` and to
    ``prefix_len[b] + j`` for every tree node j with ``tree_mask[(b,) i, j]``; positions at or
    beyond ``prefix_len[b] + T`` are never read. GQA: query head h reads kv head
    ``h // (Hq // Hkv)``. ``scale`` defaults to ``1 / sqrt(D)``. Math in fp32 (the reference
    uses fp64 for fp64 inputs); the result has q's dtype. A node that sees no key at all
    (prefix_len 0 and a mask row without even the node itself) gets an all-zero row.

    ``k_cache``/``v_cache`` may be strided views (e.g. ``cache[2 * l]`` and ``cache[2 * l + 1]``
    of the compact_kv_ layout ``[2 x layers, B, Hkv, S, D]``) with a contiguous last dim.

    CUDA-graph use: pass a packed int32 mask, an int32 ``prefix_len``, ``out``, a
    ``workspace`` from :func:`tree_attention_workspace` (``num_splits`` defaults to a device
    heuristic capped at ``workspace.max_splits``) and ``validate=False``: then the op neither
    allocates nor syncs. ``workspace`` may also be a tuple ``(partial_out [B, Hq, T, ns, D],
    partial_lse [B, Hq, T, ns])`` of fp32 tensors, which fixes ``num_splits = ns``.

    ``validate=True`` (default) checks ``0 <= prefix_len[b]`` and ``prefix_len[b] + T <= S``
    (one host sync) and raises ``ValueError`` before writing anything; with ``validate=False``
    the GPU kernels (Triton, CUDA) clamp bad values and still never read outside the cache,
    and the C++ CPU kernel checks each row on the host (no sync on the CPU) and raises
    ``RuntimeError``.
    ``backend``: "reference", "cpu", "triton" or "cuda"; default: the best available for q's
    device that has a tree_attention kernel; on CUDA tensors Triton, until a GPU run has proven
    the CUDA kernel (``sequoia_kernels._backend.TRITON_FIRST_ON_CUDA`` says why). "cuda" runs
    the tensor-core kernel for fp16/bf16, head dims 64 and 128 and 16-byte aligned tensors; for
    anything else it runs the Triton kernel and warns once per reason.
    """
    return _tree_attention(q, k_cache, v_cache, prefix_len, tree_mask, scale, backend, out=out, workspace=workspace,
                           num_splits=num_splits, validate=validate, tree_len=tree_len)[0]


def _tree_attention(q, k_cache, v_cache, prefix_len, tree_mask, scale=None, backend=None, *, out=None,
                    workspace=None, num_splits=None, validate=True,
                    tree_len=None) -> tuple[torch.Tensor, CpuLaunch | None]:
    """:func:`tree_attention`, and the :class:`CpuLaunch` it ran when that was the compiled CPU
    kernel (else None)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{_OP}: q must be a torch.Tensor, got {type(q).__name__}")
    backend = resolve_op_backend(_OP, backend, q.device)
    if tree_len is None:
        tree_len = q.shape[2] if q.dim() == 4 else 0
    tree_len = int(tree_len)
    _check_layout(q, k_cache, v_cache, prefix_len, tree_mask, tree_len, out, backend)
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    scale = float(scale)
    if num_splits is not None and not (1 <= int(num_splits) <= _MAX_SPLITS):
        raise ValueError(f"{_OP}: num_splits must lie in [1, {_MAX_SPLITS}], got {num_splits}")
    if workspace is not None and isinstance(workspace, TreeAttentionWorkspace) and num_splits is not None \
            and num_splits > workspace.max_splits:
        raise ValueError(f"{_OP}: num_splits = {num_splits} exceeds the workspace's max_splits = {workspace.max_splits}")
    if validate:
        _check_values(prefix_len, tree_len, S)

    if backend == "reference":
        result = tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_mask, scale, tree_len)
        return (result if out is None else out.copy_(result)), None

    mask_bits = pack_tree_mask(tree_mask) if tree_mask.dtype == torch.bool else tree_mask
    if mask_bits.dim() == 2:
        mask_bits = mask_bits.unsqueeze(0)
    if not mask_bits.is_contiguous():  # e.g. an expanded [B, T, W] mask
        mask_bits = mask_bits.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if backend == "cuda":
        why = _cuda_fallback_reason(q, k_cache, v_cache, out if out is not None else q)
        if why is not None:  # said once per reason, never silently
            if why not in _warned:
                _warned.add(why)
                warnings.warn(f"{_OP}: backend 'cuda' runs the Triton kernel for {why}", stacklevel=2)
            backend = "triton"
    if num_splits is None:
        if workspace is not None and not isinstance(workspace, TreeAttentionWorkspace) and workspace[1].dim() == 4:
            num_splits = workspace[1].shape[-1]
        else:
            num_splits = default_num_splits(B, Hq, Hkv, T, D, S, q.device, backend, q.dtype)
            if isinstance(workspace, TreeAttentionWorkspace):
                num_splits = min(num_splits, workspace.max_splits)
    partial_out, partial_lse = _split_buffers(workspace, B, Hq, T, D, int(num_splits), q.device)
    result = out if out is not None else torch.empty_like(q, memory_format=torch.contiguous_format)

    if backend == "triton":
        from ..triton_kernels.tree_attention import tree_attention_triton

        tree_attention_triton(q, k_cache, v_cache, prefix_len, mask_bits, tree_len, scale, result, partial_out,
                              partial_lse)
        return result, None
    # "cpu" and "cuda": the two dispatch keys of the compiled op (both honour out's strides)
    torch.ops.sequoia_kernels.tree_attention(q, k_cache, v_cache, prefix_len, mask_bits, tree_len, scale, result,
                                             partial_out, partial_lse)
    if backend == "cpu":
        return result, CpuLaunch(mask_bits, tree_len, scale, partial_out, partial_lse)
    return result, None
