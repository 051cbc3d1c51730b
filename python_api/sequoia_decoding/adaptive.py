"""Online re-planning: the tree of every step re-solved from the live acceptance of the request
being served and from the loop's own step times (``SequoiaGenerator(..., adaptive=...)``).

**Live acceptance** (:class:`AcceptanceEstimate`). At every node on a step's accepted path the
verifier tried the node's children in rank order: the accepted child of rank ``r`` says "ranks
1..r-1 rejected, rank r accepted"; the path's last node, when it had ``c`` children, says "ranks
1..c rejected". So each rank ``k`` has a *hazard* ``h_k`` (the chance rank k is accepted when
ranks < k were not), estimated as hits / trials with the offline vector as a prior of
``prior_strength`` pseudo-trials per rank, observations decayed by ``decay`` per step and the
prior's pseudo-trials with them down to ``prior_floor``. That is exponential forgetting of the
whole Beta posterior: once a request has run ~``1 / (1 - decay)`` steps the estimate is its own (a
prior that kept its 24 pseudo-trials against the ~25 steps of evidence a decay of 0.96 leaves would
hold every estimate halfway between the offline vector and the request's; on prompts where the
draft accepted a third as often as offline no tree was ever dropped). The acceptance vector is
``p_k = h_k * prod_{j<k} (1 - h_j)`` (Sequoia's ``p_k``: the chance the k-th sampled child is the
accepted one). Per batch and per row; the uncertainty of ``p_1`` is
its Beta posterior's standard deviation. A prior that is a :class:`.tree.LevelAcceptance` (a
feature head: its first level reads true features, deeper ones its own) is estimated per level
too: the root's children's trials against the first level's, every deeper node's against ``deep``.
When sampling, a node's first child is accepted with probability ``sum_x min(p(x), q(x))`` given
the node's target and draft distributions (the verifier accepts x drawn from q with probability
min(1, p(x) / q(x))); the loop hands that probability in, and it stands in for the child's 0/1
outcome: the same mean, far less variance (a Rao-Blackwellised estimate of ``h_1``; the later
ranks, tried only after a rejection, keep their outcomes).
With ``prior_doubt`` > 0 the prior is *robust*: a mixture of the offline prior and a vague one
(``prior_floor`` pseudo-trials, the same mean), each weighted by its prior weight times its
Beta-binomial marginal likelihood of the decayed evidence (all ranks and levels), so a request
that contradicts the offline vector leaves it within a few steps instead of ~``1 / (1 - decay)``,
while one that agrees reads the same mean.

**Live costs** (:class:`LiveCosts`). The loop times each step against what the cost model
predicted for it, and every candidate is charged its predicted step times a correction at its
node count (interpolated in log2 n between the node counts learnt, the nearest one beyond them).
Only ratios between node counts move a choice, and a shared machine's speed drifts (a 2-core
VM's by 20-30% within minutes), so a correction is learnt only where two node counts ran moments
apart: the first ``window`` steps after a switch of tree size against the last ``window`` before
it (medians; the first run against the calibration, taken minutes before, only beyond 30%), and
it fades unless later switches confirm it. A tree that never gives way never times plain decoding
next to itself, so where the calibration overprices plain decoding against trees (a spell of the
machine that speeds the target's forward and not the draft's or the loop's own time, or a stale
profile: on multilingual prompts at T = 0 a (16, 2) tree predicted 1.20x a plain step ran 1.36x) it
keeps a tree that loses. Hence **cost checks** (opt-in): after ``check_every`` tree steps without
a plain one, while the tree is predicted less than ``check_margin`` faster per token than plain
decoding, plain steps run until the live costs hold a window of them (no peeks meanwhile), the
switch there and back teaches the ratio, and the re-plan that follows keeps the tree or drops it
on the corrected costs (with the hysteresis of any other change). Per-size running means of
measured / predicted, the earlier rule, compared plain steps timed in a slow spell with tree
steps timed minutes later in a fast one and kept a tree that lost 15% for hundreds of steps
(multilingual prompts, first child accepted 0.04-0.09).

**Re-planning** (:class:`Replanner`). Every ``every`` steps, and at once when ``p_1``'s estimate
leaves two standard deviations of the value it was last planned with, the planner's cost model
(``planner._charge``: the draft's forwards, T(n), the time outside the forwards) is re-solved
with the DP for every (budget, depth) of the profile: budgets whose trees cannot beat plain
decoding at any depth (an upper bound on E, :func:`_any_depth_values`) get no DP, E(n, d) comes
from the DP tables (one compiled call) and a tree is rebuilt only for candidates whose lower bound
beats the best so far; answers are memoised by the estimate rounded to ``1 / quantum``. A re-plan
runs right after the target's forward has evicted every cache, where each distinct numpy call
costs tens of microseconds: the estimate and the live costs are plain Python. The answer replaces the current tree only
when predicted ``min_gain`` faster under the live estimate and also with ``p_1`` moved
``switch_sd`` (0.5) standard deviations below and above it (hysteresis: near-equal trees are not
swapped on the estimate's noise, each swap costing a first step of a new shape, and a tree that
wins only where the estimate happens to sit usually loses where the request's acceptance is; a
plain step observes nothing, so a drop to plain decoding made on noise lasts until peeks undo it).
A tree is weighed against plain decoding (a re-plan's answer, a drop, a climb back) on a
*pessimistic* estimate instead: every hazard lowered ``plain_sd`` standard deviations of its
posterior, with ``min_gain`` and without the shifts. Plain decoding's one token a step is certain,
while a tree's E is an estimate that the re-planner picks where it reads high: on multilingual
prompts at T = 0 the (4, 2), (8, 2) and (16, 2) trees it ran expected 1.19 / 1.23-1.24 / 1.40 tokens a
step and made 1.16 / 1.15-1.20 / 1.19-1.34, so trees that only break even ran for a predicted 3-7%
they never made. (``plain_sd`` 0: a drop is judged with the shifts, p_1 raised binding; a climb back
on the estimate itself.) A 1-node plan is plain decoding (the drafters then skip their forwards and
catch up when a tree returns). With ``trees="planned"`` a re-plan runs no DP: the first step's
tree is the only tree, weighed against plain decoding as above, so a request whose tree keeps
winning runs exactly the static plan's steps. With ``trees="size"`` the DP runs at the first
step's node count only, to one level deeper at most: a tree of fewer levels where acceptance is
below the plan's (each level's draft forward and sampling saved), one of a level more where it is
above (the cost model charges a level its draft forward and its sampling), never more nodes.
``adaptive=True`` (:func:`default_config`) re-plans sampled requests so and greedy ones with the
DP over every tree: at T > 0 a re-solved tree rests on an estimate whose noise the 0/1 outcomes
of a few dozen steps leave wide, and trees the DP chose from it of any size lost 3-10% to the
static tree in every measurement, gaining only where plain decoding won, which the restricted
modes reach too; on creative text a shallower tree of the same size won 4-7% (``docs/adaptive.md``).

**Peeks** (:meth:`Replanner.peek`). A plain step observes nothing, so a request that fell back to
plain decoding would never see acceptance return (the earlier rule let forgetting bring the
prior's tree back blind, a *probe*, which lost whenever acceptance had not returned, and on
prompts where it had, came back only after ~60 steps). The ``peek_every``-th plain step since
a drop, and then ``peek_every`` steps after a peek that saw the first child accepted, twice the
last gap (up to ``peek_every * peek_backoff``) after one that did not (a peek and the slower steps
after it cost ~4-5 ms: look often where looking finds acceptance, rarely where it finds none), the
drafter drafts the star of ``PEEK_CHILDREN`` children at the root as for a tree step, the target
still forwards the root alone, and the star's verification is played out on the root's target
distribution with its own random numbers (the emitted token is the plain step's, drawn as
without a peek): the star's first level is observed as a tree step's is, for one draft forward.
The estimate forgets per observed step (tree steps and peeks), so in plain decoding its memory
spans ``peek_every`` times as many steps.

**Across calls** (``carry``). A generator's next ``generate`` call continues where its last one
ended: the same plan, live costs, and the estimate's evidence pooled over the last
call's rows (still forgetting), so traffic whose acceptance differs from the offline vector is
planned for from its first step instead of every request learning it again.

**Exactness.** The tree of step ``t`` is a function of what steps ``< t`` accepted and how long
they took, never of step ``t``'s own random numbers; verification is exact for any tree fixed
before its draws (``verify_tree``'s spec), so each step's tokens are distributed as the target's
given the prefix, and by induction over the steps so is the whole output.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from .dp import _compiled, _make_plan, tables_for
from .logs import say_once
from .planner import _draft_s, _level_widths, _monotone, _overhead_fn, level_widths, validate_draft_latency, \
    validate_latency
from .profiles import calibration_for, find_cached_profile
from .tree import LevelAcceptance, TreePlan, deep_of, tree_from_parents, validate_acceptance

__all__ = ["PEEK_CHILDREN", "AdaptiveConfig", "AcceptanceEstimate", "LiveCosts", "Replanner", "ReplanStats",
           "adaptive_costs", "default_config"]

PEEK_CHILDREN = 4  # the star a peek drafts at the root (ranks observed; trees near plain decoding have <= 7)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of online re-planning (module docstring)."""

    every: int = 8  # re-plan every this many steps (and when p_1 leaves its interval)
    prior_strength: float = 24.0  # pseudo-trials per rank of the offline vector, at a request's start ...
    prior_floor: float = 2.0  # ... forgotten like observations down to this many (or prior_strength if less)
    # per-step forgetting of observations (memory ~ 1 / (1 - decay) steps, ~3 requests of 64
    # tokens): the robust prior leaves a contradicted offline vector on its own; three paired runs
    # per prompt set read 0.98 against 0.96 0.99-1.02x, then 0.99 against 0.98 0.98-1.04x, each
    # with fewer changes chasing one request's luck into the next (docs/adaptive.md)
    decay: float = 0.99
    # the prior's doubt: a vague prior of ``prior_floor`` pseudo-trials (the offline vector's mean)
    # weighted this much against the offline prior before any evidence, each then by how well it
    # predicted the evidence (module docstring); 0: the offline prior alone. 0.5: three paired runs
    # per prompt set against 0 read 0.99-1.06x, the gains where the prior was wrong (docs/adaptive.md)
    prior_doubt: float = 0.5
    live_costs: bool = True  # correct the cost model with the loop's step times
    max_depth: int = 16
    quantum: int = 200  # estimates are rounded down to 1 / quantum for memoising plans
    # a re-solved tree replaces the current one only when predicted this much faster (seconds per
    # token, both charged under the same live estimate): trees within the cost model's error of
    # each other are not swapped back and forth on the estimate's noise
    min_gain: float = 0.03
    carry: bool = True  # a generator's next call continues this one's estimate, plan and costs
    peek_every: int = 16  # plain decoding drafts the root's star every this many steps to observe acceptance
    # the gap between peeks doubles after each one that did not see the first child accepted, up to
    # ``peek_every * peek_backoff`` steps, and is ``peek_every`` again after one that did and
    # after a drop to plain decoding (1: a fixed gap; the schedule carries across calls). A peek
    # costs ~4-5 ms on the AMX Xeon, its own step and the slower steps after it (multilingual
    # prompts, bf16: ~3% of plain decoding at a gap of 16, ~1% at 64; docs/adaptive.md): look often
    # where looking finds acceptance, rarely where it finds none
    peek_backoff: int = 4
    # a tree gives way (to another tree or to plain decoding) only when the change is predicted
    # ``min_gain`` faster also with p_1 this many of its standard deviations below and above the
    # estimate: a change made on the estimate's noise costs (a drop lasts until peeks undo it)
    switch_sd: float = 0.5
    # a tree is weighed against plain decoding with every hazard lowered this many of its posterior
    # standard deviations (``AcceptanceEstimate.lowered``): where trees only break even, the
    # estimate's noise, and the re-planner's picking of the tree it makes look best, bias a tree's
    # E upwards (multilingual prompts, T = 0: an (8, 2) tree expected 1.23 tokens a step and made
    # 1.15); plain decoding's one token a step is certain. It gives up a tree that truly wins by
    # less than its margin (~3% at 0.5, ~6% at 1 in ``tests/test_adaptive.py``). Three paired runs
    # against 0 on multilingual prompts: 0.5 1.003-1.015x, 1 1.012-1.045x (both 0.97-0.98x AR);
    # one run of 1 on three sets where trees win: the same trees (docs/adaptive.md)
    plain_sd: float = 0.5
    # a cost check (module docstring): after this many tree steps without a plain one, while the
    # tree is predicted less than ``check_margin`` faster per token than plain decoding, plain
    # steps until the live costs hold a window of them, then the re-plan goes on; 0: never (the
    # default: three paired runs per prompt set with 96 read 0.93-1.03x, docs/adaptive.md)
    check_every: int = 0
    check_margin: float = 0.2
    # the trees a re-plan may pick: "any" (the DP's best for the estimate), "planned" (the first
    # step's tree or plain decoding: re-planning only drops a tree that loses to plain decoding and
    # climbs back to it, so a call whose tree keeps winning runs exactly the static plan's steps) or
    # "size" (the DP's best of the first step's size to one level deeper at most, or plain decoding:
    # what ``adaptive=True`` and ``SequoiaDecoding`` re-plan sampled requests with: ``default_config``)
    trees: str = "any"
    # the cost model's first estimate: a profile's calibrated latency fields (``draft_step_s``,
    # ``target_latency_s``, optional ``draft_latency_s``) and the loop's time outside the forwards
    # by node count; None: this machine's cached profile (``profiles.cached_calibration``)
    latency: Mapping | None = field(default=None, compare=False)
    overhead_s: Mapping[int, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"AdaptiveConfig.every must be an int >= 1, got {self.every!r}")
        if not (self.prior_strength > 0 and math.isfinite(self.prior_strength)):
            raise ValueError(f"AdaptiveConfig.prior_strength must be finite and > 0, got {self.prior_strength!r}")
        if not (self.prior_floor > 0 and math.isfinite(self.prior_floor)):
            raise ValueError(f"AdaptiveConfig.prior_floor must be finite and > 0, got {self.prior_floor!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"AdaptiveConfig.decay must be in (0, 1], got {self.decay!r}")
        if self.trees not in ("any", "size", "planned"):
            raise ValueError(f"AdaptiveConfig.trees must be 'any', 'size' or 'planned', got {self.trees!r}")
        if not 0.0 <= self.prior_doubt < 1.0:
            raise ValueError(f"AdaptiveConfig.prior_doubt must be in [0, 1), got {self.prior_doubt!r}")
        if isinstance(self.max_depth, bool) or not isinstance(self.max_depth, int) or self.max_depth < 1:
            raise ValueError(f"AdaptiveConfig.max_depth must be an int >= 1, got {self.max_depth!r}")
        if not (self.switch_sd >= 0 and math.isfinite(self.switch_sd)):
            raise ValueError(f"AdaptiveConfig.switch_sd must be finite and >= 0, got {self.switch_sd!r}")
        if not (self.plain_sd >= 0 and math.isfinite(self.plain_sd)):
            raise ValueError(f"AdaptiveConfig.plain_sd must be finite and >= 0, got {self.plain_sd!r}")
        if isinstance(self.peek_every, bool) or not isinstance(self.peek_every, int) or self.peek_every < 1:
            raise ValueError(f"AdaptiveConfig.peek_every must be an int >= 1, got {self.peek_every!r}")
        if isinstance(self.peek_backoff, bool) or not isinstance(self.peek_backoff, int) or self.peek_backoff < 1:
            raise ValueError(f"AdaptiveConfig.peek_backoff must be an int >= 1, got {self.peek_backoff!r}")
        if isinstance(self.check_every, bool) or not isinstance(self.check_every, int) or self.check_every < 0:
            raise ValueError(f"AdaptiveConfig.check_every must be an int >= 0, got {self.check_every!r}")
        if not 0.0 <= self.check_margin < 1.0:
            raise ValueError(f"AdaptiveConfig.check_margin must be in [0, 1), got {self.check_margin!r}")
        if isinstance(self.quantum, bool) or not isinstance(self.quantum, int) or self.quantum < 1:
            raise ValueError(f"AdaptiveConfig.quantum must be an int >= 1, got {self.quantum!r}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"AdaptiveConfig.min_gain must be in [0, 1), got {self.min_gain!r}")


def _lbeta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def _hazards(p: Sequence[float]) -> np.ndarray:
    """The hazards of an acceptance vector: h_k = p_k / (1 - p_1 - ... - p_{k-1})."""
    p = np.asarray(p, dtype=np.float64)  # [..., K]
    left = 1.0 - np.concatenate((np.zeros(p.shape[:-1] + (1,)), np.cumsum(p, -1)[..., :-1]), -1)
    return np.where(left > 1e-12, p / np.maximum(left, 1e-12), 0.0).clip(0.0, 1.0)


def _vector_of(h: Sequence[float]) -> list[float]:
    """The acceptance vector of one level's hazards: p_k = h_k prod_{j<k} (1 - h_j)."""
    out, survive = [], 1.0
    for x in h:
        out.append(x * survive)
        survive *= 1.0 - x
    return out


def _as_acceptance(v) -> tuple[float, ...]:
    """[L, K] vectors (hazards' products: valid by construction; an array or lists) -> a vector or
    a LevelAcceptance."""
    rows = v.tolist() if isinstance(v, np.ndarray) else v
    return tuple(rows[0]) if len(rows) == 1 else LevelAcceptance(tuple(rows[0]), tuple(rows[1]), _checked=True)


def _any_depth_values(acc: Sequence[float], n: int) -> list[float]:
    """``E[m - 1]``, m = 1..n: at least the E of every tree of m nodes, at any depth, under ``acc`` (a
    vector or a :class:`.tree.LevelAcceptance`). A node is on the accepted path with the product of
    the p's along its path; each level's vector sorted descending only raises every tree's products
    (a node's children take the largest p's in turn), and with it the m - 1 largest products of all
    nodes, found best first (a node's products are at most its parent's and its elder sibling's),
    bound any tree's m - 1 non-root nodes."""
    first, deep = sorted(acc, reverse=True), sorted(deep_of(acc), reverse=True)
    heap = [(-first[0], 0, 1.0, True)] if first and first[0] > 0 else []  # (-product, rank - 1, parent's, at root)
    E = [1.0]
    while len(E) < n:
        if not heap:
            E.append(E[-1])
            continue
        neg, k, parent, root = heapq.heappop(heap)
        E.append(E[-1] - neg)
        vec = first if root else deep
        if k + 1 < len(vec) and vec[k + 1] > 0:  # the next sibling
            heapq.heappush(heap, (-parent * vec[k + 1], k + 1, parent, root))
        if deep and deep[0] > 0:  # the first child
            heapq.heappush(heap, (neg * deep[0], 0, -neg, False))
    return E


def path_observations(plan: TreePlan, children: Sequence[int], path: Sequence[int], num: int
                      ) -> tuple[list[int], int]:
    """(accepted ranks along the path, children of its last node): what one row's step of ``plan``
    says (``children``: ``plan.children_counts()``)."""
    return [plan.rank[path[i]] for i in range(1, num)], children[path[num - 1]] if num else 0


class AcceptanceEstimate:
    """Live acceptance vector per row and for the batch (module docstring). ``prior``: the
    offline vector (its length K bounds the ranks tracked).

    Plain Python lists, not numpy: the re-planner reads the estimate right after the target's
    forward has streamed its weights through every cache, where each distinct numpy call cost
    10-40 us (a re-plan's ~15 of them were half its time). Forgetting is lazy: the stored sums are
    the decayed ones times ``_unit``, the weight a new observation is stored with (1 / decay more
    every step), so a step forgets in O(1)."""

    def __init__(self, prior: Sequence[float], rows: int, *, strength: float = 24.0, decay: float = 0.96,
                 floor: float | None = None, doubt: float = 0.0):
        prior = validate_acceptance(prior)
        vectors = [tuple(prior)] + ([deep_of(prior)] if isinstance(prior, LevelAcceptance) else [])
        K = max(map(len, vectors))
        self.prior = np.array([v + (0.0,) * (K - len(v)) for v in vectors])  # [L, K]: L = 1 or 2 levels
        self.h0 = _hazards(self.prior).tolist()  # [L][K]
        self.strength, self.decay = float(strength), float(decay)  # strength: the prior's pseudo-trials now
        self.floor = self.strength if floor is None else min(float(floor), self.strength)
        self.doubt = float(doubt)  # the vague prior's weight before evidence (module docstring)
        self._unit = 1.0
        self._rows = [self._zeros() for _ in range(rows)]  # per row (trials, hits) [L][K], stored sums
        self._carried = self._zeros()  # finished rows' and earlier calls' evidence, pooled
        self._batch = self._zeros()  # the carried and every row's: what the batch's estimate reads
        self._weights: dict[int | None, float] = {}  # the vague prior's weight per row (None: the batch) this step

    def _zeros(self) -> tuple[list[list[float]], list[list[float]]]:
        L, K = self.prior.shape
        return [[0.0] * K for _ in range(L)], [[0.0] * K for _ in range(L)]

    def continued(self, rows: int) -> "AcceptanceEstimate":
        """The estimate of the next call (``rows`` rows): this one's evidence pooled over its rows
        is carried (every row's estimate includes it), the prior's weight as it is now."""
        new = copy.copy(self)  # the prior, its weight now, the forgetting
        new._rows = [self._zeros() for _ in range(rows)]
        new._carried, new._batch = copy.deepcopy(self._batch), copy.deepcopy(self._batch)
        new._weights = {}
        return new

    def observe(self, plan: TreePlan, paths: Sequence[Sequence[int]], nums: Sequence[int],
                first: Sequence[Sequence[float]] | None = None) -> None:
        """One step of ``plan``: rows' accepted paths (node indices) and lengths (root included).
        ``first`` (sampling): per row, the probability that each path node's first child is
        accepted, which replaces that child's 0/1 outcome (module docstring)."""
        self._unit /= self.decay  # what was stored weighs ``decay`` times less against what comes now
        self._weights.clear()
        self.strength = max(self.floor, self.strength * self.decay)
        if self._unit > 1e100:
            self._rescale()
        (L, K), children, w = self.prior.shape, plan.children_counts(), self._unit
        for r, (path, num) in enumerate(zip(paths, nums)):
            ranks, tried = path_observations(plan, children, path, num)
            for trials, hits in (self._rows[r], self._batch):
                for j, k in enumerate(ranks):  # the j-th edge of the path: a node of depth j + 1
                    level = trials[min(j, L - 1)]
                    for i in range(min(k, K)):
                        level[i] += w
                    if k <= K:
                        hits[min(j, L - 1)][k - 1] += w
                level = trials[min(len(ranks), L - 1)]
                for i in range(min(tried, K)):
                    level[i] += w
                for j in range(len(ranks) + (tried > 0) if first is not None else 0):  # the nodes that tried a child
                    hits[min(j, L - 1)][0] += w * (first[r][j] - (j < len(ranks) and ranks[j] == 1))

    def _rescale(self) -> None:
        """Stored sums back to unit weight (before the weight of a new observation overflows)."""
        for block in [self._carried, self._batch, *self._rows]:
            for levels in block:
                for level in levels:
                    level[:] = [x / self._unit for x in level]
        self._unit = 1.0

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Only rows ``keep`` go on; the others' evidence stays in the batch's (``carried``)."""
        for r in sorted(set(range(len(self._rows))) - set(keep)):
            for mine, carried in zip(self._rows[r], self._carried):
                for level, into in zip(mine, carried):
                    into[:] = [a + b for a, b in zip(into, level)]
        self._rows = [self._rows[r] for r in keep]
        self._weights.clear()  # the rows renumbered

    def _posterior(self, row: int | None = None) -> list[list[float]]:
        """The hazards [L][K]: the prior with ``row``'s evidence (None: every row's pooled), the
        finished rows' and earlier calls' included."""
        if row is None:
            trials, hits = self._batch
        else:
            (ct, ch), (rt, rh) = self._carried, self._rows[row]
            trials = [[a + b for a, b in zip(x, y)] for x, y in zip(ct, rt)]
            hits = [[a + b for a, b in zip(x, y)] for x, y in zip(ch, rh)]
        su = self.strength * self._unit
        post = [[(su * g + h) / (su + t) for g, h, t in zip(g0, hl, tl)] for g0, hl, tl in zip(self.h0, hits, trials)]
        w = self._weight(row, trials, hits)
        if w == 0.0:
            return post
        sv = self.floor * self._unit
        return [[(1.0 - w) * x + w * (sv * g + h) / (sv + t) if t > 0.0 else x for x, g, h, t in zip(xl, g0, hl, tl)]
                for xl, g0, hl, tl in zip(post, self.h0, hits, trials)]  # (a rank never tried: the prior's, bitwise)

    def _weight(self, row: int | None, trials, hits) -> float:
        """:meth:`_vague_weight` of ``row``'s evidence (None: the batch's), computed once per step: a
        step's tree check, its re-plan and the re-plan's switch test read the same evidence."""
        if row not in self._weights:
            self._weights[row] = self._vague_weight(trials, hits)
        return self._weights[row]

    def _vague_weight(self, trials, hits) -> float:
        """The vague prior's posterior weight given the evidence (stored sums, ``_unit`` weight each):
        ``doubt`` times its marginal likelihood against ``1 - doubt`` times the offline prior's
        (Beta-binomial per rank and level, the hazards clipped into [0.001, 0.999])."""
        if self.doubt <= 0.0 or self.strength <= self.floor:
            return 0.0
        u, log_ratio, seen = self._unit, 0.0, False
        for g0, hl, tl in zip(self.h0, hits, trials):
            for g, h, t in zip(g0, hl, tl):
                if t <= 0.0:
                    continue
                seen = True
                g, t = min(max(g, 0.001), 0.999), t / u
                h = min(max(h / u, 0.0), t)
                for sign, n in ((1.0, self.floor), (-1.0, self.strength)):
                    a, b = n * g, n * (1.0 - g)
                    log_ratio += sign * (_lbeta(a + h, b + t - h) - _lbeta(a, b))
        if not seen:
            return 0.0
        log_ratio += math.log(self.doubt) - math.log1p(-self.doubt)
        return 1.0 / (1.0 + math.exp(-log_ratio)) if log_ratio > -700.0 else 0.0

    def lists(self, row: int | None = None, p1: float | None = None) -> list[list[float]]:  # [L][K]
        """The estimate's vectors, one per level (``row`` None: every row's observations pooled);
        ``p1``: the first level's rank-1 hazard set to it (at most 1) instead of its estimate."""
        hazards = self._posterior(row)
        if p1 is not None:
            hazards[0][0] = min(1.0, p1)
        return [_vector_of(h) for h in hazards]

    def lowered(self, z: float) -> list[list[float]]:  # [L][K]
        """The batch's vectors with every hazard lowered ``z`` standard deviations of its posterior
        (a Beta of the prior's pseudo-trials, the vague one's as weighted, plus the decayed trials;
        floored at 0): a pessimistic estimate."""
        hazards, (trials, _), u = self._posterior(None), self._batch, self._unit
        w = self._weight(None, *self._batch)
        n0 = (1.0 - w) * self.strength + w * self.floor
        return [_vector_of([max(0.0, h - z * math.sqrt(h * (1.0 - h) / (n0 + t / u + 1.0))) for h, t in zip(hl, tl)])
                for hl, tl in zip(hazards, trials)]

    def array(self, row: int | None = None) -> np.ndarray:  # [L, K]
        """:meth:`lists` as an array."""
        return np.array(self.lists(row))

    def vector(self, row: int | None = None) -> tuple[float, ...]:
        """The estimate for the batch (``row`` None: every row's observations pooled) or one row."""
        return _as_acceptance(self.lists(row))

    @property
    def evidence(self) -> np.ndarray:  # [2 (trials | hits), B, L, K]
        """Every row's decayed observations (for inspection)."""
        return np.array([[r[i] for r in self._rows] for i in (0, 1)]).reshape(
            (2, len(self._rows)) + self.prior.shape) / self._unit

    @property
    def carried(self) -> np.ndarray:  # [2 (trials | hits), L, K]
        """The finished rows' and earlier calls' decayed observations, pooled (for inspection)."""
        return np.array(self._carried) / self._unit

    def p1(self) -> tuple[float, float]:
        """The batch's p_1 (its rank-1 hazard, first level) and the standard deviation of its
        posterior (a Beta's; with the vague prior, the two Betas' mixture's)."""
        u, w = self._unit, self._weight(None, *self._batch)
        trials, hits = self._batch[0][0][0] / u, self._batch[1][0][0] / u

        def beta(n0: float) -> tuple[float, float]:  # a Beta posterior's mean and variance
            n = n0 + trials
            h = (n0 * self.h0[0][0] + hits) / n
            return h, h * (1.0 - h) / (n + 1.0)

        h1, v1 = beta(self.strength)
        if w == 0.0:
            return h1, math.sqrt(v1)
        h2, v2 = beta(self.floor)
        h = (1.0 - w) * h1 + w * h2
        return h, math.sqrt(max(0.0, (1.0 - w) * (v1 + h1 * h1) + w * (v2 + h2 * h2) - h * h))


