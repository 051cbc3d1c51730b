"""The loop's prefill: both models read every prompt but its last token (the first root).

A batch's prompts sit left-aligned in the caches' rows, each row padded after its prompt (the
padding's keys sit past the row's ``prefix_len``: the next forwards overwrite them, no real
position sees them). On a GPU, and for a target whose layers stream in per forward
(``offload``: a forward costs the stream, whatever its rows), the target reads the padded batch
in one forward. On a CPU a forward costs a fixed part (its weights read once: ``FORWARD_ROWS``
rows' worth of compute) plus its rows, so a ragged batch is read in **runs** of contiguous rows,
the split of least cost (``runs``), each run through a view of the cache's rows
(``SequoiaCache.rows``): the target reads about the real tokens and not B x the longest prompt
(a batch of equal prompts stays one forward). The draft, a small fraction of the target, reads
the padded batch as before (the target's features, where it asks for them, gathered into the
same padded layout).
"""

from __future__ import annotations

import torch

from sequoia_kernels.hf import SequoiaCache

from .drafters import Drafter
from .feature_drafter import target_forward
from .offload import offload_of

FORWARD_ROWS = 16  # a forward's fixed cost (the weights read once) in rows of its compute, on a CPU


def runs(lens: list[int], forward_rows: int = FORWARD_ROWS) -> list[tuple[int, int]]:
    """Contiguous row runs ``[(start, stop), ...]`` covering every row of positive length that
    cost the fewest row-units in all, a run costing ``forward_rows`` plus its padded size (rows x
    its longest): the cheapest split by a dynamic program over the rows (O(B^2)). Rows of length
    0 (one-token prompts) read nothing; a run never starts or ends with one."""
    B = len(lens)
    best = [0] + [None] * B  # best[z]: the least cost of rows 0 .. z - 1; how[z]: its last run's start
    how = [0] * (B + 1)
    for z in range(1, B + 1):
        if lens[z - 1] == 0:  # nothing to read: as the rows before it
            best[z], how[z] = best[z - 1], z - 1
            continue
        longest = 0
        for a in range(z - 1, -1, -1):
            longest = max(longest, lens[a])
            cost = best[a] + forward_rows + (z - a) * longest
            if best[z] is None or cost < best[z]:
                best[z], how[z] = cost, a
    out, z = [], B
    while z > 0:  # a run ends at a row that reads (and never starts at an empty one: that costs more)
        if lens[z - 1]:
            out.append((how[z], z))
        z = how[z]
    return out[::-1]


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
    feats = None  # [B, W, F]: the target's features of every row (zeros past a run's longest prompt)
    for start, stop in parts:
        w, rows = max(lens[start:stop]), tcache if (start, stop) == (0, B) else tcache.rows(start, stop)
        _, f = target_forward(target, ids[start:stop, :w], drafter.feature_layers, logits=False,
                              cache=rows, position_ids=pos[start:stop, :w], use_cache=True)
        rows.commit(per_row[start:stop])
        if f is not None and (start, stop) == (0, B):  # the padded batch in one forward: its own
            feats = f
        elif f is not None:
            feats = f.new_zeros(B, width, f.shape[-1]) if feats is None else feats
            feats[start:stop, :w] = f
    drafter.prefill(ids, pos, per_row, feats)
    return roots
