"""compact_kv_: move the accepted tree nodes' K/V rows right after the prefix, in place."""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from ..reference.compact_kv import compact_kv_reference

_OP = "compact_kv_"
_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


@torch.library.register_fake("sequoia_kernels::compact_kv_")
def _compact_kv_fake(cache, src_pos, dst_start, num_accepted) -> None:
    return None


def _check_layout(cache, src_pos, dst_start, num_accepted) -> None:
    """Shape, dtype and device checks: no host sync."""
    for name, t in (("cache", cache), ("src_pos", src_pos), ("dst_start", dst_start),
                    ("num_accepted", num_accepted)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if cache.dim() != 5:
        raise ValueError(f"{_OP}: cache must be [N, B, H, S, D] (N = 2 x layers), got shape {tuple(cache.shape)}")
    if cache.dtype not in _CACHE_DTYPES:
        raise ValueError(f"{_OP}: cache dtype must be one of {_CACHE_DTYPES}, got {cache.dtype}")
    if cache.shape[-1] > 1 and cache.stride(-1) != 1:
        raise ValueError(f"{_OP}: the last (head) dimension of cache must be contiguous")
    B = cache.shape[1]
    if src_pos.dim() != 2 or src_pos.shape[0] != B:
        raise ValueError(f"{_OP}: src_pos must be [B, M] with B = {B}, got shape {tuple(src_pos.shape)}")
    for name, t in (("dst_start", dst_start), ("num_accepted", num_accepted)):
        if t.dim() != 1 or t.shape[0] != B:
            raise ValueError(f"{_OP}: {name} must be [B] with B = {B}, got shape {tuple(t.shape)}")
    for name, t in (("src_pos", src_pos), ("dst_start", dst_start), ("num_accepted", num_accepted)):
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{_OP}: {name} must be int32 or int64, got {t.dtype}")
        if t.device != cache.device:
            raise ValueError(f"{_OP}: {name} is on {t.device} but cache is on {cache.device}")


def _check_values(cache, src_pos, dst_start, num_accepted) -> None:
    """Index range and order checks: one host sync."""
    S, M = cache.shape[3], src_pos.shape[1]
    n = num_accepted.long()
    d = dst_start.long()
    src = src_pos.long()
    col = torch.arange(M, device=src.device)
    live = col[None, :] < n[:, None]  # [B, M] columns that are read
    prev = torch.cat([torch.full_like(src[:, :1], -1), src[:, :-1]], dim=1)
    bad = torch.stack([
        ((n < 0) | (n > M)).any(),
        ((d < 0) | (d + n.clamp(0, M) > S)).any(),
        (live & ((src < 0) | (src >= S))).any(),
        (live & (col[None, :] > 0) & (src <= prev)).any(),
        (live & (src < d[:, None] + col[None, :])).any(),
    ]).tolist()
    msgs = [
        f"num_accepted must lie in [0, M = {M}]",
        f"dst_start must be >= 0 and dst_start + num_accepted <= S = {S}",
        f"src_pos entries in use must lie in [0, S = {S})",
        "src_pos rows must be strictly increasing over the accepted columns",
        "src_pos[b, i] must be >= dst_start[b] + i (compaction moves rows towards the prefix)",
    ]
    for flag, msg in zip(bad, msgs):
        if flag:
            raise ValueError(f"{_OP}: {msg}; the cache was not modified")


def compact_kv_(
    cache: torch.Tensor,  # [N, B, H, S, D]; N = 2 x layers: cache[2l] is layer l's K, cache[2l+1] its V
    src_pos: torch.Tensor,  # [B, M] int32/int64: cache positions of the accepted nodes, increasing
    dst_start: torch.Tensor,  # [B]: where the accepted rows go (usually the prefix length)
    num_accepted: torch.Tensor,  # [B]: how many columns of src_pos are used in each row
    backend: str | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """In place: ``cache[:, b, :, dst_start[b] + i] = cache[:, b, :, src_pos[b, i]]`` for
    ``i < num_accepted[b]``, for every layer's K and V and every head, as if copied from a
    snapshot (sources and destinations may overlap). Positions that are not destinations keep
    their bits. Returns ``cache``.

    ``validate=True`` checks index values first (one host sync) and raises ``ValueError``
    without touching the cache. A captured CUDA-graph loop passes ``validate=False``: the
    kernels still never read or write outside the cache (out-of-range copies are skipped).
    ``backend``: "reference", "cpu", "triton" or "cuda"; default: the best for the device.
    """
    _check_layout(cache, src_pos, dst_start, num_accepted)
    backend = resolve_backend(backend, cache.device, _OP)
    if validate:
        _check_values(cache, src_pos, dst_start, num_accepted)
    if backend == "reference":
        compact_kv_reference(cache, src_pos, dst_start, num_accepted)
    elif backend == "triton":
        from ..triton_kernels.compact_kv import compact_kv_triton

        compact_kv_triton(cache, src_pos, dst_start, num_accepted)
    else:  # "cpu" and "cuda" are the two dispatch keys of the compiled op
        torch.ops.sequoia_kernels.compact_kv_(cache, src_pos, dst_start, num_accepted)
    return cache
