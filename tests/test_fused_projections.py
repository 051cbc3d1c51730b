"""Fused projections (``sequoia_kernels.ops.fused_projections``): q / k / v and gate / up in one
packed call are bitwise each projection's own packed call, for fp32 and bf16, awkward widths and
biases; whole models give the same bits fused or not; fallbacks and the restore."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama

from sequoia_kernels.ops.fused_bf16 import use_fused_bf16
from sequoia_kernels.ops.fused_projections import GATE_UP, QKV, fused_linear, use_fused_projections
from sequoia_kernels.ops.packed_linear import (packed_linear_supported, packed_prefill_pays, release_packed_linears,
                                               use_packed_linears)

DTYPES = [d for d in (torch.float32, torch.bfloat16) if packed_linear_supported(d)]
pytestmark = pytest.mark.skipif(not DTYPES, reason="no packed_linear on this CPU")


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), heads=st.integers(1, 5), kv=st.integers(1, 3), head_dim=st.sampled_from([8, 16, 48]),
       inter=st.integers(5, 140), rows=st.integers(1, 9), bias=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fused_is_bitwise_each_projections_own_call(dtype, heads, kv, head_dim, inter, rows, bias, seed):
    kv = min(kv, heads)
    heads -= heads % kv  # GQA: query heads a multiple of the KV heads
    model = tiny_llama(seed % 1000, layers=1, hidden=heads * (head_dim + 1), heads=heads, kv_heads=kv, head_dim=head_dim,
                       inter=inter, dtype=dtype, attention_bias=bias, mlp_bias=bias)
    layer = model.model.layers[0]
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    with torch.no_grad(), use_packed_linears(model, True, 16), use_fused_projections(model):
        for mod, names in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            fused = fused_linear(mod, x)
            assert fused is not None and fused.dtype == dtype
            want = torch.cat([getattr(mod, n)(x) for n in names], -1)  # each on its own packed call
            assert torch.equal(fused, want), names
        long_ok = packed_prefill_pays(dtype)  # any rows packed (bf16 without AMX / AVX-512-BF16), else a limit
        assert (fused_linear(layer.self_attn, x.repeat(17, 1)[:17]) is not None) is long_ok
    assert fused_linear(layer.self_attn, x) is None  # outside the block


@pytest.mark.parametrize("dtype", DTYPES)
def test_models_give_the_same_bits_fused_or_not(dtype):
    model = tiny_llama(4, layers=2, hidden=96, heads=3, kv_heads=1, head_dim=32, inter=200, dtype=dtype)
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with use_packed_linears(model, True, 64), use_fused_bf16(model):
            want = model(ids).logits
        with use_packed_linears(model, True, 64), use_fused_bf16(model), use_fused_projections(model) as n:
            got = model(ids).logits
            # fp32: attention and MLP switched here; bf16: the MLPs are use_fused_bf16's, fused through gate_up
            assert n == (4 if dtype == torch.float32 else 2)
    assert torch.equal(got, want)
    for layer in model.model.layers:
        assert "_sequoia_cat_q_proj_k_proj_v_proj" in layer.self_attn.__dict__
        assert "_sequoia_cat_gate_proj_up_proj" in layer.mlp.__dict__
        assert "forward" not in layer.self_attn.__dict__ and "_sequoia_fused_proj_fallback" not in layer.self_attn.__dict__
        assert "_sequoia_fuse" not in layer.self_attn.__dict__ and "_sequoia_fuse" not in layer.mlp.__dict__
    assert release_packed_linears(model) >= 4
    assert not any(k.startswith("_sequoia_cat_") for m in model.modules() for k in m.__dict__)


def test_a_changed_weight_is_repacked_and_other_calls_run_the_modules_code():
    dtype = DTYPES[0]
    model = tiny_llama(5, layers=1, dtype=dtype)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 3, model.config.hidden_size).to(dtype)
    with torch.no_grad(), use_packed_linears(model, True, 8), use_fused_projections(model):
        first = fused_linear(attn, x)
        attn.k_proj.weight.mul_(2.0)  # in place: the fused copy must follow
        second = fused_linear(attn, x)
        nq, nk = attn.q_proj.out_features, attn.k_proj.out_features
        assert torch.equal(second[..., :nq], first[..., :nq]) and not torch.equal(second[..., nq:nq + nk],
                                                                                  first[..., nq:nq + nk])
        assert torch.equal(second, torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1))
        with torch.enable_grad():  # autograd: the module's own code, not the packed path
            xg = x.clone().requires_grad_(True)
            assert fused_linear(attn, xg) is None
    with use_fused_projections(model) as n:  # outside use_packed_linears: nothing to fuse
        assert n == 0


def test_another_transformers_forward_is_not_switched(monkeypatch):
    """The attention / MLP forwards are mirrored from one transformers version: another version's
    (a different source) leaves the modules to their own code."""
    import sequoia_kernels.ops.fused_projections as fp

    model = tiny_llama(6, layers=1, dtype=DTYPES[0])
    assert fp._mirrors("attention") and fp._mirrors("mlp")  # the pinned version's
    fp._mirrors.cache_clear()
    monkeypatch.setitem(fp._MIRRORED, "attention", ("0" * 16,))
    try:
        with use_packed_linears(model, True, 8), use_fused_projections(model) as n:
            assert n == 1 and "_sequoia_fuse" not in model.model.layers[0].self_attn.__dict__
    finally:
        fp._mirrors.cache_clear()


@pytest.mark.parametrize("built_inside", [False, True], ids=["params", "inference-tensor-params"])
def test_under_inference_mode(built_inside):
    """torch.inference_mode: the fused copy is an inference tensor, and a model built inside it
    has weights without a version counter; both run, with the same bits as under no_grad."""
    dtype = DTYPES[-1]
    ids = torch.randint(0, 61, (1, 4), generator=torch.Generator().manual_seed(1))
    if built_inside:
        with torch.inference_mode():
            model = tiny_llama(7, layers=1, dtype=dtype)
    else:
        model = tiny_llama(7, layers=1, dtype=dtype)
    with torch.inference_mode(), use_packed_linears(model, True, 8), use_fused_projections(model):
        got = model(ids).logits
    release_packed_linears(model)
    with torch.no_grad(), use_packed_linears(model, True, 8):
        want = model(ids).logits
    assert torch.equal(got, want)
