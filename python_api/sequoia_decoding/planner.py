"""Sequoia tree planner: the optimal speculation tree for a budget and a depth.

Sequoia (arXiv 2402.12374) speculates a *tree* of draft tokens per step. The draft
samples the children of a node without replacement; ``p_k`` (the *acceptance vector*)
is the probability that the k-th sampled child is the one the target accepts, so a node
reached from the root through children of ranks ``r_1, ..., r_j`` is accepted with
probability ``p_{r_1} * ... * p_{r_j}`` and the expected number of tokens a step yields is

    E(tree) = sum over nodes of prod over the edges on its root path of p_(rank),

the root (the last accepted token, always "accepted") counting 1.

:func:`plan_tree` (:mod:`.dp`, re-exported here) finds the tree maximising ``E`` among trees
with at most ``budget`` nodes (root included: the tokens the target verifies per step) and at
most ``max_depth`` levels (root included), exactly, with Sequoia's dynamic program.

:func:`choose_plan` adds the hardware: with one draft step taking ``t_d`` seconds and the
target taking ``T(n)`` to verify ``n`` tokens, it picks ``(n, d)`` minimising the predicted
seconds per token ``(d * t_d + T(n)) / E(n, d)``.

Trees themselves (:class:`TreePlan`, chain and k x d shapes, ``E``) live in :mod:`.tree`, plots in
:mod:`.plotting`; both are re-exported here. This module needs only numpy.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .dp import _make_plan, plan_tree, tables_for
from .plotting import plot_tree
from .tree import (
    DEFAULT_ACCEPTANCE,
    LevelAcceptance,
    TreePlan,
    _check_int,
    chain_tree,
    expected_tokens,
    kxd_tree,
    tree_from_parents,
    validate_acceptance,
)

__all__ = [  # plan_tree is re-exported from .dp, the tree names from .tree, plot_tree from .plotting
    "DEFAULT_ACCEPTANCE", "LevelAcceptance", "TreePlan", "HardwarePlan", "PlanCandidate", "plan_tree", "expected_tokens",
    "validate_acceptance", "choose_plan", "load_latency", "validate_latency", "tree_from_parents", "chain_tree",
    "kxd_tree", "plot_tree",
]


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
    step_s: float  # (max_depth - 1) * draft_step_s + T(budget) (+ O(num_nodes) with step_overhead_s)
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


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """T(n) as charged: the running maximum over the budgets <= n (a forward of more tokens never
    costs less; a measured dip is noise, and charging it would favour the larger tree)."""
    out, hi = {}, 0.0
    for n in sorted(table):
        hi = max(hi, table[n])
        out[n] = hi
    return out


def _overhead_fn(step_overhead_s: Mapping[int, float] | None):
    """O(n): piecewise linear through the measured (n, seconds), constant beyond the largest; 0 if
    None. A tree step (n >= 2) samples and verifies a tree, which plain decoding (n = 1) does not,
    so trees are interpolated among the measured trees only: below the smallest measured tree the
    line through the two smallest is extended (not below O(1)), instead of a line down to O(1)
    that charged a 4-node tree half what the loop measured."""
    if not step_overhead_s:
        return lambda n: 0.0
    pts = sorted((int(k), float(v)) for k, v in step_overhead_s.items())
    for k, v in pts:
        if k < 1 or not (v >= 0.0) or v == float("inf"):
            raise ValueError(f"step_overhead_s must map node counts >= 1 to finite seconds >= 0, got {k}: {v}")
    xs = np.array([k for k, _ in pts], dtype=float)
    ys = np.array([v for _, v in pts], dtype=float)
    trees = [(k, v) for k, v in pts if k >= 2]
    o1 = float(np.interp(1.0, xs, ys))

    def oh(n):
        n = float(n)
        if n >= 2 and len(trees) >= 2 and n < trees[0][0]:
            (k0, v0), (k1, v1) = trees[0], trees[1]
            return max(v0 + (v1 - v0) * (n - k0) / (k1 - k0), o1)
        if n >= 2 and len(trees) == 1 and n < trees[0][0]:
            return trees[0][1]
        return float(np.interp(n, xs, ys))

    return oh


def level_widths(plan: TreePlan) -> list[int]:
    """The token count of each of the draft's forwards in a step of ``plan``: the loop feeds
    level l's nodes to the draft to sample level l + 1, so every level but the last (leaves
    only) is fed, the first with the previous step's last accepted token in front of the root
    (it rewrites that token's draft cache entry: ``generate``'s module docstring). A 1-node plan
    runs no draft: ``[]``."""
    return _level_widths(plan.depth)


def _level_widths(depth: Sequence[int]) -> list[int]:
    """:func:`level_widths` of a tree given by its nodes' depths."""
    levels = max(depth) + 1
    widths = [0] * levels
    for d in depth:
        widths[d] += 1
    return [widths[0] + 1] + widths[1:-1] if levels > 1 else []


