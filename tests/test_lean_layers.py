"""Lean decoder layers (``sequoia_kernels.ops.lean_layers``): a switched Llama layer gives bitwise
the logits of the switched modules it replaces (prefill, tree steps, one-token steps; fp32 and
bf16, GQA, batch rows), falls back to them for calls it does not take, and is restored on exit."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import tiny_llama

import sequoia_kernels.ops.lean_layers as ll
from sequoia_kernels.hf import SequoiaCache, cache_kw
from sequoia_kernels.ops.fused_bf16 import use_fused_bf16
from sequoia_kernels.ops.fused_projections import use_fused_projections
from sequoia_kernels.ops.packed_linear import packed_linear_supported, use_packed_linears

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packed_linear_supported(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="no packed_linear on this CPU")


@contextlib.contextmanager
def switched(model, lean: bool, max_rows: int = 16, packed: bool = True):
    """The loop's patching of ``model`` (``sequoia_models``' parts), with or without the lean
    layers; ``packed=False``: torch's linears (the loop's fp32 where packing does not pay)."""
    model.set_attn_implementation("sequoia_tree")
    try:
        with use_packed_linears(model, packed, max_rows), use_fused_bf16(model, packed), \
                use_fused_projections(model, packed), ll.use_lean_layers(model, lean) as n:
            yield n
    finally:
        model.set_attn_implementation("sdpa")


def decode(model, ids: torch.Tensor, steps) -> list[torch.Tensor]:
    """Logits of a prefill of ``ids`` [B, P] and then of each step in ``steps``: (tokens [B, T],
    depth [T], bool mask [T, T], accepted count or None for a commit of every token)."""
    B, P = ids.shape
    cache = SequoiaCache(model.config, batch_size=B, max_cache_len=P + 40, dtype=model.dtype)
    outs = []
    with torch.no_grad():
        outs.append(model(ids, **cache_kw(model, cache), position_ids=torch.arange(P)[None].expand(B, P),
                          use_cache=True).logits)
        cache.commit(P)
        for tokens, depth, mask, keep in steps:
            outs.append(model(tokens, **cache_kw(model, cache), use_cache=True, **cache.tree_inputs(depth, mask)).logits)
            if keep is None:
                cache.commit(tokens.shape[1])
            else:
                nodes = torch.arange(keep)[None].expand(B, keep)
                cache.accept(nodes, torch.full((B,), keep, dtype=torch.int32))
    return outs


def _model(seed: int, dtype: torch.dtype, **kw):
    """A tiny Llama whose norms have weights of their own (ones would hide a norm read for another)."""
    model = tiny_llama(seed, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model


def _steps(vocab: int, B: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2, 2])
    one = (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, dtype=torch.long))
    return [(torch.randint(0, vocab, (B, 5), generator=g), depth, tree, 2),  # a tree step, 2 nodes kept
            (torch.randint(0, vocab, (B, 1), generator=g), one[1], one[0], None),  # a one-token step
            (torch.randint(0, vocab, (B, 3), generator=g), torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril(),
             None),
            (torch.randint(0, vocab, (B, 5), generator=g), depth, tree, 3)]


@pytest.mark.parametrize("dtype, packed", [(d, True) for d in DTYPES] + [(torch.float32, False)],
                         ids=[f"{str(d)[6:]}-packed" for d in DTYPES] + ["float32-torch-linears"])
@pytest.mark.parametrize("B, inter", [(1, 136), (2, 136), (2, 160)])
def test_lean_layers_give_the_switched_modules_bits(dtype, packed, B, inter):
    model = _model(11, dtype, layers=3, hidden=96, heads=6, kv_heads=2, head_dim=16, inter=inter)
    ids = torch.randint(0, 61, (B, 7), generator=torch.Generator().manual_seed(B))
    steps = _steps(61, B, seed=3)
    with switched(model, lean=False, packed=packed) as n:
        assert n == 0
        want = decode(model, ids, steps)
    with switched(model, lean=True, packed=packed) as n:
        assert n == 3
        calls = {"lean": 0, "rotated": 0, "silu": 0}
        orig, orig_rot, orig_silu = ll._weights, ll._qkv_rotated, ll._gate_up_silu

        def counting(*a):
            got = orig(*a)
            calls["lean"] += got is not None
            return got

        def rotating(*a):
            calls["rotated"] += 1
            return orig_rot(*a)

        def silu(*a):
            calls["silu"] += 1
            return orig_silu(*a)

        ll._weights, ll._qkv_rotated, ll._gate_up_silu = counting, rotating, silu
        try:
            got = decode(model, ids, steps)
        finally:
            ll._weights, ll._qkv_rotated, ll._gate_up_silu = orig, orig_rot, orig_silu
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"forward {i}"
    assert calls["lean"] >= 3 * 4  # every step's layers ran lean (the prefill packs the weights first)
    # bf16 on the packed path: q and k (6 x 16 + 2 x 16 = 128 columns) rotated in the qkv product's store
    assert calls["rotated"] == (calls["lean"] if dtype == torch.bfloat16 and packed else 0)
    # and SiLU-and-multiply in the gate-up product's store where the MLP's width is a multiple of 32
    assert calls["silu"] == (calls["lean"] if dtype == torch.bfloat16 and packed and inter % 32 == 0 else 0)
    assert calls["lean"] == 3 * 5 or packed
    for layer in model.model.layers:
        assert "forward" not in layer.__dict__ and "_sequoia_lean" not in layer.__dict__
        assert "_sequoia_lean_fallback" not in layer.__dict__


def test_calls_the_lean_path_does_not_take_run_the_layers_own_forward(monkeypatch):
    from sequoia_kernels.ops import packed_linear

    monkeypatch.setattr(packed_linear, "packed_prefill_pays", lambda dtype: False)  # the row limit holds
    dtype = DTYPES[-1]
    model = _model(12, dtype, layers=2)
    ids = torch.randint(0, 61, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), switched(model, lean=True, max_rows=4) as n:
        assert n == 2
        layer = model.model.layers[0]
        model(ids[:, :2])  # packs the weights
        x = torch.randn(1, 5, model.config.hidden_size).to(dtype)
        pe = model.model.rotary_emb(x, torch.arange(5)[None])
        assert ll._weights(layer, layer._sequoia_lean, x, pe) is None  # 5 rows > 4: the modules' code
        assert ll._weights(layer, layer._sequoia_lean, x[:, :3], pe) is not None
        assert ll._weights(layer, layer._sequoia_lean, x[:, :3], None) is None  # no position embeddings
        layer.mlp.down_proj.weight.mul_(2.0)  # in place: the packed copy is stale until the module repacks it
        assert ll._weights(layer, layer._sequoia_lean, x[:, :3], pe) is None
        got = model(ids[:, :3]).logits
        assert ll._weights(layer, layer._sequoia_lean, x[:, :3], pe) is not None  # repacked by the fallback
        with torch.enable_grad():
            assert ll._weights(layer, layer._sequoia_lean, x[:, :3].requires_grad_(True), pe) is None
    with torch.no_grad(), switched(model, lean=False, max_rows=4):
        want = model(ids[:, :3]).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "fused-attention"])
@pytest.mark.parametrize("rows", [3, 6], ids=["switched", "fallback"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # the old name, on purpose
def test_a_switched_layer_takes_the_cache_by_either_keyword(lean, rows, monkeypatch):
    """transformers 5.24 on hands a decoder layer and its attention the KV cache as ``cache``
    (before: ``past_key_values``): a switched layer (lean, or its attention on the fused
    projections) writes and reads it by either name with the same bits, on its own code and
    falling back to the modules' (more rows than the packed limit); by the new name the cache's
    update gets the attention's keyword arguments, as 5.24's attention gives them."""
    from sequoia_kernels.ops import packed_linear

    monkeypatch.setattr(packed_linear, "packed_prefill_pays", lambda dtype: False)  # the row limit holds
    dtype, updates = DTYPES[-1], []

    class Spy(SequoiaCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            updates.append(sorted(kwargs))
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    model = _model(21, dtype, layers=1)
    layer, g = model.model.layers[0], torch.Generator().manual_seed(4)
    x = torch.randn(2, rows, model.config.hidden_size, generator=g).to(dtype)  # [B, T, H]
    pos = torch.arange(rows)[None].expand(2, rows)
    outs = []
    with torch.no_grad(), switched(model, lean=lean, max_rows=8):  # the rows: B x T = 6 or 12
        model(torch.tensor([[1, 2]]))  # packs the weights
        pe = model.model.rotary_emb(x, pos)
        for name in ("past_key_values", "cache"):
            cache = Spy(model.config, batch_size=2, max_cache_len=16, dtype=dtype)
            out = layer(x, attention_mask=None, position_ids=pos, use_cache=True, position_embeddings=pe,
                        **{name: cache})
            outs.append((out, cache.tensor[:, :, :, :rows].clone()))
    assert outs[0][1].abs().sum() > 0 and torch.equal(outs[0][1], outs[1][1])  # the same keys and values written
    assert torch.equal(outs[0][0], outs[1][0])
    if rows == 3:  # written by the project's code: as transformers 5.24's attention writes it
        assert updates[-1] == ["kwargs"]


def test_layers_the_lean_forward_does_not_mirror_are_left_alone(monkeypatch):
    dtype = DTYPES[0]
    with_bias = tiny_llama(13, layers=2, dtype=dtype, attention_bias=True)
    with switched(with_bias, lean=True) as n:
        assert n == 0  # biases: the modules' code
    model = tiny_llama(13, layers=2, dtype=dtype)
    with use_packed_linears(model, True, 8), ll.use_lean_layers(model) as n:
        assert n == 0  # projections packed but not fused: not lean
    bf16 = tiny_llama(13, layers=2, dtype=torch.bfloat16)
    with switched(bf16, lean=True, packed=False) as n:
        assert n == 0  # bf16 on torch's linears: the modules' code
    hooked = tiny_llama(13, layers=2, dtype=dtype)
    seen = []
    handle = hooked.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad(), switched(hooked, lean=True) as n:
        assert n == 1 and "_sequoia_lean" not in hooked.model.layers[1].__dict__  # its hook would be skipped
        hooked(torch.tensor([[1, 2, 3]]))
        hooked(torch.tensor([[4]]))
    assert len(seen) == 2
    handle.remove()
    ll._mirrors.cache_clear()
    monkeypatch.setattr(ll, "_MIRRORED", ("0" * 16,))  # another transformers version's layer code
    try:
        with switched(model, lean=True) as n:
            assert n == 0
    finally:
        ll._mirrors.cache_clear()


def _head_forwards(head, B: int, seed: int) -> list[torch.Tensor]:
    """A feature head's predicted features over a prefill of 6 slots, a 5-node tree step (true
    features) and a 3-node step on its own predictions, through a SequoiaCache."""
    g = torch.Generator().manual_seed(seed)
    dtype, V = head.fc.weight.dtype, head.full_vocab_size
    cache = SequoiaCache(head.config, batch_size=B, max_cache_len=24, dtype=dtype)
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    outs = []
    with torch.no_grad():
        ids, feats = torch.randint(0, V, (B, 6), generator=g), torch.randn(B, 6, head.feature_width, generator=g)
        outs.append(head(ids, feats.to(dtype), fused=False, position_ids=torch.arange(6)[None].expand(B, 6),
                         past_key_values=cache))
        cache.commit(6)
        ids, feats = torch.randint(0, V, (B, 5), generator=g), torch.randn(B, 5, head.feature_width, generator=g)
        outs.append(head(ids, feats.to(dtype), fused=False, past_key_values=cache,
                         **cache.tree_inputs(torch.tensor([0, 1, 1, 2, 2]), tree)))
        cache.accept(torch.arange(2)[None].expand(B, 2), torch.full((B,), 2, dtype=torch.int32))
        ids = torch.randint(0, V, (B, 3), generator=g)
        outs.append(head(ids, outs[-1][:, :3], fused=True, past_key_values=cache,
                         **cache.tree_inputs(torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril())))
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,depth", [(16, 1), (32, 1), (16, 2)])
def test_a_feature_heads_layer_runs_lean_with_the_same_bits(dtype, head_dim, depth):
    """An EAGLE-1 head's layer (no input norm) is marked, not switched: the head's forward calls
    ``lean_block`` itself, and its predicted features are the modules' bits (head size 32: q and k
    fill 192 columns, so bf16 takes the qkv product's rotary epilogue; 16: 96, the rotary op);
    ``depth`` 2: a second layer (with its input norm) after it, switched, the same."""
    from sequoia_decoding.modeling.feature_head import FeatureHead

    target = _model(14, dtype, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16)
    c = target.config
    torch.manual_seed(14)
    head = FeatureHead(dict(hidden_size=64, intermediate_size=c.intermediate_size, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=head_dim, vocab_size=61, max_position_embeddings=256,
                            rms_norm_eps=c.rms_norm_eps, rope_theta=10000.0, num_hidden_layers=depth), "eagle1",
                       feature_layers=(1, -1))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    head = head.to(dtype).eval()
    head.bind(target)
    with switched(head, lean=False) as n:
        assert n == 0
        want = _head_forwards(head, 2, seed=5)
    calls, rotated = [], []
    orig, orig_rot = ll._weights, ll._qkv_rotated
    ll._weights = lambda *a: calls.append(orig(*a)) or calls[-1]
    ll._qkv_rotated = lambda *a: rotated.append(1) or orig_rot(*a)
    try:
        with switched(head, lean=True) as n:
            assert n == depth and "forward" not in head.layers[0].__dict__
            got = _head_forwards(head, 2, seed=5)
    finally:
        ll._weights, ll._qkv_rotated = orig, orig_rot
    assert sum(c is not None for c in calls) >= 2 * depth  # the tree steps ran lean (the prefill packed the weights)
    assert bool(rotated) == (dtype == torch.bfloat16 and head_dim == 32 and sum(c is not None for c in calls) > 0)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"forward {i}"
    assert "_sequoia_lean" not in head.layers[0].__dict__
