"""Tests of the Sequoia tree planner (sequoia_decoding.planner): exactness against
brute-force enumeration, structural invariants, speed, and the hardware-aware choice."""

from __future__ import annotations

import functools
import json
import math
import statistics
import time

import numpy as np
import pytest

from sequoia_decoding.planner import (
    DEFAULT_ACCEPTANCE,
    HardwarePlan,
    TreePlan,
    chain_tree,
    choose_plan,
    level_widths,
    plan_step_s,
    expected_tokens,
    load_latency,
    plan_tree,
    predicted_speedup,
    validate_acceptance,
)

SEED = 20240219


# ----------------------------------------------------------------------- brute force


@functools.lru_cache(maxsize=None)
def _trees(m: int, d: int) -> tuple:
    """All ordered rooted trees with exactly m nodes and at most d levels; a tree is the
    tuple of its children's subtrees, in sampling-rank order."""
    if m < 1 or d < 1:
        return ()
    return tuple(_forests(m - 1, d - 1))


@functools.lru_cache(maxsize=None)
def _forests(m: int, d: int) -> tuple:
    """All sequences of trees (each <= d levels) with m nodes in all."""
    if m == 0:
        return ((),)
    out = []
    for s in range(1, m + 1):
        for t in _trees(s, d):
            for rest in _forests(m - s, d):
                out.append((t,) + rest)
    return tuple(out)


def _tree_value(tree: tuple, p) -> float:
    return 1.0 + sum((p[i] if i < len(p) else 0.0) * _tree_value(c, p) for i, c in enumerate(tree))


def _to_parents(tree: tuple) -> list[int]:
    parents = [-1]
    queue = [(0, tree)]
    while queue:
        node, t = queue.pop(0)
        for c in t:
            parents.append(node)
            queue.append((len(parents) - 1, c))
    return parents


def _brute_best(p, n: int, d: int) -> float:
    return max(_tree_value(t, p) for m in range(1, n + 1) for t in _trees(m, d))


def _random_acceptance(rng: np.random.Generator, k: int, monotone: bool) -> list[float]:
    x = rng.uniform(0.05, 1.0, size=k)
    if monotone:
        x = np.sort(x)[::-1]
    x = x / x.sum() * rng.uniform(0.4, 0.98)
    return [float(v) for v in x]


def _acceptance_cases():
    rng = np.random.default_rng(SEED)
    cases = []
    for k in (1, 2, 3, 5, 12):
        for monotone in (True, False):
            cases.append(_random_acceptance(rng, k, monotone))
    # explicit non-monotone vectors, zeros in the middle and at the end
    cases += [[0.1, 0.6, 0.2], [0.3, 0.0, 0.5], [0.0, 0.9], [0.5, 0.0, 0.0], [0.0, 0.0], [0.05, 0.05, 0.8]]
    return cases


ACCEPTANCE_CASES = _acceptance_cases()


@pytest.mark.parametrize("p", ACCEPTANCE_CASES, ids=lambda p: "K%d-%s" % (len(p), ",".join(f"{x:.2f}" for x in p[:3])))
def test_dp_matches_brute_force(p):
    for n in range(1, 9):
        for d in (1, 2, 3, 4, 8):
            plan = plan_tree(p, n, d)
            best = _brute_best(p, n, d)
            assert plan.expected_tokens == pytest.approx(best, abs=1e-12, rel=0), (n, d)
            assert expected_tokens(plan.parents, p) == pytest.approx(plan.expected_tokens, abs=1e-12, rel=0)
            assert plan.num_nodes <= n and plan.num_levels <= d


def test_expected_tokens_matches_direct_evaluation():
    rng = np.random.default_rng(SEED + 1)
    p = _random_acceptance(rng, 3, monotone=False)
    for t in _trees(7, 7):
        parents = _to_parents(t)
        assert expected_tokens(parents, p) == pytest.approx(_tree_value(t, p), abs=1e-12)


def test_expected_tokens_examples():
    p = [0.5, 0.3]
    assert expected_tokens([-1], p) == 1.0
    # root -> (a, b), a -> (c); non-BFS order is fine for evaluation
    assert expected_tokens([-1, 0, 1, 0], p) == pytest.approx(1 + 0.5 + 0.25 + 0.3)
    # rank beyond K has p = 0
    assert expected_tokens([-1, 0, 0, 0], p) == pytest.approx(1.8)
    with pytest.raises(ValueError):
        expected_tokens([0, 0], p)
    with pytest.raises(ValueError):
        expected_tokens([-1, 1], p)
    with pytest.raises(ValueError):
        expected_tokens([], p)


# ------------------------------------------------------------------------ invariants


def _full_tree_size(k: int, d: int) -> int:
    return sum(k**level for level in range(d))


def _check_structure(plan: TreePlan):
    n = plan.num_nodes
    par, dep, rank = plan.parents, plan.depth, plan.rank
    assert par[0] == -1 and dep[0] == 0 and rank[0] == 0
    assert len(par) == len(dep) == len(rank) == n
    for i in range(1, n):
        assert 0 <= par[i] < i
        assert dep[i] == dep[par[i]] + 1
        assert dep[i - 1] <= dep[i]  # levels contiguous (BFS)
        if i >= 2:
            assert par[i - 1] <= par[i]  # within a level ordered by parent
        # children consecutive, ranks 1, 2, ...
        if par[i - 1] == par[i] and i - 1 > 0:
            assert rank[i] == rank[i - 1] + 1
        else:
            assert rank[i] == 1
    assert max(dep) < plan.max_depth
    assert n <= plan.budget
    counts = plan.children_counts()
    assert sum(counts) == n - 1
    for i in range(n):
        kids = plan.children(i)
        assert len(kids) == counts[i]
        assert kids == list(range(kids[0], kids[0] + len(kids))) if kids else True
    # mask: ancestor-or-self
    mask = plan.mask()
    assert mask.dtype == np.bool_ and mask.shape == (n, n)
    expected = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = par[j]
    np.testing.assert_array_equal(mask, expected)
    # levels: groups at each depth, whose children are exactly the next depth, in order
    levels = plan.levels()
    assert [dep[nodes[0]] for nodes, _ in levels] == list(range(len(levels)))
    assert len(levels) == plan.num_levels - 1
    for nodes, cs in levels:
        level = dep[nodes[0]]
        assert all(dep[v] == level for v in nodes) and all(c >= 1 for c in cs)
        assert list(nodes) == [v for v in range(n) if dep[v] == level and counts[v] > 0]
        assert list(cs) == [counts[v] for v in nodes]
        nxt = [v for v in range(n) if dep[v] == level + 1]
        assert sum(cs) == len(nxt)
        owners = [u for u, c in zip(nodes, cs) for _ in range(c)]
        assert owners == [par[v] for v in nxt]
    # no useless node: a node whose subtree is worth 0 is only a placeholder for a
    # later sibling that is worth something
    values = plan.node_values()
    sub = list(values)
    for i in range(n - 1, 0, -1):
        sub[par[i]] += sub[i]
    for i in range(1, n):
        if sub[i] == 0.0:
            later = [j for j in plan.children(par[i]) if j > i]
            assert any(sub[j] > 0 for j in later), i
    assert plan.expected_tokens == pytest.approx(math.fsum(values), abs=1e-12)


