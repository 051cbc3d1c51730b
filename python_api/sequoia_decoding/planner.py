"""Sequoia tree planner: the optimal speculation tree for a budget and a depth.

Sequoia (arXiv 2402.12374) speculates a *tree* of draft tokens per step. The draft
samples the children of a node without replacement; ``p_k`` (the *acceptance vector*)
is the probability that the k-th sampled child is the one the target accepts, so a node
reached from the root through children of ranks ``r_1, ..., r_j`` is accepted with
probability ``p_{r_1} * ... * p_{r_j}`` and the expected number of tokens a step yields is

    E(tree) = sum over nodes of prod over the edges on its root path of p_(rank),

the root (the last accepted token, always "accepted") counting 1.

:func:`plan_tree` finds the tree maximising ``E`` among trees with at most ``budget``
nodes (root included: the tokens the target verifies per step) and at most
``max_depth`` levels (root included), exactly, with Sequoia's dynamic program:

    g_d(m)    = best E of a tree with <= m nodes and <= d levels
              = 1 + S_{d,1}(m - 1),                       g_1(m) = 1
    S_{d,k}(m) = best sum over the children of rank k, k+1, ... (consecutive ranks, possibly
                none) of p_rank * g_{d-1}(subtree size), using <= m nodes in all
              = max(0, max_{s >= 1} p_k * g_{d-1}(s) + S_{d,k+1}(m - s)).

Each step over ``k`` is a max-plus convolution, evaluated for all ``m`` at once as one
``[m, s]`` numpy array (a strided view, no gather); the argmax tables rebuild the tree.
Budget 512, 16 levels, 32 ranks takes well under a second.

Trees are returned as :class:`TreePlan`: nodes in BFS order (node 0 the root with parent
-1, all nodes of a depth contiguous, the children of a node consecutive in sampling-rank
order, ``parents[i] < i``), which is what the tree-attention mask and the draft's per-level
expansion need.

:func:`choose_plan` adds the hardware: with one draft step taking ``t_d`` seconds and the
target taking ``T(n)`` to verify ``n`` tokens, it picks ``(n, d)`` minimising the predicted
seconds per token ``(d * t_d + T(n)) / E(n, d)``.

This module needs only numpy (matplotlib for :func:`plot_tree`, imported when called).
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = [
    "DEFAULT_ACCEPTANCE",
    "TreePlan",
    "HardwarePlan",
    "PlanCandidate",
    "plan_tree",
    "expected_tokens",
    "validate_acceptance",
    "choose_plan",
    "load_latency",
    "validate_latency",
    "tree_from_parents",
    "chain_tree",
    "kxd_tree",
    "plot_tree",
]

#: Paper-like acceptance vector (a 7B-class draft for a 70B-class target), used when the
#: caller gives none. Sums to 0.915.
DEFAULT_ACCEPTANCE: tuple[float, ...] = (0.63, 0.11, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)

_SUM_TOL = 1e-6
# Largest [rows, cols] float64 block the DP builds at once (32 MiB); bigger budgets are
# processed in row chunks.
_BLOCK_ELEMS = 1 << 22


# --------------------------------------------------------------------------- validation


def validate_acceptance(acceptance: Iterable[float]) -> tuple[float, ...]:
    """Check an acceptance vector and return it as a tuple of floats.

    Raises ``ValueError`` (one-line message) when it is empty, holds something that is not
    a real number, a NaN or infinity, a negative entry, or sums to more than 1 (+1e-6).
    """
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
    BFS order. The root counts 1.
    """
    p = validate_acceptance(acceptance)
    _, rank = _tree_shape(parents)
    value = [1.0] * len(parents)
    for i in range(1, len(parents)):
        r = rank[i]
        value[i] = value[int(parents[i])] * (p[r - 1] if r <= len(p) else 0.0)
    return math.fsum(value)


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

    def node_values(self) -> list[float]:
        """Probability that each node is accepted (product of p over its root path)."""
        p = self.acceptance
        v = [1.0] * self.num_nodes
        for i in range(1, self.num_nodes):
            r = self.rank[i]
            v[i] = v[self.parents[i]] * (p[r - 1] if r <= len(p) else 0.0)
        return v

    # -- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the fields, plus derived ``num_nodes``, ``num_levels``, ``levels``."""
        return {
            "expected_tokens": self.expected_tokens,
            "num_nodes": self.num_nodes,
            "num_levels": self.num_levels,
            "budget": self.budget,
            "max_depth": self.max_depth,
            "acceptance": list(self.acceptance),
            "parents": list(self.parents),
            "depth": list(self.depth),
            "rank": list(self.rank),
            "levels": [
                {"depth": self.depth[nodes[0]], "nodes": list(nodes), "child_counts": list(counts)}
                for nodes, counts in self.levels()
            ],
        }

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
        acceptance = validate_acceptance(d["acceptance"])
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


