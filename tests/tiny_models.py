"""The test suite's tiny random models and the references they are checked against: one place
for every test file (no model hub here: each model is built from a config and a seed)."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from sequoia_kernels.hf import cache_kw


def tiny_llama(seed: int = 0, *, vocab: int = 61, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, inter: int | None = None, head_dim: int | None = None, sharpen: float | None = None,
               dtype: torch.dtype | None = None, attn: str | None = "sdpa", max_pos: int = 256,
               special_tokens: bool = False, **config) -> LlamaForCausalLM:
    """A random ``LlamaForCausalLM`` in eval mode, built after ``torch.manual_seed(seed)``.
    ``inter``: the MLP width (default 2 x hidden); ``sharpen``: the output head's weights scaled by
    it (peaked distributions: more agreement between two models, no near-ties in greedy
    decisions); ``special_tokens=False`` leaves eos / bos / pad unset; ``config``: more
    ``LlamaConfig`` fields (``initializer_range``, ``rope_theta``, ...)."""
    if not special_tokens:
        config = {"eos_token_id": None, "bos_token_id": None, "pad_token_id": None, **config}
    if head_dim is not None:
        config["head_dim"] = head_dim
    if attn is not None:
        config["attn_implementation"] = attn
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter or 2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, **config)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    if dtype is not None:
        model = model.to(dtype)
    if sharpen is not None:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model


@torch.no_grad()
def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """The model's own greedy decoding with Hugging Face's sdpa attention and no cache (every step
    recomputes the whole sequence): what every greedy decoder here must reproduce."""
    model.set_attn_implementation("sdpa")
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def record_cache_snapshots(gen) -> list:
    """Make every cache ``gen`` builds record (model, prefix_len, row 0 of its tensor) after each
    ``accept``; returns the list they go to."""
    snapshots, orig = [], gen._cache

    def spy(model, batch, need=None):
        cache = orig(model, batch, need)
        accept = cache.accept

        def accept_and_snapshot(*a, **kw):
            accept(*a, **kw)
            snapshots.append((model, int(cache.prefix_len[0]), cache.tensor[:, 0].clone()))

        cache.accept = accept_and_snapshot
        return cache

    gen._cache = spy
    return snapshots


@torch.no_grad()
def check_cache_snapshots(snapshots: list, seq: list[int], draft) -> None:
    """Each snapshot against a plain run of its model over ``seq[:prefix_len]`` (the draft's newest
    entry excepted: an accepted leaf is rewritten by the next step)."""
    for model, n, tensor in snapshots:
        model.set_attn_implementation("sdpa")
        ref = DynamicCache()
        model(torch.tensor([seq[:n]]), **cache_kw(model, ref), use_cache=True)
        m = n - 1 if model is draft else n
        for layer in range(model.config.num_hidden_layers):
            torch.testing.assert_close(tensor[2 * layer, :, :m], ref.layers[layer].keys[0, :, :m], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(tensor[2 * layer + 1, :, :m], ref.layers[layer].values[0, :, :m],
                                       atol=1e-5, rtol=1e-5)
        model.set_attn_implementation("sequoia_tree")