def test_structure_and_monotonicity_random():
    rng = np.random.default_rng(SEED + 2)
    for trial in range(12):
        k = int(rng.integers(1, 10))
        p = _random_acceptance(rng, k, monotone=bool(trial % 2))
        d = int(rng.integers(1, 7))
        prev = 0.0
        for n in (1, 2, 3, 5, 8, 13, 21, 34):
            plan = plan_tree(p, n, d)
            _check_structure(plan)
            # all p > 0: every node adds value until the full K-ary tree is reached
            assert plan.num_nodes == min(n, _full_tree_size(k, d))
            assert plan.expected_tokens >= prev - 1e-12
            prev = plan.expected_tokens
            if d < 6:
                assert plan_tree(p, n, d + 1).expected_tokens >= plan.expected_tokens - 1e-12


def test_structure_with_zeros_and_big_budgets():
    for p, n, d in [([0.3, 0.0, 0.5], 40, 4), ([0.0, 0.9], 30, 5), ([0.5, 0.0, 0.0], 50, 6),
                    ([0.0, 0.0], 10, 3), (DEFAULT_ACCEPTANCE, 300, 12), ([0.2] * 4, 1000, 3)]:
        plan = plan_tree(p, n, d)
        _check_structure(plan)
    assert plan_tree([0.2] * 4, 1000, 3).num_nodes == 21  # full 4-ary tree of 3 levels
    assert plan_tree([0.5, 0.0, 0.0], 50, 6).num_nodes == 6  # a chain
    assert plan_tree([0.0, 0.0], 10, 3).num_nodes == 1


def test_trivial_cases():
    for p in ([0.5], DEFAULT_ACCEPTANCE, [0.0]):
        one = plan_tree(p, 1, 10)
        assert one.parents == (-1,) and one.expected_tokens == 1.0 and one.levels() == []
        flat = plan_tree(p, 10, 1)
        assert flat.parents == (-1,) and flat.expected_tokens == 1.0
    two = plan_tree(DEFAULT_ACCEPTANCE, 9, 2)
    assert two.parents == (-1,) + (0,) * 8
    assert two.expected_tokens == pytest.approx(1 + sum(DEFAULT_ACCEPTANCE))
    assert two.levels() == [((0,), (8,))]
    chain = plan_tree([0.9], 6, 20)
    assert chain.parents == (-1, 0, 1, 2, 3, 4)
    assert chain.expected_tokens == pytest.approx(sum(0.9**i for i in range(6)))


def test_greedy_agrees_for_monotone_acceptance():
    """For nonincreasing p the optimal tree is the n most probable nodes of the infinite
    depth-limited tree (their set is closed under parent and earlier sibling)."""
    rng = np.random.default_rng(SEED + 3)
    for _ in range(3):
        p = _random_acceptance(rng, 6, monotone=True)
        n, d = 60, 6
        import heapq

        heap, vals = [(-1.0, 0)], []
        while heap and len(vals) < n:
            v, dep = heapq.heappop(heap)
            vals.append(-v)
            if dep + 1 < d:
                for x in p:
                    heapq.heappush(heap, (v * x, dep + 1))
        assert plan_tree(p, n, d).expected_tokens == pytest.approx(math.fsum(vals), abs=1e-12)


def test_speed_n512_d16_k32():
    rng = np.random.default_rng(SEED + 4)
    p = np.r_[0.8, rng.dirichlet(np.ones(31)) * 0.19]  # keeps all 16 levels useful
    plan_tree(p, 8, 4)  # warm numpy
    t0 = time.perf_counter()
    plan = plan_tree(p, 512, 16)
    elapsed = time.perf_counter() - t0
    assert plan.num_nodes == 512 and plan.num_levels == 16
    assert elapsed < 2.0, f"planner took {elapsed:.2f} s"


# ----------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [[], [-0.1, 0.5], [0.6, 0.5], [float("nan")], [float("inf")], ["a"], "0.5", [True]])
def test_validate_acceptance_rejects(bad):
    with pytest.raises(ValueError) as e:
        validate_acceptance(bad)
    assert "\n" not in str(e.value)


def test_validate_acceptance_accepts():
    assert validate_acceptance(np.array([0.5, 0.5 + 1e-9])) == (0.5, 0.5 + 1e-9)
    assert validate_acceptance([1, 0]) == (1.0, 0.0)


@pytest.mark.parametrize("budget,depth", [(0, 3), (5, 0), (2.5, 3), ("8", 3), (True, 3)])
def test_plan_tree_rejects_bad_sizes(budget, depth):
    with pytest.raises(ValueError):
        plan_tree(DEFAULT_ACCEPTANCE, budget, depth)


# ----------------------------------------------------------------------- serialisation


def test_round_trip_json(tmp_path):
    plan = plan_tree(DEFAULT_ACCEPTANCE, 40, 6)
    path = tmp_path / "plan.json"
    text = plan.to_json(path)
    assert json.loads(text)["parents"] == list(plan.parents)
    assert TreePlan.load(path) == plan
    assert TreePlan.from_dict(plan.to_dict()) == plan
    d = plan.to_dict()
    for key in ("depth", "rank", "expected_tokens"):
        d.pop(key)
    again = TreePlan.from_dict(d)
    assert again.parents == plan.parents
    assert again.expected_tokens == pytest.approx(plan.expected_tokens, abs=1e-12)
    s = str(plan)
    assert "40 nodes" in s and "#0 root" in s and f"{plan.expected_tokens:.4f}" in s


def test_from_dict_rejects_bad_trees():
    good = plan_tree(DEFAULT_ACCEPTANCE, 6, 3).to_dict()
    for bad in ({**good, "parents": [-1, 0, 2]}, {**good, "depth": [0] * len(good["parents"])},
                {k: v for k, v in good.items() if k != "parents"}, [1, 2],
                {**good, "parents": [-1, 0, 1, 0]}):  # not BFS
        with pytest.raises(ValueError):
            TreePlan.from_dict(bad)


def test_draw_truncates():
    plan = plan_tree(DEFAULT_ACCEPTANCE, 200, 10)
    text = plan.draw(max_lines=10)
    assert len(text.splitlines()) == 11 and "190 more nodes" in text
    assert len(plan.draw(max_lines=None).splitlines()) == 200


# ------------------------------------------------------------------- hardware choice


def _synthetic_latency():
    budgets = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    # flat until the GPU saturates, then linear (a typical large-model curve)
    return {n: 0.05 * max(1.0, n / 48.0) + 0.0001 * n for n in budgets}


