"""Verification with the target's logits computed only where it reads them (``lazy_logits``).

``verify_reading`` must return exactly what ``verify_tree`` returns on the full logits (the same
path, length, bonus and the same p along the path, bitwise) for every tree, filter and batch
(hypothesis); the loop with it must give the same tokens as without it, follow the target's
filtered distribution at T > 0 (chi-square), compute few of a large tree's rows, and refuse NaN
logits in a row it reads as the full forward does.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiny_models
from conftest import assert_pairs_follow, filtered_two_token_distribution, pair_counts
from test_feature_drafter import VOCAB, bigram_target_and_oracle
from test_loop_properties import random_bfs_tree

from sequoia_decoding.drafters import block_eos, filtered_probs, first_child_acceptance
from sequoia_decoding.generate import NonFiniteLogitsError, SamplingParams, SequoiaGenerator
from sequoia_decoding.lazy_logits import LAZY_MIN_NODES, lazy_from, verify_reading
from sequoia_decoding.planner import plan_tree
from sequoia_decoding.spec import first_children
from sequoia_decoding.step_buffers import KeptRows
from sequoia_kernels.ops.verify_tree import verify_tree


class RowHead(torch.nn.Module):
    """An LM head whose rows are computed one by one (a product and a sum per row): a row's logits
    are the same bits whatever other rows share the call, as the loop's packed linears."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.calls: list[int] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V]
        self.calls.append(h[..., 0].numel())
        return (h[..., None, :] * self.weight).sum(-1)


@st.composite
def reading_cases(draw):
    V = draw(st.integers(4, 40))
    parents = draw(random_bfs_tree(max_nodes=40, max_children=min(5, V)))
    temperature = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0]))
    return dict(V=V, parents=parents, B=draw(st.integers(1, 3)), temperature=temperature,
                top_k=draw(st.sampled_from([0, 1, 3])), top_p=draw(st.sampled_from([0.3, 0.9, 1.0])),
                sharp=draw(st.sampled_from([1.0, 4.0])), eos=draw(st.booleans()),
                q_none=temperature == 0.0 and draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _case_tensors(c):
    """Hidden states, a head, tokens (children among their parent's likeliest tokens, shuffled a
    little: paths go deep and often through later children), q, uniforms, EOS blocking."""
    g = torch.Generator().manual_seed(c["seed"])
    B, V, H, parents = c["B"], c["V"], 8, c["parents"]
    T = len(parents)
    head = RowHead(torch.randn(V, H, generator=g, dtype=torch.float64) * c["sharp"])
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    logits = head(hidden)
    tokens = torch.full((B, T), -1, dtype=torch.int64)
    for u in range(T):
        kids = [c_ for c_ in range(T) if parents[c_] == u]
        if kids:
            order = logits[:, u].argsort(-1, descending=True)  # [B, V]
            swap = torch.randint(0, 2, (B,), generator=g).bool()  # some rows: the second likeliest first
            order[swap, :2] = order[swap, :2].flip(-1)
            tokens[:, kids] = order[:, :len(kids)]
    q = None if c["q_none"] else (logits + torch.randn(B, T, V, generator=g, dtype=torch.float64)).float().softmax(-1)
    uniforms = None if c["temperature"] == 0.0 else torch.rand(B, T, generator=g)
    depth = torch.tensor([0] * T)
    for u in range(1, T):
        depth[u] = depth[parents[u]] + 1
    eos = (torch.tensor([0, V - 1]), torch.randint(0, 4, (B,), generator=g)) if c["eos"] else None
    return head, hidden, tokens, q, uniforms, depth, eos


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=reading_cases())
def test_verify_reading_is_verify_tree_on_the_full_logits(c):
    head, hidden, tokens, q, uniforms, depth, eos = _case_tensors(c)
    sampling = SamplingParams(temperature=c["temperature"], top_k=c["top_k"], top_p=c["top_p"])
    parents = torch.tensor(c["parents"])

    full = head(hidden)  # [B, T, V]
    block_eos(full, depth, eos)
    p_full = filtered_probs(full, sampling, None)
    want = verify_tree(p_full, q if q is not None else p_full, tokens, parents, greedy=sampling.greedy,
                       uniforms=uniforms, validate=False)
    head.calls.clear()
    path, num, bonus, p, bad = verify_reading(head, hidden, q, tokens, parents, first_children(c["parents"], "cpu"),
                                              depth, sampling, uniforms, None, eos)
    assert torch.equal(path, want[0]) and torch.equal(num, want[1]) and torch.equal(bonus, want[2])
    assert not bool(bad)
    for b in range(c["B"]):  # p along the path: the full forward's bits
        read = path[b, :num[b]]
        assert torch.equal(p[b, read], p_full[b, read])
    if q is not None:  # what the adaptive re-planner reads of a step (the path's rows)
        assert torch.equal(first_child_acceptance(p, q, path), first_child_acceptance(p_full, q, path))
    assert len(head.calls) <= int(depth.max()) + 1  # one pass per level at most

    # placeholder rows kept from earlier steps: any distributions, here the ones that mislead most
    # (each node's row on its last child's token: passes wander deep through rows not computed)
    placeholders = KeptRows()
    stale = placeholders.rows(c["B"], len(c["parents"]) + 1, c["V"], "cpu")  # a larger tree's step before
    stale.zero_()
    for u, kids in enumerate([[k for k in range(len(parents)) if c["parents"][k] == u] for u in range(len(parents))]):
        last = tokens[:, kids[-1]] if kids else torch.zeros(c["B"], dtype=torch.int64)
        stale.view(-1, c["V"])[torch.arange(c["B"]) * len(parents) + u, last] = 1.0  # the layout this step views
    head.calls.clear()
    again = verify_reading(head, hidden, q, tokens, parents, first_children(c["parents"], "cpu"), depth, sampling,
                           uniforms, None, eos, placeholders=placeholders)
    assert all(torch.equal(a, b) for a, b in zip(again[:3], want))
    assert len(head.calls) <= int(depth.max()) + 1
    for b in range(c["B"]):
        read = path[b, :num[b]]
        assert torch.equal(again[3][b, read], p_full[b, read])


