"""RoPE tables (``sequoia_decoding.rope_tables``): cos / sin looked up per position are bitwise
what the rotary module computes per call, for every static RoPE kind, dtype, batch and position
(the table grows past its first size); dynamic kinds are left alone; the model is restored."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_llama

from sequoia_decoding.patching import sequoia_models
from sequoia_decoding.rope_tables import MIN_POSITIONS, STATIC_ROPE, use_rope_tables

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "theta": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def _rotary(rope: str, head_dim: int):
    model = tiny_llama(0, layers=1, hidden=2 * head_dim, heads=2, kv_heads=1, head_dim=head_dim,
                       rope_parameters=dict(ROPES[rope]), max_pos=8192)
    return model, model.model.rotary_emb


@settings(max_examples=40, deadline=None)
@given(rope=st.sampled_from(sorted(ROPES)), head_dim=st.sampled_from([16, 48, 64, 128]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), batch=st.integers(1, 3),
       width=st.integers(1, 9), top=st.integers(1, 5000), seed=st.integers(0, 2**31 - 1))
@example(rope="default", head_dim=64, dtype=torch.bfloat16, batch=1, width=1, top=MIN_POSITIONS - 1, seed=0)
@example(rope="llama3", head_dim=64, dtype=torch.float32, batch=2, width=9, top=MIN_POSITIONS, seed=1)
def test_table_is_bitwise_the_modules_own(rope, head_dim, dtype, batch, width, top, seed):
    model, rot = _rotary(rope, head_dim)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, 2 * head_dim, generator=g).to(dtype)
    calls = [torch.randint(0, top + 1, (batch, width), generator=g) for _ in range(3)]
    calls.append(torch.full((batch, width), top))  # the largest position itself
    want = [rot(x, pos) for pos in calls]
    with use_rope_tables(model) as n:
        assert n == 1
        got = [rot(x, pos) for pos in calls]
    for (wc, ws), (gc, gs) in zip(want, got):
        assert gc.dtype == wc.dtype == dtype and gc.shape == wc.shape == (batch, width, head_dim)
        assert torch.equal(gc, wc) and torch.equal(gs, ws)


def test_table_grows_and_is_dropped_on_exit():
    model, rot = _rotary("default", 64)
    x = torch.zeros(1, 1, 128)
    with use_rope_tables(model):
        rot(x, torch.tensor([[3]]))
        assert rot._sequoia_rope[0].shape[0] == MIN_POSITIONS
        rot(x, torch.tensor([[MIN_POSITIONS]]))  # one past the table: doubled
        assert rot._sequoia_rope[0].shape[0] == 2 * MIN_POSITIONS
        rot(x.double(), torch.tensor([[5]]))  # another dtype: a table in it
        assert rot._sequoia_rope[0].dtype == torch.float64
    assert "forward" not in rot.__dict__ and "_sequoia_rope" not in rot.__dict__
    assert "_sequoia_rope_fallback" not in rot.__dict__


def test_a_rotary_that_returns_fp32_for_bf16_inputs_keeps_one_table():
    """Olmo2's rotary computes in fp32 and does not cast back: the table is keyed by x's dtype (it
    was compared with the table's own, never equal there, so every forward remade it twice as long:
    a bf16 Olmo2 ran out of memory after ~20 forwards)."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    try:
        config = Olmo2Config(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4)
    except Exception as e:  # noqa: BLE001  (transformers 5.4: Olmo2Config fails its own field validation)
        pytest.skip(f"transformers {transformers.__version__} cannot build an Olmo2Config: {e}")
    model = Olmo2ForCausalLM(config).eval()
    rot = model.model.rotary_emb
    x, pos = torch.randn(1, 3, 64).to(torch.bfloat16), torch.tensor([[0, 7, 100]])
    want = rot(x, pos)
    assert want[0].dtype == torch.float32
    with use_rope_tables(model) as n:
        assert n == 1
        got = [rot(x, pos) for _ in range(6)]
        assert rot._sequoia_rope[0].shape[0] == MIN_POSITIONS
    assert all(torch.equal(c, want[0]) and torch.equal(s, want[1]) for c, s in got)


def test_a_rotary_that_returns_one_complex_tensor():
    """Llama 4's rotary returns one complex ``freq_cis`` [B, T, D / 2], not (cos, sin): the table
    holds what the module returns (the switch unpacked two tensors from it and raised ValueError at
    a Llama 4 target's first forward in the loop)."""
    Config = getattr(transformers, "Llama4TextConfig", None)
    if Config is None:
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    config = Config(vocab_size=61, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = transformers.Llama4ForCausalLM(config).eval()
    rot = model.model.rotary_emb
    x, pos = torch.randn(2, 3, 64), torch.tensor([[0, 7, 100], [MIN_POSITIONS, 2, 5000]])
    want = rot(x, pos)
    assert isinstance(want, torch.Tensor) and want.is_complex()
    with use_rope_tables(model) as n:
        assert n == 1
        got = rot(x, pos)
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)


def test_dynamic_ropes_are_not_switched():
    assert "dynamic" not in STATIC_ROPE and "longrope" not in STATIC_ROPE  # their inv_freq follows the length
    model = tiny_llama(0, layers=1, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with use_rope_tables(model) as n:
        assert n == 0


def test_nested_blocks_and_a_model_forward_unchanged():
    model = tiny_llama(3, layers=2, dtype=torch.float32)
    ids = torch.randint(0, 61, (2, 7))
    want = model(ids).logits
    with use_rope_tables(model) as outer, use_rope_tables(model) as inner:
        assert (outer, inner) == (1, 0)  # the enclosing block's switch stands
        got = model(ids).logits
    assert torch.equal(got, want)
    with sequoia_models(model, packed_linears=False):  # the loop's patching includes the tables
        assert "_sequoia_rope_fallback" in model.model.rotary_emb.__dict__
    assert "_sequoia_rope_fallback" not in model.model.rotary_emb.__dict__
