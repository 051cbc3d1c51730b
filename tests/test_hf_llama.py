"""sequoia_kernels.hf: an unmodified transformers LlamaForCausalLM running tree forwards through
tree_attention equals HF's own SDPA run of each node's root-to-node path after the prefix."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

import tiny_models  # noqa: E402

import sequoia_kernels.hf as skhf  # noqa: E402
from sequoia_kernels.reference.tree_attention import pack_tree_mask  # noqa: E402

from test_tree_attention import (  # noqa: E402
    chain_parents,
    depths,
    parents_to_mask,
    planned_parents,
    random_parents,
    star_parents,
)

VOCAB = 97
ATOL = 1e-5  # fp32; SDPA vs eager on these models differs by ~1e-6

BACKENDS = ["reference", "triton", "cpu"]


def tiny_llama(num_kv_heads: int, seed: int = 0, layers: int = 2) -> LlamaForCausalLM:
    """2 layers, hidden 64, 4 query heads of dim 64 (num_kv_heads = 4: Llama-2 MHA, 2: Llama-3 GQA)."""
    return tiny_models.tiny_llama(seed, vocab=VOCAB, layers=layers, kv_heads=num_kv_heads, head_dim=64, max_pos=512,
                                  special_tokens=True, initializer_range=0.1)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of a plain causal run with HF's SDPA attention."""
    model.set_attn_implementation("sdpa")
    return model(torch.tensor([ids]), use_cache=False).logits[0]


def leaves(parents):
    has_child = set(parents[1:])
    return [i for i in range(len(parents)) if i not in has_child]


def path(parents, i):
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def make_tree(kind, T, g):
    return {"chain": chain_parents, "star": star_parents, "planned": planned_parents}[kind](T) \
        if kind != "random" else random_parents(T, g)


@torch.no_grad()
def prefill(model, cache, prompts):
    """Plain causal forward of prompts of different lengths (padded), then commit each row's length."""
    P = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (P - len(p)) for p in prompts])
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    pos = cache.prefix_len.long()[:, None] + torch.arange(P)
    logits = model(ids, position_ids=pos, **skhf.cache_kw(model, cache)).logits
    cache.commit(torch.tensor([len(p) for p in prompts]))
    return logits


