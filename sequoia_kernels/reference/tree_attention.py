"""Tree attention, the specification: dense masks, fp32 math (fp64 for fp64 inputs). The packed
tree-mask format the kernels read is ``sequoia_kernels.tree_mask`` (re-exported here)."""

from __future__ import annotations

import math

import torch

from ..tree_mask import mask_words, pack_tree_mask, unpack_tree_mask  # noqa: F401  (re-exported)

def dense_visibility(
    prefix_len: torch.Tensor,  # [B] int
    tree_mask: torch.Tensor,  # [Bm, T, Tk] bool, Bm in {1, B}
    S: int,
) -> torch.Tensor:
    """bool ``[B, T, S]``: may query node i of row b read cache position s?

    Prefix positions s < prefix_len[b] always; tree positions prefix_len[b] + j iff
    tree_mask[b, i, j]; nothing at or beyond prefix_len[b] + Tk.
    """
    B = prefix_len.shape[0]
    T, Tk = tree_mask.shape[-2], tree_mask.shape[-1]
    p = prefix_len.to(torch.int64).view(B, 1)
    rel = torch.arange(S, device=tree_mask.device).view(1, S) - p  # [B, S]: tree node index
    in_tree = (rel >= 0) & (rel < Tk)
    m = tree_mask.expand(B, T, Tk)
    idx = rel.clamp(0, max(Tk - 1, 0)).view(B, 1, S).expand(B, T, S)
    tree_vis = torch.gather(m, 2, idx) & in_tree.view(B, 1, S)
    return tree_vis | (rel < 0).view(B, 1, S)


def tree_attention_reference(
    q: torch.Tensor,  # [B, Hq, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D]
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    prefix_len: torch.Tensor,  # [B] int
    tree_mask: torch.Tensor,  # bool [T, Tk] / [B, T, Tk], or packed int32 [Bm, T, ceil(Tk / 32)]
    scale: float | None = None,
    tree_len: int | None = None,  # Tk, default T (or the bool mask's last dim)
) -> torch.Tensor:  # [B, Hq, T, D], q's dtype
    """Softmax attention of each query node over the prefix and the tree keys its mask allows.

    Query head h reads kv head ``h // (Hq // Hkv)``. Cache positions the row may not read
    (at or beyond prefix_len[b] + Tk) are zeroed before use, so NaNs there cannot leak.
    A node that sees no key at all gets an all-zero output row.
    """
    B, Hq, T, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if tree_mask.dtype != torch.bool:
        tree_mask = unpack_tree_mask(tree_mask, T if tree_len is None else tree_len)
    if tree_mask.dim() == 2:
        tree_mask = tree_mask.unsqueeze(0)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    vis = dense_visibility(prefix_len.to(q.device), tree_mask.to(q.device), S)  # [B, T, S]
    readable = vis.any(1)  # [B, S]
    k = torch.where(readable.view(B, 1, S, 1), k_cache.to(acc), 0.0)
    v = torch.where(readable.view(B, 1, S, 1), v_cache.to(acc), 0.0)
    qg = q.to(acc).reshape(B, Hkv, G, T, D)
    scores = torch.einsum("bhgtd,bhsd->bhgts", qg, k) * scale
    scores = scores.masked_fill(~vis.view(B, 1, 1, T, S), float("-inf"))
    mx = scores.amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)  # rows that see nothing
    p = torch.exp(scores - mx)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgts,bhsd->bhgtd", p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.reshape(B, Hq, T, D).to(q.dtype)