def test_kept_rows_keep_one_buffer():
    """A step's [B, T, V] rows: one buffer reused while it is large enough (no allocation, no fill
    per step), its entries the fill when made (1 / V: distributions), grown for a larger step."""
    ph = KeptRows()
    a = ph.rows(2, 8, 10, "cpu")
    assert a.shape == (2, 8, 10) and torch.allclose(a.sum(-1), torch.ones(2, 8)) and bool((a > 0).all())
    a[0, 0] = torch.nn.functional.one_hot(torch.tensor(3), 10).float()  # a step writes a real row
    b = ph.rows(1, 5, 10, "cpu")  # a smaller step: the same storage, the row written still there
    assert b.data_ptr() == a.data_ptr() and torch.equal(b[0, 0], a[0, 0])
    c = ph.rows(4, 8, 10, "cpu")  # a larger one: a new buffer, all 1 / V
    assert c.shape == (4, 8, 10) and torch.allclose(c, torch.full_like(c, 0.1))
    d = ph.rows(1, 5, 8, "cpu")  # another vocabulary (320 values hold 40 rows of 8): rows of 8 afresh
    assert torch.allclose(d.sum(-1), torch.ones(1, 5)) and d.data_ptr() != c.data_ptr()
    with ph.held():  # a call: the buffer kept through it, freed after
        assert ph.rows(1, 5, 8, "cpu").data_ptr() == d.data_ptr()
    assert ph._buf is None
    q = KeptRows(0.0)  # a draft's q: zeros where no step writes
    first = q.rows(3, 4, 6, "cpu")
    assert not bool(first.any()) and q.rows(2, 4, 6, "cpu").data_ptr() == first.data_ptr()


def test_lazy_from_chooses_and_refuses():
    cpu = torch.device("cpu")
    assert lazy_from(None, cpu, None, False) == LAZY_MIN_NODES
    assert lazy_from(True, cpu, None, False) == 2
    assert lazy_from(False, cpu, None, False) > 10**9
    assert lazy_from(None, torch.device("cuda"), None, False) > 10**9  # the GPU's head over all rows is cheap
    with pytest.raises(ValueError, match="CUDA graph"):
        lazy_from(True, torch.device("cuda"), None, True)
    with pytest.raises(ValueError, match="lazy_logits must be"):
        lazy_from("yes", cpu, None, False)


def _pairs():
    """A tiny standalone pair (fp32) and a bigram target with an oracle feature head (deep paths)."""
    target, draft = tiny_models.tiny_llama(0, vocab=VOCAB, sharpen=8.0), tiny_models.tiny_llama(1, vocab=VOCAB,
                                                                                                 layers=1, sharpen=8.0)
    return {"standalone": (target, draft), "head": bigram_target_and_oracle(dtype=torch.float32)}


@pytest.mark.parametrize("drafter", ["standalone", "head"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=3),
                                      SamplingParams(temperature=0.7, top_p=0.85, seed=4)])