@torch.no_grad()
def tree_step(model, cache, tokens, parents_per_row):
    """One verification forward: tokens [B, T], one parents list per row."""
    mask = torch.stack([parents_to_mask(p) for p in parents_per_row])
    depth = torch.tensor([depths(p) for p in parents_per_row])
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    return model(tokens, **skhf.cache_kw(model, cache), **cache.tree_inputs(depth, mask)).logits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("B", [1, 2])
def test_tree_forward_matches_hf_paths(backend, num_kv_heads, B):
    g = torch.Generator().manual_seed(B * 10 + num_kv_heads)
    model = tiny_llama(num_kv_heads)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (11, 5)[:B]]
    cache = skhf.SequoiaCache(model.config, batch_size=B, max_cache_len=64, backend=backend)

    logits = prefill(model, cache, prompts)
    for b, prompt in enumerate(prompts):  # the prefill itself (a causal "tree")
        torch.testing.assert_close(logits[b, :len(prompt)], hf_logits(model, prompt), atol=ATOL, rtol=0)

    history = [list(p) for p in prompts]
    for step, (kind, T) in enumerate([("planned", 12), ("random", 9), ("chain", 5), ("star", 7)]):
        trees = [make_tree(kind, T, g) for _ in range(B)] if kind == "random" else [make_tree(kind, T, g)] * B
        tokens = torch.randint(1, VOCAB, (B, T), generator=g)
        out = tree_step(model, cache, tokens, trees)
        assert out.shape == (B, T, VOCAB)
        for b in range(B):
            for leaf in leaves(trees[b]):
                nodes = path(trees[b], leaf)
                expect = hf_logits(model, history[b] + tokens[b, nodes].tolist())[-len(nodes):]
                torch.testing.assert_close(out[b, nodes], expect, atol=ATOL, rtol=0,
                                           msg=lambda m: f"step {step} ({kind}) row {b} path {nodes}: {m}")
        # accept a root path per row (different lengths), compact, continue from there
        accepted = []
        for b in range(B):
            leaf = leaves(trees[b])[(step + b) % len(leaves(trees[b]))]
            nodes = path(trees[b], leaf)[: 1 + (step + b) % 3]
            accepted.append(nodes)
            history[b] += tokens[b, nodes].tolist()
        M = max(map(len, accepted))
        idx = torch.tensor([a + [a[-1] + 1] * (M - len(a)) for a in accepted])  # padding is ignored
        cache.accept(idx, torch.tensor([len(a) for a in accepted]))
        assert cache.prefix_len.tolist() == [len(h) for h in history]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plain_decoding_and_dynamic_cache(backend):
    """Without a SequoiaCache (no cache, HF's DynamicCache): keys are dense, the op runs causal/decoding."""
    model = tiny_llama(2)
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    expect = hf_logits(model, ids[0].tolist())
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    with torch.no_grad():
        got = model(ids, use_cache=False, sequoia_backend=backend).logits[0]
        torch.testing.assert_close(got, expect, atol=ATOL, rtol=0)
        dyn = DynamicCache(config=model.config)
        first = model(ids[:, :6], **skhf.cache_kw(model, dyn), use_cache=True, sequoia_backend=backend).logits[0]
        rest = [model(ids[:, t:t + 1], **skhf.cache_kw(model, dyn), use_cache=True, sequoia_backend=backend).logits[0, 0]
                for t in range(6, 9)]
    torch.testing.assert_close(torch.cat([first, torch.stack(rest)]), expect, atol=ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_long_causal_forward_is_chunked(backend, monkeypatch):
    monkeypatch.setattr(skhf, "CAUSAL_CHUNK", 4)
    model = tiny_llama(4)
    prompt = torch.randint(1, VOCAB, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = skhf.SequoiaCache(model.config, batch_size=1, max_cache_len=32, backend=backend)
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    with torch.no_grad():
        got = model(torch.tensor([prompt]), **skhf.cache_kw(model, cache)).logits[0]  # no position_ids: equal rows
    torch.testing.assert_close(got, hf_logits(model, prompt), atol=ATOL, rtol=0)


def test_attention_fn_is_called_and_no_dense_mask(monkeypatch):
    """set_attn_implementation("sequoia_tree") on an unmodified model routes every layer through
    tree_attention with a packed mask, and HF builds no attention mask for it."""
    calls = []
    real = skhf._tree_attention

    def spy(q, k, v, prefix_len, mask, **kw):
        calls.append((tuple(q.shape), mask.dtype, tuple(mask.shape)))
        return real(q, k, v, prefix_len, mask, **kw)

    monkeypatch.setattr(skhf, "_tree_attention", spy)
    model = tiny_llama(2)
    assert skhf.ATTN_IMPLEMENTATION in transformers.AttentionInterface._global_mapping
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == skhf.ATTN_IMPLEMENTATION
    cache = skhf.SequoiaCache(model.config, batch_size=2, max_cache_len=40)
    cache.commit(torch.tensor([3, 8]))
    parents = planned_parents(6)
    with torch.no_grad():
        model(torch.ones(2, 6, dtype=torch.long), **skhf.cache_kw(model, cache),
              **cache.tree_inputs(torch.tensor(depths(parents)), parents_to_mask(parents)))
    # the first layer runs the checked op; on the CPU kernel the second replays that launch
    # (test_cpu_layers_after_the_first_replay_its_checked_launch), elsewhere it is checked too
    replayed = bool(cache._attn_fast)
    assert calls == [((2, 4, 6, 64), torch.int32, (1, 6, 1))] * (1 if replayed else 2)
    from sequoia_kernels._backend import resolve_op_backend

    assert replayed == (resolve_op_backend("tree_attention", None, torch.device("cpu")) == "cpu")
    if replayed:
        (bits,) = [launch.mask_bits for _, _, launch in cache._attn_fast.values()]
        assert bits.dtype == torch.int32 and tuple(bits.shape) == (1, 6, 1)
    from transformers.masking_utils import create_causal_mask

    mask = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(2, 6, 64), attention_mask=None,
                              **skhf.cache_kw(model, cache), position_ids=torch.zeros(2, 6, dtype=torch.long))
    assert mask is None


def test_cache_layout_and_errors():
    model = tiny_llama(2)
    cache = skhf.SequoiaCache(model.config, batch_size=2, max_cache_len=16)
    assert cache.tensor.shape == (4, 2, 2, 16, 64)
    assert cache.prefix_len.dtype == torch.int32 and cache.prefix_len.tolist() == [0, 0]
    assert cache.layers[1].keys.data_ptr() == cache.tensor[2].data_ptr()
    assert cache.get_max_length() == 16 and len(cache) == 2
    k = torch.randn(2, 2, 3, 64)
    cache.commit(torch.tensor([4, 9]))
    kk, vv = cache.update(k, k + 1, 1)
    assert kk.shape == (2, 2, 16, 64)
    assert torch.equal(cache.tensor[2, 0, :, 4:7], k[0]) and torch.equal(cache.tensor[2, 1, :, 9:12], k[1])
    assert torch.equal(cache.tensor[3, 1, :, 9:12], k[1] + 1)
    with pytest.raises(ValueError, match="different prefix lengths"):
        cache.get_seq_length()
    cache.commit(torch.tensor([8, 3]))
    assert cache.get_seq_length() == 12
    before = cache.tensor.clone()
    with pytest.raises(ValueError, match="exceed max_cache_len"):
        cache.update(torch.randn(2, 2, 5, 64), torch.randn(2, 2, 5, 64), 0)
    assert torch.equal(cache.tensor, before)
    with pytest.raises(ValueError, match="key/value states must be"):
        cache.update(torch.randn(2, 4, 1, 64), torch.randn(2, 4, 1, 64), 0)
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    with pytest.raises(ValueError, match="4-D attention_mask"):
        model(torch.ones(1, 2, dtype=torch.long), attention_mask=torch.zeros(1, 1, 2, 2), use_cache=False)
    cache.reset()
    assert cache.prefix_len.tolist() == [0, 0]


def test_packed_mask_kwarg_is_accepted_as_is():
    """The packed form passes through unchanged (pack once per tree, reuse in every layer)."""
    model = tiny_llama(4)
    parents = chain_parents(4)
    packed = pack_tree_mask(parents_to_mask(parents))
    cache = skhf.SequoiaCache(model.config, batch_size=1, max_cache_len=16)
    model.set_attn_implementation(skhf.ATTN_IMPLEMENTATION)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a = model(ids, **skhf.cache_kw(model, cache), **cache.tree_inputs(torch.arange(4), packed)).logits
    torch.testing.assert_close(a[0], hf_logits(model, [5, 6, 7, 8]), atol=ATOL, rtol=0)


def count_checked_launches(monkeypatch) -> list:
    """A list that grows by one at every checked tree_attention call of the attention function."""
    checked = []
    real = skhf._tree_attention

    def counting(*a, **kw):
        checked.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(skhf, "_tree_attention", counting)
    return checked


def test_cpu_layers_after_the_first_replay_its_checked_launch(monkeypatch):
    """On the CPU the first layer of a forward runs the checked tree_attention; the other layers
    (same shapes, strides and mask) launch the op directly with the same arguments: bitwise the
    logits of a forward that checks every layer, and a new mask or batch size checks again."""
    model = tiny_llama(2, layers=3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (11, 6)]
    tokens = torch.randint(1, VOCAB, (2, 7), generator=g)
    trees = [planned_parents(7)] * 2
    checked = count_checked_launches(monkeypatch)
    outs = []
    for replay in (True, False):
        cache = skhf.SequoiaCache(model.config, batch_size=2, max_cache_len=64, backend="cpu")
        prefill(model, cache, prompts)
        if not replay:  # every layer checked: forget the launch before each layer
            for layer in model.model.layers:
                layer.self_attn.register_forward_pre_hook(lambda *_: cache._attn_fast.clear())
        checked.clear()
        outs.append(tree_step(model, cache, tokens, trees))
        assert len(checked) == (1 if replay else 3)
        if replay:
            checked.clear()
            tree_step(model, cache, tokens, trees)  # a new mask tensor: checked again at its first layer
            assert len(checked) == 1
            cache.keep_rows(torch.tensor([1]))
            assert cache._attn_fast == {}
    assert torch.equal(outs[0], outs[1])


def test_cpu_launches_replay_across_forwards_per_mask(monkeypatch):
    """A drafter's level masks are packed once and reused every step: a forward whose packed mask
    object (and shapes) an earlier forward checked replays that launch from its first layer on,
    for each of several masks in turn (each level of a tree alternating), bitwise the logits of
    a cache that checks every forward; a mask tensor not seen before is checked again."""
    model = tiny_llama(2, layers=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    masks = {T: pack_tree_mask(torch.ones(T, T, dtype=torch.bool).tril()) for T in (1, 3)}
    checked = count_checked_launches(monkeypatch)
    logits = []
    for replay in (True, False):
        cache = skhf.SequoiaCache(model.config, batch_size=2, max_cache_len=64, backend="cpu")
        prefill(model, cache, prompts)
        checked.clear()
        out = []
        for step, T in enumerate((1, 3, 1, 3, 1)):
            if not replay:
                cache._attn_fast.clear()
            ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(step))
            with torch.no_grad():
                out.append(model(ids, **skhf.cache_kw(model, cache), **cache.tree_inputs(torch.arange(T), masks[T])).logits)
            cache.commit(1)
        assert len(checked) == (2 if replay else 5)  # replayed: only the first forward with each mask checks
        logits.append(torch.cat([o.flatten() for o in out]))
        with torch.no_grad():  # a new (equal) mask tensor is checked again
            before, new = len(checked), masks[1].clone()
            model(torch.ones(2, 1, dtype=torch.long), **skhf.cache_kw(model, cache), **cache.tree_inputs(torch.arange(1), new))
            assert len(checked) == before + 1 and id(new) in cache._attn_fast and len(cache._attn_fast) > 1
            monkeypatch.setattr(skhf, "_FAST_SCRATCH_BYTES", 0)  # over the scratch bound: the kept ones dropped
            row = masks[3][:, :1, :]  # [1, 1, 1]: the causal mask of one token, another tensor
            model(torch.ones(2, 1, dtype=torch.long), **skhf.cache_kw(model, cache), **cache.tree_inputs(torch.arange(1), row))
            assert len(cache._attn_fast) == 1
            monkeypatch.setattr(skhf, "_FAST_SCRATCH_BYTES", 64 << 20)
    assert torch.equal(logits[0], logits[1])


def test_an_older_transformers_is_refused_at_import_naming_the_version():
    """Before 5.4 a batch of rows at different lengths fails in the model's forward (docs/build.md):
    refused at import, in a fresh process where transformers reports 5.3.0."""
    import subprocess
    import sys

    code = ("import transformers; transformers.__version__ = '5.3.0'\n"
            "try:\n    import sequoia_kernels.hf\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"needs transformers >= {skhf.MIN_TRANSFORMERS}, found 5.3.0" in out.stdout, out.stdout + out.stderr