@pytest.mark.parametrize("draft_step", [0.0005, 0.004, 0.02])
def test_choose_plan_is_brute_force_minimiser(draft_step):
    p = DEFAULT_ACCEPTANCE
    lat = _synthetic_latency()
    hp = choose_plan(p, draft_step, lat, max_depth=10)
    assert isinstance(hp, HardwarePlan)
    best = None
    for n, t in lat.items():
        for d in range(1, 11):
            e = plan_tree(p, n, d).expected_tokens
            spt = ((d - 1) * draft_step + t) / e  # one level: no draft runs
            if best is None or spt < best[0] - 1e-15:
                best = (spt, n, d)
    assert hp.seconds_per_token == pytest.approx(best[0], rel=1e-12)
    assert (hp.budget, hp.max_depth) == (best[1], best[2])
    assert hp.plan == plan_tree(p, best[1], best[2])
    assert hp.plan.num_levels == hp.max_depth
    assert hp.speedup == pytest.approx(lat[1] / best[0], rel=1e-12)
    assert len(hp.candidates) == len(lat) * 10
    assert min(c.seconds_per_token for c in hp.candidates) == hp.seconds_per_token
    best_n = hp.best_per_budget()
    assert list(best_n) == sorted(lat)
    for n, c in best_n.items():
        assert c.seconds_per_token == min(x.seconds_per_token for x in hp.candidates if x.budget == n)
    assert best_n[hp.budget].max_depth == hp.max_depth
    json.dumps(hp.to_dict())


def ref_overhead(overhead: dict, n: int) -> float:
    """What a step of n nodes is charged: piecewise linear through the measured points, constant
    beyond; a tree (n >= 2) below the smallest measured tree on the line through the two smallest
    trees (not below O(1)), or that tree's value when only one tree was measured."""
    xs = sorted(overhead)
    lin = float(np.interp(n, xs, [overhead[k] for k in xs]))
    trees = [k for k in xs if k >= 2]
    if n < 2 or not trees or n >= trees[0]:
        return lin
    if len(trees) == 1:
        return overhead[trees[0]]
    k0, k1 = trees[:2]
    return max(overhead[k0] + (overhead[k1] - overhead[k0]) * (n - k0) / (k1 - k0),
               float(np.interp(1, xs, [overhead[k] for k in xs])))


@pytest.mark.parametrize("overhead", [{1: 0.001, 8: 0.004, 32: 0.01}, {1: 0.0, 64: 0.02}, {4: 0.003},
                                      {1: 0.0005, 8: 0.0046, 32: 0.0092}, {1: 0.001, 8: 0.001, 32: 0.01}])
def test_choose_plan_charges_step_overhead(overhead):
    """With step_overhead_s a candidate of n nodes is charged O(n) (``ref_overhead``) and the
    baseline O(1): brute force agrees, and the overhead never makes the planner pick a plan
    predicted to lose."""
    p = DEFAULT_ACCEPTANCE
    lat = _synthetic_latency()
    draft_step = 0.004
    hp = choose_plan(p, draft_step, lat, max_depth=6, step_overhead_s=overhead)

    def O(n):
        return ref_overhead(overhead, n)

    best = None
    for n, t in lat.items():
        for d in range(1, 7):
            plan = plan_tree(p, n, d)
            spt = ((d - 1) * draft_step + t + O(plan.num_nodes)) / plan.expected_tokens
            if best is None or spt < best[0] - 1e-15:
                best = (spt, n, d)
    assert hp.seconds_per_token == pytest.approx(best[0], rel=1e-12)
    assert (hp.budget, hp.max_depth) == (best[1], best[2])
    assert hp.speedup == pytest.approx((lat[1] + O(1)) / best[0], rel=1e-12)
    assert hp.speedup >= 1.0


def test_step_overhead_of_a_small_tree_is_not_drawn_towards_plain_decoding():
    """Plain decoding samples and verifies no tree: a 4-node tree's time outside the forwards is
    read off the line through the measured trees (8 and 32 nodes), not off a line down to n = 1."""
    oh = {1: 0.0005, 8: 0.0046, 32: 0.0092}
    plan = plan_tree(DEFAULT_ACCEPTANCE, 4, 2)
    lat = {1: 0.05, 4: 0.055, 8: 0.06, 32: 0.09}
    phases, _ = plan_step_s(plan, 4, 0.006, lat, oh)
    assert phases[2] == pytest.approx(0.0046 - 0.0046 * 4 / 24)
    assert plan_step_s(plan_tree(DEFAULT_ACCEPTANCE, 1, 1), 1, 0.006, lat, oh)[0][2] == pytest.approx(0.0005)
    assert plan_step_s(plan, 4, 0.006, lat, {1: 0.001, 8: 0.001, 32: 0.01})[0][2] == pytest.approx(0.001)
    assert plan_step_s(plan, 4, 0.006, lat, {1: 0.001, 16: 0.004})[0][2] == pytest.approx(0.004)


def test_step_overhead_can_make_speculation_not_pay():
    """A tree that wins on forwards alone loses once its sampling and verification are priced."""
    lat = {1: 0.05, 8: 0.055, 32: 0.06}
    assert choose_plan(DEFAULT_ACCEPTANCE, 0.002, lat, max_depth=4).plan.num_nodes > 1
    hp = choose_plan(DEFAULT_ACCEPTANCE, 0.002, lat, max_depth=4, step_overhead_s={1: 0.0, 8: 0.2, 32: 0.8})
    assert hp.plan.num_nodes == 1 and hp.speedup == 1.0
    with pytest.raises(ValueError, match="step_overhead_s"):
        choose_plan(DEFAULT_ACCEPTANCE, 0.002, lat, step_overhead_s={0: 0.1})
    with pytest.raises(ValueError, match="step_overhead_s"):
        choose_plan(DEFAULT_ACCEPTANCE, 0.002, lat, step_overhead_s={1: -0.1})