def test_the_loop_gives_the_same_tokens_with_and_without_lazy_logits(drafter, sampling):
    target, draft = _pairs()[drafter]
    plan = plan_tree([0.6, 0.2, 0.1, 0.05], 40, 6)
    prompts = [[3, 17, 5, 9], [22, 4]]
    outs = [SequoiaGenerator(target, draft, plan, sampling, max_length=160, lazy_logits=lazy).generate(
        prompts, max_new_tokens=24, eos_token_id=[7], min_new_tokens=6) for lazy in (False, True)]
    assert outs[0].tokens == outs[1].tokens
    assert [s.accepted for s in outs[0].steps] == [s.accepted for s in outs[1].steps]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_re_planning_every_step_with_lazy_logits(temperature):
    """The re-planner reads each step's p along the path (first-child acceptance): with lazy
    logits forced and a tree re-solved every step, greedy calls make the target's own greedy
    tokens and sampled ones (top-p 0.9) follow its filtered distribution (chi-square)."""
    from test_adaptive import LATENCY, OVERHEAD
    from test_loop_properties import sharp_llama
    from tiny_models import greedy_reference

    from sequoia_decoding.adaptive import AdaptiveConfig

    target, draft = sharp_llama(0, 2), sharp_llama(1, 1)
    sampling = SamplingParams(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=11)
    cfg = AdaptiveConfig(every=1, decay=0.5, prior_strength=1.0, latency=LATENCY, overhead_s=OVERHEAD)
    gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2, 0.1], 9, 4), sampling, max_length=160, adaptive=cfg,
                           lazy_logits=True)
    prompt = [3, 17, 5]
    if temperature == 0.0:
        out = gen.generate([prompt], max_new_tokens=30, eos_token_id=[])
        assert out.tokens[0] == greedy_reference(target, prompt, 30) and out.replan.replans >= len(out.steps) - 1
        return
    n = 3000
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])  # n independent rows
    assert_pairs_follow(pair_counts(out.tokens, VOCAB), filtered_two_token_distribution(target, prompt, sampling), n)


def test_a_large_tree_computes_few_of_its_rows():
    """An oracle head on a 64-node tree: the LM head runs over a few rows a step, not 64."""
    target, head = bigram_target_and_oracle(dtype=torch.float32)
    rows: list[int] = []
    hook = target.get_output_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    try:
        gen = SequoiaGenerator(target, head, plan_tree([0.6, 0.2, 0.1, 0.05], 64, 8), SamplingParams(),
                               max_length=256)
        out = gen.generate([[3, 17, 5]], max_new_tokens=40, eos_token_id=[])
    finally:
        hook.remove()
    steps = len(out.steps)
    assert gen._lazy_from <= 64 and steps > 1
    per_step = (sum(rows) - 1) / steps  # the prefill's last position aside
    assert per_step <= 2 * out.tokens_per_step + 2, (per_step, out.tokens_per_step)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["standalone", "head"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.85), (0.6, 4, 1.0), (1.0, 0, 1.0)])
def test_sampling_with_lazy_logits_is_exact(drafter, temperature, top_k, top_p):
    """The first two new tokens follow the target's filtered distribution (chi-square) with the
    rows computed on demand, on a DP tree: an oracle head's (deep paths) and a random draft's
    (later children accepted: second passes)."""
    target, head = _pairs()[drafter]
    prompt, n = [3, 17, 5], 3000
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=21)
    exact = filtered_two_token_distribution(target, prompt, sampling)
    gen = SequoiaGenerator(target, head, plan_tree([0.6, 0.2, 0.1], 12, 4), sampling, max_length=64,
                           lazy_logits=True)
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])
    assert out.tokens_per_step > (1.5 if drafter == "head" else 1.0)
    assert_pairs_follow(pair_counts(out.tokens, VOCAB), exact, n)


@pytest.mark.parametrize("validate", [True, False])
def test_nan_in_a_row_it_reads_is_refused_and_the_generator_goes_on(validate):
    """Refused either way (``validate=False``: when the step's tokens are read); the placeholder
    rows a call kept (NaN among them now) are freed with the call, as after a call that succeeds."""
    target, draft = _pairs()["standalone"]
    gen = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2, 0.1], 40, 5), SamplingParams(temperature=0.8, seed=1),
                           max_length=128, lazy_logits=True, validate=validate)
    calls = {"n": 0}

    def poison(module, args, out):
        calls["n"] += 1
        if calls["n"] > 1:  # every pass after the prefill's
            out[..., 2] = float("nan")
        return out

    handle = target.get_output_embeddings().register_forward_hook(poison)
    try:
        with pytest.raises(NonFiniteLogitsError, match="decoding step 0: the target model returned NaN"):
            gen.generate([[3, 4, 5]], max_new_tokens=30, eos_token_id=[])
    finally:
        handle.remove()
    assert gen._placeholders._buf is None
    assert len(gen.generate([[3, 4, 5]], max_new_tokens=6, eos_token_id=[]).tokens[0]) == 6
    assert gen._placeholders._buf is None


def test_the_profile_times_what_the_loop_runs():
    """``profile_latency`` times a target's LM head over all of a small tree's rows and over
    ``LAZY_PROFILE_ROWS`` of a lazily verified one's (the loop's first pass)."""
    from sequoia_decoding.tools import LAZY_PROFILE_ROWS, profile_latency

    target, draft = _pairs()["standalone"]
    rows: list[int] = []
    hook = target.get_output_embeddings().register_forward_hook(
        lambda m, args, out: rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    try:
        prof = profile_latency(target, None, sizes=[8, LAZY_MIN_NODES + 3], prefix=8, repeats=1, progress=False)
    finally:
        hook.remove()
    assert set(rows) == {1, 8, LAZY_PROFILE_ROWS}, rows
    assert set(prof["target_latency_s"]) == {"1", "8", str(LAZY_MIN_NODES + 3)}
