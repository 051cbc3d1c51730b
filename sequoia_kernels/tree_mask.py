"""The packed tree mask, the Python side of ``csrc/kernels/tree_mask.h`` (production code: the
decoding loop and the Hugging Face integration pack with it; the reference re-exports it).

int32 ``[Bm, T, W]`` with ``W = ceil(Tk / 32)``; bit ``j % 32`` of word ``j // 32`` of row ``i``
is set iff query node ``i`` may see tree key ``j``. Words are two's-complement int32, so a
word with bit 31 set is negative. Usually the queries are the whole tree (``Tk = T``, a square
mask); a draft that grows the tree level by level queries only the newest level, the last
``T`` of ``Tk`` nodes (a ``[T, Tk]`` mask). Prefix positions are always visible.
"""

from __future__ import annotations

import torch

__all__ = ["mask_words", "pack_tree_mask", "unpack_tree_mask"]

_WORD = 32


def mask_words(Tk: int) -> int:
    """W, the number of int32 words of one packed mask row over Tk tree keys."""
    return (Tk + _WORD - 1) // _WORD


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool ``[T, Tk]`` or ``[B, T, Tk]`` -> int32 ``[Bm, T, W]`` (Bm = 1 or B, W = ceil(Tk / 32)),
    on mask's device.

    Pack once per tree (not per layer); packing has no host sync.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"pack_tree_mask: mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(f"pack_tree_mask: mask must be bool, got {mask.dtype}")
    if mask.dim() == 2:
        mask = mask.unsqueeze(0)
    if mask.dim() != 3:
        raise ValueError(f"pack_tree_mask: mask must be [T, Tk] or [B, T, Tk], got shape {tuple(mask.shape)}")
    Bm, T, Tk = mask.shape
    W = mask_words(Tk)
    padded = torch.zeros(Bm, T, W * _WORD, dtype=torch.int64, device=mask.device)
    padded[..., :Tk] = mask
    weights = torch.ones(_WORD, dtype=torch.int64, device=mask.device) << torch.arange(_WORD, device=mask.device)
    words = (padded.view(Bm, T, W, _WORD) * weights).sum(-1)  # [Bm, T, W] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement
    return words.to(torch.int32)


def unpack_tree_mask(bits: torch.Tensor, Tk: int) -> torch.Tensor:
    """int32 ``[Bm, T, W]`` (or ``[T, W]``) -> bool ``[Bm, T, Tk]``; the inverse of pack_tree_mask."""
    if bits.dim() == 2:
        bits = bits.unsqueeze(0)
    if bits.dim() != 3 or bits.shape[2] != mask_words(Tk):
        raise ValueError(f"unpack_tree_mask: bits must be [Bm, T, W={mask_words(Tk)}], got {tuple(bits.shape)}")
    words = bits.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(_WORD, device=bits.device)
    flat = ((words.unsqueeze(-1) >> shifts) & 1).bool()  # [Bm, T, W, 32]
    return flat.flatten(-2)[..., :Tk]