def validate_draft_latency(draft_latency_s: Any) -> dict[int, float] | None:
    """Check a draft latency curve ``{tokens: seconds}`` (as ``target_latency_s``; None passes)."""
    if draft_latency_s is None:
        return None
    try:
        _, table = validate_latency(0.0, draft_latency_s)
    except ValueError as e:
        raise ValueError(str(e).replace("target_latency_s", "draft_latency_s")) from None
    return _monotone(table)


def _draft_s(widths: Sequence[int], t_d: float, curve: Mapping[int, float] | None) -> float:
    """The draft's share of a step whose draft forwards have ``widths`` (:func:`level_widths`: one
    per level but the leaves, none for a 1-node plan): ``len(widths)`` draft steps of ``t_d`` (the
    first forward's extra token is not charged); with a measured ``curve`` (draft forward seconds
    by token count, piecewise linear, constant beyond its ends) the sum of the curve at each width."""
    if not widths:
        return 0.0
    if curve is None:
        return len(widths) * t_d
    xs = np.array(sorted(curve), dtype=float)
    ys = np.array([curve[int(x)] for x in xs], dtype=float)
    return float(sum(np.interp(float(w), xs, ys) for w in widths))


def _charge(plan: TreePlan, t_n: float, t_d: float, table: Mapping[int, float], curve, oh
            ) -> tuple[float, float, float]:
    """THE cost model: one step of ``plan`` with the target charged ``t_n``, by phase (the draft's
    forwards, the target's forward, the time outside the forwards ``oh(n)``); a 1-node plan is
    plain decoding at any budget (no draft, ``T(1)``, ``oh(1)``). :func:`choose_plan` and
    :func:`plan_step_s` both charge through it (the re-planner through :func:`_charge_shape`)."""
    return _charge_shape(plan.num_nodes, level_widths(plan), t_n, t_d, table, curve, oh)


def _charge_shape(nodes: int, widths: Sequence[int], t_n: float, t_d: float, table: Mapping[int, float], curve, oh
                  ) -> tuple[float, float, float]:
    """:func:`_charge` of a tree given by its node count and draft widths (no TreePlan built)."""
    if nodes == 1:
        return 0.0, table[1], oh(1)
    return _draft_s(widths, t_d, curve), t_n, oh(nodes)


def predicted_speedup(plan: TreePlan, budget: int, draft_step_s: float, target_latency_s: Mapping[int, float],
                      step_overhead_s: Mapping[int, float] | None = None,
                      draft_latency_s: Mapping[int, float] | None = None) -> float:
    """The speedup :func:`choose_plan`'s cost model predicts for ``plan`` charged at ``budget``
    (``T(budget)``), with a given step overhead: for a plan chosen under one setting (say
    unfiltered sampling) and run under another (top-p, whose sampling costs more)."""
    return plan_step_s(plan, budget, draft_step_s, target_latency_s, step_overhead_s, draft_latency_s)[1]


def plan_step_s(plan: TreePlan, budget: int, draft_step_s: float, target_latency_s: Mapping[int, float],
                step_overhead_s: Mapping[int, float] | None = None,
                draft_latency_s: Mapping[int, float] | None = None) -> tuple[tuple[float, float, float], float]:
    """What :func:`choose_plan` charges one step of ``plan`` at ``budget``, by phase -- (the draft's
    forwards, the target's forward, the time outside the forwards) in seconds -- and the speedup
    it predicts over plain decoding (``T(1) + O(1)`` per token)."""
    t_d, table = validate_latency(draft_step_s, target_latency_s)
    table = _monotone(table)
    oh = _overhead_fn(step_overhead_s)
    phases = _charge(plan, table[int(budget)], t_d, table, validate_draft_latency(draft_latency_s), oh)
    return phases, (table[1] + oh(1)) / (sum(phases) / plan.expected_tokens)