def test_measure_step_overhead_on_a_tiny_pair():
    """tools.measure_step_overhead runs the real loop: a positive time per node count, and a tree's
    step spends more outside the forwards than plain decoding's (it samples and verifies more)."""

    from sequoia_decoding.generate import SamplingParams
    from sequoia_decoding.tools import measure_step_overhead

    pytest.importorskip("torch")
    import tiny_models

    target, draft = (tiny_models.tiny_llama(s, vocab=300, layers=1, hidden=32, heads=2, kv_heads=1,
                                            special_tokens=True, attn=None) for s in (0, 1))
    trees = {1: plan_tree(DEFAULT_ACCEPTANCE, 1, 1), 16: plan_tree(DEFAULT_ACCEPTANCE, 16, 4)}
    oh = measure_step_overhead(target, draft, trees, SamplingParams(temperature=0.8, seed=1), prefix=32, steps=4)
    assert set(oh) == {1, 16} and all(v > 0 for v in oh.values())
    assert oh[16] > oh[1]
    d = measure_step_overhead(target, draft, trees, SamplingParams(temperature=0.8, seed=1), prefix=32, steps=4,
                              detail=True)
    assert set(d) == {"overhead_s", "target_s", "draft_forward_s", "first_forward_s", "deep_forward_s", "level_s",
                      "levels", "draft_widths", "calls_per_step"}
    # the draft by level (trees only): the first forward, a later one, the drafter's own time per later level
    assert set(d["level_s"]) == set(d["first_forward_s"]) == set(d["deep_forward_s"]) == {16}
    assert 0 < d["level_s"][16] * 2 < d["overhead_s"][16]
    assert 0 < d["first_forward_s"][16] and 0 < d["deep_forward_s"][16]
    assert d["first_forward_s"][16] + 2 * d["deep_forward_s"][16] == pytest.approx(d["draft_forward_s"][16], rel=0.5)
    assert d["draft_widths"][1] == [] and d["draft_widths"][16] == level_widths(trees[16])
    # every level but the leaf level is fed to the draft, the first with the pending token in front of the root
    plan16 = trees[16]
    leaves = sum(1 for x in plan16.depth if x == plan16.num_levels - 1)
    assert len(d["draft_widths"][16]) == plan16.num_levels - 1 and d["draft_widths"][16][0] == 2
    assert sum(d["draft_widths"][16]) == 16 - leaves + 1
    # a 1-layer model makes tens of framework calls per forward; a tree step has draft forwards too
    assert 20 < d["calls_per_step"][1] < d["calls_per_step"][16]
    assert d["draft_forward_s"][1] == 0 and d["draft_forward_s"][16] > 0 and d["levels"][16] == 4


def test_a_draft_level_charged_its_sampling_moves_the_plan_shallower():
    """``profiles.with_level_cost``: the time a drafter spends around each draft forward (its
    sampling) charged per level. The overhead by node count alone charges a 4-node tree the same
    at 2 and 3 levels; with the level's time charged where it belongs, the shallower tree wins
    once the extra level's tokens no longer pay for it, and the predicted step of each candidate
    is the unfolded charge plus the level cost times its draft forwards."""
    from sequoia_decoding.profiles import with_level_cost

    lat = {"draft_step_s": 0.001, "target_latency_s": {1: 0.020, 2: 0.0201, 4: 0.0202, 8: 0.03},
           "draft_latency_s": {1: 0.001, 2: 0.0011, 4: 0.0012}}
    acc, oh = [0.45, 0.15, 0.05], {1: 0.0005, 4: 0.001, 8: 0.0015}
    assert with_level_cost(lat, None) is lat and with_level_cost(lat, 0.0) is lat
    folded = with_level_cost(lat, 0.004)
    assert folded["draft_step_s"] == pytest.approx(0.005) and lat["draft_step_s"] == 0.001  # a copy
    assert folded["draft_latency_s"] == pytest.approx({1: 0.005, 2: 0.0051, 4: 0.0052})
    deep = choose_plan(acc, lat["draft_step_s"], lat["target_latency_s"], max_depth=4, step_overhead_s=oh,
                       draft_latency_s=lat["draft_latency_s"])
    shallow = choose_plan(acc, folded["draft_step_s"], folded["target_latency_s"], max_depth=4, step_overhead_s=oh,
                          draft_latency_s=folded["draft_latency_s"])
    assert deep.max_depth > shallow.max_depth > 1
    for hp in (deep, shallow):
        (d0, t0, o0), _ = plan_step_s(hp.plan, hp.budget, lat["draft_step_s"], lat["target_latency_s"], oh,
                                      lat["draft_latency_s"])
        (d1, t1, o1), _ = plan_step_s(hp.plan, hp.budget, folded["draft_step_s"], folded["target_latency_s"], oh,
                                      folded["draft_latency_s"])
        assert (t1, o1) == (t0, o0) and d1 == pytest.approx(d0 + 0.004 * (hp.plan.num_levels - 1))


def test_stored_level_cost_is_charged_by_calibration_for(tmp_path):
    """The demo stores each setting's time per draft level with its overhead; ``calibration_for``
    hands it back folded into the draft's charge (:func:`profiles.with_level_cost`), the nearest
    calibrated setting's of the same kind; a calibration stored before it was measured has none."""
    import json

    from sequoia_decoding import profiles

    prof = {"draft_step_s": 0.001, "target_latency_s": {"1": 0.01, "4": 0.0102}}
    path = tmp_path / "p.json"
    cal = {**prof, "draft_latency_s": {"1": 0.001, "4": 0.0012}}
    overhead = {(0.0, 0, 1.0): {1: 0.0005, 4: 0.001}, (0.6, 0, 1.0): {1: 0.0006, 4: 0.0012},
                (0.6, 0, 0.9): {1: 0.0006, 4: 0.0013}}
    stored = profiles.store_calibration(path, prof, cal, overhead, {(0.0, 0, 1.0): 1e-5, (0.6, 0, 1.0): 4e-4,
                                                                    (0.6, 0, 0.9): 5e-4})
    assert json.loads(path.read_text()) == stored
    for setting, c in (((0.0, 0, 1.0), 1e-5), ((0.7, 0, 1.0), 4e-4), ((0.6, 0, 0.8), 5e-4)):
        latency, oh, _ = profiles.calibration_for(stored, setting)
        assert latency["draft_step_s"] == pytest.approx(0.001 + c), setting
        assert latency["draft_latency_s"] == pytest.approx({"1": 0.001 + c, "4": 0.0012 + c}), setting
        assert latency["target_latency_s"] == cal["target_latency_s"]
    assert oh == {1: 0.0006, 4: 0.0013}
    old = {**stored, "calibration": {**stored["calibration"], "overhead": [
        {k: v for k, v in r.items() if k != "level_s"} for r in stored["calibration"]["overhead"]]}}
    assert profiles.calibration_for(old, (0.6, 0, 1.0))[0] == stored["calibration"]["latency"]


def test_calibrate_latency_rescales_to_the_loop():
    from sequoia_decoding.tools import calibrate_latency

    prof = {"target_latency_s": {"1": 0.1, "8": 0.2, "32": 0.4, "64": 0.8}, "draft_step_s": 0.01}
    loop = {"target_s": {1: 0.09, 32: 0.44}, "draft_forward_s": {1: 0.0, 32: 0.06}, "levels": {1: 1, 32: 4}}
    cal = calibrate_latency(prof, loop)
    lat = {int(k): v for k, v in cal["target_latency_s"].items()}
    assert lat[1] == pytest.approx(0.09) and lat[32] == pytest.approx(0.44)
    assert lat[64] == pytest.approx(0.8 * 1.1)  # the last ratio held beyond
    c8 = 0.9 + (1.1 - 0.9) * (8 - 1) / (32 - 1)
    assert lat[8] == pytest.approx(0.2 * c8)
    assert cal["draft_step_s"] == pytest.approx(0.02) and cal["calibrated"]  # 4 levels: 3 draft forwards
    assert prof["draft_step_s"] == 0.01  # the input is not modified


