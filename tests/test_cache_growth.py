"""A call's caches hold room for ``FIRST_ROOM`` new tokens at first and grow (doubling) as its rows
lengthen (``request_checks.make_room``, ``SequoiaCache.grow``). They used to hold the whole
request from the start: ``max_new_tokens=32768`` ("until EOS", as servers set it) zeroed 1.5 GB for
the SmolLM2 pair in fp32 on every call, 0.73 s against 0.34 s for the same 8-token answer, slower
than plain ``generate()`` (which grows its cache as it goes)."""

from __future__ import annotations

import pytest
import torch
import tiny_models
from test_feature_drafter import random_head

from sequoia_decoding import request_checks
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import chain_tree, plan_tree
from sequoia_kernels.hf import SequoiaCache, cache_kw

VOCAB = 61


def _pair():
    target = tiny_models.tiny_llama(0, vocab=VOCAB, sharpen=8.0, max_pos=2048)
    return target, tiny_models.tiny_llama(1, vocab=VOCAB, layers=1, sharpen=8.0, max_pos=2048)


@torch.no_grad()
def test_grow_keeps_what_the_cache_holds():
    """A grown cache holds the positions it had and the forwards after it are the bits of a cache
    that was that large from the start; growing to fewer positions changes nothing; past the
    model's sliding window is a ValueError that leaves the cache as it was."""
    target, _ = _pair()
    target.set_attn_implementation("sequoia_tree")
    prompt = torch.randint(2, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    big, small = (SequoiaCache(target.config, batch_size=2, max_cache_len=n) for n in (192, 64))
    for cache in (big, small):
        target(prompt, position_ids=torch.arange(40)[None].expand(2, -1), **cache_kw(target, cache))
        cache.commit(40)
    small.grow(32)
    assert small.max_cache_len == 64
    small.grow(192)
    assert small.max_cache_len == 192 and torch.equal(small.tensor[:, :, :, :40], big.tensor[:, :, :, :40])
    depth = torch.tensor([0, 1, 1, 2])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]).bool()  # [T, T]: a root, 2 children
    for _ in range(3):  # forwards past the old end
        ids = torch.randint(2, VOCAB, (2, 4))
        out = [target(ids, **cache_kw(target, c), **c.tree_inputs(depth, mask)).logits for c in (big, small)]
        assert torch.equal(out[0], out[1])
        for c in (big, small):
            c.accept(torch.tensor([[0, 1, 3], [0, 2, 2]]), torch.tensor([3, 2]))
    assert torch.equal(small.prefix_len, big.prefix_len)
    assert torch.equal(small.tensor[:, :, :, :52], big.tensor[:, :, :, :52])
    windowed = tiny_models.tiny_llama(0, vocab=VOCAB, sliding_window=96)
    cache = SequoiaCache(windowed.config, batch_size=1, max_cache_len=64)
    before = cache.tensor
    with pytest.raises(ValueError, match="slides a window of 96"):
        cache.grow(128)
    assert cache.tensor is before and cache.max_cache_len == 64


def _head(target):
    return random_head(target, "eagle1", 3)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafter", ["model", "head", "none"])
def test_a_call_grows_its_caches_as_its_rows_lengthen(monkeypatch, drafter, temperature):
    """700 new tokens for two ragged rows (room for 256 at first: grown twice) decode to the tokens
    of the same call whose caches hold everything from the start, sampled ones included."""
    target, draft = _pair()
    draft = {"model": draft, "head": _head(target), "none": None}[drafter]
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4) if draft is not None else chain_tree(0)
    prompts = [[3, 17, 5, 9, 22, 8, 4], [7, 2, 30]]
    grown = []
    grow = SequoiaCache.grow
    monkeypatch.setattr(SequoiaCache, "grow", lambda self, n: (grown.append(n), grow(self, n))[1])

    def run():
        gen = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=temperature, seed=5), max_length=None)
        return gen.generate(prompts, max_new_tokens=700, eos_token_id=[]).tokens

    got = run()
    assert grown and all(len(t) == 700 for t in got)
    monkeypatch.setattr(request_checks, "FIRST_ROOM", 10**6)
    grown.clear()
    assert run() == got and not grown


def test_a_far_larger_max_new_tokens_allocates_what_the_call_uses():
    """``max_new_tokens=100000`` for a call that stops after 20 tokens: caches of a few hundred
    positions (not 100,000), the tokens of ``max_new_tokens=20``."""
    target, draft = _pair()
    gen = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2, 0.1], 8, 4), SamplingParams(), max_length=None)
    sizes, make = [], gen._cache
    gen._cache = lambda model, batch, need: (c := make(model, batch, need), sizes.append(c.max_cache_len))[0]
    want = gen.generate([[3, 17, 5]], max_new_tokens=20, eos_token_id=[]).tokens
    sizes.clear()
    made = []

    def stop(b: int, new: list[int]) -> int | None:  # the row ends at 20 tokens
        made.extend(new)
        return None if len(made) < 20 else len(new) - (len(made) - 20)

    got = gen.generate([[3, 17, 5]], max_new_tokens=100_000, eos_token_id=[], stop=stop).tokens
    assert got == want and len(sizes) == 2 and max(sizes) <= 320, sizes
