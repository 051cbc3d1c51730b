"""Online re-planning (``sequoia_decoding.adaptive``): the live acceptance estimate, the re-planner's
choices against the offline planner, and the loop with a tree that changes every step (plain
decoding included): greedy output unchanged, both caches right after plain steps, sampling exact."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch

import tiny_models
from conftest import assert_pairs_follow, filtered_two_token_distribution, pair_counts
from tiny_models import greedy_reference

from sequoia_decoding.adaptive import PEEK_CHILDREN, AcceptanceEstimate, AdaptiveConfig, Replanner, _as_acceptance, \
    _hazards
from sequoia_decoding.feature_drafter import FeatureDrafter
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import chain_tree, choose_plan, kxd_tree, plan_tree
from sequoia_decoding.tree import tree_from_parents

VOCAB = 61
# a CPU-like profile: T(n) grows with n, a draft curve by width, the loop's time outside the forwards
LATENCY = {"draft_step_s": 0.006, "target_latency_s": {1: 0.040, 2: 0.041, 4: 0.043, 8: 0.048, 16: 0.056, 32: 0.070,
                                                       64: 0.095, 128: 0.15},
           "draft_latency_s": {1: 0.006, 4: 0.0065, 16: 0.008, 64: 0.012}}
OVERHEAD = {1: 0.001, 4: 0.003, 16: 0.006, 64: 0.012}


def simulate_paths(plan, hazards, steps: int, rng: random.Random, deep_hazards=None):
    """Accepted paths of ``steps`` steps of ``plan`` when rank k is accepted with hazard h_k
    (``deep_hazards``: below the root's children, when given)."""
    out = []
    for _ in range(steps):
        path, node = [0], 0
        while True:
            kids = plan.children(node)
            hz = hazards if node == 0 or deep_hazards is None else deep_hazards
            nxt = next((c for k, c in enumerate(kids) if k < len(hz) and rng.random() < hz[k]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        out.append(path)
    return out


def test_the_estimate_recovers_the_acceptance_vector_it_observes():
    """Censored observations (the last node's children all rejected) give the hazards back: with
    no forgetting and a weak prior the estimate is the true vector on the ranks the tree tries,
    and the prior's on the ranks it never tries."""
    true_p = [0.5, 0.2, 0.1, 0.05]
    prior = [0.3, 0.1, 0.05, 0.05, 0.2]
    left, hz = 1.0, []
    for p in true_p:
        hz.append(p / left)
        left -= p
    plan = plan_tree(true_p, 14, 4)
    assert max(plan.children_counts()) == 4
    est = AcceptanceEstimate(prior, rows=2, strength=1.0, decay=1.0)
    rng = random.Random(0)
    for _ in range(3000):
        paths = simulate_paths(plan, hz, 2, rng)
        est.observe(plan, paths, [len(p) for p in paths])
    got = est.vector()
    assert max(abs(a - b) for a, b in zip(got[:4], true_p)) < 0.02, got
    # rank 5 is never tried: its hazard stays the prior's (0.2 / (1 - 0.5)), times the live survival
    assert abs(got[4] - 0.4 * (1 - sum(got[:4]))) < 1e-6
    assert abs(est.vector(0)[0] - 0.5) < 0.03 and abs(est.vector(1)[0] - 0.5) < 0.03
    p1, sd = est.p1()
    assert p1 == pytest.approx(got[0], abs=1e-12) and 0 < sd < 0.01
    est.keep_rows([1])
    assert est.evidence.shape[1] == 1


class _EagerEstimate:
    """The estimate as first written (numpy, every sum decayed every step): the reference of
    :class:`AcceptanceEstimate`'s lists and lazy forgetting."""

    def __init__(self, est: AcceptanceEstimate, rows: int):
        self.h0, self.s, self.decay, self.floor = np.array(est.h0), est.strength, est.decay, est.floor
        self.t, self.h = np.zeros((rows,) + est.prior.shape), np.zeros((rows,) + est.prior.shape)
        self.carried = np.zeros((2,) + est.prior.shape)

    def observe(self, plan, paths, nums, first=None):
        from sequoia_decoding.adaptive import path_observations

        self.t *= self.decay
        self.h *= self.decay
        self.carried *= self.decay
        self.s = max(self.floor, self.s * self.decay)
        (L, K), children = self.h0.shape, plan.children_counts()
        for r, (path, num) in enumerate(zip(paths, nums)):
            ranks, tried = path_observations(plan, children, path, num)
            for j, k in enumerate(ranks):
                self.t[r, min(j, L - 1), :min(k, K)] += 1.0
                if k <= K:
                    self.h[r, min(j, L - 1), k - 1] += 1.0
            self.t[r, min(len(ranks), L - 1), :min(tried, K)] += 1.0
            for j in range(len(ranks) + (tried > 0) if first is not None else 0):
                self.h[r, min(j, L - 1), 0] += first[r][j] - (j < len(ranks) and ranks[j] == 1)

    def keep_rows(self, keep):
        done = sorted(set(range(len(self.t))) - set(keep))
        self.carried += np.stack((self.t[done].sum(0), self.h[done].sum(0)))
        self.t, self.h = self.t[list(keep)], self.h[list(keep)]

    def vectors(self, row=None):
        rows = slice(None) if row is None else [row]
        t, h = self.carried + np.stack((self.t[rows].sum(0), self.h[rows].sum(0)))
        hz = (self.s * self.h0 + h) / (self.s + t)
        return hz * np.cumprod(np.concatenate((np.ones((len(hz), 1)), 1.0 - hz[:, :-1]), 1), 1)


def _in_lockstep(ests, plan, paths, first, keep=None) -> int:
    """One step observed by every estimate of ``ests``, then (``keep``) only those rows go on; the rows left."""
    for e in ests:
        e.observe(plan, paths, [len(p) for p in paths], first)
        if keep is not None:
            e.keep_rows(keep)
    return len(keep) if keep is not None else len(paths)


@pytest.mark.parametrize("decay", [0.5, 0.96, 1.0])
def test_the_lazy_estimate_is_the_eager_one(decay):
    """Lists and lazy forgetting (the stored sums scaled by a growing unit, rescaled before it
    overflows: decay 0.5 rescales every ~330 steps) give the eagerly decayed numpy estimate, per
    row and pooled, with first-child probabilities, finished rows and a carried next call."""
    from sequoia_decoding.planner import LevelAcceptance

    rng = random.Random(int(decay * 100))
    plan = plan_tree(LevelAcceptance([0.5, 0.2, 0.1], [0.3, 0.2]), 12, 4)
    est = AcceptanceEstimate(LevelAcceptance([0.4, 0.1, 0.05, 0.05], [0.3, 0.1, 0.05]), rows=3,
                             strength=8.0, decay=decay, floor=2.0)
    ref = _EagerEstimate(est, 3)
    rows = 3
    for step in range(900):
        paths = simulate_paths(plan, [0.5, 0.3, 0.2], rows, rng, [0.3, 0.2])
        first = [[rng.random() for _ in range(len(p))] for p in paths] if step % 3 else None
        rows = _in_lockstep((est, ref), plan, paths, first, keep=[0, 2] if step == 500 else None)
        if step in (20, 499, 899):
            for row in (None, *range(rows)):
                np.testing.assert_allclose(est.array(row), ref.vectors(row), rtol=1e-9, atol=1e-12)
            assert est.p1()[0] == pytest.approx(ref.vectors()[0, 0] / 1.0, rel=1e-9)
    assert est._unit < 1e100 and (decay > 0.5 or est._unit < 2.0 ** 400)
    nxt = est.continued(2)
    np.testing.assert_allclose(nxt.array(), est.array(), rtol=1e-12)
    np.testing.assert_allclose(nxt.carried, ref.carried + np.stack((ref.t.sum(0), ref.h.sum(0))), rtol=1e-9,
                               atol=1e-12)


def test_the_pruning_bound_is_an_upper_bound():
    """:func:`adaptive._any_depth_values` (the re-planner skips the DP for budgets it rules out)
    is at least the DP's E at every budget and depth, for unsorted vectors and per-level ones."""
    from sequoia_decoding.adaptive import _any_depth_values
    from sequoia_decoding.dp import tables_for
    from sequoia_decoding.planner import LevelAcceptance

    rng = np.random.default_rng(5)
    for trial in range(60):
        K = int(rng.integers(1, 9))
        v = (rng.dirichlet(np.ones(K + 1))[:K] * rng.uniform(0.05, 1.0)).tolist()
        w = (rng.dirichlet(np.ones(K + 1))[:K] * rng.uniform(0.05, 1.0)).tolist()
        acc = LevelAcceptance(v, w) if trial % 2 else tuple(v)
        E_hi = _any_depth_values(acc, 24)
        for n in (2, 3, 5, 8, 13, 24):
            for d in (2, 3, 5, 8):
                assert tables_for(acc, n, d).value(d, n) <= E_hi[n - 1] + 1e-12, (acc, n, d)
    chain = _any_depth_values((0.5,), 4)  # one rank: the chain, every node's product is the best left
    assert chain == pytest.approx([1.0, 1.5, 1.75, 1.875])


@pytest.mark.parametrize("scale", [0.05, 0.1, 0.15, 0.2, 0.3, 0.6])
@pytest.mark.parametrize("per_level", [False, True])
def test_near_break_even_the_first_plan_is_the_offline_planners(scale, per_level):
    """Where acceptance is low the re-planner rules budgets out before any DP: it still picks
    what the offline planner picks (the same predicted seconds per token), plain decoding
    included."""
    from sequoia_decoding.planner import LevelAcceptance

    first = [scale * x for x in (0.6, 0.25, 0.1, 0.05)]
    assert_first_plan_is_the_offline_planners(LevelAcceptance(first, [0.3, 0.1, 0.05]) if per_level else first)


def test_a_head_is_estimated_per_level():
    """A LevelAcceptance prior (a feature head) is estimated per level: the root's children and
    the deeper nodes each recover their own vector, and the re-planner plans with both."""
    from sequoia_decoding.planner import LevelAcceptance

    first, deep = [0.5, 0.2, 0.1], [0.25, 0.15, 0.1]

    def hazards(p):
        left, out = 1.0, []
        for x in p:
            out.append(x / left)
            left -= x
        return out

    plan = plan_tree(LevelAcceptance(first, deep), 24, 4)
    assert max(plan.children_counts()[1:]) >= 3 and plan.children_counts()[0] >= 3
    est = AcceptanceEstimate(LevelAcceptance([0.3, 0.1, 0.05], [0.3, 0.1, 0.05]), rows=1, strength=1.0, decay=1.0)
    rng = random.Random(1)
    for _ in range(4000):
        paths = simulate_paths(plan, hazards(first), 1, rng, hazards(deep))
        est.observe(plan, paths, [len(p) for p in paths])
    got = est.vector()
    assert isinstance(got, LevelAcceptance)
    assert max(abs(a - b) for a, b in zip(got, first)) < 0.03, got
    assert max(abs(a - b) for a, b in zip(got.deep, deep)) < 0.03, got.deep
    assert est.p1()[0] == pytest.approx(got[0], abs=1e-12)
    r = Replanner(LevelAcceptance(first, deep), LATENCY, OVERHEAD, 1, AdaptiveConfig(max_depth=8))
    hp = choose_plan(LevelAcceptance(first, deep), LATENCY["draft_step_s"], LATENCY["target_latency_s"], max_depth=8,
                     step_overhead_s=OVERHEAD, draft_latency_s=LATENCY["draft_latency_s"])
    assert r.predicted_step_s(r.plan) / r.plan.expected_tokens == pytest.approx(hp.seconds_per_token, rel=1e-9)
    assert r.plan.acceptance.deep == tuple(deep)


@pytest.mark.parametrize("acc", [
    [0.4, 0.12, 0.05, 0.03, 0.02, 0.02],
    [0.8, 0.1, 0.05],
    [0.1, 0.05],
    [0.6, 0.2, 0.1, 0.05, 0.02, 0.01, 0.01],
    [0.2, 0.15, 0.12, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.035, 0.03, 0.025],
])
def test_the_first_plan_is_the_offline_planners(acc):
    """Without a current plan the re-planner searches the whole space with the offline planner's
    cost model (branch and bound over exact E): the same predicted seconds per token."""
    assert_first_plan_is_the_offline_planners(acc)


def assert_first_plan_is_the_offline_planners(acc) -> None:
    hp = choose_plan(acc, LATENCY["draft_step_s"], LATENCY["target_latency_s"], max_depth=12,
                     step_overhead_s=OVERHEAD, draft_latency_s=LATENCY["draft_latency_s"])
    r = Replanner(acc, LATENCY, OVERHEAD, 1, AdaptiveConfig(max_depth=12))
    spt = (r.predicted_step_s(r.plan) / r.plan.expected_tokens) if r.plan.num_nodes > 1 else hp.baseline_s
    assert spt == pytest.approx(hp.seconds_per_token, rel=1e-9), (r.plan.num_nodes, hp.budget, hp.max_depth)
    assert (r.plan.num_nodes == 1) == (hp.plan.num_nodes == 1)


@pytest.mark.parametrize("backoff", [1, 4])
def test_falls_back_to_plain_decoding_and_peeks_bring_a_tree_back(backoff):
    """Nothing accepted: the re-planner drops to plain decoding. A plain step observes nothing, so
    no tree comes back blind; the ``peek_every``-th plain step peeks (the root's star drafted, its
    verification played out), then after gaps doubling up to ``peek_every * peek_backoff`` while
    peeks see nothing accepted, and plain decoding stays; once they see the first child accepted
    the gap is ``peek_every`` again and a tree returns within a few re-plans."""
    r = Replanner([0.6, 0.2, 0.1], LATENCY, OVERHEAD, 2, AdaptiveConfig(
        every=2, decay=0.95, prior_strength=2.0, live_costs=False, peek_every=3, peek_backoff=backoff))
    assert r.plan.num_nodes > 1
    peeks = []

    def step(accepted: bool):
        steps = r._steps
        plan, star = r.next_plan(), r.peek()
        assert star is None or plan.num_nodes == 1
        path = [0, 1] if accepted else [0]
        if star is not None:
            peeks.append(steps)
            r.observe(star, [path, path], [len(path)] * 2, 0.05, peeked=True)
        else:
            r.observe(plan, [path, path] if plan.num_nodes > 1 else [[0], [0]], [len(path) if plan.num_nodes > 1
                                                                               else 1] * 2, 0.05)
        return plan

    for _ in range(340):  # every row rejects every child, and peeks see nothing accepted
        plan = step(False)
    assert plan.num_nodes == 1 and [n for _, n, _ in r.stats.history].count(1) == 1  # one drop, never undone
    drop = r.stats.history[-1][0]  # the first plain step
    gaps = np.diff([drop - 1] + peeks).tolist()
    assert gaps == [min(3 * 2 ** i, 3 * backoff) for i in range(len(gaps))], gaps[:6]
    before = len(peeks)
    for n in range(60):  # peeks see the first child accepted
        plan = step(True)
        if plan.num_nodes > 1:
            break
    assert plan.num_nodes > 1 and n < 40 + 3 * backoff, n
    assert np.diff(peeks[before:]).tolist() == [3] * (len(peeks) - before - 1), peeks[before:]  # looks often again
    assert r.stats.plan_changes >= 2 and r.stats.replans >= r.stats.plan_changes
    assert r.stats.replan_ms > 0 and r.stats.history[0][0] == 0 and r.stats.history[1][0] > 0
    for _ in range(200):  # nothing accepted again: a second drop restarts the gaps at peek_every
        plan = step(False)
    second = r.stats.history[-1][0]
    assert plan.num_nodes == 1 and second > drop
    assert [p for p in peeks if p >= second][:2] == [second + 2, second + 2 + min(6, 3 * backoff)]


def _one_row_steps(r: Replanner, n: int, peek_path: list[int]) -> tuple[list[int], list[int]]:
    """``n`` steps of ``r`` on one row that accepts nothing on its own steps and ``peek_path`` on
    its peeks: (each step's node count, the steps at which it peeked)."""
    nodes, peeks = [], []
    for _ in range(n):
        steps = r._steps
        plan, star = r.next_plan(), r.peek()
        path = [0] if star is None else peek_path
        nodes.append(plan.num_nodes)
        peeks += [steps] if star is not None else []
        r.observe(star or plan, [path], [len(path)], 0.05, peeked=star is not None)
    return nodes, peeks


@pytest.mark.parametrize("child, gaps", [(1, [3, 3, 3, 3]), (2, [3, 6, 12, 12]), (None, [3, 6, 12, 12])])
def test_peeks_come_often_while_they_see_the_first_child_accepted(child, gaps):
    """The gap after a peek is ``peek_every`` when its star's first child was accepted, else twice
    the last one (up to ``peek_every * peek_backoff``): a later child or none counts as a miss."""
    plain = tree_from_parents((-1,), [0.6, 0.2, 0.1])
    r = Replanner([0.6, 0.2, 0.1], LATENCY, OVERHEAD, 1, AdaptiveConfig(
        every=2, live_costs=False, peek_every=3, peek_backoff=4, min_gain=0.9), start=plain)
    nodes, peeks = _one_row_steps(r, 40, [0] if child is None else [0, child])
    assert nodes == [1] * 40  # min_gain 0.9: no tree wins
    assert np.diff([-1] + peeks).tolist()[:4] == gaps, peeks


def test_the_peek_schedule_carries_across_calls():
    """A generator's next call continues the last one's peeks where they stood (``carry``): plain
    decoding that outlasted its peeks is looked at as rarely in the next call."""
    r = Replanner([0.6, 0.2, 0.1], LATENCY, OVERHEAD, 1, AdaptiveConfig(
        every=2, decay=0.95, prior_strength=2.0, live_costs=False, peek_every=3, peek_backoff=4))
    for call in range(4):
        nodes, peeks = _one_row_steps(r, 40, [0])
        if call:  # plain all through: one peek every 12 steps, counted on from the last call's
            assert nodes[-1] == 1 and np.diff([last - 40] + peeks).tolist() == [12] * len(peeks), (last, peeks)
        last = peeks[-1]
        r = r.continued(1)


def _one_request(acc, start, config: AdaptiveConfig, phases, rng) -> tuple[list, Replanner]:
    """One request's plans step by step (peeks played) through ``phases`` [(hazards, steps)], with
    a re-planner from the prior ``acc`` and the first plan ``start``; and the re-planner."""
    r = Replanner(acc, LATENCY, OVERHEAD, 1, config, start=start)
    plans = []
    for hazards, steps in phases:
        for _ in range(steps):
            plan, star = r.next_plan(), r.peek()
            plans.append(plan)
            ran = star if star is not None else plan
            path = simulate_paths(ran, hazards, 1, rng)[0] if ran.num_nodes > 1 else [0]
            r.observe(ran, [path], [len(path)], 0.05, peeked=star is not None)
    return plans, r


@pytest.mark.parametrize("seed", [0, 1])
def test_planned_trees_only_drop_to_plain_decoding_and_climb_back(seed):
    """``trees="planned"``: re-plans run the first step's tree or plain decoding, nothing else.
    Where acceptance is the prior's the tree never changes (its steps are the static plan's);
    where nothing is accepted it drops to plain decoding, and peeks bring the same tree back when
    the first child is accepted again. The same run with ``trees="any"`` picks other trees."""
    acc, rng = [0.6, 0.2, 0.1], random.Random(seed)
    start = plan_tree(acc, 16, 4)

    def run(trees, phases):
        plans, r = _one_request(acc, start, AdaptiveConfig(every=2, decay=0.95, prior_strength=4.0, live_costs=False,
                                                           peek_every=3, trees=trees), phases, rng)
        return [p.parents for p in plans], r

    shapes, r = run("planned", [(_hazards(acc).tolist(), 200)])
    assert set(shapes) == {start.parents} and r.stats.plan_changes == 0
    shapes, r = run("planned", [([0.0] * 3, 60), ([0.95] * 3, 120)])
    assert set(shapes) == {start.parents, (-1,)}, {len(s) for s in set(shapes)}
    dropped = shapes.index((-1,))
    assert dropped < 60 and shapes[-1] == start.parents and start.parents in shapes[dropped:]
    shapes, _ = run("any", [([0.0] * 3, 60), ([0.95] * 3, 120)])
    assert set(shapes) - {start.parents, (-1,)}


@pytest.mark.parametrize("seed", [0, 1])
def test_size_trees_keep_the_first_size_within_one_level(seed):
    """``trees="size"``: re-plans run trees of the first step's node count and at most one level
    more (or plain decoding). Where acceptance is the prior's the tree stays; where the first
    child is accepted but nothing deeper, a tree of fewer levels of the same size takes over (each
    level's draft forward and sampling saved); where acceptance is high, one of a level more and
    never more nodes (``trees="any"`` grows)."""
    acc, rng = [0.7, 0.2, 0.1], random.Random(seed)
    start = plan_tree(acc, 4, 3)  # the prior's best of 4 nodes, (4, 2) ~7% slower there

    def run(trees, phases):  # the default prior and memory: a near-tie is not swapped on noise
        return _one_request(acc, start, AdaptiveConfig(every=2, live_costs=False, peek_every=3, trees=trees), phases,
                            rng)

    def kept(plans):
        return all(p.num_nodes <= start.num_nodes and p.num_levels <= start.num_levels + 1 for p in plans)

    plans, r = run("size", [(_hazards(acc).tolist(), 200)])
    assert {p.parents for p in plans} == {start.parents} and r.stats.plan_changes == 0
    low = _hazards([0.35, 0.1, 0.05]).tolist()  # a (4, 2) is predicted ~6% faster, plain decoding ~15% slower
    plans, r = run("size", [(low, 200)])
    assert kept(plans) and (plans[-1].num_nodes, plans[-1].num_levels) == (4, 2) and r.stats.plan_changes >= 1
    for phases in ([([0.95] * 3, 200)], [([0.0] * 3, 60), ([0.95] * 3, 120)]):
        plans, _ = run("size", phases)  # a 4-node chain of 4 levels (the 4-node tree of most levels)
        assert kept(plans) and (plans[-1].num_nodes, plans[-1].num_levels) == (4, 4), plans[-1]
    plans, _ = run("any", [([0.95] * 3, 200)])
    assert any(p.num_nodes > start.num_nodes for p in plans)


def _wins_everywhere(r, cur, plan, p1, sd, k):
    """Whether ``plan`` is predicted ``min_gain`` faster than ``cur`` at the estimate and with p_1 moved k sd either way."""
    mg = r.config.min_gain
    accs = [r.est.vector()] + [_as_acceptance(r.est.lists(p1=max(0.0, p1 + s * sd))) for s in (-k, k)]
    return all(r.seconds_per_token(plan, a) < (1 - mg) * r.seconds_per_token(cur, a) for a in accs)


@pytest.mark.parametrize("switch_sd", [0.5, 1.0])
def test_plain_decoding_replaces_a_tree_only_if_it_wins_with_p1_higher(switch_sd):
    """Dropping to plain decoding (which only peeks undo) needs plain predicted ``min_gain`` faster
    than the tree even with p_1 ``switch_sd`` standard deviations above its estimate: while acceptance falls,
    the tree outlives the steps where the estimate alone would have dropped it, and every drop
    holds under the raised p_1; with the evidence in, it drops (``plain_sd`` 0: with it, a tree is
    weighed against plain decoding on the pessimistic estimate, the test below)."""
    r = Replanner([0.6, 0.2, 0.1], LATENCY, OVERHEAD, 1, AdaptiveConfig(every=1, live_costs=False, prior_strength=2.0,
                                                                        decay=0.95, switch_sd=switch_sd, plain_sd=0.0))
    mg, kept = r.config.min_gain, 0
    assert r.plan.num_nodes > 1
    for step in range(80):  # every child rejected: p_1 falls, its standard deviation with it
        cur, acc = r.plan, r.est.vector()
        plain_spt = (r.table[1] + r._oh(1)) * r.costs.factor(1)
        p1, sd = r.est.p1()
        point_drops = r._solve(acc, cur).num_nodes == 1 and plain_spt < (1 - mg) * r.seconds_per_token(cur, acc)
        plan = r.next_plan()
        if plan.num_nodes == 1:
            assert plain_spt < (1 - mg) * r.seconds_per_token(cur, _as_acceptance(r.est.lists(p1=p1 + switch_sd * sd)))
            break
        kept += point_drops
        r.observe(plan, [[0]], [1], 0.05)
    assert plan.num_nodes == 1 and kept >= 1, (step, kept)
    hi = _as_acceptance(r.est.lists(p1=0.9))  # the raised hazard, the rest of the estimate as it is
    assert hi[0] == pytest.approx(0.9) and sum(hi) <= 1.0 + 1e-12


@pytest.mark.parametrize("switch_sd", [0.5, 1.0])
def test_a_tree_gives_way_to_another_only_if_it_wins_with_p1_lower_and_higher(switch_sd):
    """A tree replaces the current one only when predicted ``min_gain`` faster at the estimate and
    with p_1 ``switch_sd`` standard deviations below and above it: while a request's acceptance
    climbs above the offline vector's, the current tree outlives the steps where the estimate
    alone would have swapped it for a deeper one, every swap holds at both moved estimates, and
    with the evidence in the deeper tree comes (without the rule the first swap comes earlier)."""
    def run(k):
        r = Replanner([0.35, 0.15, 0.1], LATENCY, OVERHEAD, 1, AdaptiveConfig(
            every=1, live_costs=False, prior_strength=8.0, decay=0.95, switch_sd=k))
        rng, start, kept, first = random.Random(5), r.plan, 0, None
        assert start.num_nodes > 1
        for step in range(120):  # the request accepts far more than the prior says
            cur, acc, (p1, sd) = r.plan, r.est.vector(), r.est.p1()
            cand = r._solve(acc, cur)
            point = cand.parents != cur.parents and _wins_everywhere(r, cur, cand, p1, sd, 0.0)
            plan = r.next_plan()
            if plan.parents != cur.parents:
                assert _wins_everywhere(r, cur, plan, p1, sd, k), step
                first = step if first is None else first
            else:
                kept += point
            paths = simulate_paths(plan, [0.8, 0.5, 0.3], 1, rng, deep_hazards=[0.8, 0.5, 0.3])
            r.observe(plan, paths, [len(p) for p in paths], 0.05)
        return r, start, kept, first

    r, start, kept, first = run(switch_sd)
    assert kept >= 1 and first is not None and r.plan.num_levels > start.num_levels, (kept, first)
    _, _, kept0, first0 = run(0.0)
    assert kept0 == 0 and first0 is not None and first0 < first, (first0, first)


def test_the_pessimistic_estimate_lowers_each_hazard_by_its_posterior_sd():
    """``lowered(z)``: every hazard of the batch's estimate minus z standard deviations of its Beta
    posterior (prior pseudo-trials plus the decayed trials), floored at 0; z = 0 is the estimate."""
    from sequoia_decoding.adaptive import _hazards, _vector_of
    from sequoia_decoding.planner import LevelAcceptance

    rng = random.Random(11)
    prior = LevelAcceptance([0.4, 0.1, 0.05, 0.01], [0.3, 0.1, 0.001])
    plan = plan_tree(LevelAcceptance([0.5, 0.2, 0.1], [0.3, 0.2]), 12, 4)
    est = AcceptanceEstimate(prior, rows=2, strength=8.0, decay=0.97, floor=2.0)
    ref = _EagerEstimate(est, 2)
    for _ in range(60):
        paths = simulate_paths(plan, [0.3, 0.2, 0.02], 2, rng, [0.2, 0.1])
        _in_lockstep((est, ref), plan, paths, None)
    t, h = ref.carried + np.stack((ref.t.sum(0), ref.h.sum(0)))
    hz = (ref.s * ref.h0 + h) / (ref.s + t)
    for z in (0.0, 0.5, 2.0):
        lo = np.clip(hz - z * np.sqrt(hz * (1 - hz) / (ref.s + t + 1)), 0.0, None)
        np.testing.assert_allclose(est.lowered(z), [_vector_of(x) for x in lo], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(est.lowered(0.0), est.lists(), rtol=1e-12)
    assert min(_hazards(est.lowered(50.0)).flat) == 0.0


@pytest.mark.parametrize("p1, plain_sd, tree_share", [(0.2, 0.0, (0.8, 1.0)), (0.2, 0.5, (0.0, 0.3)),
                                                      (0.25, 0.5, (0.8, 1.0)), (0.25, 1.0, (0.0, 0.3)),
                                                      (0.6, 0.0, (0.99, 1.0)), (0.6, 1.0, (0.99, 1.0))])
def test_near_break_even_a_tree_must_beat_plain_decoding_pessimistically(p1, plain_sd, tree_share):
    """``plain_sd``: a tree is weighed against plain decoding with its hazards lowered ``plain_sd``
    posterior sds. Here the estimate is unbiased (the rows accept about as the prior says), so the rule
    gives up what the tree truly wins where that is within its margin: the best tree wins 2% at
    p_1 = 0.2 (lost with 0.5 sd), 6% at 0.25 (kept with 0.5, lost with 1), 40% at 0.6 (kept)."""
    rng = random.Random(5)
    cfg = AdaptiveConfig(live_costs=False, plain_sd=plain_sd)
    r = Replanner([p1, 0.06, 0.03], LATENCY, OVERHEAD, 1, cfg, start=plan_tree([p1, 0.06, 0.03], 4, 2))
    trees = 0
    for step in range(400):
        plan = r.next_plan()
        trees += plan.num_nodes > 1 and step >= 100
        peek = r.peek()
        seen = peek or plan
        paths = simulate_paths(seen, [p1, 0.08, 0.05], 1, rng)
        r.observe(seen, paths if seen.num_nodes > 1 else [[0]], [len(paths[0])] if seen.num_nodes > 1 else [1],
                  0.05, peeked=peek is not None)
    assert tree_share[0] <= trees / 300 <= tree_share[1], trees / 300


def _mixture_reference(est: AcceptanceEstimate, ref: "_EagerEstimate", row=None) -> np.ndarray:
    """The doubted prior's estimate from the eager sums (scipy's betaln): the offline prior's and
    the vague prior's (``floor`` pseudo-trials, the same mean) Beta posteriors per rank and level,
    mixed with weights prior x Beta-binomial marginal likelihood of the evidence."""
    from scipy.special import betaln

    rows = slice(None) if row is None else [row]
    t, h = ref.carried + np.stack((ref.t[rows].sum(0), ref.h[rows].sum(0)))
    seen = t > 0
    g, hh = np.clip(ref.h0, 0.001, 0.999), np.clip(h, 0.0, t)

    def log_m(n):
        return np.where(seen, betaln(n * g + hh, n * (1 - g) + t - hh) - betaln(n * g, n * (1 - g)), 0.0).sum()

    hz = (ref.s * ref.h0 + h) / (ref.s + t)
    if seen.any() and ref.s > ref.floor:
        lr = log_m(ref.floor) - log_m(ref.s) + np.log(est.doubt / (1 - est.doubt))
        w = 1.0 / (1.0 + np.exp(-lr))
        hz = np.where(seen, (1 - w) * hz + w * (ref.floor * ref.h0 + h) / (ref.floor + t), hz)
    return hz * np.cumprod(np.concatenate((np.ones((len(hz), 1)), 1.0 - hz[:, :-1]), 1), 1)


def test_the_doubted_prior_is_the_mixture_of_two_priors():
    """``doubt`` > 0: the estimate mixes the offline prior's posterior with a vague prior's (the
    floor's pseudo-trials), each weighted by its marginal likelihood of the evidence (scipy's
    reference above, per row and pooled, with first-child probabilities and finished rows); with
    no evidence it is the offline prior's bit for bit; p1's mean is the mixture's, its sd the
    mixture's (at least either component's spread around the mean)."""
    from sequoia_decoding.planner import LevelAcceptance

    rng = random.Random(11)
    plan = plan_tree(LevelAcceptance([0.5, 0.2, 0.1], [0.3, 0.2]), 12, 4)
    prior = LevelAcceptance([0.4, 0.1, 0.05, 0.05], [0.3, 0.1, 0.05])
    est = AcceptanceEstimate(prior, rows=3, strength=24.0, decay=0.96, floor=2.0, doubt=0.5)
    assert est.lists() == AcceptanceEstimate(prior, rows=3, strength=24.0, decay=0.96, floor=2.0).lists()
    ref, rows = _EagerEstimate(est, 3), 3
    for step in range(120):
        live = [0.1, 0.1, 0.1] if step < 60 else [0.5, 0.3, 0.2]  # contradicting the prior, then not
        paths = simulate_paths(plan, live, rows, rng, [0.3, 0.2])
        first = [[rng.random() * 0.3 for _ in range(len(p))] for p in paths] if step % 2 else None
        rows = _in_lockstep((est, ref), plan, paths, first, keep=[0, 2] if step == 70 else None)
        if step in (3, 12, 59, 119):
            for row in (None, *range(rows)):
                np.testing.assert_allclose(est.array(row), _mixture_reference(est, ref, row), rtol=1e-9, atol=1e-12)
            p1, sd = est.p1()
            assert p1 == pytest.approx(_mixture_reference(est, ref)[0, 0], rel=1e-9)
            assert sd > 0


def test_a_doubted_prior_reads_each_rows_own_evidence_after_rows_finish():
    """Each row's mixture weight is computed once per step; when rows finish and the others are
    renumbered, a row reads its own evidence's weight, not the one its number had before."""
    rng = random.Random(3)
    plan, prior = plan_tree([0.5, 0.2, 0.1], 8, 3), [0.4, 0.1, 0.05]
    est = AcceptanceEstimate(prior, rows=3, strength=24.0, decay=0.96, floor=2.0, doubt=0.5)
    ref = _EagerEstimate(est, 3)
    for _ in range(12):  # row 0 accepts nothing, rows 1 and 2 often
        _in_lockstep((est, ref), plan, [[0]] + simulate_paths(plan, [0.9, 0.5, 0.3], 2, rng), None)
    before = [est.array(r) for r in range(3)]  # every row's weight cached under its number
    for e in (est, ref):
        e.keep_rows([2])
    np.testing.assert_allclose(est.array(0), _mixture_reference(est, ref, 0), rtol=1e-9, atol=1e-12)
    assert not np.allclose(before[0], before[2])


def test_a_doubted_prior_gives_way_sooner_and_holds_where_it_was_right():
    """Where a request contradicts the offline vector, the doubted prior's estimate reaches the
    request's acceptance within a few steps (the prior alone is still halfway after 16 steps);
    where the request accepts as the prior says, the two estimates read the same (the vague
    component has the prior's mean); and the re-planner with the default config drops a tree that
    no longer pays sooner than with ``prior_doubt=0``."""
    prior, plan = [0.46, 0.12, 0.06], tree_from_parents([-1, 0, 0, 0])
    hz_prior = [0.46, 0.12 / 0.54, 0.06 / 0.42]
    for live in ([0.08, 0.05, 0.03], hz_prior):
        errs = {0.0: 0.0, 0.5: 0.0}
        for seed in range(40):
            rng = random.Random(seed)
            ests = {d: AcceptanceEstimate(prior, rows=1, strength=24.0, decay=0.96, floor=2.0, doubt=d) for d in errs}
            for _ in range(16):
                _in_lockstep(ests.values(), plan, simulate_paths(plan, live, 1, rng), None)
            for d, e in ests.items():
                errs[d] += abs(e.p1()[0] - live[0]) / 40
        if live[0] < 0.2:
            assert errs[0.5] < 0.5 * errs[0.0] and errs[0.0] > 0.1, errs
        else:
            assert abs(errs[0.5] - errs[0.0]) < 0.03, errs

    def steps_to_plain(doubt):
        r = Replanner(prior, LATENCY, OVERHEAD, 1, AdaptiveConfig(live_costs=False, prior_doubt=doubt))
        assert r.plan.num_nodes > 1
        rng = random.Random(5)
        for step in range(200):
            plan = r.next_plan()
            if plan.num_nodes == 1:
                return step
            paths = simulate_paths(plan, [0.03, 0.02, 0.01], 1, rng)
            r.observe(plan, paths, [len(p) for p in paths], 0.01)
        return 200

    assert steps_to_plain(0.5) < steps_to_plain(0.0), (steps_to_plain(0.5), steps_to_plain(0.0))


def test_the_prior_is_forgotten_with_the_evidence():
    """The prior's pseudo-trials decay like the observations, down to the floor: after a request's
    first ~1 / (1 - decay) steps the estimate is the request's own, not held halfway to the
    offline vector (with the prior kept whole it would read ~0.25 here), and the re-planner drops
    a tree that no longer pays within one short request."""
    prior, live_h1 = [0.375, 0.12, 0.06], 0.12
    plan = tree_from_parents([-1, 0, 0, 0])
    rng = random.Random(3)
    kept, forgot = (AcceptanceEstimate(prior, rows=1, strength=24.0, decay=0.96, floor=f) for f in (24.0, 2.0))
    means = [0.0, 0.0]  # p1's mean over steps 40..400 (one estimate's noise is ~0.07 at this memory)
    for step in range(400):
        paths = simulate_paths(plan, [live_h1, 0.05, 0.03], 1, rng)
        for i, est in enumerate((kept, forgot)):
            est.observe(plan, paths, [len(p) for p in paths])
            means[i] += est.p1()[0] / 360 if step >= 40 else 0.0
    assert forgot.strength == 2.0 and kept.strength == 24.0
    assert abs(means[1] - live_h1) < 0.03 and means[0] > 0.2, means
    # the default config: a tree planned for the offline vector, a request that accepts almost nothing
    r = Replanner(prior, LATENCY, OVERHEAD, 1, AdaptiveConfig(live_costs=False))
    assert r.plan.num_nodes > 1
    for step in range(64):
        plan = r.next_plan()
        if plan.num_nodes == 1:
            break
        paths = simulate_paths(plan, [0.03, 0.01, 0.01], 1, rng)
        r.observe(plan, paths, [len(p) for p in paths], 0.05)
    assert plan.num_nodes == 1 and step <= 40, step  # 32 before plain decoding needed p_1 + switch_sd * sd to win


def test_a_generators_next_call_continues_its_replanning():
    """``carry``: a generator's next call starts from its last call's plan and evidence (without
    it, from the static plan and the prior); greedy output is the target's either way."""
    from dataclasses import replace

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2, sharpen=3.0)
    draft = tiny_models.tiny_llama(1, vocab=VOCAB, layers=1, sharpen=3.0)
    static, prompts = plan_tree([0.9, 0.05], 16, 6), [[1, 5, 7], [3, 3]]
    cfg = AdaptiveConfig(every=1, decay=0.8, latency=LATENCY, overhead_s=OVERHEAD, live_costs=False)
    for carry in (True, False):
        gen = SequoiaGenerator(target, draft, static, adaptive=replace(cfg, carry=carry), max_length=160)
        first = gen.generate(prompts, max_new_tokens=20, eos_token_id=[])
        last = gen._last_replan
        assert last.plan.parents != static.parents and first.replan.plan_changes >= 1
        pooled = last.est.carried + last.est.evidence.sum(1)  # the call's evidence
        assert pooled[0].sum() > 0
        np.testing.assert_allclose(gen._replanner(len(prompts)).est.carried, pooled if carry else 0 * pooled, rtol=1e-12)
        second = gen.generate(prompts, max_new_tokens=20, eos_token_id=[])
        expected = last.plan if carry else static
        assert second.replan.history[0] == (0, expected.num_nodes, expected.num_levels)
        for out in (first, second):
            for b, p in enumerate(prompts):
                assert out.tokens[b] == greedy_reference(target, p, 20)
    other = SequoiaGenerator(target, draft, static, SamplingParams(temperature=0.7), adaptive=cfg, max_length=160)
    with pytest.raises(ValueError, match="another model pair or sampling setting"):
        other.continue_adaptive(gen)  # another sampling setting: its evidence would mislead


def test_live_costs_move_the_choice():
    """Trees that run far slower than the profile said (beyond the drift a first run is allowed
    against the calibration), end smaller than the same steps with live costs off (acceptance alike in both: the rank-1
    child accepted every other step)."""
    acc = [0.6, 0.2, 0.1, 0.05]
    ends = {}
    for live in (False, True):
        r = Replanner(acc, LATENCY, OVERHEAD, 1, AdaptiveConfig(every=1, live_costs=live))
        for step in range(30):
            plan = r.next_plan()
            slow = 1.0 if plan.num_nodes == 1 else 1.0 + 0.2 * plan.num_nodes  # trees cost far more than predicted
            path = [0, 1] if step % 2 == 0 and plan.num_nodes > 1 else [0]
            r.observe(plan, [path], [len(path)], r.predicted_step_s(plan) * slow)
        ends[live] = r.plan.num_nodes
    assert ends[True] < ends[False], ends


class _RunningMeans:
    """The earlier live-cost rule: per node count, a running mean of measured / predicted."""

    def __init__(self):
        self.ratio = {}

    def observe(self, nodes, predicted_s, measured_s):
        r = measured_s / predicted_s
        self.ratio[nodes] = r if nodes not in self.ratio else self.ratio[nodes] + 0.25 * (r - self.ratio[nodes])

    def factor(self, nodes):
        return float(self.factors((nodes,))[0])

    def factors(self, nodes):
        xs = sorted(self.ratio) or [1]
        return np.interp(np.log2(nodes), np.log2(xs), [self.ratio.get(x, 1.0) for x in xs])

    def least(self):
        return min([1.0] + list(self.ratio.values()))


def test_machine_drift_does_not_pose_as_a_cheap_tree():
    """Plain decoding runs while the machine is 30% slower than calibrated, then a tree; ten steps
    into the tree the machine speeds up (to 25% faster than calibrated), then plain decoding again.
    The cost model is exact relative to plain decoding all along. Corrections learnt across
    switches, from steps moments apart, stay near 1 throughout; per-size running means (the earlier
    rule) charged the tree 0.58x plain decoding's ratio while it ran: on the real pair that kept
    a tree losing 15% for ~300 steps."""
    from sequoia_decoding.adaptive import LiveCosts

    runs = [(1, 30, lambda i: 1.3), (4, 60, lambda i: 1.3 - 0.55 * min(max((i - 10) / 20, 0.0), 1.0)),
            (1, 30, lambda i: 0.75)]
    for costs, earlier in ((_RunningMeans(), True), (LiveCosts(), False)):
        seen = []
        for nodes, steps, speed in runs:
            for i in range(steps):
                costs.observe(nodes, 0.01 * nodes, 0.01 * nodes * speed(i) * (1 + 0.02 * (i % 3)))
                seen.append(costs.factor(4) / costs.factor(1))
        if earlier:
            assert min(seen[30:90]) < 0.65, min(seen)  # the illusion this test is about
        else:
            assert all(abs(math.log(x)) < 0.1 for x in seen), (min(seen), max(seen))


def test_first_child_acceptance_is_the_verifiers_rank_one_rate():
    """``first_child_acceptance`` (sum_x min(p, q)) against the verifier itself: over many draws of
    a first child from q and of the uniforms, ``verify_tree`` accepts it at that rate (a peek's
    ``play_out`` hands the same value for its root)."""
    from sequoia_kernels.ops.verify_tree import verify_tree
    from sequoia_decoding.drafters import first_child_acceptance

    g = torch.Generator().manual_seed(5)
    V, B = 9, 40000
    p = torch.softmax(2 * torch.randn(V, generator=g), 0)
    q = torch.softmax(2 * torch.randn(V, generator=g), 0)
    P, Q = p.expand(B, 2, V).contiguous(), q.expand(B, 2, V).contiguous()
    tokens = torch.stack([torch.zeros(B, dtype=torch.int64), torch.multinomial(q, B, replacement=True, generator=g)], 1)
    path, num, _ = verify_tree(P, Q, tokens, torch.tensor([-1, 0]), uniforms=torch.rand(B, 2, generator=g),
                               backend="reference")
    rate, want = (num == 2).double().mean().item(), torch.minimum(p, q).sum().item()
    assert abs(rate - want) < 4 * math.sqrt(want * (1 - want) / B), (rate, want)
    got = first_child_acceptance(P[:3], Q[:3], torch.tensor([[0, 1], [0, -1], [0, -1]]))
    torch.testing.assert_close(got[:, 0], torch.full((3,), want), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0, 1], torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_rank_one_probabilities_estimate_with_far_less_noise():
    """Steps whose first child is accepted with a probability that varies by context (uniform on
    [0, 0.3]): fed that probability (``first``) instead of the 0/1 outcome, the estimate of p_1
    has the same mean and a fraction of the spread (Rao-Blackwell)."""
    plan = tree_from_parents([-1, 0, 0])
    ests = {"outcome": [], "probability": []}
    for seed in range(200):
        rng = random.Random(seed)
        a = AcceptanceEstimate([0.15, 0.05], rows=1, strength=2.0, decay=0.96, floor=2.0)
        b = AcceptanceEstimate([0.15, 0.05], rows=1, strength=2.0, decay=0.96, floor=2.0)
        for _ in range(100):
            h1 = rng.uniform(0.0, 0.3)
            path = [0, 1] if rng.random() < h1 else [0]
            a.observe(plan, [path], [len(path)])
            b.observe(plan, [path], [len(path)], first=[[h1]])
        ests["outcome"].append(a.p1()[0])
        ests["probability"].append(b.p1()[0])
    mean = {k: float(np.mean(v)) for k, v in ests.items()}
    sd = {k: float(np.std(v)) for k, v in ests.items()}
    assert abs(mean["probability"] - mean["outcome"]) < 0.01 and abs(mean["probability"] - 0.15) < 0.01, mean
    assert sd["probability"] < 0.5 * sd["outcome"], sd


def test_live_costs_learn_a_shape_across_switches():
    """Trees of 4 nodes cost 1.5x what the model says relative to plain decoding, under a machine
    that drifts slowly, and a stalled step now and then: comparisons across switches learn the ratio."""
    from sequoia_decoding.adaptive import LiveCosts

    costs, t = LiveCosts(), 0
    for _ in range(6):
        for nodes, shape in ((1, 1.0), (4, 1.5)):
            for _ in range(10):
                drift = 1.0 + 0.3 * math.sin(t / 200)  # slow against a run of 10 steps
                costs.observe(nodes, 0.01, 0.01 * shape * drift * (3.0 if t % 7 == 0 else 1.0))
                t += 1
    # (fading between switches, 20 steps apart here, holds it a little under the truth)
    assert 1.4 < costs.factor(4) < 1.52 and costs.factor(1) == 1.0, costs.log_shape
    assert costs.factor(2) == pytest.approx(math.sqrt(costs.factor(4)), rel=1e-9)  # log-log interpolation


def _run_with_costs(acc, tree_cost: float, check_every: int, steps: int = 600):
    """``steps`` of a re-planner whose rows accept as ``acc`` says, on a machine where a tree step
    costs ``tree_cost`` times its prediction and a plain one what it is predicted: (tokens per
    second over plain decoding's, the share of plain steps, the re-planner). Checks that a cost
    check's plain steps are never peeks."""
    rng, h = random.Random(0), _hazards(acc).tolist()
    r = Replanner(acc, LATENCY, OVERHEAD, 1, AdaptiveConfig(check_every=check_every, prior_doubt=0.0, decay=0.96,
                                                            plain_sd=0.0))  # (a pessimistic E would drop the tree)
    plain_s = r.predicted_step_s(chain_tree(0))
    tokens = secs = plain = 0.0
    for _ in range(steps):
        plan, star = r.next_plan(), r.peek()
        assert star is None or r._check is None  # no peek during a cost check
        if star is not None:
            path = simulate_paths(star, h, 1, rng)[0]
            r.observe(star, [path], [len(path)], plain_s, peeked=True)
            tokens, secs, plain = tokens + 1, secs + plain_s, plain + 1
            continue
        path = simulate_paths(plan, h, 1, rng)[0] if plan.num_nodes > 1 else [0]
        s = r.predicted_step_s(plan) * (tree_cost if plan.num_nodes > 1 else 1.0)
        r.observe(plan, [path], [len(path)], s)
        tokens, secs, plain = tokens + len(path), secs + s, plain + (plan.num_nodes == 1)
    return tokens / secs * plain_s, plain / steps, r


def test_a_cost_check_finds_plain_decoding_that_the_calibration_overprices():
    """The calibration prices a tree's step 1.3x too low against plain decoding's (a spell of the
    machine, or a stale profile); the tree is predicted ~7% faster per token than plain decoding and
    is ~11% slower. A tree that never gives way never times plain decoding, so live costs learnt
    across switches alone keep it for good; cost checks time plain steps beside it and drop it."""
    acc = [0.3, 0.1, 0.05]
    never, never_plain, r0 = _run_with_costs(acc, 1.3, check_every=0)
    checked, checked_plain, r = _run_with_costs(acc, 1.3, check_every=96)
    assert never_plain == 0.0 and r0.stats.cost_checks == 0 and never < 0.92, never
    assert r.stats.cost_checks >= 1 and checked_plain > 0.5 and checked > never + 0.03, (checked, checked_plain)
    assert r.costs.factor(4) > 1.1, r.costs.log_shape  # what the check taught


def test_a_cost_check_times_a_window_of_plain_steps_without_peeks():
    """A check runs plain steps (no peeks, though plain decoding here peeks every step) until the
    live costs hold ``window`` timed ones (its first step, a new shape's, untimed), then resumes
    the tree it interrupted."""
    r = Replanner([0.3, 0.1, 0.05], LATENCY, OVERHEAD, 1,
                  AdaptiveConfig(every=1, check_every=1, peek_every=1, peek_backoff=1,
                                 prior_doubt=0.0))
    tree, seen = r.plan, []
    for _ in range(1 + 1 + r.costs.window + 1):
        plan, star = r.next_plan(), r.peek()
        seen.append((plan.num_nodes, star is None))
        path = [0, 1] if plan.num_nodes > 1 else [0]
        r.observe(plan, [path], [len(path)], r.predicted_step_s(plan))
    assert tree.num_nodes > 1 and r.stats.cost_checks >= 1
    assert seen[:2] == [(tree.num_nodes, True), (1, True)], seen
    assert seen[2:-1] == [(1, True)] * r.costs.window and seen[-1] == (tree.num_nodes, True), seen


@pytest.mark.parametrize("acc, checks", [([0.3, 0.1, 0.05], True), ([0.6, 0.2, 0.1], False)])
def test_cost_checks_cost_little_where_the_tree_wins(acc, checks):
    """Costs as predicted: a tree predicted less than ``check_margin`` faster than plain decoding is
    checked every ``check_every`` tree steps and kept (under 1% of its speed lost); one predicted
    far faster is never checked."""
    never, _, _ = _run_with_costs(acc, 1.0, check_every=0)
    checked, plain, r = _run_with_costs(acc, 1.0, check_every=96)
    assert (r.stats.cost_checks >= 3) == checks and (r.stats.cost_checks == 0) == (not checks), r.stats
    assert r.plan.num_nodes > 1 and checked > 0.99 * never and plain < 0.1, (checked, never, plain)


@pytest.mark.parametrize("min_gain", [0.0, 0.03, 0.5])
def test_a_new_tree_must_be_predicted_min_gain_faster(min_gain):
    """Hysteresis: every re-solved tree that replaced the current one was predicted at least
    ``min_gain`` faster under the estimate of that moment; a large margin keeps the first tree
    although the re-solve prefers another (the re-plans still run)."""
    r = Replanner([0.4, 0.2, 0.1], LATENCY, OVERHEAD, 1, AdaptiveConfig(every=1, min_gain=min_gain, live_costs=False,
                                                                        prior_strength=2.0))
    first, solved_other = r.plan, False
    for step in range(40):  # every step accepts the first child at every level: acceptance climbs
        acc, cur = r.est.vector(), r.plan
        plan = r.next_plan()
        if step and plan is cur:
            solved_other |= r._solve(acc, cur).parents != cur.parents
        if plan is not cur:
            assert r.seconds_per_token(plan, acc) < (1 - min_gain) * r.seconds_per_token(cur, acc)
        r.observe(plan, [list(range(0, plan.num_nodes)) if plan.num_levels == plan.num_nodes else
                         [0] + [i for i in range(1, plan.num_nodes) if plan.rank[i] == 1]],
                  [plan.num_levels], 0.05)
    if min_gain == 0.5:
        assert r.plan is first and r.stats.plan_changes == 0 and r.stats.replans > 0 and solved_other
    else:
        assert r.stats.plan_changes >= 1 and r.plan.expected_tokens > first.expected_tokens


def test_bad_configs_are_refused():
    for kw in ({"every": 0}, {"decay": 0.0}, {"prior_strength": -1.0}, {"prior_floor": 0.0}, {"prior_doubt": 1.0},
               {"prior_doubt": -0.1},
               {"prior_floor": float("nan")}, {"max_depth": 0}, {"quantum": 0}, {"min_gain": 1.0}, {"min_gain": -0.1},
               {"switch_sd": -0.5}, {"switch_sd": float("nan")}, {"check_every": -1}, {"check_every": True},
               {"check_margin": 1.0}, {"check_margin": -0.1}, {"plain_sd": -0.5}, {"plain_sd": float("inf")},
               {"trees": "all"}, {"trees": None}, {"peek_every": 0}, {"peek_backoff": 0}, {"peek_backoff": 2.0},
               {"peek_backoff": True}):
        with pytest.raises(ValueError, match="AdaptiveConfig"):
            AdaptiveConfig(**kw)
    target = tiny_models.tiny_llama(0, vocab=VOCAB)
    with pytest.raises(ValueError, match="needs a draft"):
        SequoiaGenerator(target, None, adaptive=True)
    with pytest.raises(ValueError, match="adaptive must be"):
        SequoiaGenerator(target, tiny_models.tiny_llama(1, vocab=VOCAB), plan_tree([0.5], 3, 2), adaptive="yes")


def test_adaptive_true_re_plans_sampled_requests_between_their_tree_and_plain_decoding(monkeypatch):
    """``adaptive=True`` is ``default_config(sampling)``: greedy requests re-planned over any tree,
    sampled ones between the first step's tree and plain decoding (``trees="planned"``); a config
    given is used as it is, sampled or not."""
    from dataclasses import replace

    from sequoia_decoding import generate as generate_mod
    from sequoia_decoding.adaptive import default_config

    monkeypatch.setattr(generate_mod, "adaptive_costs", lambda cfg, *a: replace(cfg, latency=LATENCY,
                                                                                overhead_s=OVERHEAD))
    target, draft = tiny_models.tiny_llama(0, vocab=VOCAB), tiny_models.tiny_llama(1, vocab=VOCAB, layers=1)
    plan = plan_tree([0.5, 0.2], 4, 3)
    for sampling, trees in ((SamplingParams(), "any"), (SamplingParams(temperature=0.8), "size"),
                            (SamplingParams(temperature=0.8, top_p=0.9), "size")):
        gen = SequoiaGenerator(target, draft, plan, sampling, adaptive=True, max_length=64)
        assert gen.adaptive.trees == trees and gen.adaptive == replace(default_config(sampling), latency=LATENCY)
        given = SequoiaGenerator(target, draft, plan, sampling, adaptive=AdaptiveConfig(every=3), max_length=64)
        assert given.adaptive.trees == "any" and given.adaptive.every == 3
    assert default_config(SamplingParams(temperature=0.8), every=2).every == 2


def test_without_a_cached_profile_the_plan_stays_static_and_says_so(monkeypatch, tmp_path, caplog):
    from sequoia_decoding.modeling import smollm2

    monkeypatch.setattr(smollm2, "CACHE_ROOT", tmp_path)
    target, draft = tiny_models.tiny_llama(0, vocab=VOCAB), tiny_models.tiny_llama(1, vocab=VOCAB, layers=1)
    with caplog.at_level(logging.WARNING, logger="sequoia_decoding"):
        gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2], 4, 3), adaptive=True, max_length=64)
    assert gen.adaptive is None and "plan stays static" in caplog.text
    assert gen.generate([[3, 4]], max_new_tokens=4, eos_token_id=[]).replan is None
    # a static 1-node plan is plain decoding: the draft is not kept (nor run, nor patched)
    assert SequoiaGenerator(target, draft, chain_tree(0), adaptive=True, max_length=64).draft is None