class LiveCosts:
    """The cost model's correction by node count, learnt from the loop's step times across
    switches of node count (module docstring): ``log_shape[n]`` is log(measured / predicted) at
    ``n`` nodes minus the same at one node (0 by definition). The median of the first ``window``
    steps of the new node count after a switch is compared with the median of the last ``window``
    before it (a median, so that one stalled step cannot teach a shape). The first run is compared
    with the calibration (ratio 1 at one node) only beyond ``drift`` in log (the machine may have
    drifted that much since: a calibration wrong by more is still caught before any switch). Each
    comparison moves the learnt difference by ``weight`` of its error, and every step fades what
    was learnt by ``fade`` (a correction that no later switch confirms goes back to the
    calibration within a few hundred steps instead of holding a tree that it alone made look
    cheap)."""

    def __init__(self, weight: float = 0.5, window: int = 6, fade: float = 0.995, drift: float = math.log(1.3)):
        self.weight, self.window, self.fade = weight, window, fade
        self.log_shape: dict[int, float] = {1: 0.0}
        self._nodes: int | None = None  # node count of the current run of steps
        self._run: list[float] = []  # its last ``window`` steps' log(measured / predicted)
        # (node count, median log-ratio, dead zone) the run is compared with: first the calibration
        self._before: tuple[int, float, float] | None = (1, 0.0, drift)

    def observe(self, nodes: int, predicted_s: float, measured_s: float) -> None:
        if predicted_s <= 0 or not math.isfinite(measured_s) or measured_s <= 0:
            return
        for n in self.log_shape:
            self.log_shape[n] *= self.fade
        x = math.log(measured_s / predicted_s)
        if nodes != self._nodes:
            if self._nodes is not None:  # a run too short to say its level: nothing to compare with
                full = len(self._run) == self.window
                self._before = (self._nodes, statistics.median(self._run), 0.0) if full else None
            self._nodes, self._run = nodes, []
        self._run = (self._run + [x])[-self.window:]
        if self._before is not None and len(self._run) == self.window:
            (a, xa, dead), self._before = self._before, None
            delta = statistics.median(self._run) - xa
            self._learn(a, nodes, math.copysign(max(abs(delta) - dead, 0.0), delta))

    def _learn(self, a: int, b: int, delta: float) -> None:
        """An observation of log_shape[b] - log_shape[a]: the one that is not n = 1 moves (b when neither is)."""
        if a == b:  # the first run at n = 1 against the calibration: n = 1 is the reference
            return
        if b == 1:
            self.log_shape[a] = self._log(a) + self.weight * (-delta - self._log(a))
        else:
            self.log_shape[b] = self._log(b) + self.weight * (self._log(a) + delta - self._log(b))

    def _log(self, n: int) -> float:
        """log_shape at ``n`` nodes: piecewise linear in log2 n between the node counts learnt, the
        nearest one's beyond them (in Python: a re-plan reads it with cold caches, see
        :class:`AcceptanceEstimate`)."""
        xs = sorted(self.log_shape)
        if n <= xs[0] or n >= xs[-1]:
            return self.log_shape[xs[0] if n <= xs[0] else xs[-1]]
        i = bisect.bisect_right(xs, n)
        a, b = xs[i - 1], xs[i]
        ya, yb = self.log_shape[a], self.log_shape[b]
        return ya + (yb - ya) * (math.log2(n) - math.log2(a)) / (math.log2(b) - math.log2(a))

    def factor(self, nodes: int) -> float:
        return math.exp(self._log(nodes))

    def factors(self, nodes: Sequence[int]) -> list[float]:
        """The correction at each node count (interpolated in log2 of the node count, the nearest
        learnt one beyond them)."""
        return [math.exp(self._log(n)) for n in nodes]

    def points(self) -> tuple[list[int], list[float]]:
        """The node counts learnt (ascending) and their log corrections (the compiled search's copy
        of :meth:`factor`)."""
        xs = sorted(self.log_shape)
        return xs, [self.log_shape[x] for x in xs]

    def least(self) -> float:
        """The smallest correction at any node count (for the planner's lower bounds)."""
        return math.exp(min(0.0, *self.log_shape.values()))


