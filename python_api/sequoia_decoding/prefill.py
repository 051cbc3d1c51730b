"""The loop's prefill: both models read every prompt but its last token (the first root).

A batch's prompts sit left-aligned in the caches' rows, each row padded after its prompt (the
padding's keys sit past the row's ``prefix_len``: the next forwards overwrite them, no real
position sees them). On a GPU, and for a target whose layers stream in per forward
(``offload``: a forward costs the stream, whatever its rows), the target reads the padded batch
in one forward. On a CPU, where a forward costs about its rows, a ragged batch is read in
**runs**: contiguous rows whose padding costs at most ``WASTE`` of their own forward, each
through a view of the cache's rows (``SequoiaCache.rows``), so the target reads about the real
tokens and not B x the longest prompt (a batch of equal prompts stays one forward). The draft,
a small fraction of the target, reads the padded batch as before (the target's features, where
it asks for them, gathered into the same padded layout).
"""

from __future__ import annotations

import torch

from sequoia_kernels.hf import SequoiaCache

from .drafters import Drafter
from .feature_drafter import target_forward
from .offload import offload_of

WASTE = 0.25  # a run's padding may cost at most this share of its forward


def runs(lens: list[int], waste: float = WASTE) -> list[tuple[int, int]]:
    """Contiguous row runs ``[(start, stop), ...]`` covering every row of positive length, a row
    joining the run before it while the run's padded size (rows x longest) stays within
    ``1 / (1 - waste)`` of its real tokens. Rows of length 0 (one-token prompts) read nothing."""
    out: list[tuple[int, int]] = []
    start, total, longest = None, 0, 0
    for b, n in enumerate(lens):
        if start is not None and (b + 1 - start) * max(longest, n) * (1 - waste) <= total + n:
            total, longest = total + n, max(longest, n)
            continue
        if start is not None:
            out.append((start, b))
        start, total, longest = (b, n, n) if n > 0 else (None, 0, 0)
    if start is not None:
        out.append((start, len(lens)))
    return out


@torch.no_grad()
def prefill(target, tcache: SequoiaCache, drafter: Drafter, prompts: list[list[int]]) -> torch.Tensor:
    """Both models read every prompt but its last token; returns the first roots [B]."""
    device = tcache.prefix_len.device
    B, lens = len(prompts), [len(p) - 1 for p in prompts]
    width = max(lens)
    roots = torch.tensor([p[-1] for p in prompts], device=device)  # [B]
    if width == 0:
        return roots
    ids = torch.zeros(B, width, dtype=torch.int64, device=device)  # [B, W]: each prompt but its last token
    for b, p in enumerate(prompts):
        ids[b, : lens[b]] = torch.tensor(p[:-1])
    pos = torch.arange(width, device=device).expand(B, width)  # [B, W]
    per_row = torch.tensor(lens, device=device)
    parts = runs(lens) if device.type == "cpu" and offload_of(target) is None else [(0, B)]
    if parts == [(0, B)]:
        _, feats = target_forward(target, ids, drafter.feature_layers, logits=False, past_key_values=tcache,
                                  position_ids=pos, use_cache=True)  # feats [B, W, F] or None
        tcache.commit(per_row)
    else:
        feats = None
        for start, stop in parts:
            w, rows = max(lens[start:stop]), tcache.rows(start, stop)
            _, f = target_forward(target, ids[start:stop, :w], drafter.feature_layers, logits=False,
                                  past_key_values=rows, position_ids=pos[start:stop, :w], use_cache=True)
            rows.commit(per_row[start:stop])
            if f is not None:
                feats = f.new_zeros(B, width, f.shape[-1]) if feats is None else feats  # [B, W, F]
                feats[start:stop, :w] = f
    drafter.prefill(ids, pos, per_row, feats)
    return roots
