"""The device tensors of a tree plan that every decoding step reuses (:class:`TreeSpec`), and
the draft's forwards over it (:class:`Level`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sequoia_kernels.tree_mask import pack_tree_mask

from .tree import TreePlan

__all__ = ["Level", "TreeSpec", "first_children"]


def first_children(parents: list[int] | tuple[int, ...], device) -> torch.Tensor:  # [T] int64, -1: a leaf
    """Each node's first child (its highest-ranked: siblings are consecutive, in rank order)."""
    first = [-1] * len(parents)
    for c in range(len(parents) - 1, 0, -1):
        first[parents[c]] = c
    return torch.tensor(first, dtype=torch.int64, device=device)


@dataclass(frozen=True)
class Level:
    """One draft forward: nodes ``[start, end)`` of the draft's tree (the spec's nodes, shifted by
    one when the pending token is node 0) forwarded together, and how the children of its
    expanded nodes (the next level: nodes ``[end, end + C)``) are sampled: row ``child_row[c]``
    of the expanded nodes, rank ``child_col[c]``. Every forwarded level expands some node (the
    leaf level is never forwarded)."""

    start: int
    end: int
    depth: torch.Tensor  # [end - start] int64: the tree depth per node (-1: the pending token)
    pos: torch.Tensor  # [end - start] int64: position per node after the draft cache's prefix_len
    mask: torch.Tensor  # [1, end - start, W] int32: packed tree mask of the level's rows over keys [0, end)
    expanded: torch.Tensor  # [m] int64: the level's nodes with children (draft-tree indices)
    expanded_rel: torch.Tensor  # [m] int64: their rows in the level's logits
    expanded_node: torch.Tensor  # [m] int64: their indices in the plan's tree (rows of q)
    counts: torch.Tensor  # [m] int64: children to sample per expanded node
    max_children: int
    child_row: torch.Tensor  # [C] int64
    child_col: torch.Tensor  # [C] int64


class TreeSpec:
    """Device tensors of a TreePlan that every step reuses: parents, depth, first children, the packed mask, and
    the draft's forwards (:class:`Level`, built from ``TreePlan.levels()``): ``draft_levels`` for
    the first step, ``draft_levels_pending`` for later ones, whose first forward also feeds the
    pending token (node 0 of the draft's tree, the plan's nodes shifted by one)."""

    def __init__(self, plan: TreePlan, device: torch.device):
        self.plan, self.T, self.device = plan, plan.num_nodes, device
        self.parents = torch.tensor(plan.parents, dtype=torch.int64, device=device)  # [T]
        self.depth = torch.tensor(plan.depth, dtype=torch.int64, device=device)  # [T]
        self.first_child = first_children(plan.parents, device)  # [T], -1: a leaf
        mask = torch.from_numpy(plan.mask()).to(device)  # [T, T] ancestor-or-self
        self.mask = pack_tree_mask(mask)
        self.draft_levels = self._draft_levels(plan, mask, 0)
        self.draft_levels_pending = self._draft_levels(plan, mask, 1)

    def _draft_levels(self, plan: TreePlan, mask: torch.Tensor, shift: int) -> list[Level]:
        T, device = self.T, self.device
        depth = self.depth
        if shift:  # node 0: the pending token, an ancestor of every node, one position before the root
            ext = torch.zeros(T + 1, T + 1, dtype=mask.dtype, device=device)
            ext[:, 0] = 1
            ext[1:, 1:] = mask
            mask = ext  # [T + 1, T + 1]
            depth = torch.cat([depth.new_full((1,), -1), depth])  # [T + 1]
        pos = depth + shift
        expanded = {plan.depth[nodes[0]]: (nodes, counts) for nodes, counts in plan.levels()}
        t = lambda xs: torch.tensor(list(xs), dtype=torch.int64, device=device)  # noqa: E731
        levels = []
        for d in range(plan.num_levels - 1):  # the last level holds leaves only: never forwarded
            nodes = [i for i in range(T) if plan.depth[i] == d]
            s, e = (0 if d == 0 else nodes[0] + shift), nodes[-1] + 1 + shift
            parents, counts = expanded[d]
            row_of = {node: r for r, node in enumerate(parents)}
            children = range(nodes[-1] + 1, nodes[-1] + 1 + sum(counts))  # BFS: exactly the next level
            levels.append(Level(start=s, end=e, depth=depth[s:e], pos=pos[s:e], mask=pack_tree_mask(mask[s:e, :e]),
                                expanded=t(i + shift for i in parents), expanded_rel=t(i + shift - s for i in parents),
                                expanded_node=t(parents), counts=t(counts), max_children=max(counts),
                                child_row=t(row_of[plan.parents[c]] for c in children),
                                child_col=t(plan.rank[c] - 1 for c in children)))
        return levels
