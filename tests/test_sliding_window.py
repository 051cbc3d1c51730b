"""Models whose attention slides a window (Mistral, whose config defaults to a 4096-token window;
Phi-3; Qwen2 / Qwen3 with ``use_sliding_window``): the ``"sequoia_tree"`` attention sees every
earlier key, which is their own attention exactly while the positions fit in the window. Within
it the loop and the Hugging Face entry point are the target's decoding token for token; beyond
it each refuses with a clear error before anything runs (before, the loop decoded with the
window ignored: another distribution, silently)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import greedy_reference, tiny_llama
from transformers import (LlamaConfig, MistralConfig, MistralForCausalLM, Phi3Config, Qwen2Config)

from sequoia_decoding import SequoiaDecoding
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.tree import kxd_tree
from sequoia_kernels.hf import SequoiaCache, attention_span_of, sequoia_tree_attention, sliding_window_of

VOCAB = 61
PROMPT = [3, 17, 5, 9, 22, 8, 4, 5, 6, 7, 8, 9, 10, 11]  # 14 tokens


def mistral(seed: int, layers: int, window: int | None) -> MistralForCausalLM:
    torch.manual_seed(seed)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, sliding_window=window, eos_token_id=None,
        pad_token_id=0, bos_token_id=None)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: no near-ties in greedy decisions
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_sliding_window_of_reads_each_config_family():
    assert sliding_window_of(LlamaConfig()) is None
    assert sliding_window_of(MistralConfig()) == 4096  # Mistral's default (Mistral-7B-v0.1's)
    assert sliding_window_of(MistralConfig(sliding_window=None)) is None
    assert sliding_window_of(Phi3Config(sliding_window=2047)) == 2047  # Phi-3-mini-4k's
    assert sliding_window_of(Qwen2Config()) is None  # use_sliding_window=False
    assert sliding_window_of(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=1,
                                         num_hidden_layers=4)) == 512
    assert sliding_window_of(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=4,
                                         num_hidden_layers=4)) is None  # every layer full
    assert sliding_window_of(None) is None
    if hasattr(transformers, "Llama4TextConfig"):  # Llama 4's chunked layers: exact within the first chunk
        assert attention_span_of(transformers.Llama4TextConfig(num_hidden_layers=4))[0] == 8192
        full = transformers.Llama4TextConfig(num_hidden_layers=4, layer_types=["full_attention"] * 4)
        assert attention_span_of(full) is None
    assert attention_span_of(MistralConfig(sliding_window=300, attention_chunk_size=200))[0] == 300  # no chunked layers


def test_the_attention_is_exact_within_the_window_and_refuses_beyond_it():
    model = mistral(0, 2, window=8)
    model.set_attn_implementation("eager")
    ids = torch.tensor([PROMPT])
    for n in (5, 8):  # within the window: the model's own (eager) attention
        want = model(ids[:, :n]).logits
        model.set_attn_implementation("sequoia_tree")
        try:
            got = model(ids[:, :n]).logits
        finally:
            model.set_attn_implementation("eager")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sequoia_tree")
    try:
        with pytest.raises(ValueError, match="slides a window of 8 tokens.*there are 9"):
            model(ids[:, :9])
    finally:
        model.set_attn_implementation("eager")
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    for kw, what in (({"softcap": 50.0}, "soft-capping"), ({"s_aux": torch.zeros(4)}, "sinks")):
        with pytest.raises(ValueError, match=what):
            sequoia_tree_attention(torch.nn.Module(), q, k, k, None, **kw)


def test_a_sequoia_cache_longer_than_the_window_is_refused():
    config = mistral(0, 1, window=60).config
    assert SequoiaCache(config, batch_size=1, max_cache_len=60).tensor.shape[3] == 60
    with pytest.raises(ValueError, match="window of 60 tokens.*max_cache_len = 61"):
        SequoiaCache(config, batch_size=1, max_cache_len=61)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_the_loop_is_exact_within_the_window_and_refuses_beyond_it(which):
    """Window 60 (not a multiple of the 64 the caches round to: the loop caps them at the window):
    a 14-token prompt + n new tokens + a 7-node tree needs 14 + n + 7 - 2 positions: 60 at n = 41."""
    windows = {"target": 60, "draft": None} if which == "target" else {"target": None, "draft": 60}
    target, draft = mistral(0, 2, windows["target"]), mistral(1, 1, windows["draft"])
    plan = kxd_tree(2, 3)
    assert plan.num_nodes == 7
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=256)
    found = [m.config._attn_implementation for m in (target, draft)]
    for n in (30, 41):
        assert gen.generate([PROMPT], max_new_tokens=n).tokens[0] == greedy_reference(target, PROMPT, n)
    with pytest.raises(ValueError, match=f"the {which}'s attention slides a window of 60 tokens.*needs 61"):
        gen.generate([PROMPT], max_new_tokens=42)
    assert [m.config._attn_implementation for m in (target, draft)] == found
    assert gen.generate([PROMPT], max_new_tokens=30).tokens[0] == greedy_reference(target, PROMPT, 30)


def test_the_hf_entry_point_within_the_window_and_beyond_it():
    target, draft = mistral(0, 2, 60), mistral(1, 1, None)
    ids = torch.tensor([PROMPT])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    want = target.generate(ids, max_new_tokens=30, **kw)
    got = target.generate(ids, max_new_tokens=30, custom_generate=SequoiaDecoding(draft, budget=8, max_depth=3), **kw)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="slides a window of 60 tokens"):
        target.generate(ids, max_new_tokens=48, custom_generate=SequoiaDecoding(draft, budget=8, max_depth=3), **kw)


def test_a_llama_pair_is_not_limited():
    """No window: caches of any length, as before (the cap is the window's only)."""
    target = tiny_llama(0)
    gen = SequoiaGenerator(target, tiny_llama(1, layers=1), kxd_tree(2, 2), SamplingParams(), max_length=256)
    assert gen.generate([PROMPT], max_new_tokens=100, eos_token_id=[]).tokens[0] == greedy_reference(target,
                                                                                                   PROMPT, 100)
