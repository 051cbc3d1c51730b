"""A standalone draft whose vocabulary is the target's padded to another size (Qwen2 / Qwen2.5:
151,665 tokens padded to 151,936 rows in the small models, 152,064 in the large): the loop, the
Hugging Face entry point and measure-acceptance take it, and decode exactly the target's
distribution."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_pairs_follow, filtered_two_token_distribution, pair_counts
from tiny_models import greedy_reference, tiny_llama

from sequoia_decoding import SequoiaDecoding
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import chain_tree, plan_tree
from sequoia_decoding.tools import measure_acceptance

V = 64  # the target's vocabulary
SMALLER, LARGER = V - 8, V + 8  # the drafts' (padded to fewer ids than the target's, and to more)


def padded_copy(target, vocab: int):
    """The target itself with its vocabulary cut or padded to ``vocab`` ids (new rows random): on
    the ids both have, the same model (a perfect draft, but for the ids it lacks)."""
    draft = copy.deepcopy(target)
    torch.manual_seed(1)
    draft.resize_token_embeddings(vocab, mean_resizing=False)
    assert draft.get_output_embeddings().weight.shape[0] == vocab
    return draft


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0, vocab=V, sharpen=4.0)


@pytest.mark.parametrize("vocab", [SMALLER, LARGER])
def test_greedy_decoding_is_the_targets(target, vocab):
    """Token for token the target's own greedy decoding, in a ragged batch whose prompts and
    continuations hold ids past the smaller draft's (read by it as its last id); through
    Hugging Face ``generate()`` too. The larger draft (the target's logits on the target's ids)
    has every drafted token of a chain accepted."""
    draft = padded_copy(target, vocab)
    prompts = [[60, 3, 61, 5], [7, 8], [63, 1, 2, 9, 58]]
    gen = SequoiaGenerator(target, draft, chain_tree(4), max_length=128)
    out = gen.generate(prompts, max_new_tokens=30, eos_token_id=[])
    assert out.tokens == [greedy_reference(target, p, 30) for p in prompts]
    assert any(t >= SMALLER for row in out.tokens for t in row)  # the target emits what the smaller draft lacks
    if vocab == LARGER:
        assert out.tokens_per_step == 5.0
    ids = torch.tensor([[60, 3, 61, 5]])
    plain = target.generate(ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=20, do_sample=False,
                                       custom_generate=SequoiaDecoding(draft, budget=8, max_depth=4)), plain)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,temperature,top_k,top_p", [
    (SMALLER, 1.0, 0, 1.0), (SMALLER, 0.8, 0, 0.9), (SMALLER, 0.7, 6, 1.0), (LARGER, 1.0, 0, 1.0),
    (LARGER, 0.8, 5, 0.9)])
def test_sampling_is_exact(vocab, temperature, top_k, top_p):
    """The first two new tokens follow the target's filtered distribution (chi-square) on a DP
    tree: the target's ids the smaller draft lacks come from the residual alone, at their rate."""
    target = tiny_llama(0, vocab=V, sharpen=25.0)  # peaked: the pairs' cells hold counts to test
    draft = padded_copy(target, vocab)
    prompt, n = [3, 17, 5], 3000
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    exact = filtered_two_token_distribution(target, prompt, sampling)
    if vocab == SMALLER:  # the ids the draft lacks are drawn: the residual's part is tested
        assert float(exact[SMALLER:].sum()) > 0.1
    gen = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2, 0.1], 8, 4), sampling, max_length=64)
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])
    assert out.tokens_per_step > 1.5  # the drafts are accepted: the tree's deeper nodes are exercised
    assert_pairs_follow(pair_counts(out.tokens, V), exact, n)


def test_measure_acceptance_reads_the_draft_over_the_targets_ids(target):
    """A draft with the target's logits on the target's ids (the larger) has its first child
    always accepted (q = p); the smaller draft is measured too, below it."""
    prompts = [[3, 17, 5], [60, 2]]
    for temperature in (0.0, 0.8):
        kw = dict(temperature=temperature, width=4, max_new_tokens=16, progress=False, eos_token_id=[])
        assert measure_acceptance(target, padded_copy(target, LARGER), prompts, **kw)["acceptance"] == [1.0, 0, 0, 0]
        acc = measure_acceptance(target, padded_copy(target, SMALLER), prompts, **kw)["acceptance"]
        assert 0.0 < acc[0] < 1.0 and sum(acc) <= 1.0


def test_a_reduced_vocabulary_draft_of_a_padded_target(target):
    """A reduced-vocabulary draft (``DraftLM``: its tokens mapped to a full vocabulary, here the
    smaller draft's) for a target padded past that vocabulary: the target's greedy decoding."""
    from sequoia_decoding.modeling.draft import DraftLM, build_draft_llama

    torch.manual_seed(2)
    inner = build_draft_llama(20, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                              head_dim=16, intermediate_size=64, max_position_embeddings=256)
    draft = DraftLM(inner, torch.arange(0, 40, 2), full_vocab_size=SMALLER).eval()
    prompts = [[60, 3, 61, 5], [7, 8]]
    out = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2, 0.1], 8, 4), max_length=128).generate(
        prompts, max_new_tokens=24, eos_token_id=[])
    assert out.tokens == [greedy_reference(target, p, 24) for p in prompts]


def test_a_vocabulary_far_from_the_targets_is_refused(target):
    """More than 256 ids apart the pair cannot share a tokenizer: refused, naming both sizes; a
    feature head (which reads out over the vocabulary it was made for) needs the target's."""
    from test_feature_drafter import random_head

    with pytest.raises(ValueError, match=r"vocabularies differ \(61 vs 64\)"):
        SequoiaGenerator(target, random_head(tiny_llama(3, vocab=61, layers=4), "eagle1", 0), chain_tree(2),
                         max_length=64)
    draft = padded_copy(target, V + 300)
    with pytest.raises(ValueError, match=r"vocabularies differ \(364 vs 64\)"):
        SequoiaGenerator(target, draft, chain_tree(2), max_length=64)
    with pytest.raises(ValueError, match="vocabularies differ"):
        measure_acceptance(target, draft, [[1, 2]], temperature=0.0, width=2, progress=False)