# ------------------------------------------------------------------ the loop with changing trees

STAR = tree_from_parents((-1,) + (0,) * PEEK_CHILDREN)
PLANS = [chain_tree(0), plan_tree([0.5, 0.2, 0.1], 9, 4), chain_tree(0), chain_tree(0), chain_tree(3),
         kxd_tree(2, 3), chain_tree(0), plan_tree([0.4, 0.3, 0.2], 12, 3)]


class Flipper:
    """A re-planner that changes the tree at every step, from what the previous step accepted
    (as a re-planner does): plain decoding (several steps in a row too) and trees of every shape;
    every other plain step peeks (the star of ``PEEK_CHILDREN`` children drafted and played out)."""

    stats = None

    def __init__(self, plans=PLANS):
        self.plans, self.i, self.plain, self.peeks = plans, 0, 0, 0

    def next_plan(self):
        return self.plans[self.i % len(self.plans)]

    def peek(self):
        if self.next_plan().num_nodes > 1:
            return None
        self.plain += 1
        self.peeks += self.plain % 2 == 0
        return STAR if self.plain % 2 == 0 else None

    def observe(self, plan, paths, nums, step_s, keep=None, peeked=False, first=None):
        assert peeked == (plan is STAR) and len(paths) == len(nums) and (first is None or len(first) == len(nums))
        self.i += 1 + sum(nums) % 2