def _candidates(acc, tables, table: Mapping[int, float], depths: Sequence[int], t_d: float, curve, oh
                ) -> tuple[list[PlanCandidate], dict[tuple[int, int], TreePlan]]:
    """Every (budget, depth limit) candidate, budgets then depths ascending, charged by ``_charge``."""
    baseline = table[1] + oh(1)
    candidates: list[PlanCandidate] = []
    plans: dict[tuple[int, int], TreePlan] = {}
    for n, t_n in table.items():
        for d in depths:
            plan = plans[(n, d)] = _make_plan(acc, tables, n, d)
            step = sum(_charge(plan, t_n, t_d, table, curve, oh))
            spt = step / plan.expected_tokens
            candidates.append(PlanCandidate(n, d, plan.num_nodes, plan.num_levels, plan.expected_tokens, step, spt,
                                            baseline / spt))
    return candidates, plans


def choose_plan(
    acceptance: Iterable[float],
    draft_step_s: float,
    target_latency_s: Mapping[int, float],
    max_depth: int | range | Sequence[int] = 16,
    step_overhead_s: Mapping[int, float] | None = None,
    draft_latency_s: Mapping[int, float] | None = None,
) -> HardwarePlan:
    """Choose the budget and depth that minimise predicted seconds per token.

    For every budget ``n`` among the keys of ``target_latency_s`` and every level limit
    ``d`` (``max_depth``: an int D means ``d = 1..min(D, largest budget)``,
    as more levels than nodes cannot be used; a range or sequence is used as given), plans the optimal tree ``E(n, d)`` and predicts

        seconds per token = ((d - 1) * draft_step_s + T(n)) / E(n, d)

    (one cost model, ``_charge``, shared with :func:`plan_step_s`) where ``d`` counts the levels
    the tree uses *including the root*, so a ``d``-level tree with ``d >= 2`` is charged ``d - 1`` draft steps: the forwards that sample the levels below the root (the
    first also feeds the previous step's last accepted token, which Sequoia's formula charges
    as a d-th step; the leaf level is never forwarded). ``d = 1`` is autoregressive decoding
    (no draft at all): charged ``T(n)`` alone, so the candidate ``(1, 1)`` is plain decoding at
    speedup exactly 1 and a tree is chosen only when it is predicted faster: the planner never
    picks a plan it expects to lose with. ``T(n)`` is charged for the key ``n`` even if the
    tree uses fewer nodes, except a 1-node plan (any budget, ``d = 1``), which is plain decoding
    and charged ``T(1)``; ``T`` is taken as its running maximum over the budgets (a measured dip,
    T(4) < T(1) on a noisy profile, is not charged). The chosen candidate minimises seconds per
    token; ties go to the smaller budget, then the smaller depth (plain decoding wins a tie). The
    predicted speedup is ``T(1) / seconds_per_token`` (``T(1)`` must be in the table). The DP
    runs once for the largest budget and depth.

    ``step_overhead_s`` (optional, ``tools.measure_step_overhead``): seconds per step outside the
    model forwards, measured on the real loop for a few node counts; a candidate of n nodes is
    charged ``O(n)`` on top (piecewise linear between the measured counts, constant beyond
    them), plain decoding ``O(1)``, so sampling, verification and bookkeeping are priced too.

    ``draft_latency_s`` (optional, ``tools.profile_latency``'s curve of the same name): the
    draft's forward time by token count. A level of w nodes is one draft forward of w tokens,
    and a wide level costs more than a one-token step (on a CPU ~1.3x at 8 tokens), so with the
    curve a candidate's draft is charged the sum over its draft forwards of the curve at each
    one's width (:func:`level_widths`) instead of ``(d - 1) * draft_step_s``.
    """
    acc = validate_acceptance(acceptance)
    t_d, table = validate_latency(draft_step_s, target_latency_s)
    curve = validate_draft_latency(draft_latency_s)
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
    tables = tables_for(acc, max(table), max(depths))
    table = _monotone(table)
    oh = _overhead_fn(step_overhead_s)
    baseline = table[1] + oh(1)
    candidates, plans = _candidates(acc, tables, table, depths, t_d, curve, oh)
    best = min(candidates, key=lambda c: c.seconds_per_token)  # the first of equals: smaller n, then d
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
