"""Speculation trees: :class:`TreePlan` (a tree in BFS order with its shape, mask and
expected tokens per step), the fixed shapes (chain, SpecInfer-style k x d, any tree given by its
parents) and the acceptance-vector arithmetic they share.

A node reached from the root through children of sampling ranks ``r_1, ..., r_j`` is accepted
with probability ``p_{r_1} * ... * p_{r_j}`` (``p`` the *acceptance vector*), so a step yields

    E(tree) = sum over nodes of prod over the edges on its root path of p_(rank)

tokens in expectation, the root (the last accepted token) counting 1. A draft whose deeper levels
accept differently from the first (a feature head reads the target's true features at the root
and its own predicted ones below) gives a :class:`LevelAcceptance`: the first level's vector
carrying the vector of every level below (``p`` of a node's rank is then read from the vector of
its depth). Nodes are in BFS order
(node 0 the root with parent -1, every depth contiguous, the children of a node consecutive in
rank order, ``parents[i] < i``): what the tree-attention mask and the draft's per-level
expansion need. Sequoia's optimal trees come from :mod:`.planner`. Needs numpy only.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_ACCEPTANCE",
    "LevelAcceptance",
    "TreePlan",
    "expected_tokens",
    "validate_acceptance",
    "tree_from_parents",
    "chain_tree",
    "kxd_tree",
]

#: Paper-like acceptance vector (a 7B-class draft for a 70B-class target), used when the
#: caller gives none. Sums to 0.915.
DEFAULT_ACCEPTANCE: tuple[float, ...] = (0.63, 0.11, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)

_SUM_TOL = 1e-6


# --------------------------------------------------------------------------- validation


class LevelAcceptance(tuple):
    """An acceptance vector by depth: the tuple is the first level's vector (the root's children),
    ``deep`` the vector of every node at depth >= 2. Everything that takes an acceptance vector
    takes one (it is a tuple of the first level's values); the DP, ``expected_tokens`` and the
    plans read ``deep`` where the depth matters. Measured for a feature head by
    ``measure-acceptance`` (``deep_acceptance`` in its JSON: the head reading its own predicted
    feature of the parent, as deeper levels do)."""

    deep: tuple[float, ...]

    def __new__(cls, first: Iterable[float], deep: Iterable[float], *, _checked: bool = False):
        # _checked: both vectors are tuples of floats known to be valid (built by the estimators)
        self = super().__new__(cls, first if _checked else validate_acceptance(first))
        self.deep = deep if _checked else validate_acceptance(deep)
        return self

    def __reduce__(self):
        return LevelAcceptance, (tuple(self), self.deep)

    def __repr__(self) -> str:
        return f"LevelAcceptance({tuple(self)!r}, deep={self.deep!r})"


def acceptance_from(first: Iterable[float], deep: Iterable[float] | None = None) -> tuple[float, ...]:
    """A checked vector from its stored form (a JSON file's ``acceptance`` and, for a feature
    head, ``deep_acceptance``): a :class:`LevelAcceptance` when ``deep`` is given."""
    return validate_acceptance(first) if deep is None else LevelAcceptance(first, deep)


def deep_of(acceptance: Sequence[float]) -> tuple[float, ...]:
    """The vector of nodes at depth >= 2: ``acceptance.deep`` for a :class:`LevelAcceptance`,
    else the vector itself (every level alike)."""
    return acceptance.deep if isinstance(acceptance, LevelAcceptance) else tuple(acceptance)


def validate_acceptance(acceptance: Iterable[float]) -> tuple[float, ...]:
    """Check an acceptance vector and return it as a tuple of floats (a :class:`LevelAcceptance`
    stays one, both of its vectors checked).

    Raises ``ValueError`` (one-line message) when it is empty, holds something that is not
    a real number, a NaN or infinity, a negative entry, or sums to more than 1 (+1e-6).
    """
    if isinstance(acceptance, LevelAcceptance):
        return acceptance
    if isinstance(acceptance, (str, bytes)):
        raise ValueError("acceptance must be a sequence of numbers, not a string")
    try:
        values = list(acceptance)
    except TypeError:
        raise ValueError(f"acceptance must be a sequence of numbers, got {type(acceptance).__name__}") from None
    if not values:
        raise ValueError("acceptance vector is empty")
    out = []
    for k, v in enumerate(values, start=1):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise ValueError(f"acceptance p_{k} is not a number: {v!r}")
        x = float(v)
        if math.isnan(x) or math.isinf(x):
            raise ValueError(f"acceptance p_{k} is not finite: {x}")
        if x < 0:
            raise ValueError(f"acceptance p_{k} is negative: {x}")
        out.append(x)
    total = math.fsum(out)
    if total > 1 + _SUM_TOL:
        raise ValueError(f"acceptance probabilities sum to {total:.6g} > 1")
    return tuple(out)


def _check_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _tree_shape(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Depth and 1-based sibling rank of each node; checks the topological format."""
    n = len(parents)
    if n == 0:
        raise ValueError("a tree needs at least the root")
    depth = [0] * n
    rank = [0] * n
    nchild = [0] * n
    for i, q in enumerate(parents):
        if isinstance(q, (bool, np.bool_)) or not isinstance(q, (int, np.integer)):
            raise ValueError(f"parents[{i}] is not an integer: {q!r}")
        q = int(q)
        if i == 0:
            if q != -1:
                raise ValueError(f"parents[0] must be -1 (the root), got {q}")
            continue
        if not 0 <= q < i:
            raise ValueError(f"parents[{i}] = {q}: each node's parent must come before it (0 <= parent < {i})")
        depth[i] = depth[q] + 1
        nchild[q] += 1
        rank[i] = nchild[q]
    return depth, rank


def expected_tokens(parents: Sequence[int], acceptance: Iterable[float]) -> float:
    """Expected tokens per step of any tree, given in topological parent form.

    ``parents[0] == -1`` (the root), ``0 <= parents[i] < i`` otherwise. The sampling rank
    of a node is its position among its parent's children in index order (1-based);
    children of rank beyond ``len(acceptance)`` have acceptance 0. The tree need not be in
    BFS order. The root counts 1. A :class:`LevelAcceptance` prices nodes at depth >= 2 with
    its ``deep`` vector.
    """
    return math.fsum(_node_values(parents, validate_acceptance(acceptance)))


def _node_values(parents: Sequence[int], acceptance: tuple[float, ...], shape=None) -> list[float]:
    """Each node's acceptance probability: the product over its root path of p of the edge's
    rank, read from the first level's vector under the root and from ``deep_of`` below.
    ``shape``: (depth, rank) when the caller has them checked already (a TreePlan)."""
    depth, rank = shape if shape is not None else _tree_shape(parents)
    first, deep = tuple(acceptance), deep_of(acceptance)
    value = [1.0] * len(parents)
    for i in range(1, len(parents)):
        p, r = (first if depth[i] == 1 else deep), rank[i]
        value[i] = value[int(parents[i])] * (p[r - 1] if r <= len(p) else 0.0)
    return value


# ------------------------------------------------------------------------------ TreePlan


@dataclass(frozen=True)
class TreePlan:
    """A speculation tree: nodes in BFS order, node 0 the root.

    Fields: ``acceptance`` (the vector it was planned for), ``budget`` (node budget it was
    planned for, root included), ``max_depth`` (level limit it was planned for, root
    included), ``parents`` (root -1), ``depth`` (root 0), ``rank`` (1-based sampling rank
    among siblings, root 0) and ``expected_tokens`` (E, the root counting 1).

    Invariants (checked on construction): ``parents[i] < i``; depth is nondecreasing in
    the index (each level contiguous); within a level nodes are ordered by parent; the
    children of a node are consecutive with ranks 1, 2, ...
    """

    acceptance: tuple[float, ...]
    budget: int
    max_depth: int
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    expected_tokens: float

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if not isinstance(self.acceptance, LevelAcceptance):
            set_(self, "acceptance", tuple(float(x) for x in self.acceptance))
        set_(self, "parents", tuple(int(x) for x in self.parents))
        set_(self, "depth", tuple(int(x) for x in self.depth))
        set_(self, "rank", tuple(int(x) for x in self.rank))
        set_(self, "expected_tokens", float(self.expected_tokens))
        n = len(self.parents)
        if len(self.depth) != n or len(self.rank) != n:
            raise ValueError(f"parents, depth and rank must have the same length ({n}, {len(self.depth)}, {len(self.rank)})")
        depth, rank = _tree_shape(self.parents)
        if list(self.depth) != depth:
            raise ValueError("depth does not match parents")
        if list(self.rank) != rank:
            raise ValueError("rank does not match parents")
        for i in range(2, n):
            if self.parents[i] < self.parents[i - 1]:
                raise ValueError(f"nodes are not in BFS order (node {i} has parent {self.parents[i]} "
                                 f"< parent {self.parents[i - 1]} of node {i - 1})")

    # -- shape ---------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root included (tokens the target verifies per step)."""
        return len(self.parents)

    @property
    def num_levels(self) -> int:
        """Levels in the tree, root included (max depth + 1)."""
        return max(self.depth) + 1

    def children_counts(self) -> list[int]:
        """Number of children of each node."""
        counts = [0] * self.num_nodes
        for q in self.parents[1:]:
            counts[q] += 1
        return counts

    def children(self, node: int) -> list[int]:
        """Indices of a node's children, in rank order (a consecutive range)."""
        return [i for i in range(node + 1, self.num_nodes) if self.parents[i] == node]

    def levels(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """What the draft expands at each level.

        One entry per depth ``l`` that has nodes with children, in depth order:
        ``(nodes, counts)`` where ``nodes`` are the depth-``l`` nodes that have children
        (ascending; nodes without children are left out) and ``counts[j] >= 1`` the number
        of children to sample for ``nodes[j]``. Because the plan is in BFS order, those
        children are exactly the nodes of depth ``l + 1``, in order: the first
        ``counts[0]`` belong to ``nodes[0]``, and so on.
        """
        counts = self.children_counts()
        out: dict[int, tuple[list[int], list[int]]] = {}
        for i, c in enumerate(counts):
            if c:
                nodes, cs = out.setdefault(self.depth[i], ([], []))
                nodes.append(i)
                cs.append(c)
        return [(tuple(out[l][0]), tuple(out[l][1])) for l in sorted(out)]

    def mask(self) -> np.ndarray:
        """Ancestor-or-self mask, numpy bool ``[n, n]``.

        ``mask[i, j]`` is True iff node ``j`` is an ancestor of node ``i`` or ``i`` itself
        (row ``i`` is what token ``i`` may attend to inside the tree).
        """
        n = self.num_nodes
        m = np.zeros((n, n), dtype=bool)
        for i in range(n):
            q = self.parents[i]
            if q >= 0:
                m[i, : q + 1] = m[q, : q + 1]
            m[i, i] = True
        return m

    def node_values(self, acceptance: Sequence[float] | None = None) -> list[float]:
        """Probability that each node is accepted (product of p over its root path) under the
        plan's vector, or under ``acceptance`` (a vector already validated, e.g. a live estimate)."""
        acc = self.acceptance if acceptance is None else acceptance
        return _node_values(self.parents, acc, (self.depth, self.rank))

    # -- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the fields, plus derived ``num_nodes``, ``num_levels``, ``levels``
        (and ``deep_acceptance`` when the plan's vector is a :class:`LevelAcceptance`)."""
        return {
            "expected_tokens": self.expected_tokens,
            "num_nodes": self.num_nodes,
            "num_levels": self.num_levels,
            "budget": self.budget,
            "max_depth": self.max_depth,
            "acceptance": list(self.acceptance),
            **({"deep_acceptance": list(self.acceptance.deep)} if isinstance(self.acceptance, LevelAcceptance) else {}),
            "parents": list(self.parents),
            "depth": list(self.depth),
            "rank": list(self.rank),
            "levels": [
                {"depth": self.depth[nodes[0]], "nodes": list(nodes), "child_counts": list(counts)}
                for nodes, counts in self.levels()
            ],
        }

    @classmethod
    def of_search(cls, acceptance: tuple[float, ...], budget: int, max_depth: int, parents: tuple[int, ...],
                  depth: tuple[int, ...], rank: tuple[int, ...]) -> "TreePlan":
        """A plan of a DP search's rebuilt tree (``adaptive``'s re-plans): ``acceptance`` validated
        already, the int tuples as the search returns them (BFS order, depth and rank those of
        ``parents``: the searches' tests build every such plan checked too), E from them. The
        checks of the constructor re-derive the shape in Python, ~0.3 ms for a 256-node tree
        right after a streamed forward, on every re-plan whose answer differs."""
        plan = object.__new__(cls)
        fields = dict(acceptance=acceptance, budget=int(budget), max_depth=int(max_depth), parents=parents,
                      depth=depth, rank=rank,
                      expected_tokens=math.fsum(_node_values(parents, acceptance, (depth, rank))))
        for k, v in fields.items():
            object.__setattr__(plan, k, v)
        return plan

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TreePlan":
        """Inverse of :meth:`to_dict`. ``depth`` and ``rank`` may be omitted (derived from
        ``parents``); ``expected_tokens`` too (recomputed). Extra keys are ignored.
        Raises ``ValueError`` on a malformed or inconsistent dict."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a tree plan must be a JSON object, got {type(d).__name__}")
        for key in ("acceptance", "budget", "max_depth", "parents"):
            if key not in d:
                raise ValueError(f"tree plan is missing {key!r}")
        acceptance = acceptance_from(d["acceptance"], d.get("deep_acceptance"))
        parents = d["parents"]
        if not isinstance(parents, (list, tuple)):
            raise ValueError("tree plan 'parents' must be a list")
        depth, rank = _tree_shape(parents)
        e = d.get("expected_tokens")
        if e is None:
            e = expected_tokens(parents, acceptance)
        elif isinstance(e, bool) or not isinstance(e, (int, float)):
            raise ValueError(f"tree plan 'expected_tokens' is not a number: {e!r}")
        return cls(
            acceptance=acceptance,
            budget=_check_int("budget", d["budget"]),
            max_depth=_check_int("max_depth", d["max_depth"]),
            parents=tuple(parents),
            depth=tuple(d.get("depth", depth)),
            rank=tuple(d.get("rank", rank)),
            expected_tokens=float(e),
        )

    def to_json(self, path: str | os.PathLike | None = None, indent: int | None = None) -> str:
        """The plan as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TreePlan":
        """Read a plan written by :meth:`to_json`."""
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{os.fspath(path)}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(d)

    # -- drawing -------------------------------------------------------------------------

    def draw(self, max_lines: int | None = 64) -> str:
        """Text drawing of the tree, one node a line in depth-first order:
        ``#index r<rank> <acceptance probability of the node>``; at most ``max_lines``
        node lines (None: all), then a line saying how many were left out."""
        values = self.node_values()
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parents[i]].append(i)
        lines = ["#0 root 1"]
        stack = [(c, "", j == len(kids[0]) - 1) for j, c in reversed(list(enumerate(kids[0])))]
        shown = 1
        while stack and (max_lines is None or shown < max_lines):
            node, prefix, last = stack.pop()
            lines.append(f"{prefix}{'└─' if last else '├─'}#{node} r{self.rank[node]} {values[node]:.3g}")
            shown += 1
            child_prefix = prefix + ("  " if last else "│ ")
            ks = kids[node]
            stack.extend((c, child_prefix, j == len(ks) - 1) for j, c in reversed(list(enumerate(ks))))
        if shown < self.num_nodes:
            lines.append(f"… {self.num_nodes - shown} more nodes")
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (f"TreePlan: {self.num_nodes} nodes, {self.num_levels} levels, "
                f"E = {self.expected_tokens:.4f} tokens/step "
                f"(budget {self.budget}, max depth {self.max_depth})")
        return head + "\n" + self.draw()



# ------------------------------------------------------------------------------ fixed shapes


def tree_from_parents(parents: Sequence[int], acceptance: Iterable[float] = DEFAULT_ACCEPTANCE) -> TreePlan:
    """A TreePlan for a given tree (BFS order, children consecutive), E evaluated for `acceptance`."""
    acc = validate_acceptance(acceptance)
    depth, rank = _tree_shape(parents)
    n = len(parents)
    return TreePlan(acc, n, max(depth) + 1, tuple(parents), tuple(depth), tuple(rank),
                    expected_tokens(parents, acc))


def chain_tree(length: int, acceptance: Iterable[float] = DEFAULT_ACCEPTANCE) -> TreePlan:
    """Chain speculation: the root and `length` drafted tokens in a line (length 0: autoregressive)."""
    length = _check_int("length", length, 0)
    return tree_from_parents([-1] + list(range(length)), acceptance)


def kxd_tree(k: int, d: int, acceptance: Iterable[float] = DEFAULT_ACCEPTANCE) -> TreePlan:
    """SpecInfer-style k x d tree: the root samples k children (without replacement), each of
    which continues as a chain, d drafted tokens deep in all (k * d + 1 nodes)."""
    k, d = _check_int("k", k), _check_int("d", d)
    parents = [-1] + [0] * k  # level 1: the k branches
    for level in range(1, d):
        start = 1 + (level - 1) * k
        parents += list(range(start, start + k))
    return tree_from_parents(parents, acceptance)