def test_calibrate_latency_holds_t_between_the_loop_times_around_it():
    """A profile point whose interpolated ratio lands outside the loop's own times at the measured
    node counts around it is held between them (a streamed target's noisy small-n profile); points
    outside the measured range and points already between them keep the interpolation."""
    from sequoia_decoding.tools import calibrate_latency

    prof = {"target_latency_s": {"1": 0.21, "8": 0.21, "32": 0.214, "64": 0.155, "128": 0.18, "256": 0.21},
            "draft_step_s": 0.002}
    loop = {"target_s": {1: 0.138, 8: 0.136, 64: 0.157}, "draft_forward_s": {1: 0.0}, "levels": {1: 1}}
    lat = {int(k): v for k, v in calibrate_latency(prof, loop)["target_latency_s"].items()}
    c32 = 0.136 / 0.21 + (0.157 / 0.155 - 0.136 / 0.21) * (32 - 8) / (64 - 8)
    assert 0.214 * c32 > 0.157  # what the interpolation alone charged: above the loop's T(64)
    assert lat[32] == pytest.approx(0.157)
    assert lat[1] == pytest.approx(0.138) and lat[8] == pytest.approx(0.136) and lat[64] == pytest.approx(0.157)
    assert lat[128] == pytest.approx(0.18 * 0.157 / 0.155)  # beyond the last measured count: unchanged
    # a point between the loop times around it keeps its interpolated value
    prof["target_latency_s"]["32"] = 0.18
    lat = {int(k): v for k, v in calibrate_latency(prof, loop)["target_latency_s"].items()}
    assert lat[32] == pytest.approx(0.18 * c32) and 0.136 < lat[32] < 0.157
    # the loop's T(1) above its T(8) (its own noise): a point between them is held in [T(8), T(1)]
    prof["target_latency_s"]["4"] = 0.15
    lat = {int(k): v for k, v in calibrate_latency(prof, loop)["target_latency_s"].items()}
    assert 0.15 * 0.136 / 0.21 < 0.136 and lat[4] == pytest.approx(0.136)


def test_calibrate_latency_scales_the_draft_curve_by_the_loop():
    """With the profile's draft curve, the loop's draft time of each tree is compared with what
    the curve charges for that tree's level widths; the whole curve is scaled by the median ratio."""
    from sequoia_decoding.tools import calibrate_latency

    prof = {"target_latency_s": {"1": 0.1, "8": 0.2, "32": 0.4}, "draft_step_s": 0.01,
            "draft_latency_s": {"1": 0.01, "8": 0.02, "32": 0.04}}
    # tree 8: widths 1, 3, 4 -> 0.01 + (0.01 + 2/7 * 0.01) + (0.01 + 3/7 * 0.01); tree 32: 1, 8, 23
    charged8 = 0.01 + (0.01 + 0.01 * 2 / 7) + (0.01 + 0.01 * 3 / 7)
    charged32 = 0.01 + 0.02 + (0.02 + 0.02 * 15 / 24)
    loop = {"target_s": {1: 0.1, 8: 0.2, 32: 0.4}, "draft_forward_s": {1: 0.0, 8: 1.2 * charged8, 32: 1.4 * charged32},
            "levels": {1: 1, 8: 3, 32: 3}, "draft_widths": {1: [], 8: [1, 3, 4], 32: [1, 8, 23]}}
    cal = calibrate_latency(prof, loop)
    scale = 1.3  # the median of 1.2 and 1.4
    assert {k: v for k, v in cal["draft_latency_s"].items()} == pytest.approx(
        {"1": 0.01 * scale, "8": 0.02 * scale, "32": 0.04 * scale})
    assert cal["draft_step_s"] == pytest.approx(0.01 * scale)
    assert prof["draft_latency_s"]["8"] == 0.02  # the input is not modified


def test_calibrate_latency_fits_later_levels_and_the_first_one_goes_to_the_overhead():
    """Where the loop timed a tree's first draft level apart (it also forwards the pending tokens),
    the curve is scaled on the later levels alone, and the first forward's excess over its width's
    charge is what ``first_level_excess`` hands to that tree's overhead: the two together charge
    each measured tree exactly its draft forwards."""
    from sequoia_decoding.tools import calibrate_latency, first_level_excess

    prof = {"target_latency_s": {"1": 0.1, "8": 0.2, "32": 0.4}, "draft_step_s": 0.01,
            "draft_latency_s": {"1": 0.01, "8": 0.02, "32": 0.04}}
    later8 = (0.01 + 0.01 * 2 / 7) + (0.01 + 0.01 * 3 / 7)  # widths 3, 4
    later32 = 0.02 + (0.02 + 0.02 * 15 / 24)  # widths 8, 23
    loop = {"target_s": {1: 0.1, 8: 0.2, 32: 0.4}, "levels": {1: 1, 8: 4, 32: 4},
            "draft_widths": {1: [], 8: [2, 3, 4], 32: [2, 8, 23]},
            "first_forward_s": {8: 0.03, 32: 0.031}, "deep_forward_s": {8: 0.9 * later8 / 2, 32: 1.1 * later32 / 2}}
    loop["draft_forward_s"] = {1: 0.0, **{n: loop["first_forward_s"][n] + 2 * loop["deep_forward_s"][n] for n in (8, 32)}}
    cal = calibrate_latency(prof, loop)
    assert cal["draft_latency_s"] == pytest.approx({"1": 0.01, "8": 0.02, "32": 0.04})  # the median of 0.9, 1.1
    excess = first_level_excess(cal, loop)
    assert excess == pytest.approx({8: 0.03 - 0.01 * 8 / 7, 32: 0.031 - 0.01 * 8 / 7})
    for n, later in ((8, later8), (32, later32)):  # each tree: charged forwards + excess = measured up to the fit
        scale = loop["deep_forward_s"][n] * 2 / later
        assert 0.01 * 8 / 7 + later + excess[n] == pytest.approx(loop["draft_forward_s"][n] - (scale - 1) * later)
    # without the split (an older loop): every forward fitted, no excess
    old = {k: v for k, v in loop.items() if k not in ("first_forward_s", "deep_forward_s")}
    assert first_level_excess(calibrate_latency(prof, old), old) == {}
    # a profile without the curve: the draft step is a later level's forward
    flat = {k: v for k, v in prof.items() if k != "draft_latency_s"}
    assert calibrate_latency(flat, loop)["draft_step_s"] == pytest.approx(
        statistics.median(loop["deep_forward_s"].values()))