@dataclass
class ReplanStats:
    """What re-planning did in one ``generate`` call."""

    replans: int = 0  # re-plans run (memoised answers included)
    plan_changes: int = 0  # re-plans that changed the tree
    replan_s: float = 0.0  # time spent re-planning
    cost_checks: int = 0  # cost checks run (plain steps timed beside a tree that plain decoding nearly matched)
    history: list[tuple[int, int, int]] = field(default_factory=list)  # (step, nodes, levels): the first, each change

    @property
    def replan_ms(self) -> float:
        return 1e3 * self.replan_s / self.replans if self.replans else 0.0


def _tokens(plan: TreePlan, acc: Sequence[float]) -> float:
    """``plan``'s expected tokens a step under ``acc`` (a validated vector)."""
    return math.fsum(plan.node_values(acc)) if plan.num_nodes > 1 else 1.0


class Replanner:
    """Chooses each step's tree from the steps before it (module docstring), for one call.

    ``acceptance``: the offline vector (the prior); ``latency``: a profile's (calibrated) fields
    ``draft_step_s``, ``target_latency_s``, optional ``draft_latency_s``; ``overhead_s``: the loop's
    time outside the forwards by node count (or None); ``start``: the first step's plan (the
    static plan: None plans it from the prior)."""

    def __init__(self, acceptance: Sequence[float], latency: Mapping, overhead_s: Mapping[int, float] | None,
                 rows: int, config: AdaptiveConfig = AdaptiveConfig(), start: TreePlan | None = None):
        self.config = config
        self.est = AcceptanceEstimate(acceptance, rows, strength=config.prior_strength, decay=config.decay,
                                      floor=config.prior_floor, doubt=config.prior_doubt)
        self.t_d, table = validate_latency(latency["draft_step_s"], latency["target_latency_s"])
        self.table = _monotone(table)
        self.curve = validate_draft_latency(latency.get("draft_latency_s"))
        self.oh = _overhead_fn(overhead_s)
        # what any tree costs at least: one draft forward's least time, the least overhead of a tree
        self._draft_lo = min(self.curve.values()) if self.curve else self.t_d
        self._oh_lo = min(self.oh(m) for m in (2, 4, 8, 16, 32, 64, 128, 256))
        self._draft_w: dict[int, float] = {}  # the draft curve and the overhead at integer widths / node
        self._oh_n: dict[int, float] = {}  # counts, memoised (a re-plan charges the same few many times)
        self.costs = LiveCosts()
        self.stats = ReplanStats()
        self._memo: dict[tuple, TreePlan] = {}
        self._charges: tuple[list[float], list[float]] = ([], [])  # the compiled search's draft and overhead lists
        self._steps, self._planned_p1 = 0, None
        self._restart_peeks()
        self._star = tree_from_parents((-1,) + (0,) * PEEK_CHILDREN)  # what a peek drafts
        self._plain = _make_plan(acceptance, tables_for(acceptance, 1, 1), 1, 1)
        self._tree_steps = 0  # tree steps since the last plain one (the next cost check's clock)
        self._check: TreePlan | None = None  # during a cost check: the tree it interrupted
        self._check_seen = 0  # ... and the plain steps it timed
        self.plan = start if start is not None else self._solve(self.est.vector())
        self._start = self.plan  # trees="planned": the only tree a re-plan may return to
        self.stats.history.append((0, self.plan.num_nodes, self.plan.num_levels))
        self._predicted = self.predicted_step_s(self.plan)
        self._fresh = True  # the first step of a plan (allocations, warm-up): not timed into the costs

    def predicted_step_s(self, plan: TreePlan) -> float:
        """The cost model's step time for ``plan`` (before the live correction): T at its budget
        (the smallest profiled budget that holds it, for a budget the profile has not timed)."""
        return self._step_s(plan.budget, plan.num_nodes, level_widths(plan))

    def _step_s(self, budget: int, nodes: int, widths: Sequence[int]) -> float:
        """``sum(planner._charge_shape(...))`` bitwise, from memoised draft and overhead charges."""
        n = budget if budget in self.table else min((b for b in self.table if b >= nodes), default=max(self.table))
        if nodes == 1:
            return self.table[1] + self._oh(1)
        if self.curve is None:
            draft = len(widths) * self.t_d
        else:
            draft = 0.0
            for w in widths:
                if w not in self._draft_w:
                    self._draft_w[w] = _draft_s([w], self.t_d, self.curve)
                draft += self._draft_w[w]
        return draft + self.table[n] + self._oh(nodes)

    def _oh(self, nodes: int) -> float:
        if nodes not in self._oh_n:
            self._oh_n[nodes] = float(self.oh(nodes))
        return self._oh_n[nodes]

    def seconds_per_token(self, plan: TreePlan, acc: Sequence[float]) -> float:
        """``plan``'s predicted seconds per token under the acceptance ``acc`` and the live costs."""
        return self.predicted_step_s(plan) * self.costs.factor(plan.num_nodes) / _tokens(plan, acc)

    def _solve(self, acc: Sequence[float], around: TreePlan | None = None) -> TreePlan:
        """The plan minimising corrected seconds per token for ``acc`` (branch and bound over the
        profile's budgets and the depths: exact E from the DP tables, a tree rebuilt only where its
        lower bound beats the best so far). ``around``: the current plan, to search near it."""
        # warm start: around the current plan (up to twice its nodes, two more levels), so one
        # re-plan stays a small DP; the whole space at the first plan
        cap = max(2 * around.num_nodes, 8) if around is not None else max(self.table)
        budgets = [n for n in self.table if n <= cap]
        D = min(self.config.max_depth, max(around.num_levels + 2, 3) if around is not None else self.config.max_depth)
        found = self._search(acc, budgets, D, native=around is not None)
        if found is None:
            plain = around is not None and around.num_nodes == 1
            return around if plain else _make_plan(acc, tables_for(acc, 1, 1), 1, 1)
        n, d, parents, depth, rank = found
        if around is not None and n == around.budget and parents == around.parents:
            return around  # the same tree: no new TreePlan to build and validate
        return TreePlan.of_search(acc, n, d, parents, depth, rank)

    def _search(self, acc: Sequence[float], budgets: list[int], D: int, native: bool = True) -> tuple | None:
        """The best tree of ``budgets`` and up to ``D`` levels (:meth:`_search_python`), in the
        extension's one call where it is compiled and ``native`` (a re-plan's), else in Python."""
        op = _compiled("dp_search") if native else None
        return self._search_native(op, acc, budgets, D) if op else self._search_python(acc, budgets, D)

    def _search_native(self, op, acc: Sequence[float], budgets: list[int], D: int) -> tuple | None:
        """:meth:`_search_python` in one call of the extension's ``dp_search`` (csrc/cpu/dp_search.h:
        the same arithmetic, the same plans: ``tests/test_adaptive.py``): a re-plan runs right
        after the target's forward, with cold caches, where each numpy or torch call of the Python
        search cost 10-40 us (:class:`AcceptanceEstimate`) and they were most of a re-plan."""
        N = max(budgets)
        while len(self._charges[0]) < N + 2:  # draft by width, overhead by node count (fixed per call)
            m = len(self._charges[0])
            self._charges[0].append(_draft_s([m], self.t_d, self.curve) if m else 0.0)
            self._charges[1].append(self._oh(m) if m else 0.0)
        xs, ys = self.costs.points()
        per_level = isinstance(acc, LevelAcceptance)
        r = op(deep_of(acc), acc if per_level else (), per_level, D, budgets, [self.table[n] for n in budgets],
               self._charges[0][:N + 2], self._charges[1][:N + 1], xs, ys, self._draft_lo, self._oh_lo,
               self.t_d if self.curve is None else -1.0)
        if not r:
            return None
        n, d, m = r[:3]
        return n, d, tuple(r[3:3 + m]), tuple(r[3 + m:3 + 2 * m]), tuple(r[3 + 2 * m:])

    def _search_python(self, acc: Sequence[float], budgets: list[int], D: int) -> tuple | None:
        """The best tree of ``budgets`` (ascending, the first 1) and up to ``D`` levels that beats
        plain decoding, as (budget, levels, parents, depth, rank), or None (the first plan's search
        over the whole space, and the reference of :meth:`_search_native`)."""
        base = (self.table[1] + self._oh(1)) * self.costs.factor(1)
        mass = max(sum(acc), sum(deep_of(acc)))
        E_max = sum(mass ** j for j in range(D))  # E of the unbounded tree of D levels, at least
        # a budget whose trees cannot beat plain decoding gets no DP (where acceptance is low, none
        # does): what a tree of n nodes costs at least against what it yields at most, at any depth
        budgets = [n for n in budgets if n == 1 or self.table[n] < base * E_max]
        E_hi, f_lo = _any_depth_values(acc, max(budgets)), self.costs.least()
        tree_lo = self._draft_lo + self._oh_lo  # what a tree costs beyond T(n), at least
        budgets = [n for n in budgets if n == 1 or (self.table[n] + tree_lo) * f_lo < base * E_hi[n - 1]]
        if max(budgets) <= 1 or not mass > 0:
            return None
        if len(budgets) > 2:  # staged: the DP to the largest budget only where its trees could win
            found, best_spt = self._search_tables(acc, budgets[:-1], D, f_lo, base)
            n = budgets[-1]
            # its trees cost (T(n) + a draft forward + the overhead) x f_lo a step at least and yield
            # E_hi at most: none of them beats what the smaller budgets found (the DP's cost grows as
            # n^2: a re-plan around a 256-node tree spent 27 ms of its 28 on the 512-node tables)
            if (self.table[n] + tree_lo) * f_lo > best_spt * E_hi[n - 1]:
                return found
        return self._search_tables(acc, budgets, D, f_lo, base)[0]

    def _search_tables(self, acc: Sequence[float], budgets: list[int], D: int, f_lo: float, base: float
                       ) -> tuple[tuple | None, float]:
        """:meth:`_search_python`'s search over ``budgets`` (filtered; ascending, the first 1) on the
        DP tables to their largest: (the best tree as (budget, levels, parents, depth, rank) or None,
        its seconds per token, ``base`` where none beats plain decoding)."""
        N = max(budgets)
        tables = tables_for(acc, N, D)
        best, best_spt = None, base  # plain decoding first: a tree must beat it
        bounds = []
        for i, n in enumerate(budgets[1:]):
            for d in range(2, min(D, tables.d_eff) + 1):
                E = tables.value(d, n)
                # a candidate whose E a smaller budget or depth reaches is that candidate's tree at a
                # higher charge; one that is new uses exactly d levels: d - 1 draft forwards at least
                if E <= tables.value(d - 1, n) or E <= tables.value(d, budgets[i]):
                    continue
                lo = (self.table[n] + (d - 1) * self._draft_lo + self._oh_lo) * f_lo / E  # its s/token, at least
                bounds.append((lo, n, d))
        for lo, n, d in sorted(bounds):
            if lo >= best_spt:
                break
            # charged from the rebuilt tree's shape and the DP's E (a TreePlan only for the winner)
            parents, depth, rank = tables.rebuild(min(n, tables.N), d)
            if len(depth) < 2:
                continue
            spt = self._step_s(n, len(depth), _level_widths(depth)) * self.costs.factor(len(depth)) / tables.value(d, n)
            if spt < best_spt:
                best, best_spt = (n, d, tuple(parents), tuple(depth), tuple(rank)), spt
        return best, best_spt

    def observe(self, plan: TreePlan, paths: Sequence[Sequence[int]], nums: Sequence[int], step_s: float,
                keep: Sequence[int] | None = None, peeked: bool = False,
                first: Sequence[Sequence[float]] | None = None) -> None:
        """One finished step of ``plan``: the rows' accepted paths and lengths, the step's time, and
        the rows that go on (None: all). ``peeked``: a plain step with a peek; ``plan`` is then the
        star it drafted and the paths its played-out verification's (its time is not a plain step's).
        ``first``: :meth:`AcceptanceEstimate.observe`'s."""
        if plan.num_nodes > 1:  # a plain step without a peek observes nothing (and forgets nothing)
            self.est.observe(plan, paths, nums, first)
        if self.config.live_costs and not self._fresh and not peeked:
            self.costs.observe(plan.num_nodes, self._predicted, step_s)
            self._check_seen += self._check is not None
        self._fresh = False
        self._tree_steps = 0 if plan.num_nodes == 1 else self._tree_steps + (not peeked)
        if peeked:  # the next peek: soon after one that saw the first child accepted, later after one that did not
            cfg, hit = self.config, any(len(p) > 1 and p[1] == 1 for p in paths)  # (the star's node 1)
            self._gap = cfg.peek_every if hit else min(2 * self._gap, cfg.peek_every * cfg.peek_backoff)
            self._next_peek = self._steps + self._gap
        self._steps += 1
        if keep is not None and len(keep) < len(nums):
            self.est.keep_rows(keep)

    def continued(self, rows: int) -> "Replanner":
        """The re-planner of the same generator's next call (``rows`` rows, module docstring:
        *across calls*): this one's plan, live costs and memo, its estimate carried."""
        new = copy.copy(self)
        new.est, new.stats = self.est.continued(rows), ReplanStats()
        new.stats.history.append((0, self.plan.num_nodes, self.plan.num_levels))
        new._steps, new._fresh, new._next_peek = 0, True, max(0, self._next_peek - self._steps)  # peeks: on schedule
        return new

    def peek(self) -> TreePlan | None:
        """The star to draft beside the step :meth:`next_plan` just chose when plain decoding is
        due a peek (module docstring: *peeks*; no cost check running); else None."""
        checking = self._check is not None  # a cost check times plain steps
        return self._star if self.plan.num_nodes == 1 and self._steps >= self._next_peek and not checking else None

    def _wins(self, plan: TreePlan, est: list[list[float]], p1: float, sd: float, lo=None) -> bool:
        """Whether ``plan`` replaces the current one (module docstring: *re-planning*): predicted
        ``min_gain`` faster per token under the estimate ``est`` ([L][K]) and with its ``p_1`` moved
        ``switch_sd`` standard deviations down and up; from plain decoding, under ``est`` alone.
        ``lo`` (``plain_sd``): the pessimistic estimate that a tree and plain decoding are weighed on."""
        k, keep = (self.config.switch_sd if self.plan.num_nodes > 1 else 0.0), 1.0 - self.config.min_gain
        # seconds_per_token's arithmetic, each plan's corrected step charged once
        new, cur = (self.predicted_step_s(plan) * self.costs.factor(plan.num_nodes),
                    self._predicted * self.costs.factor(self.plan.num_nodes))
        if lo is not None and (plan.num_nodes == 1) != (self.plan.num_nodes == 1):  # a tree against plain
            return new / _tokens(plan, lo) < keep * (cur / _tokens(self.plan, lo))  # decoding: its pessimistic E
        for shift in (0.0, -k, k) if k else (0.0,):
            acc = _as_acceptance(self.est.lists(p1=max(0.0, p1 + shift * sd)) if shift else est)
            if new / _tokens(plan, acc) >= keep * (cur / _tokens(self.plan, acc)):
                return False
        return True

    def next_plan(self) -> TreePlan:
        """The plan of the next step: re-solved every ``every`` steps or when p_1 moved (checked
        after tree steps; in plain decoding only every ``every`` steps, the peeks' evidence), and
        at the end of a cost check, which resumes the tree it interrupted unless plain decoding wins."""
        resumed = self._check is not None
        if resumed:
            if self._check_seen < self.costs.window:
                return self.plan
            self._switch(self._check, change=False)  # the check's plain run is timed: back to the tree ...
            self._check = None
        elif self._steps == 0 or (self._steps % self.config.every and self.plan.num_nodes == 1):
            return self.plan
        due = self._steps % self.config.every == 0 or resumed  # ... and re-planned at once
        p1, sd = self.est.p1()  # the whole vector only when re-planning
        if not due and (self._planned_p1 is None or abs(p1 - self._planned_p1) <= 2 * sd):
            return self.plan
        t0 = time.perf_counter()
        est = self.est.lists()  # [L][K]
        plan = self._candidate(est)
        self._planned_p1 = p1
        self.stats.replans += 1
        lo = (_as_acceptance(self.est.lowered(self.config.plain_sd))  # a tree against plain decoding: pessimistic
              if self.config.plain_sd and (plan.num_nodes > 1 or self.plan.num_nodes > 1) else None)
        if lo is not None and plan.num_nodes > 1 and \
                self.seconds_per_token(plan, lo) >= self.seconds_per_token(self._plain, lo):
            plan = self._plain  # no tree beats plain decoding on the pessimistic estimate
        if plan.parents != self.plan.parents and self._wins(plan, est, p1, sd, lo):
            self._switch(plan)
        elif self._check_due(est):
            self._check, self._check_seen = self.plan, 0
            self.stats.cost_checks += 1
            self._switch(self._plain, change=False)
        self.stats.replan_s += time.perf_counter() - t0
        return self.plan

    def _candidate(self, est: list[list[float]]) -> TreePlan:
        """The tree a re-plan weighs against the current plan: the first step's (``trees="planned"``:
        no DP), else the DP's best for ``est`` ([L][K]) rounded down to ``1 / quantum`` (memoised):
        of any size and depth around the current plan, or (``trees="size"``) of the first step's
        size to one level deeper at most."""
        if self.config.trees == "planned" or (self.config.trees == "size" and self._start.num_nodes == 1):
            return self._start
        q = self.config.quantum
        levels = tuple(tuple(math.floor(x * q) for x in level) for level in est)  # the estimate, rounded down
        key = (levels, *(round(f * q) for f in self.costs.factors((1, 2, 8, 32))),
               self.plan.num_nodes, self.plan.num_levels)  # the search is around the current plan
        if key not in self._memo:
            acc = _as_acceptance([[k / q for k in lv] for lv in levels])
            self._memo[key] = self._solve(acc, self.plan) if self.config.trees == "any" else self._solve_size(acc)
        return self._memo[key]

    def _solve_size(self, acc: Sequence[float]) -> TreePlan:
        """The best tree of the first step's budget and at most one level more than it for ``acc``
        (one budget's DP); the first step's tree where none beats plain decoding (a re-plan weighs
        plain decoding itself) or its budget is not one the profile timed."""
        n, D = self._start.budget, min(self.config.max_depth, self._start.num_levels + 1)
        if n not in self.table:
            return self._start
        found = self._search(acc, [1, n], D)
        if found is None or found[2] == self._start.parents:
            return self._start
        return TreePlan.of_search(acc, *found)

    def _switch(self, plan: TreePlan, change: bool = True) -> None:
        """``plan`` from the next step on (``change``: a re-plan's decision, counted)."""
        self.stats.plan_changes += change
        self.stats.history.append((self._steps, plan.num_nodes, plan.num_levels))
        self.plan, self._predicted, self._fresh = plan, self.predicted_step_s(plan), True
        if plan.num_nodes == 1 and change:  # a drop
            self._restart_peeks()

    def _restart_peeks(self) -> None:
        """Peeks from here on as after a drop: the ``peek_every``-th plain step from now, then the
        gaps of the module docstring (*peeks*)."""
        self._gap, self._next_peek = self.config.peek_every, self._steps + self.config.peek_every - 1

    def _check_due(self, est: list[list[float]]) -> bool:
        """Whether a cost check starts now (module docstring): a tree has run ``check_every``
        steps since plain decoding last ran, and is predicted less than ``check_margin`` faster."""
        cfg = self.config
        if not (cfg.live_costs and cfg.check_every and self.plan.num_nodes > 1 and self._tree_steps >= cfg.check_every):
            return False
        tree = self._predicted * self.costs.factor(self.plan.num_nodes) / _tokens(self.plan, _as_acceptance(est))
        return tree > (1.0 - cfg.check_margin) * self.predicted_step_s(self._plain) * self.costs.factor(1)


def default_config(sampling, **knobs) -> AdaptiveConfig:
    """What ``adaptive=True`` re-plans with for ``sampling`` (``SamplingParams``; ``knobs``: other
    fields): greedy requests any tree the DP picks, sampled ones a tree of their first step's size
    to one level deeper at most, or plain decoding (``trees="size"``, module docstring)."""
    return AdaptiveConfig(trees="any" if sampling.greedy else "size", **knobs)


def adaptive_costs(config: AdaptiveConfig, target, draft, sampling, device) -> AdaptiveConfig | None:
    """``config`` with the cost model re-planning starts from: its own, or this machine's cached,
    loop-calibrated profile of the pair for ``sampling``'s kind of setting; None when there is none
    (the plan then stays static: said once in the log)."""
    if config.latency is not None:
        return config
    prof = find_cached_profile(target, draft, device, next(target.parameters()).dtype)
    latency, overhead, note = calibration_for(prof, (sampling.temperature, sampling.top_k, sampling.top_p))
    if latency is None:
        say_once(f"adaptive re-planning: {note}: the plan stays static; `sequoia-kernels demo` (or `make demo`) "
                 "profiles and calibrates this machine once")
        return None
    return replace(config, latency=latency, overhead_s=overhead)
