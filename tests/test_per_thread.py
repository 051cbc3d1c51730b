"""A plain call on a model from another thread while the loop has it switched (a server answering
a request with options the tree verifier does not take by plain ``generate()``, beside a Sequoia
call on the same model): it sees the model as it was (``sequoia_kernels.per_thread``). Before, it
ran on the switched model: a padded batch had its padding ignored (the tree attention builds no
mask) in 9 of 10 calls of a probe and raised in the tenth; a bf16 call took the loop's rounding."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from tiny_models import tiny_llama
from transformers import DynamicCache

from sequoia_decoding import SequoiaDecoding
from sequoia_decoding.patching import sequoia_models
from sequoia_kernels.hf import cache_kw

DTYPES = [torch.float32, torch.bfloat16]


def _pair(dtype):
    target = tiny_llama(0, layers=4, hidden=128, sharpen=4.0, dtype=dtype, special_tokens=True, pad_token_id=0)
    return target, tiny_llama(1, layers=1, sharpen=4.0, dtype=dtype)


def _in_thread(fn):
    """``fn()`` run in another thread (joined within 120 s): its result, or the exception it raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 (returned to the test)
            out["value"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the other thread did not finish"
    return out["value"]


PADDED = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6], [0, 9, 8, 7, 6, 5]])  # left padding, pad id 0
MASK = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
HIDDEN = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0))  # [B, T, hidden]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_forward_from_another_thread_during_a_block_is_the_models_own(dtype):
    """Inside the block the calling thread's model runs our attention and kernels; another thread's
    forward of a padded batch with a ``DynamicCache`` (prefill, then a step) gives the bits it gives
    outside the block, and it reads the model's own attention implementation."""
    target, draft = _pair(dtype)

    @torch.no_grad()
    def plain():
        cache = DynamicCache(config=target.config)
        first = target(PADDED, attention_mask=MASK, **cache_kw(target, cache)).logits
        mask = torch.cat([MASK, torch.ones(3, 1, dtype=MASK.dtype)], 1)
        step = target(torch.tensor([[4], [4], [4]]), attention_mask=mask, **cache_kw(target, cache)).logits
        return first, step, target.config._attn_implementation, target.model.layers[0].mlp(HIDDEN.to(dtype))

    want = plain()
    with sequoia_models(target, draft, packed_linears=True):
        assert target.config._attn_implementation == draft.config._attn_implementation == "sequoia_tree"
        got = _in_thread(plain)
        assert not isinstance(got, Exception), got
    assert got[2] == "sdpa"
    for g, w in zip((got[0], got[1], got[3]), (want[0], want[1], want[3])):
        assert torch.equal(g, w)


def test_configs_are_left_as_found():
    """The config's class is the model's own again after the block (and in the block for other
    threads it behaves as the model's: its dict, its pickling)."""
    target, draft = _pair(torch.float32)
    classes, as_dict = (type(target.config), type(draft.config)), target.config.to_dict()
    with sequoia_models(target, draft, packed_linears=True):
        with sequoia_models(target, packed_linears=True):  # nested: the enclosing block's switch holds
            assert target.config._attn_implementation == "sequoia_tree"
        assert target.config._attn_implementation == "sequoia_tree"
        assert isinstance(target.config, classes[0]) and target.config.to_dict() == as_dict
        copies = [pickle.loads(pickle.dumps(target.config)), copy.deepcopy(target.config)]
        assert [type(c) for c in copies] == [classes[0]] * 2 and all(c.to_dict() == as_dict for c in copies)
        assert _in_thread(lambda: target.config._attn_implementation) == "sdpa"
    assert (type(target.config), type(draft.config)) == classes
    assert target.config.to_dict() == as_dict and target.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_plain_and_sequoia_calls_from_two_threads(dtype):
    """One thread decodes with Sequoia calls over and over, another runs plain padded batches on
    the same target: every plain call returns plain ``generate()``'s tokens, every Sequoia call its
    own tokens as when run alone, and the models are left as found."""
    target, draft = _pair(dtype)
    prompt = torch.tensor([[3, 4, 5, 6]])

    def sequoia():
        return target.generate(prompt, max_new_tokens=30, custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))

    def plain():
        return target.generate(PADDED, attention_mask=MASK, max_new_tokens=20, do_sample=False)

    want_sequoia, want_plain = sequoia(), plain()
    stop, seq_ok = threading.Event(), []

    def loop():
        while not stop.is_set():
            seq_ok.append(torch.equal(sequoia(), want_sequoia))

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        while not seq_ok:  # a call under way or done
            stop.wait(0.01)
        got = [plain() for _ in range(4)]
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not worker.is_alive()
    assert all(torch.equal(g, want_plain) for g in got)
    assert seq_ok and all(seq_ok)
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    assert torch.equal(plain(), want_plain)


def test_a_config_that_is_not_a_transformers_config_is_switched_for_every_thread():
    """A model whose config holds ``_attn_implementation`` as a plain attribute (no transformers
    property to answer per thread): switched with ``set_attn_implementation`` for the block, for
    every thread, and back on exit."""
    import types

    from sequoia_kernels.per_thread import use_tree_attention

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config, self.calls = types.SimpleNamespace(_attn_implementation="eager"), []

        def set_attn_implementation(self, impl):
            self.calls.append(impl)
            self.config._attn_implementation = impl

    model = Model()
    with use_tree_attention(model):
        assert _in_thread(lambda: model.config._attn_implementation) == "sequoia_tree"
    assert model.calls == ["sequoia_tree", "eager"] and model.config._attn_implementation == "eager"