def test_choose_plan_charges_the_draft_by_level_width():
    """With a draft latency curve a candidate's draft costs the curve at each of its tree's level
    widths, summed (a wide level is one forward of many tokens); plan_step_s and
    predicted_speedup charge the chosen plan exactly as choose_plan did."""
    lat = {1: 0.05, 4: 0.055, 8: 0.06, 16: 0.07, 32: 0.09}
    curve = {1: 0.005, 4: 0.006, 8: 0.007, 16: 0.009, 32: 0.013}
    oh = {1: 0.001, 8: 0.003, 32: 0.006}
    hp = choose_plan(DEFAULT_ACCEPTANCE, 0.005, lat, 6, step_overhead_s=oh, draft_latency_s=curve)
    xs = sorted(curve)
    for c in hp.candidates:
        plan = plan_tree(DEFAULT_ACCEPTANCE, c.budget, c.max_depth)
        if plan.num_nodes == 1:
            assert c.step_s == pytest.approx(lat[1] + oh[1])
            continue
        draft = sum(np.interp(w, xs, [curve[x] for x in xs]) for w in level_widths(plan))
        assert c.step_s == pytest.approx(draft + lat[c.budget] + ref_overhead(oh, plan.num_nodes))
    assert hp.plan.num_nodes > 1
    phases, speedup = plan_step_s(hp.plan, hp.budget, 0.005, lat, oh, curve)
    assert sum(phases) == pytest.approx(hp.seconds_per_token * hp.plan.expected_tokens)
    assert speedup == pytest.approx(hp.speedup)
    assert predicted_speedup(hp.plan, hp.budget, 0.005, lat, oh, curve) == pytest.approx(hp.speedup)
    # a flat curve at the draft step charges what d - 1 draft steps charge, for the trees that use all d levels
    flat = choose_plan(DEFAULT_ACCEPTANCE, 0.005, lat, 6, draft_latency_s={n: 0.005 for n in curve})
    plain = choose_plan(DEFAULT_ACCEPTANCE, 0.005, lat, 6)
    for a, b in zip(flat.candidates, plain.candidates):
        if a.num_levels == a.max_depth:
            assert a.step_s == pytest.approx(b.step_s)
    with pytest.raises(ValueError, match="draft_latency_s"):
        choose_plan(DEFAULT_ACCEPTANCE, 0.005, lat, 6, draft_latency_s={0: 0.1})
    assert level_widths(plan_tree(DEFAULT_ACCEPTANCE, 1, 1)) == []
    assert level_widths(chain_tree(5)) == [2, 1, 1, 1, 1]  # 6 levels: the leaf is not forwarded
    assert level_widths(plan_tree(DEFAULT_ACCEPTANCE, 4, 2)) == [2]


def test_choose_plan_depth_range_and_errors():
    lat = {1: 0.03, 8: 0.031, 64: 0.04}
    hp = choose_plan(DEFAULT_ACCEPTANCE, 0.001, lat, max_depth=range(3, 6))
    assert {c.max_depth for c in hp.candidates} == {3, 4, 5}
    # string keys (as read from JSON) are accepted
    assert choose_plan(DEFAULT_ACCEPTANCE, 0.001, {"1": 0.03, "8": 0.031}, 4).budget in (1, 8)
    # no speculation when drafting is too slow: n = 1, d = 1, speedup 1
    slow = choose_plan(DEFAULT_ACCEPTANCE, 10.0, lat, 4)
    assert (slow.budget, slow.max_depth) == (1, 1) and slow.speedup == 1.0 and slow.plan.num_nodes == 1


def test_choose_plan_never_picks_a_plan_predicted_to_lose():
    """A curve where every tree is predicted a little slower than plain decoding (the case a
    busy 2-core machine produced: knee at n = 1, a draft step 1/8 of the target's) chooses
    the 1-node plan, at speedup exactly 1; any chosen tree is predicted >= 1x."""
    lat = {1: 0.110, 2: 0.182, 4: 0.211, 8: 0.230, 16: 0.265, 32: 0.368}
    hp = choose_plan((0.40, 0.15, 0.08, 0.05), 0.0195, lat, 8)
    assert hp.plan.num_nodes == 1 and hp.speedup == 1.0
    for draft_step in (0.0005, 0.004, 0.02, 0.1):
        assert choose_plan(DEFAULT_ACCEPTANCE, draft_step, _synthetic_latency(), 10).speedup >= 1.0
    for bad in ({8: 0.03}, {1: 0.0}, {1: -1.0}, {0: 0.1, 1: 0.1}, {"x": 0.1, 1: 0.1}, {}):
        with pytest.raises(ValueError):
            choose_plan(DEFAULT_ACCEPTANCE, 0.001, bad, 4)
    with pytest.raises(ValueError):
        choose_plan(DEFAULT_ACCEPTANCE, -0.001, lat, 4)