def flipping(gen):
    """``gen`` with a :class:`Flipper` per call (``gen.flippers``)."""
    gen.flippers = []

    def make(batch):
        gen.flippers.append(Flipper())
        return gen.flippers[-1]

    gen._replanner = make
    return gen


@pytest.mark.parametrize("drafter", ["model", "head"])
def test_greedy_output_is_the_targets_with_a_tree_that_changes_every_step(drafter):
    from test_feature_drafter import random_head

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=4, dtype=torch.float64, sharpen=3.0)
    draft = tiny_models.tiny_llama(1, vocab=VOCAB, layers=1, dtype=torch.float64, sharpen=3.0) \
        if drafter == "model" else random_head(target, "eagle3", 5, 40)
    prompts, n = [[1, 5, 7, 9, 11], [3], [8, 2]], 15
    gen = flipping(SequoiaGenerator(target, draft, PLANS[1], max_length=128, backend="reference"))
    out = gen.generate(prompts, max_new_tokens=n, eos_token_id=[])
    assert {s.emitted and len(s.accepted) for s in out.steps}  # ran
    for b, p in enumerate(prompts):
        assert out.tokens[b] == greedy_reference(target, p, n), b


def test_both_caches_are_right_after_plain_steps():
    """After every tree step's compaction both caches hold what a plain run over the emitted
    tokens computes (the draft's newest entry excepted, as in test_generate), also when plain
    decoding steps came before it: the draft caught up on the tokens it skipped (also after a
    peek, which forwards the draft's root without a tree)."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2)
    draft = tiny_models.tiny_llama(1, vocab=VOCAB, layers=1)
    prompt = [5, 6, 7, 8]
    gen = flipping(SequoiaGenerator(target, draft, PLANS[1], SamplingParams(temperature=0.9, seed=3), max_length=64))
    snapshots = tiny_models.record_cache_snapshots(gen)
    out = gen.generate([prompt], max_new_tokens=24, eos_token_id=[])
    plain, peeks = sum(1 for s in out.steps if s.draft_forward_s == 0.0), gen.flippers[0].peeks
    # a tree step compacts both caches, a peek the draft's alone (the target commits its root)
    assert plain >= 3 and peeks >= 2 and len(snapshots) == 2 * (len(out.steps) - plain - peeks) + peeks
    tiny_models.check_cache_snapshots(snapshots, prompt + out.tokens[0], draft)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_feature_drafter_catches_up_after_plain_steps(monkeypatch, temperature):
    """Every tree the head proposes after plain-decoding steps is the cache-free recomputation
    from the target's features (tokens, and every expanded node's q when sampling)."""
    from test_feature_drafter import check_against_naive, random_head

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, dtype=torch.float64, sharpen=3.0)
    head = random_head(target, "eagle3", 5, 40)
    prompts, n = [[1, 5, 7, 9, 11], [3], [8, 2]], 14
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=3)
    seen, propose = [], FeatureDrafter.propose

    def recording(self, spec, root, eos, st):
        prop = propose(self, spec, root, eos, st)
        seen.append((spec.plan, prop.tokens.clone(), None if prop.q is None else prop.q.clone()))
        return prop

    monkeypatch.setattr(FeatureDrafter, "propose", recording)
    gen = flipping(SequoiaGenerator(target, head, PLANS[1], sampling, max_length=128, backend="reference"))
    out = gen.generate(prompts, max_new_tokens=n, eos_token_id=[])
    emitted, active, checked = [0] * len(prompts), list(range(len(prompts))), 0
    for s, st in enumerate(out.steps):
        plan, tokens, q = seen[s]
        for r, b in enumerate(active):
            if plan.num_nodes > 1 and s > 0 and seen[s - 1][0].num_nodes == 1:
                check_against_naive(target, head, plan, prompts[b] + out.tokens[b][:emitted[b]], len(prompts[b]),
                                    tokens[r].tolist(), None if q is None else q[r], sampling)
                checked += 1
            emitted[b] += st.emitted[r]
        active = [b for b in active if emitted[b] < n]
    assert checked >= 3


@pytest.mark.slow
@pytest.mark.parametrize("planner", ["flipping", "replanner", "planned", "size"])
def test_sampling_is_exact_with_a_tree_replanned_every_step(planner):
    """The first two tokens follow the target's distribution (T = 0.8, top-p 0.9) when every
    step's tree is chosen from the steps before it: a tree chosen from the previous step's
    outcome (plain decoding first), the re-planner solving every step, or choosing every step
    between the planned tree and plain decoding (``trees="planned"``)."""
    from test_loop_properties import sharp_llama

    target, draft = sharp_llama(0, 2), sharp_llama(1, 1)
    prompt, n = [3, 17, 5], 3000
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    exact = filtered_two_token_distribution(target, prompt, sampling)
    if planner == "flipping":
        gen = SequoiaGenerator(target, draft, PLANS[1], sampling, max_length=64)
        gen._replanner = lambda batch: Flipper([chain_tree(0), plan_tree([0.5, 0.2, 0.1], 9, 4), chain_tree(2)])
    else:
        cfg = AdaptiveConfig(every=1, decay=0.5, prior_strength=1.0, latency=LATENCY, overhead_s=OVERHEAD,
                             trees=planner if planner in ("planned", "size") else "any")
        start = plan_tree([0.5, 0.2, 0.1], 8 if planner == "size" else 9, 4)  # "size": a budget the profile timed
        gen = SequoiaGenerator(target, draft, start, sampling, max_length=160, adaptive=cfg)  # room: the largest tree
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])  # n independent rows
    if planner == "size":  # trees of the first one's budget, shallower ones among them
        assert out.replan.plan_changes > 0, out.replan
        assert {(b, d) for _, b, d in out.replan.history} - {(start.num_nodes, start.num_levels), (1, 1)}
    counts = pair_counts(out.tokens, VOCAB)
    assert_pairs_follow(counts, exact, n)


def test_the_replanner_in_the_loop_records_what_it_did():
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2, sharpen=3.0)
    draft = tiny_models.tiny_llama(1, vocab=VOCAB, layers=1, sharpen=3.0)
    cfg = AdaptiveConfig(every=1, decay=0.8, latency=LATENCY, overhead_s=OVERHEAD)
    gen = SequoiaGenerator(target, draft, plan_tree([0.9, 0.05], 16, 6), adaptive=cfg, max_length=160)
    prompts = [[1, 5, 7], [3, 3]]
    out = gen.generate(prompts, max_new_tokens=20, eos_token_id=[])
    assert out.replan.replans == len(out.steps) - 1 and out.replan.plan_changes >= 1, out.replan
    for b, p in enumerate(prompts):
        assert out.tokens[b] == greedy_reference(target, p, 20)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_loop_hands_the_replanner_peeks_and_first_child_probabilities(monkeypatch, temperature):
    """In the loop, sampled tree steps and peeks come with each observed node's first-child
    acceptance probability (in [0, 1], one per node tried), greedy ones with none; a peek's
    observation is the star's, of a plain step."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2, sharpen=3.0)
    draft = tiny_models.tiny_llama(1, vocab=VOCAB, layers=1, sharpen=3.0)
    seen, orig = [], Replanner.observe

    def spy(self, plan, paths, nums, step_s, keep=None, peeked=False, first=None):
        seen.append((plan.num_nodes, self.plan.num_nodes, peeked, first, nums))
        orig(self, plan, paths, nums, step_s, keep, peeked, first)

    monkeypatch.setattr(Replanner, "observe", spy)
    costly = {**LATENCY, "draft_step_s": 0.03, "draft_latency_s": None}  # a draft this slow: plain decoding soon
    cfg = AdaptiveConfig(every=1, decay=0.8, latency=costly, overhead_s=OVERHEAD, peek_every=2, prior_strength=2.0)
    gen = SequoiaGenerator(target, draft, plan_tree([0.05, 0.02], 8, 3), SamplingParams(temperature=temperature, seed=1),
                           adaptive=cfg, max_length=200)
    gen.generate([[1, 5, 7], [3, 3]], max_new_tokens=40, eos_token_id=[])
    peeks = [s for s in seen if s[2]]
    assert seen[0][0] > 1 and peeks and all(n == PEEK_CHILDREN + 1 and cur == 1 for n, cur, _, _, _ in peeks)
    for nodes, _, peeked, first, nums in seen:
        if temperature == 0 or nodes == 1:
            assert first is None
        else:
            assert len(first) == len(nums) and all(0.0 <= x <= 1.0 + 1e-6 for f, n in zip(first, nums)
                                                   for x in f[:n]), first  # a peek: the root's alone


