"""Sequoia's dynamic program: the tree of at most ``budget`` nodes and ``max_depth`` levels that
maximises the expected tokens per step ``E`` for an acceptance vector (the definitions of the
acceptance vector and of ``E``: :mod:`.planner`).

:func:`plan_tree` finds the tree maximising ``E`` among trees with at most ``budget``
nodes (root included: the tokens the target verifies per step) and at most
``max_depth`` levels (root included), exactly, with Sequoia's dynamic program:

    g_d(m)    = best E of a tree with <= m nodes and <= d levels
              = 1 + S_{d,1}(m - 1),                       g_1(m) = 1
    S_{d,k}(m) = best sum over the children of rank k, k+1, ... (consecutive ranks, possibly
                none) of p_rank * g_{d-1}(subtree size), using <= m nodes in all
              = max(0, max_{s >= 1} p_k * g_{d-1}(s) + S_{d,k+1}(m - s)).

Each step over ``k`` is a max-plus convolution over all ``m``: every level of a DP in one call
of the compiled ``dp_tables`` op (``csrc/cpu/dp_level.cpp``), or without the extension one level
at a time as one ``[m, s]`` numpy array (a strided view, no gather; the op's reference, bitwise);
the argmax tables rebuild the tree. Budget 512, 16 levels, 32 ranks takes well under a second.

Trees are returned as :class:`TreePlan`: nodes in BFS order (node 0 the root with parent
-1, all nodes of a depth contiguous, the children of a node consecutive in sampling-rank
order, ``parents[i] < i``), which is what the tree-attention mask and the draft's per-level
expansion need.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Iterable

import numpy as np

from .tree import LevelAcceptance, TreePlan, _check_int, deep_of, expected_tokens, validate_acceptance

__all__ = ["plan_tree"]

# Largest [rows, cols] float64 block the DP builds at once (32 MiB); bigger budgets are
# processed in row chunks.
_BLOCK_ELEMS = 1 << 22


# ------------------------------------------------------------------------------- the DP


def _useful_acceptance(p: tuple[float, ...]) -> np.ndarray:
    """p as float64 with trailing zeros dropped (those ranks are never worth sampling)."""
    k = len(p)
    while k and not p[k - 1] > 0:
        k -= 1
    return np.array(p[:k], dtype=np.float64)


_OP: dict = {}  # op name -> the compiled op or None, decided once the extension is loaded


def _compiled(name: str):
    """torch.ops.sequoia_kernels.<name> (``dp_level``, ``dp_tables``: csrc/cpu/dp_level.cpp), or
    the extension's Python function ``dp_search`` (csrc/cpu/dp_search.h), once sequoia_kernels._C
    is loaded (by whatever runs the kernels: the decoding loop, the profiler), else None. Never
    imported here: the planner and ``sequoia-kernels plan`` stay light (numpy only)."""
    if name not in _OP and "sequoia_kernels._C" in sys.modules:
        if name == "dp_search":
            _OP[name] = getattr(sys.modules["sequoia_kernels._C"], name, None)
            return _OP[name]
        import torch

        from sequoia_kernels._backend import compiled_op_available

        _OP[name] = getattr(torch.ops.sequoia_kernels, name).default if compiled_op_available("cpu", name) else None
    return _OP.get(name)


def _level_numpy(p: np.ndarray, g_prev: np.ndarray, C: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """One level of the DP: ``g[m] = 1 + S_1(m - 1)`` (a root whose children of ranks 1..K are
    priced with ``p`` and whose subtrees are worth ``g_prev``, subtrees of at most ``C`` nodes)
    and the argmax table ``arg[k-1, m]`` (the rank-k child's subtree size within m nodes). The
    reference of the compiled ``dp_level`` op and, level by level, of ``dp_tables``."""
    K = len(p)
    arg = np.zeros((K, M + 1), dtype=np.int32)
    rows = np.arange(M + 1)
    # r[C + j] = S_{k+1}(j), r[:C] = -inf; A[m, s] = r[C + m - s] is a strided view of r
    # (no copy, no gather: numpy's per-call overhead is most of a small DP's time)
    r = np.zeros(C + M + 1)
    r[:C] = -np.inf
    view = np.ndarray((M + 1, C + 1), np.float64, buffer=r, offset=C * r.itemsize,
                      strides=(r.itemsize, -r.itemsize))  # view[m, s] = S_{k+1}(m - s)
    step = max(1, _BLOCK_ELEMS // (C + 1))
    pgs = p[:, None] * g_prev[None, : C + 1]  # [K, C + 1]
    for k in range(K, 0, -1):
        # A[m, s] = p_k g_prev(s) + S_{k+1}(m - s) for s = 1..C (-inf if s > m); A[m, 0] = 0.
        pg = pgs[k - 1]
        if step > M:  # one block (every re-plan's size): fewest numpy calls, they are most of its time
            a = view + pg
            a[:, 0] = 0.0
            best = arg[k - 1] = a.argmax(axis=1)
            r[C:] = a[rows, best]  # a is a copy: S_k replaces S_{k+1} under the view
            continue
        S_k = np.empty(M + 1)
        for lo in range(0, M + 1, step):
            hi = min(M + 1, lo + step)
            a = view[lo:hi] + pg
            a[:, 0] = 0.0
            best = a.argmax(axis=1)
            arg[k - 1, lo:hi] = best
            S_k[lo:hi] = a[rows[: hi - lo], best]
        r[C:] = S_k  # S_k replaces S_{k+1} under the view
    g = np.empty(M + 2)
    g[0] = 0.0
    g[1:] = 1.0 + r[C:]
    return g, arg


class _Tables:
    """DP tables for every budget <= N and every level limit <= D (see module docstring).

    ``g[d][m]`` (m = 0..N) is the best E with <= m nodes and <= d levels;
    ``arg[d][k-1, m]`` is the size of the subtree of the rank-k child in the best
    arrangement of children of ranks k, k+1, ... within m nodes (0: no rank-k child).
    Level limits beyond ``d_eff`` give the same trees as ``d_eff`` (nothing deeper helps).

    ``p1`` (a :class:`.tree.LevelAcceptance`'s first level): the root's children are priced with
    ``p1`` and every deeper node with ``p``; the root's own tables ``root[d] = (g, arg)`` combine
    ``p1`` with ``g[d - 1]``, so they are exact for that model too (the subtree under a child of
    the root is a tree of the ``p`` model). Without ``p1`` the root is priced like any node.
    """

    def __init__(self, p: np.ndarray, N: int, D: int, p1: np.ndarray | None = None):
        self.N = N
        M = N - 1  # nodes below the root
        self.K = K = min(len(p), M)
        p = p[:K]
        if _compiled("dp_tables") is not None:
            self._compiled(p, N, D, p1)
            return
        g1 = np.ones(N + 1)
        g1[0] = 0.0
        self.g: list[np.ndarray | None] = [None, g1]
        self.arg: list[np.ndarray | None] = [None, None]
        self.d_eff = 1
        fulls = [0, 1]  # fulls[d]: nodes of the full K-ary tree with d levels, capped at M
        # with p1 the root's level is separate: the p model's tables are needed to D - 1 levels only
        for d in range(2, (D if p1 is None else D - 1) + 1 if K else 1):
            C = min(M, fulls[d - 1])  # subtrees bigger than a full (d-1)-level tree are never strictly better
            fulls.append(min(M, 1 + K * fulls[d - 1]))
            g, arg = _level_numpy(p, self.g[d - 1], C, M)
            if np.array_equal(g, self.g[d - 1]):
                break  # a deeper tree does not help any budget: stop here
            self.g.append(g)
            self.arg.append(arg)
            self.d_eff = d
        self.root = None  # with p1: root[d] = (g, arg) of a root whose children are priced with p1
        if p1 is not None:
            self.K1 = min(len(p1), M)
            top = min(D, self.d_eff + 1) if self.K1 else 1
            self.root = [None, (g1, None)]
            for d in range(2, top + 1):  # the children's subtrees: trees of the p model, d - 1 levels
                self.root.append(_level_numpy(p1[: self.K1], self.g[d - 1], min(M, fulls[d - 1]), M))
            self.d_eff = top

    def _compiled(self, p: np.ndarray, N: int, D: int, p1: np.ndarray | None) -> None:
        """:meth:`__init__`'s tables in one call of the compiled ``dp_tables`` op (bitwise the same:
        ``tests/test_planner.py``)."""
        import torch

        per_level = p1 is not None
        self.K1 = min(len(p1), N - 1) if per_level else 0
        g, root_g = np.empty((D + 1, N + 1)), np.empty((D + 1, N + 1))
        arg, root_arg = np.empty((D + 1, self.K, N), np.int32), np.empty((D + 1, self.K1, N), np.int32)
        levels = np.zeros(2, np.int64)
        vectors = (p, p1[: self.K1] if per_level else p[:0])
        t = torch.from_numpy
        _compiled("dp_tables")(*(t(np.ascontiguousarray(v, np.float64)) for v in vectors), per_level, N, D,
                               t(g), t(arg), t(root_g), t(root_arg), t(levels))
        d_eff, top = int(levels[0]), int(levels[1])
        self.g = [None] + [g[d] for d in range(1, d_eff + 1)]
        self.arg = [None, None] + [arg[d] for d in range(2, d_eff + 1)]
        self.d_eff, self.root = d_eff, None
        if per_level:
            self.root = [None, (g[1], None)] + [(root_g[d], root_arg[d]) for d in range(2, top + 1)]
            self.d_eff = top

    def value(self, d: int, m: int) -> float:
        """The best E with <= m nodes and <= d levels (the root's table when the root has its own vector)."""
        m = min(m, self.N)
        if self.root is not None:
            return float(self.root[min(d, len(self.root) - 1)][0][m])
        return float(self.g[min(d, self.d_eff)][m])

    def rebuild(self, n: int, d: int) -> tuple[list[int], list[int], list[int]]:
        """parents, depth, rank of the optimal tree for budget n <= N and d levels, BFS order."""
        parents, depth, rank = [-1], [0], [0]
        queue = deque([(0, min(d, self.d_eff), n)])
        while queue:
            node, dd, m = queue.popleft()
            if dd <= 1:
                continue
            at_root = node == 0 and self.root is not None
            arg = self.root[dd][1] if at_root else self.arg[min(dd, len(self.arg) - 1)]
            mm, k = m - 1, 1
            while k <= (self.K1 if at_root else self.K) and mm > 0:
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


def _useful_budget(k: int, d: int, n: int, k1: int | None = None) -> int:
    """min(n, nodes of the full tree with d levels, k children a node (``k1`` at the root when
    given)): more nodes never add value."""
    full = 1
    for level in range(d - 1, 0, -1):
        full = 1 + (k1 if k1 is not None and level == 1 else k) * full
        if full >= n:
            return n
    return min(n, full)


def tables_for(acc: tuple[float, ...], n: int, d: int) -> _Tables:
    """The DP tables for budgets <= n (fewer when more nodes cannot help) and level limits <= d,
    for a plain vector or a :class:`.tree.LevelAcceptance` (its first level at the root)."""
    p = _useful_acceptance(deep_of(acc))
    p1 = _useful_acceptance(acc) if isinstance(acc, LevelAcceptance) else None
    n_eff = _useful_budget(len(p), d, n, None if p1 is None else len(p1))
    return _Tables(p, n_eff, min(d, n_eff), p1)


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
    A :class:`.tree.LevelAcceptance` prices the root's children with its first level and every
    deeper node with its ``deep`` vector; the DP is exact for that model too.
    """
    acc = validate_acceptance(acceptance)
    n = _check_int("budget", budget)
    d = _check_int("max_depth", max_depth)
    return _make_plan(acc, tables_for(acc, n, d), n, d)