def test_load_latency(tmp_path):
    good = tmp_path / "lat.json"
    good.write_text(json.dumps({"draft_step_s": 0.004, "target_latency_s": {"1": 0.09, "16": 0.1}, "gpu": "x"}))
    assert load_latency(good) == (0.004, {1: 0.09, 16: 0.1})
    for text in ("{", "[]", '{"draft_step_s": 0.004}', '{"draft_step_s": "a", "target_latency_s": {"1": 1}}',
                 '{"draft_step_s": 0.004, "target_latency_s": {"2": 1}}',
                 '{"draft_step_s": 0.004, "target_latency_s": [1, 2]}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError) as e:
            load_latency(bad)
        assert "\n" not in str(e.value) and "bad.json" in str(e.value)
    with pytest.raises(OSError):
        load_latency(tmp_path / "missing.json")


def test_noisy_dip_in_the_latency_curve_is_not_charged():
    """A profile taken on a busy machine can read T(4) < T(1). A 1-node plan is plain decoding at any
    budget (charged T(1): speedup exactly 1, never "n = 4, d = 1 at 1.75x"), and T is charged as its
    running maximum, so the dip does not make a tree look cheaper than plain decoding."""
    lat = {1: 0.188, 2: 0.150, 4: 0.140, 8: 0.200}
    hp = choose_plan(DEFAULT_ACCEPTANCE, 0.05, lat, max_depth=4)
    for c in hp.candidates:
        if c.num_nodes == 1:
            assert c.speedup == pytest.approx(1.0)
        else:
            assert c.step_s >= 0.188 + 0.05 * (c.num_levels - 1) - 1e-12  # the levels the tree uses
    assert hp.speedup >= 1.0
    if hp.plan.num_nodes == 1:
        assert (hp.budget, hp.max_depth) == (1, 1) and hp.speedup == 1.0
    assert predicted_speedup(plan_tree(DEFAULT_ACCEPTANCE, 1, 1), 4, 0.05, lat) == pytest.approx(1.0)


# ------------------------------------------------------------- acceptance by depth (heads)


def _level_value(tree: tuple, p1, p) -> float:
    """E of a tree whose root's children are priced with p1 and every deeper node with p."""
    return 1.0 + sum((p1[i] if i < len(p1) else 0.0) * _tree_value(c, p) for i, c in enumerate(tree))


@pytest.mark.parametrize("case", range(12))
def test_level_acceptance_dp_is_exact(case):
    """With a first level better (or worse) than the deeper ones, the DP's tree is the best of all
    trees of <= n nodes and <= d levels under the two-vector model (brute force), and its E is the
    model's value of the tree it returns."""
    from sequoia_decoding.planner import LevelAcceptance

    rng = np.random.default_rng(SEED + 100 + case)
    p1 = _random_acceptance(rng, int(rng.integers(1, 6)), monotone=bool(case % 2))
    p = _random_acceptance(rng, int(rng.integers(1, 6)), monotone=bool(case % 3))
    if case == 0:
        p = [0.0]  # nothing below the first level pays
    acc = LevelAcceptance(p1, p)
    for n in range(1, 8):
        for d in range(1, 5):
            plan = plan_tree(acc, n, d)
            best = max(_level_value(t, p1, p) for m in range(1, n + 1) for t in _trees(m, d))
            assert plan.expected_tokens == pytest.approx(best, abs=1e-12), (n, d)
            assert plan.num_nodes <= n and plan.num_levels <= d
            assert expected_tokens(plan.parents, acc) == pytest.approx(plan.expected_tokens, abs=1e-12)
            assert plan.acceptance == acc and plan.acceptance.deep == tuple(p)


def test_level_acceptance_equal_levels_is_the_plain_vector():
    from sequoia_decoding.planner import LevelAcceptance

    for n, d in ((1, 1), (8, 3), (32, 5), (100, 8)):
        a, b = plan_tree(DEFAULT_ACCEPTANCE, n, d), plan_tree(LevelAcceptance(DEFAULT_ACCEPTANCE, DEFAULT_ACCEPTANCE), n, d)
        assert a.parents == b.parents and a.expected_tokens == pytest.approx(b.expected_tokens, abs=1e-12)


def test_level_acceptance_in_choose_plan_and_json():
    """choose_plan prices every candidate with the two-vector model; plans keep the deep vector
    through JSON and pickling; a bad deep vector is a ValueError."""
    import pickle

    from sequoia_decoding.planner import LevelAcceptance

    acc = LevelAcceptance([0.35, 0.13, 0.07, 0.05], [0.27, 0.12, 0.08, 0.06])
    table = {1: 0.05, 4: 0.052, 8: 0.055, 16: 0.06, 32: 0.07}
    hp = choose_plan(acc, 0.003, table, max_depth=6)
    for c in hp.candidates:
        assert c.expected_tokens == pytest.approx(plan_tree(acc, c.budget, c.max_depth).expected_tokens, abs=1e-12)
    flat = choose_plan(tuple(acc), 0.003, table, max_depth=6)  # the first level's vector everywhere
    assert flat.plan.expected_tokens > hp.plan.expected_tokens  # the deeper levels accept less
    back = TreePlan.from_dict(json.loads(hp.plan.to_json()))
    assert back == hp.plan and back.acceptance.deep == acc.deep
    assert pickle.loads(pickle.dumps(acc)).deep == acc.deep
    with pytest.raises(ValueError, match="sum to"):
        LevelAcceptance([0.5], [0.7, 0.6])


def test_compiled_dp_level_is_the_numpy_level_bitwise():
    """csrc/cpu/dp_level.cpp against dp._level_numpy: the same g and argmax tables bit for bit
    (fp64 product then add, the first maximum), on random vectors with ties, zeros and tiny
    values, every C <= M shape the DP builds and the edges (C = 0, M = 0, one rank)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sequoia_decoding import dp

    torch = pytest.importorskip("torch")
    pytest.importorskip("sequoia_kernels._C")
    op = dp._compiled("dp_level")
    if op is None:
        pytest.skip("sequoia_kernels._C has no dp_level")

    def compiled_level(p, g_prev, C, M):
        g, arg = np.empty(M + 2), np.empty((len(p), M + 1), dtype=np.int32)
        op(torch.from_numpy(np.ascontiguousarray(p)), torch.from_numpy(np.ascontiguousarray(g_prev)), C, M,
           torch.from_numpy(g), torch.from_numpy(arg))
        return g, arg

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.integers(1, 12), st.integers(0, 40), st.integers(0, 40), st.integers(0, 2**31 - 1),
           st.sampled_from(["random", "ties", "sparse"]))
    def check(K, M, C, seed, kind):
        C = min(C, M)
        rng = np.random.default_rng(seed)
        p = rng.dirichlet(np.ones(K + 1))[:K]
        if kind == "ties":
            p = np.round(p * 4) / 16
        elif kind == "sparse":
            p = np.where(rng.random(K) < 0.5, 0.0, p * 1e-9)
        g_prev = np.concatenate(([0.0], 1.0 + np.cumsum(rng.random(C + 2) * (kind != "ties"))))
        g_c, arg_c = compiled_level(p, g_prev, C, M)
        g_n, arg_n = dp._level_numpy(p, g_prev, C, M)
        assert np.array_equal(g_c, g_n) and g_c.tobytes() == g_n.tobytes()
        assert np.array_equal(arg_c, arg_n)

    check()


def test_compiled_dp_tables_are_the_numpy_tables_bitwise(monkeypatch):
    """csrc/cpu/dp_level.cpp's dp_tables (every level of a DP in one call) against dp._Tables
    built level by level in numpy: the same g and argmax tables, levels, values and rebuilt
    trees bit for bit, for plain and per-level vectors, ties and zeros, budgets and depths from
    1 (one node, one level) up."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sequoia_decoding import dp
    from sequoia_decoding.planner import LevelAcceptance

    pytest.importorskip("sequoia_kernels._C")
    if dp._compiled("dp_tables") is None:
        pytest.skip("sequoia_kernels._C has no dp_tables")

    def numpy_tables(acc, N, D):
        with monkeypatch.context() as m:
            m.setitem(dp._OP, "dp_tables", None)
            return dp.tables_for(acc, N, D)

    @settings(max_examples=120, deadline=None, derandomize=True)
    @given(st.integers(1, 10), st.integers(1, 40), st.integers(1, 9), st.integers(0, 2**31 - 1),
           st.sampled_from(["random", "ties", "sparse"]), st.booleans())
    def check(K, N, D, seed, kind, per_level):
        rng = np.random.default_rng(seed)
        v, w = rng.dirichlet(np.ones(K + 1))[:K], rng.dirichlet(np.ones(K + 1))[:K]
        if kind == "ties":
            v = np.round(v * 4) / 16
        elif kind == "sparse":
            v = np.where(rng.random(K) < 0.5, 0.0, v)
        acc = LevelAcceptance(tuple(v), tuple(w)) if per_level else tuple(v)
        a, b = dp.tables_for(acc, N, D), numpy_tables(acc, N, D)
        assert (a.N, a.K, a.d_eff, len(a.g), len(a.arg)) == (b.N, b.K, b.d_eff, len(b.g), len(b.arg))
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a.g[1:], b.g[1:]))
        assert all(np.array_equal(x, y) for x, y in zip(a.arg[2:], b.arg[2:]))
        assert (a.root is None) == (b.root is None)
        if a.root is not None:
            assert len(a.root) == len(b.root) and a.K1 == b.K1
            assert all(x[0].tobytes() == y[0].tobytes() for x, y in zip(a.root[1:], b.root[1:]))
            assert all(np.array_equal(x[1], y[1]) for x, y in zip(a.root[2:], b.root[2:]))
        for n in range(1, a.N + 1):
            for d in range(1, D + 1):
                assert a.value(d, n) == b.value(d, n) and a.rebuild(n, d) == b.rebuild(n, d)

    check()


