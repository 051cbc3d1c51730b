"""The KV cache's keyword: transformers 5.24 renamed a model's ``past_key_values`` argument
``cache`` (the old name warns until 5.40, then lands in ``**kwargs`` unread). Every forward the
project calls gets the cache by the name that model's forward declares (``sequoia_kernels.hf.
cache_kw``): checked here with models that take only ``cache`` (as transformers 5.40's will) and
refuse the old name, through the loop with a Llama draft and with a feature head, under the
pinned transformers whatever its own name is."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, LlamaModel
from transformers.modeling_outputs import CausalLMOutputWithPast

import tiny_models
from test_feature_drafter import bigram_target_and_oracle
from tiny_models import greedy_reference

import sequoia_kernels.hf as skhf
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import kxd_tree, plan_tree

#: the name the installed transformers' Llama models take the cache by
INSTALLED = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


class _TakesCache:
    """A forward as transformers 5.40 will have it: the cache only as ``cache``."""

    def forward(self, *args, cache=None, **kwargs):
        if "past_key_values" in kwargs:
            raise TypeError(f"{type(self).__name__}.forward() got the cache as past_key_values: it takes `cache`")
        return super().forward(*args, **{INSTALLED: cache}, **kwargs)


class CacheLlamaModel(_TakesCache, LlamaModel):
    pass


class CacheLlamaForCausalLM(LlamaForCausalLM):
    """Its decoder called by the new name, as transformers 5.40's ``LlamaForCausalLM`` will."""

    def forward(self, input_ids=None, cache=None, logits_to_keep: int = 0, **kwargs):
        if "past_key_values" in kwargs:
            raise TypeError(f"{type(self).__name__}.forward() got the cache as past_key_values: it takes `cache`")
        hidden = self.model(input_ids, cache=cache, **kwargs).last_hidden_state  # [B, T, H]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden))


def renamed(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` (and its decoder, which feature drafting calls) taking the cache only as ``cache``."""
    model.__class__, model.model.__class__ = CacheLlamaForCausalLM, CacheLlamaModel
    return model


def test_cache_kw_reads_the_forward_signature():
    class Old(torch.nn.Module):
        def forward(self, ids, past_key_values=None, **kwargs):
            return ids

    class Wrapper(torch.nn.Module):  # a forward that hides the model's (*args, **kwargs)
        def forward(self, *args, **kwargs):
            return args

    cache = DynamicCache()
    model = tiny_models.tiny_llama(0)
    assert skhf.cache_kw(model, cache) == {INSTALLED: cache}
    assert skhf.cache_kw(renamed(tiny_models.tiny_llama(0)), cache) == {"cache": cache}
    assert skhf.cache_kw(Old(), cache) == {"past_key_values": cache}
    assert skhf.cache_kw(Wrapper(), None) == {INSTALLED: None}  # this transformers' own name
    with pytest.raises(TypeError, match="takes `cache`"):
        renamed(tiny_models.tiny_llama(0))(torch.tensor([[1, 2]]), past_key_values=cache)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_loop_passes_the_cache_by_the_models_keyword(temperature):
    """Target and draft taking only ``cache``: the same tokens as the pinned models give (greedy:
    the target's own greedy decoding), rows of different lengths (the prefill), caches that hold
    what plain runs compute."""
    sampling = SamplingParams(temperature=temperature, top_k=20, top_p=0.9, seed=5)
    prompts = [[3, 17, 5, 9, 22], [7], [4, 8, 15]]

    def run(convert):
        target = convert(tiny_models.tiny_llama(0, vocab=61, sharpen=8.0))
        draft = convert(tiny_models.tiny_llama(1, vocab=61, sharpen=8.0, layers=1))
        gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2, 0.1], 12, 4), sampling, max_length=128)
        snapshots = tiny_models.record_cache_snapshots(gen)
        out = gen.generate(prompts[:1], max_new_tokens=16, eos_token_id=[])
        tiny_models.check_cache_snapshots(snapshots, prompts[0] + out.tokens[0], draft)
        return out.tokens + gen.generate(prompts, max_new_tokens=16, eos_token_id=[]).tokens, target

    want, plain = run(lambda m: m)
    got, _ = run(renamed)
    assert got == want
    if temperature == 0.0:
        assert got[0] == greedy_reference(plain, prompts[0], 16)


def test_a_feature_head_reads_a_target_taking_cache():
    """A feature drafter reads the target's features through its decoder (``get_decoder()``),
    which takes the cache by its own keyword."""
    target, head = bigram_target_and_oracle()
    prompts = [[1, 5, 7, 9], [3], [8, 2, 6]]
    want = [greedy_reference(target, p, 20) for p in prompts]
    out = SequoiaGenerator(renamed(target), head, kxd_tree(2, 3), max_length=128, backend="reference").generate(
        prompts, max_new_tokens=20, eos_token_id=[])
    assert out.tokens == want and out.tokens_per_step > 1.5
