"""The loop's prefill of ragged batches (``sequoia_decoding.prefill``): on a CPU the target reads
runs of rows through views of the cache (``SequoiaCache.rows``), about the real tokens instead of
B x the longest prompt, and every cache and drafter state it leaves equals the padded batch's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiny_models
from test_feature_drafter import VOCAB, random_head
from tiny_models import greedy_reference

from sequoia_kernels.hf import SequoiaCache

from sequoia_decoding import prefill as prefill_mod
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.patching import sequoia_models
from sequoia_decoding.planner import plan_tree
from sequoia_decoding.prefill import FORWARD_ROWS, runs


def test_runs_examples():
    assert runs([7, 7, 7]) == [(0, 3)]  # equal prompts: one forward, as before
    assert runs([4, 0, 1]) == [(0, 3)]  # short rows: one forward's fixed cost outweighs their padding
    assert runs([100, 10, 100, 100]) == [(0, 1), (1, 2), (2, 4)]
    assert runs([0, 0]) == [] and runs([0, 5, 0]) == [(1, 2)]  # one-token prompts read nothing
    assert runs([40, 2, 1, 40]) == [(0, 1), (1, 3), (3, 4)]
    assert runs([2, 40, 2, 40], forward_rows=100) == [(0, 4)]  # a dear forward: padded, as on a GPU


def _cost(parts, lens, forward_rows):
    return sum(forward_rows + (z - a) * max(lens[a:z]) for a, z in parts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=9), st.sampled_from([0, 1, FORWARD_ROWS, 64]))
def test_runs_are_the_cheapest_contiguous_split_of_the_rows_that_read(lens, forward_rows):
    """Every row of positive length in exactly one run, runs contiguous, in order, starting and
    ending at a row that reads; their cost the least over every contiguous split (brute force)."""
    parts = runs(lens, forward_rows)
    covered = [b for a, z in parts for b in range(a, z)]
    assert covered == sorted(set(covered))
    assert {b for b, n in enumerate(lens) if n > 0} <= set(covered)
    assert all(lens[a] > 0 and lens[z - 1] > 0 for a, z in parts)
    B, least = len(lens), None
    for cuts in range(2 ** (B - 1)):  # every split of 0 .. B - 1 into contiguous runs
        bounds = [0] + [i + 1 for i in range(B - 1) if cuts >> i & 1] + [B]
        split = [(a, z) for a, z in zip(bounds, bounds[1:]) if any(lens[a:z])]
        cost = _cost(split, lens, forward_rows)
        least = cost if least is None else min(least, cost)
    assert _cost(parts, lens, forward_rows) == least


def test_rows_view_writes_and_commits_into_the_cache():
    cache = SequoiaCache(batch_size=3, max_cache_len=8, num_layers=2, num_kv_heads=2, head_dim=4,
                         dtype=torch.float64)
    view = cache.rows(1, 3)
    assert view.tensor.data_ptr() == cache.tensor[:, 1].data_ptr() and view.prefix_len.shape == (2,)
    k = torch.randn(2, 2, 3, 4, dtype=torch.float64)
    view.update(k, -k, 1)
    view.commit(torch.tensor([3, 1]))
    assert cache.prefix_len.tolist() == [0, 3, 1]
    torch.testing.assert_close(cache.tensor[2, 1:, :, :3], k, rtol=0, atol=0)  # layer 1's keys
    torch.testing.assert_close(cache.tensor[3, 1:, :, :3], -k, rtol=0, atol=0)
    assert not cache.tensor[:, 0].any()
    for bad in [(0, 0), (2, 4), (-1, 1)]:
        with pytest.raises(ValueError, match="not rows of a batch of 3"):
            cache.rows(*bad)


def _drafter_state(drafter) -> list[torch.Tensor]:
    """The drafter's state tensors and its cache's committed entries (past them: padding)."""
    out = [t.clone() for t in drafter.state()]
    cache = getattr(drafter, "cache", None)
    if cache is not None:
        out += [cache.tensor[:, b, :, :n].clone() for b, n in enumerate(cache.prefix_len.tolist())]
    return out


@pytest.mark.parametrize("kind", ["none", "model", "eagle1x", "eagle3"])
@torch.no_grad()
def test_ragged_prefill_reads_the_real_tokens_and_leaves_the_padded_batchs_state(kind, monkeypatch):
    """fp64: the target's forwards read sum(lens) tokens, not B x W; the target's cache entries,
    prefix lengths, roots and the drafter's state equal the padded batch's; then the same
    greedy tokens as each prompt decoded alone."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, dtype=torch.float64, sharpen=3.0)
    draft = {"none": None, "model": tiny_models.tiny_llama(1, vocab=VOCAB, layers=2, dtype=torch.float64),
             "eagle1x": random_head(target, "eagle1x", 5), "eagle3": random_head(target, "eagle3", 5, 40)}[kind]
    plan = plan_tree([0.5, 0.2], 1 if draft is None else 6, 1 if draft is None else 3)
    long = [(7 * i) % (VOCAB - 1) + 1 for i in range(41)]
    prompts = [long, [3], [8, 2, 5], long[::-1]]  # runs (0, 1), (1, 3), (3, 4)
    lens = [len(p) - 1 for p in prompts]
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=96, backend="reference")

    read = []
    hook = target.get_input_embeddings().register_forward_hook(lambda m, a, o: read.append(a[0].numel()))
    states = {}
    for mode in ("runs", "padded"):
        if mode == "padded":
            monkeypatch.setattr(prefill_mod, "runs", lambda lens_: [(0, len(lens_))])
        read.clear()
        tcache, drafter = gen._cache(target, len(prompts), 96), gen._drafter(len(prompts), 96)
        with sequoia_models(target, draft, packed_linears=gen.packed_linears):
            roots = prefill_mod.prefill(target, tcache, drafter, prompts)
        states[mode] = (sum(read), tcache, roots, _drafter_state(drafter))
    hook.remove()
    monkeypatch.undo()
    (n_runs, c_runs, r_runs, d_runs), (n_pad, c_pad, r_pad, d_pad) = states["runs"], states["padded"]
    assert n_runs == sum(lens) and n_pad == len(prompts) * max(lens)
    assert c_runs.prefix_len.tolist() == c_pad.prefix_len.tolist() == lens
    assert r_runs.tolist() == r_pad.tolist() == [p[-1] for p in prompts]
    for b, n in enumerate(lens):
        torch.testing.assert_close(c_runs.tensor[:, b, :, :n], c_pad.tensor[:, b, :, :n], rtol=1e-12, atol=1e-12)
    for a, z in zip(d_runs, d_pad):
        assert a.shape == z.shape
        torch.testing.assert_close(a, z, rtol=1e-12, atol=1e-12)
    out = gen.generate(prompts, max_new_tokens=6, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out.tokens[b] == greedy_reference(target, p, 6)


@pytest.mark.parametrize("offload", [None, "stream", "disk", "cpu"])
@torch.no_grad()
def test_an_offloaded_target_reads_the_padded_batch_in_one_forward(offload, monkeypatch):
    """A target whose layers stream in per forward costs the stream whatever its rows: one
    forward of the padded batch, not one per run."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2, dtype=torch.float64)
    monkeypatch.setattr(prefill_mod, "offload_of", lambda model: offload)
    gen = SequoiaGenerator(target, None, plan_tree([0.5], 1, 1), SamplingParams(), max_length=64,
                           backend="reference")
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9] * 5, [4], [5, 6]]
    calls = []
    hook = target.get_input_embeddings().register_forward_hook(lambda m, a, o: calls.append(tuple(a[0].shape)))
    try:
        gen.generate(prompts, max_new_tokens=1, eos_token_id=[])
    finally:
        hook.remove()
    assert calls[0] == ((3, 44) if offload else (1, 44)) and calls[1:] == ([] if offload else [(1, 1)]) + [(3, 1)]