def test_dp_tables_rejects_bad_shapes():
    import torch

    from sequoia_decoding import dp

    pytest.importorskip("sequoia_kernels._C")
    op = dp._compiled("dp_tables")
    if op is None:
        pytest.skip("sequoia_kernels._C has no dp_tables")
    f64, i32 = torch.float64, torch.int32
    p, p1 = torch.tensor([0.5, 0.2], dtype=f64), torch.tensor([0.4], dtype=f64)
    N, D = 4, 3
    g, root_g = torch.full((D + 1, N + 1), float("nan"), dtype=f64), torch.full((D + 1, N + 1), float("nan"), dtype=f64)
    arg, root_arg = torch.full((D + 1, 2, N), -7, dtype=i32), torch.full((D + 1, 1, N), -7, dtype=i32)
    levels = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="arg must be"):
        op(p, p1, True, N, D, g, arg[:, :1], root_g, root_arg, levels)
    with pytest.raises(RuntimeError, match="K, K1 <= N - 1"):
        op(torch.full((N,), 0.1, dtype=f64), p1, True, N, D, g, torch.zeros(D + 1, N, N, dtype=i32), root_g,
           root_arg, levels)
    with pytest.raises(RuntimeError, match="K1 = 0 unless per_level"):
        op(p, p1, False, N, D, g, arg, root_g, root_arg, levels)
    with pytest.raises(RuntimeError, match="g must be"):
        op(p, p1, True, N, D, g[:, :N], arg, root_g, root_arg, levels)
    assert torch.isnan(g).all() and (arg == -7).all() and (levels == 0).all()  # nothing written
    op(p, p1, True, N, D, g, arg, root_g, root_arg, levels)
    assert levels.tolist() == [2, 3] and g[1].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_dp_level_rejects_bad_shapes():
    import torch

    from sequoia_decoding import dp

    pytest.importorskip("sequoia_kernels._C")
    op = dp._compiled("dp_level")
    if op is None:
        pytest.skip("sequoia_kernels._C has no dp_level")
    p, g_prev = torch.tensor([0.5, 0.2], dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    g, arg = torch.full((5,), float("nan"), dtype=torch.float64), torch.full((2, 4), -7, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="g_prev must be"):
        op(p, g_prev[:2], 3, 3, g, arg)
    with pytest.raises(RuntimeError, match="arg must be"):
        op(p, g_prev, 3, 3, g, arg[:1])
    assert bool(g.isnan().all()) and bool((arg == -7).all())  # nothing written
    op(p, g_prev, 3, 3, g, arg)
    assert not bool(g.isnan().any())


_DP_PATHS_SCRIPT = """
import sys, torch
import sequoia_kernels  # loads the extension
from sequoia_decoding import dp
op = dp._compiled("dp_level")
outs = []
for p, g_prev, C, M in torch.load(sys.argv[1]):
    g = torch.full((M + 2,), float("nan"), dtype=torch.float64)
    arg = torch.full((p.numel(), M + 1), -7, dtype=torch.int32)
    op(p, g_prev, C, M, g, arg)
    outs.append((g, arg))
torch.save(outs, sys.argv[2])
"""


def test_dp_level_vector_paths_are_the_numpy_level_bitwise(tmp_path):
    """dp_level's loop over m on each CPU path (the baseline x86-64, AVX2's 4 lanes, AVX-512's 8
    where the CPU has it; each in its own process, chosen by ATEN_CPU_CAPABILITY): the numpy
    level's g and argmax tables bit for bit, at sizes with every vector tail (M = 0 .. 19), the
    re-planner's (M = 255, C = 17 and C = M) and ties (the first maximum must win in every lane)."""
    import torch
    from cpu_paths import outputs_per_path

    from sequoia_decoding import dp

    pytest.importorskip("sequoia_kernels._C")
    if dp._compiled("dp_level") is None:
        pytest.skip("sequoia_kernels._C has no dp_level")
    rng = np.random.default_rng(23)
    cases = []
    for K, C, M, kind in [(3, m, m, "random") for m in range(20)] + [(16, 17, 255, "random"), (16, 255, 255, "random"),
                                                                    (5, 9, 37, "ties"), (7, 61, 61, "ties")]:
        p = rng.dirichlet(np.ones(K + 1))[:K]
        steps = rng.random(C + 2)
        if kind == "ties":
            p, steps = np.round(p * 4) / 16, np.ones(C + 2)
        g_prev = np.concatenate(([0.0], 1.0 + np.cumsum(steps)))
        cases.append((torch.from_numpy(p), torch.from_numpy(g_prev), C, M))
    with open("/proc/cpuinfo") as f:
        caps = ("default", "avx2") + (("avx512",) if " avx512f" in f.read() else ())
    outs = outputs_per_path(_DP_PATHS_SCRIPT, cases, tmp_path, caps=caps)
    for i, (p, g_prev, C, M) in enumerate(cases):
        g_n, arg_n = dp._level_numpy(p.numpy(), g_prev.numpy(), C, M)
        for cap in caps:
            g, arg = outs[cap][i]
            assert g.numpy().tobytes() == g_n.tobytes(), f"case {i} on {cap}: g differs"
            assert np.array_equal(arg.numpy(), arg_n), f"case {i} on {cap}: the argmax table differs"


def test_machine_code_of_the_dp_level_paths():
    """Static (objdump) check of dp_level's vector paths: AVX-512's sums and compares candidates in
    zmm registers and AVX2's in ymm ones, neither with an FMA (each candidate is a product
    rounded, then a sum: the numpy reference's bits)."""
    import re

    from machine_code import disassembly

    for name, reg in (("level_avx512(", "zmm"), ("level_avx2(", "ymm")):
        # the function's hot body, not its .cold part (exception paths)
        m = re.search(rf"<[^>]*{re.escape(name)}[^>.]*>:\n(.*?)\n\n", disassembly(), re.S)
        if m is None:
            pytest.skip(f"no {name} in this build (not x86-64 GCC / Clang)")
        body = m.group(1)
        assert re.search(rf"vcmp\w*pd\s[^\n]*%{reg}", body), f"{name}: no packed compares on {reg}"
        assert re.search(rf"vaddpd\s[^\n]*%{reg}", body), f"{name}: no packed sums on {reg}"
        assert not re.search(r"vfn?m(add|sub)", body), f"{name}: an FMA contracts the candidate's product and sum"