def test_the_staged_search_finds_the_best_tree_of_the_whole_space(monkeypatch):
    """A re-plan builds the DP tables to its largest budget only where a lower bound says a tree of
    that budget could beat the best of the smaller ones (the tables cost ~n^2: 512 nodes 27 ms,
    256 nodes 7.5): the staged search's tree charged as every (budget, levels) of the whole space
    is charged, on latency curves from flat to steep (the largest budget pruned in some examples,
    searched in others, both counted); the native search, staged alike, returns the same tree."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sequoia_decoding import adaptive, dp
    from sequoia_decoding.planner import _level_widths
    from sequoia_decoding.tree import LevelAcceptance

    native = dp._compiled("dp_search")
    staged = {"pruned": 0, "full": 0}
    search_tables = Replanner._search_tables

    def spy(self, acc, budgets, D, f_lo, base):
        spy.calls.append(len(budgets))
        return search_tables(self, acc, budgets, D, f_lo, base)

    spy.calls = []
    monkeypatch.setattr(adaptive.Replanner, "_search_tables", spy)

    @settings(max_examples=120, deadline=None, derandomize=True)
    @given(st.integers(1, 8), st.integers(0, 2**31 - 1), st.booleans(), st.floats(0.0, 4.0), st.integers(2, 8))
    def check(K, seed, per_level, slope, max_depth):
        rng = np.random.default_rng(seed)

        def vector():
            return tuple(float(x) for x in rng.dirichlet(np.ones(K + 1))[:K])

        acc = LevelAcceptance(vector(), vector()) if per_level else vector()
        table = {2**i: 0.02 * (1 + slope * (2**i / 64) ** 1.5) * float(rng.uniform(0.95, 1.05)) for i in range(9)}
        latency = {"draft_step_s": float(rng.uniform(0.0005, 0.004)), "target_latency_s": table}
        r = Replanner(acc, latency, dict(zip((1, 16, 256), np.cumsum(rng.uniform(0, 0.004, 3)).tolist())), 1,
                      AdaptiveConfig(max_depth=max_depth))
        budgets, D = sorted(r.table), max_depth
        spy.calls = []
        found = r._search_python(acc, budgets, D)
        if spy.calls and spy.calls[0] > 2:
            staged["pruned" if len(spy.calls) == 1 and spy.calls[0] < len(budgets) else "full"] += 1
        tables = dp.tables_for(acc, max(budgets), D)  # every candidate of the space, charged as the search does

        def charge(n, d, depth):  # seconds per token of the tree (n, d) rebuilt as ``depth``
            return r._step_s(n, len(depth), _level_widths(depth)) * r.costs.factor(len(depth)) / tables.value(d, n)

        base = (r.table[1] + r._oh(1)) * r.costs.factor(1)
        best = base
        for n in budgets[1:]:
            for d in range(2, D + 1):
                depth = tables.rebuild(min(n, tables.N), d)[1]
                if len(depth) > 1:
                    best = min(best, charge(n, d, depth))
        if found is None:
            assert best >= base * (1 - 1e-12), (best, base)
        else:
            n, d, parents, depth, rank = found
            assert charge(n, d, depth) == pytest.approx(best, rel=1e-12), (found, charge(n, d, depth), best)
        if native is not None:
            assert r._search_native(native, acc, budgets, D) == found

    check()
    assert staged["pruned"] >= 10 and staged["full"] >= 10, staged


def test_the_compiled_search_picks_the_python_searchs_plans(monkeypatch):
    """The extension's dp_search (csrc/cpu/dp_search.h: a re-plan's whole search in one call)
    against Replanner._search_python through ``_solve``: the same tree (budget, levels, parents, depth, rank) or the same
    "none beats plain decoding", for plain and per-level vectors with ties and zeros, with and
    without a draft curve, live corrections learnt at several node counts, around current plans
    of every size; and its checks reject what does not fit."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sequoia_decoding import dp
    from sequoia_decoding.tree import LevelAcceptance, TreePlan, expected_tokens

    pytest.importorskip("sequoia_kernels._C")
    op = dp._compiled("dp_search")
    if op is None:
        pytest.skip("sequoia_kernels._C has no dp_search")  # (an extension built before it)

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.integers(1, 10), st.integers(0, 2**31 - 1), st.sampled_from(["random", "ties", "sparse", "high"]),
           st.booleans(), st.booleans(), st.integers(1, 12))
    def check(K, seed, kind, per_level, curve, max_depth):
        rng = np.random.default_rng(seed)

        def vector():
            v = rng.dirichlet(np.ones(K + 1) * (0.3 if kind == "high" else 1.0))[:K]
            if kind == "ties":
                v = np.round(v * 4) / 16
            elif kind == "sparse":
                v = np.where(rng.random(K) < 0.5, 0.0, v)
            return tuple(float(x) for x in v)

        acc = LevelAcceptance(vector(), vector()) if per_level else vector()
        latency = {"draft_step_s": float(rng.uniform(0.001, 0.01)),
                   "target_latency_s": {n: t * float(rng.uniform(0.8, 1.2)) for n, t in LATENCY["target_latency_s"].items()}}
        if curve:  # a draft forward's cost that grows with its width (each level charged at its own)
            latency["draft_latency_s"] = dict(zip((1, 2, 4, 16, 64), np.cumsum(rng.uniform(0.0005, 0.008, 5)).tolist()))
        overhead = dict(zip((1, 4, 16, 64), np.cumsum(rng.uniform(0.0, 0.006, 4)).tolist()))
        r = Replanner(acc, latency, overhead, 1, AdaptiveConfig(max_depth=max_depth))
        for n in rng.choice([1, 2, 4, 8, 16, 32, 64], size=int(rng.integers(0, 4)), replace=False):
            r.costs.log_shape[int(n)] = float(rng.uniform(-0.3, 0.3))
        for around in {r.plan, r._solve(acc), plan_tree(acc, int(rng.integers(2, 40)), int(rng.integers(2, 6)))}:
            if around.num_nodes == 1:
                continue
            a = r._solve(acc, around)
            with monkeypatch.context() as m:
                m.setitem(dp._OP, "dp_search", None)
                b = r._solve(acc, around)
            assert (a.budget, a.max_depth, a.parents, a.depth, a.rank) == (b.budget, b.max_depth, b.parents, b.depth,
                                                                           b.rank)
            assert a.expected_tokens == b.expected_tokens
            if a is not around:  # TreePlan.of_search's plan (unchecked) is the checked constructor's, E bitwise
                checked = TreePlan(a.acceptance, a.budget, a.max_depth, a.parents, a.depth, a.rank,
                                   expected_tokens(a.parents, a.acceptance))
                assert a == checked and a.expected_tokens == checked.expected_tokens
                assert all(type(x) is int for f in (a.parents, a.depth, a.rank) for x in f)

    check()
    good = dict(p=[0.5, 0.2], p1=[], per_level=False, depth_limit=4, budgets=[1, 2, 4, 8],
                target_s=[0.01, 0.0105, 0.011, 0.012], draft_w=[0.001] * 10, overhead_s=[0.0005] * 9,
                cost_nodes=[1], cost_log=[0.0], draft_lo=0.001, oh_lo=0.0005, t_d=-1.0)
    assert op(*good.values())[:2] in ([8, 3], [8, 4], [4, 3])
    for bad in (dict(budgets=[1, 4, 2, 8]), dict(budgets=[2, 4, 8, 16]), dict(target_s=[0.01]),
                dict(draft_w=[0.001] * 3), dict(overhead_s=[0.0] * 8), dict(cost_log=[]), dict(cost_nodes=[2, 1],
                cost_log=[0.0, 0.0]), dict(p=[1.5]), dict(p=[float("nan")]), dict(p1=[0.1]), dict(depth_limit=0)):
        with pytest.raises(ValueError, match="dp_search"):
            op(*dict(good, **bad).values())
    with pytest.raises(TypeError):
        op(*dict(good, p=3).values())
