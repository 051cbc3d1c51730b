"""Property-based tests of the whole decoding loop (hypothesis), and its exactness where the
draft's filtered distribution (top-k / top-p) has fewer tokens than a node has children.

Crossed at random: tiny Llama pairs (vocabulary 5-64, MHA and GQA), tree shapes (Sequoia DP
trees from random acceptance vectors, chains, k x d, random trees, trees wider than the
vocabulary), temperature, top-k, top-p, batch 1-4 with ragged prompts, an EOS id that the
models emit often, ``max_new_tokens`` reached in the middle of an accepted path. The models are
float64 (reference attention) or float32 (this machine's default kernels); greedy output must
equal the target's own greedy decoding token for token (and so must sampling with top-k 1,
which keeps only the argmax at any temperature).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

import tiny_models
from conftest import assert_pairs_follow, filtered_two_token_distribution, pair_counts
from tiny_models import greedy_reference

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import chain_tree, kxd_tree, plan_tree, tree_from_parents

# Bounded: a few minutes at most in `make test` on 2 cores, the same cases on every run.
LOOP_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def tiny_llama(seed: int, vocab: int, layers: int, kv_heads: int, dtype=torch.float64) -> LlamaForCausalLM:
    """Peaked distributions (top-p leaves few tokens, trees get accepted), small heads."""
    return tiny_models.tiny_llama(seed, vocab=vocab, layers=layers, hidden=32, kv_heads=kv_heads, head_dim=16,
                                  dtype=dtype, sharpen=6.0)


def cut_at_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


@st.composite
def random_bfs_tree(draw, max_nodes: int = 24, max_children: int = 6):
    """Parents of a random tree in BFS order with consecutive children (up to ``max_children`` per node)."""
    parents, frontier, nxt = [-1], [0], 1
    while frontier and nxt < max_nodes:
        level = []
        for node in frontier:
            k = draw(st.integers(0, min(max_children, max_nodes - nxt)))
            parents += [node] * k
            level += list(range(nxt, nxt + k))
            nxt += k
        frontier = level
    return parents


@st.composite
def tree_plans(draw, vocab: int):
    kind = draw(st.sampled_from(["dp", "chain", "kxd", "random", "wider_than_vocab"]))
    if kind == "dp":
        acc = draw(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6))
        total = sum(acc)
        acc = [a / max(total, 1.0) * draw(st.floats(0.05, 1.0)) for a in acc]
        return plan_tree(acc, draw(st.integers(1, 24)), draw(st.integers(1, 5)))
    if kind == "chain":
        return chain_tree(draw(st.integers(0, 6)))
    if kind == "kxd":
        return kxd_tree(draw(st.integers(1, 5)), draw(st.integers(1, 3)))
    if kind == "random":
        return tree_from_parents(draw(random_bfs_tree()))
    # the root (and its first child) ask for more children than the vocabulary has tokens
    k = vocab + draw(st.integers(1, 3))
    return tree_from_parents([-1] + [0] * k + [1] * draw(st.integers(0, 3)))


@st.composite
def loop_cases(draw):
    vocab = draw(st.integers(5, 64))
    kv_heads = draw(st.sampled_from([4, 2, 1]))  # MHA, GQA, MQA
    temperature = draw(st.sampled_from([0.0, 0.3, 1.0, 2.0]))
    top_k = draw(st.sampled_from([0, 1, 2, vocab]))
    top_p = draw(st.sampled_from([0.05, 0.5, 1.0]))
    batch = draw(st.integers(1, 4))
    prompts = [draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=7)) for _ in range(batch)]
    eos = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    # float64 runs the reference attention; float32 the default kernels of this machine
    dtype = draw(st.sampled_from([torch.float64, torch.float32]))
    return dict(dtype=dtype, vocab=vocab, kv_heads=kv_heads, plan=draw(tree_plans(vocab)), temperature=temperature, top_k=top_k,
                top_p=top_p, prompts=prompts, eos=eos, max_new_tokens=draw(st.integers(1, 12)),
                seed=draw(st.integers(0, 2**16)))


@LOOP_SETTINGS
@given(case=loop_cases())
def test_loop_never_raises_and_greedy_equals_the_targets_own_greedy(case):
    V, plan = case["vocab"], case["plan"]
    target = tiny_llama(case["seed"], V, layers=2, kv_heads=case["kv_heads"], dtype=case["dtype"])
    draft = tiny_llama(case["seed"] + 1, V, layers=1, kv_heads=case["kv_heads"], dtype=case["dtype"])
    sampling = SamplingParams(temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"],
                              seed=case["seed"])
    n, eos = case["max_new_tokens"], case["eos"]
    room = max(len(p) for p in case["prompts"]) + n + plan.num_nodes  # every drawn case fits the caches
    gen = SequoiaGenerator(target, draft if plan.num_nodes > 1 else None, plan, sampling, max_length=max(64, room),
                           backend="reference" if case["dtype"] == torch.float64 else None)
    out = gen.generate(case["prompts"], max_new_tokens=n, eos_token_id=[] if eos is None else eos)

    assert len(out.tokens) == len(case["prompts"])
    for toks in out.tokens:
        assert all(0 <= t < V for t in toks), toks
        if eos is not None and eos in toks:  # stopped at the first EOS, nothing after it
            assert toks.index(eos) == len(toks) - 1 and len(toks) <= n, toks
        else:  # exactly max_new_tokens, also when the limit fell inside an accepted path
            assert len(toks) == n, toks
    for s in out.steps:
        assert all(1 <= e <= a + 1 for e, a in zip(s.emitted, s.accepted))
        assert all(0 <= a < plan.num_nodes for a in s.accepted)

    argmax_only = case["temperature"] == 0.0 or case["top_k"] == 1
    if argmax_only:
        for prompt, toks in zip(case["prompts"], out.tokens):
            assert toks == cut_at_eos(greedy_reference(target, prompt, n), eos), (prompt, plan.parents)


# ------------------------------------------------------------------ exactness, narrow filters

VOCAB = 61


def sharp_llama(seed: int, layers: int) -> LlamaForCausalLM:
    return tiny_models.tiny_llama(seed, vocab=VOCAB, layers=layers, sharpen=8.0)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.8), (0.5, 3, 1.0)])
def test_sampling_is_exact_with_filters_narrower_than_the_tree(temperature, top_k, top_p):
    """Top-p 0.8 at T = 0.7 and top-k 3 at T = 0.5 on a DP tree whose root has more children than
    the draft's filtered support: the first two tokens follow the target's filtered distribution."""
    from sequoia_kernels.reference.sampling import sampling_probs_reference

    target, draft = sharp_llama(0, 2), sharp_llama(1, 1)
    prompt, n = [3, 17, 5], 3000
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=99)
    # a slowly decaying acceptance vector: the DP gives the root 13 children (20 nodes, 3 levels)
    plan = plan_tree([0.2, 0.15, 0.12, 0.1, 0.08, 0.07, 0.06, 0.05, 0.04, 0.035, 0.03, 0.025, 0.02, 0.015], 20, 3)
    root_children = plan.children_counts()[0]
    draft.set_attn_implementation("sdpa")
    with torch.no_grad():
        q_root = sampling_probs_reference(draft(torch.tensor([prompt])).logits[0, -1], temperature, top_k, top_p)
    support = int((q_root > 0).sum())
    assert root_children > support, (root_children, support)  # the case that crashed the loop

    exact = filtered_two_token_distribution(target, prompt, sampling)
    gen = SequoiaGenerator(target, draft, plan, sampling, max_length=64)
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])  # n independent rows
    counts = pair_counts(out.tokens, VOCAB)
    assert_pairs_follow(counts, exact, n)