# ------------------------------------------------------------------------------- the DP


def _useful_acceptance(p: tuple[float, ...]) -> np.ndarray:
    """p as float64 with trailing zeros dropped (those ranks are never worth sampling)."""
    arr = np.asarray(p, dtype=np.float64)
    nz = np.flatnonzero(arr > 0)
    return arr[: nz[-1] + 1] if nz.size else arr[:0]


class _Tables:
    """DP tables for every budget <= N and every level limit <= D (see module docstring).

    ``g[d][m]`` (m = 0..N) is the best E with <= m nodes and <= d levels;
    ``arg[d][k-1, m]`` is the size of the subtree of the rank-k child in the best
    arrangement of children of ranks k, k+1, ... within m nodes (0: no rank-k child).
    Level limits beyond ``d_eff`` give the same trees as ``d_eff`` (nothing deeper helps).
    """

    def __init__(self, p: np.ndarray, N: int, D: int):
        self.N = N
        M = N - 1  # nodes below the root
        self.K = K = min(len(p), M)
        p = p[:K]
        g1 = np.ones(N + 1)
        g1[0] = 0.0
        self.g: list[np.ndarray | None] = [None, g1]
        self.arg: list[np.ndarray | None] = [None, None]
        self.d_eff = 1
        if K == 0 or D == 1:
            return
        full = 1  # nodes of the full K-ary tree with d-1 levels, capped at M
        rows = np.arange(M + 1)
        for d in range(2, D + 1):
            g_prev = self.g[d - 1]
            C = min(M, full)  # subtrees bigger than `full` are never strictly better
            full = min(M, 1 + K * full)
            arg = np.zeros((K, M + 1), dtype=np.int32)
            S_next = np.zeros(M + 1)
            pad = np.full(C, -np.inf)
            for k in range(K, 0, -1):
                # A[m, s] = p_k g_{d-1}(s) + S_{k+1}(m - s) for s = 1..C (-inf if s > m); A[m, 0] = 0.
                q = np.concatenate((pad, S_next))[::-1]  # q[M - m + s] = S_next[m - s]
                view = np.lib.stride_tricks.sliding_window_view(q, C + 1)[::-1]  # view[m, s]
                pg = p[k - 1] * g_prev[: C + 1]
                S_k = np.empty(M + 1)
                step = max(1, _BLOCK_ELEMS // (C + 1))
                for lo in range(0, M + 1, step):
                    hi = min(M + 1, lo + step)
                    a = view[lo:hi] + pg
                    a[:, 0] = 0.0
                    best = a.argmax(axis=1)
                    arg[k - 1, lo:hi] = best
                    S_k[lo:hi] = a[rows[: hi - lo], best]
                S_next = S_k
            g = np.empty(N + 1)
            g[0] = 0.0
            g[1:] = 1.0 + S_next
            if np.array_equal(g, g_prev):
                break  # a deeper tree does not help any budget: stop here
            self.g.append(g)
            self.arg.append(arg)
            self.d_eff = d

    def rebuild(self, n: int, d: int) -> tuple[list[int], list[int], list[int]]:
        """parents, depth, rank of the optimal tree for budget n <= N and d levels, BFS order."""
        parents, depth, rank = [-1], [0], [0]
        queue = deque([(0, min(d, self.d_eff), n)])
        while queue:
            node, dd, m = queue.popleft()
            if dd <= 1:
                continue
            arg = self.arg[dd]
            mm, k = m - 1, 1
            while k <= self.K and mm > 0:
                s = int(arg[k - 1, mm])
                if s == 0:
                    break
                child = len(parents)
                parents.append(node)
                depth.append(depth[node] + 1)
                rank.append(k)
                queue.append((child, dd - 1, s))
                mm -= s
                k += 1
        return parents, depth, rank


def _useful_budget(k: int, d: int, n: int) -> int:
    """min(n, nodes of the full k-ary tree with d levels): more nodes never add value."""
    full = 1
    for _ in range(d - 1):
        full = 1 + k * full
        if full >= n:
            return n
    return min(n, full)


def _make_plan(acc: tuple[float, ...], tables: _Tables, n: int, d: int) -> TreePlan:
    parents, depth, rank = tables.rebuild(min(n, tables.N), d)
    return TreePlan(
        acceptance=acc,
        budget=n,
        max_depth=d,
        parents=tuple(parents),
        depth=tuple(depth),
        rank=tuple(rank),
        expected_tokens=expected_tokens(parents, acc),
    )


def plan_tree(acceptance: Iterable[float], budget: int, max_depth: int) -> TreePlan:
    """The speculation tree maximising expected tokens per step, exactly.

    ``acceptance``: p_1..p_K (validated by :func:`validate_acceptance`; need not be
    monotone; ranks beyond K have p = 0). ``budget``: the most nodes, root included (the
    tokens the target verifies per step), >= 1. ``max_depth``: the most levels, root
    included, >= 1 (1 = just the root).

    The tree has no useless nodes: among optimal trees the DP prefers fewer nodes, so it
    uses fewer than ``budget`` nodes only when more cannot raise E (e.g. the full K-ary
    tree of ``max_depth`` levels already fits, or some p are 0). A zero-probability node is
    kept only as the placeholder that a later-ranked sibling with p > 0 needs.
    ``expected_tokens`` of the result is recomputed from the tree (:func:`expected_tokens`).
    """
    acc = validate_acceptance(acceptance)
    n = _check_int("budget", budget)
    d = _check_int("max_depth", max_depth)
    p = _useful_acceptance(acc)
    n_eff = _useful_budget(len(p), d, n)
    tables = _Tables(p, n_eff, min(d, n_eff))
    return _make_plan(acc, tables, n, d)


# ------------------------------------------------------------------- hardware-aware choice


def validate_latency(draft_step_s: Any, target_latency_s: Any) -> tuple[float, dict[int, float]]:
    """Check a draft step time and a target latency table; return them normalised.

    ``draft_step_s``: finite, >= 0. ``target_latency_s``: mapping budget -> seconds for the
    target to verify that many tokens in one forward; keys integers >= 1 (strings of
    digits accepted, as JSON object keys are strings), values finite and > 0; budget 1
    must be present (the autoregressive baseline). Raises ``ValueError``.
    """
    if isinstance(draft_step_s, bool) or not isinstance(draft_step_s, (int, float, np.integer, np.floating)):
        raise ValueError(f"draft_step_s must be a number, got {draft_step_s!r}")
    t_d = float(draft_step_s)
    if not math.isfinite(t_d) or t_d < 0:
        raise ValueError(f"draft_step_s must be finite and >= 0, got {t_d}")
    if not isinstance(target_latency_s, Mapping) or not target_latency_s:
        raise ValueError("target_latency_s must be a non-empty mapping {budget: seconds}")
    table: dict[int, float] = {}
    for key, val in target_latency_s.items():
        if isinstance(key, str):
            if not key.strip().isdigit():
                raise ValueError(f"target_latency_s key {key!r} is not a positive integer budget")
            n = int(key)
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            n = int(key)
        else:
            raise ValueError(f"target_latency_s key {key!r} is not a positive integer budget")
        if n < 1:
            raise ValueError(f"target_latency_s budget must be >= 1, got {n}")
        if n in table:
            raise ValueError(f"target_latency_s has budget {n} twice")
        if isinstance(val, bool) or not isinstance(val, (int, float, np.integer, np.floating)):
            raise ValueError(f"target_latency_s[{n}] is not a number: {val!r}")
        t = float(val)
        if not math.isfinite(t) or t <= 0:
            raise ValueError(f"target_latency_s[{n}] must be finite and > 0, got {t}")
        table[n] = t
    if 1 not in table:
        raise ValueError("target_latency_s must include budget 1 (the autoregressive baseline T(1))")
    return t_d, dict(sorted(table.items()))


def load_latency(path: str | os.PathLike) -> tuple[float, dict[int, float]]:
    """Read a latency file: ``{"draft_step_s": 0.004, "target_latency_s": {"1": 0.09, ...}}``.

    Other top-level fields are ignored. Returns ``(draft_step_s, {budget: seconds})`` as
    :func:`validate_latency` does; raises ``ValueError`` on malformed content and
    ``OSError`` when the file cannot be read.
    """
    name = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"latency file {name}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except UnicodeDecodeError:
            raise ValueError(f"latency file {name}: not UTF-8 text") from None
    if not isinstance(d, dict):
        raise ValueError(f"latency file {name}: expected a JSON object")
    for key in ("draft_step_s", "target_latency_s"):
        if key not in d:
            raise ValueError(f"latency file {name}: missing {key!r}")
    try:
        return validate_latency(d["draft_step_s"], d["target_latency_s"])
    except ValueError as e:
        raise ValueError(f"latency file {name}: {e}") from None


@dataclass(frozen=True)
class PlanCandidate:
    """One (budget, max_depth) candidate of :func:`choose_plan`."""

    budget: int
    max_depth: int
    num_nodes: int
    num_levels: int
    expected_tokens: float
    step_s: float  # max_depth * draft_step_s + T(budget)
    seconds_per_token: float  # step_s / expected_tokens
    speedup: float  # T(1) / seconds_per_token

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class HardwarePlan:
    """Result of :func:`choose_plan`: the chosen ``(budget, max_depth)``, its tree, the
    predicted seconds per token and speedup over autoregressive decoding (``T(1)`` per
    token), and every candidate evaluated (sorted by budget, then depth)."""

    budget: int
    max_depth: int
    plan: TreePlan
    seconds_per_token: float
    speedup: float
    baseline_s: float  # T(1)
    draft_step_s: float
    candidates: list[PlanCandidate] = field(default_factory=list)

    def best_per_budget(self) -> dict[int, PlanCandidate]:
        """For each budget, its candidate with the fewest predicted seconds per token (the
        first such on a tie, so the smaller depth), sorted by budget."""
        best: dict[int, PlanCandidate] = {}
        for c in self.candidates:
            if c.budget not in best or c.seconds_per_token < best[c.budget].seconds_per_token:
                best[c.budget] = c
        return dict(sorted(best.items()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "max_depth": self.max_depth,
            "expected_tokens": self.plan.expected_tokens,
            "seconds_per_token": self.seconds_per_token,
            "speedup": self.speedup,
            "baseline_s": self.baseline_s,
            "draft_step_s": self.draft_step_s,
            "plan": self.plan.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
        }


def choose_plan(
    acceptance: Iterable[float],
    draft_step_s: float,
    target_latency_s: Mapping[int, float],
    max_depth: int | range | Sequence[int] = 16,
) -> HardwarePlan:
    """Choose the budget and depth that minimise predicted seconds per token.

    For every budget ``n`` among the keys of ``target_latency_s`` and every level limit
    ``d`` (``max_depth``: an int D means ``d = 1..min(D, largest budget)``,
    as more levels than nodes cannot be used; a range or sequence is used as given), plans the optimal tree ``E(n, d)`` and predicts

        seconds per token = (d * draft_step_s + T(n)) / E(n, d)

    taking the issue's formula literally: ``d`` counts the levels *including the root*,
    so a ``d``-level tree is charged ``d`` draft steps (``d - 1`` forwards that sample the
    levels below the root, plus one to run the draft over the accepted tokens), and
    ``d = 1`` (no speculation) is charged one. ``T(n)`` is charged for the key ``n`` even
    if the tree uses fewer nodes. The chosen candidate minimises seconds per token; ties go
    to the smaller budget, then the smaller depth. Since a tree never needs more levels
    than it is allowed, when the depths are 1..D the winner's tree has exactly ``d``
    levels. The predicted speedup is ``T(1) / seconds_per_token``; ``T(1)`` must be in the
    table. The DP runs once for the largest budget and depth.
    """
    acc = validate_acceptance(acceptance)
    t_d, table = validate_latency(draft_step_s, target_latency_s)
    if isinstance(max_depth, (int, np.integer)) and not isinstance(max_depth, bool):
        # levels beyond the largest budget cannot be used and only cost draft steps
        depths = list(range(1, min(_check_int("max_depth", max_depth), max(table)) + 1))
    else:
        try:
            depths = sorted({_check_int("max_depth", d) for d in max_depth})
        except TypeError:
            raise ValueError(f"max_depth must be an int or a range of ints, got {max_depth!r}") from None
        if not depths:
            raise ValueError("max_depth gives no depth to try")
    p = _useful_acceptance(acc)
    N = _useful_budget(len(p), max(depths), max(table))
    tables = _Tables(p, N, min(max(depths), N))
    baseline = table[1]
    best = None
    candidates: list[PlanCandidate] = []
    plans: dict[tuple[int, int], TreePlan] = {}
    for n, t_n in table.items():
        for d in depths:
            plan = _make_plan(acc, tables, n, d)
            plans[(n, d)] = plan
            step = d * t_d + t_n
            spt = step / plan.expected_tokens
            c = PlanCandidate(n, d, plan.num_nodes, plan.num_levels, plan.expected_tokens, step, spt, baseline / spt)
            candidates.append(c)
            if best is None or spt < best.seconds_per_token:
                best = c
    assert best is not None
    return HardwarePlan(
        budget=best.budget,
        max_depth=best.max_depth,
        plan=plans[(best.budget, best.max_depth)],
        seconds_per_token=best.seconds_per_token,
        speedup=best.speedup,
        baseline_s=baseline,
        draft_step_s=t_d,
        candidates=candidates,
    )


# -------------------------------------------------------------------------------- plotting


def plot_tree(plan: TreePlan, path: str | os.PathLike, title: str | None = None) -> None:
    """Draw the tree to an image file (format from the extension, e.g. ``.png``).

    Root on top, one row per level; leaves spread left to right in depth-first order;
    nodes coloured by their acceptance probability, labelled with their rank when the
    tree is small. Uses matplotlib's Agg canvas directly (no pyplot, no GUI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    n = plan.num_nodes
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[plan.parents[i]].append(i)
    x = [0.0] * n
    next_leaf = 0
    order: list[int] = []  # post-order
    stack = [(0, False)]
    while stack:
        node, done = stack.pop()
        if done or not kids[node]:
            if kids[node]:
                x[node] = (x[kids[node][0]] + x[kids[node][-1]]) / 2
            else:
                x[node] = float(next_leaf)
                next_leaf += 1
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(kids[node]))
    y = [-float(dep) for dep in plan.depth]
    values = np.asarray(plan.node_values())
    leaves = max(1, next_leaf)
    width = min(40.0, max(6.5, 0.25 * leaves + 2.5))
    height = min(20.0, max(2.5, 0.9 * plan.num_levels + 1.2))
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    segs = [((x[plan.parents[i]], y[plan.parents[i]]), (x[i], y[i])) for i in range(1, n)]
    if segs:
        ax.add_collection(LineCollection(segs, colors="0.6", linewidths=0.6, zorder=1))
    size = max(8.0, min(160.0, 4000.0 / n))
    sc = ax.scatter(x, y, c=np.log10(np.maximum(values, 1e-12)), cmap="viridis", s=size,
                    vmin=min(-3.0, float(np.log10(max(values.min(), 1e-12)))), vmax=0.0,
                    zorder=2, edgecolors="k", linewidths=0.3)
    if n <= 64:
        for i in range(1, n):
            ax.annotate(str(plan.rank[i]), (x[i], y[i]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)
    fig.colorbar(sc, ax=ax, label="log10 P(node accepted)")
    ax.set_yticks([-l for l in range(plan.num_levels)])
    ax.set_yticklabels([str(l) for l in range(plan.num_levels)])
    ax.set_ylabel("depth")
    ax.set_xticks([])
    ax.set_xlim(-1, leaves)
    ax.set_ylim(-(plan.num_levels - 1) - 0.5, 0.6)
    ax.set_title(title or f"Sequoia tree: {n} nodes, {plan.num_levels} levels\n"
                          f"E = {plan.expected_tokens:.3f} tokens/step", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)


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
