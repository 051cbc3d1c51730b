"""Sequoia's offloading setting: a target whose decoder layers accelerate streams in per forward
(``sequoia_decoding.offload``), decoded by the loop exactly as the resident model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import tiny_models
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.offload import load_offloaded, offload_device_map, offload_of
from sequoia_decoding.planner import plan_tree
from sequoia_decoding.profiles import machine_key
from sequoia_kernels.hf import cache_kw
from sequoia_kernels.ops.packed_linear import packed_linear_supported, use_packed_linears

pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="offloading needs accelerate")
PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [13, 4]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    tiny_models.tiny_llama(0, vocab=61, layers=3, sharpen=3.0).save_pretrained(root / "target")
    return root, tiny_models.tiny_llama(1, vocab=61, layers=1, sharpen=3.0)


@pytest.mark.parametrize("where", ["disk", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_offloaded_target_decodes_as_the_resident_one(pair, where, dtype, tmp_path):
    """Greedy and sampled (seeded), batch 2: the loop on the offloaded target emits what it emits on
    the resident target, and greedy Sequoia what plain decoding emits; the loop's packed linears
    reach the hooked layers (accelerate patches their ``forward``) and keep no resident packed copy
    of an offloaded weight."""
    if not packed_linear_supported(dtype):
        pytest.skip(f"no packed_linear path for {dtype} on this CPU")
    root, draft = pair
    from transformers import AutoModelForCausalLM

    resident = AutoModelForCausalLM.from_pretrained(root / "target", dtype=dtype).eval()
    target = load_offloaded(str(root / "target"), dtype=dtype, device="cpu", where=where, folder=str(tmp_path / "w"))
    assert offload_of(target) == where and offload_of(resident) is None
    draft = draft.to(dtype)
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)):
        got = [SequoiaGenerator(m, d, p, sampling, max_length=96, packed_linears=True).generate(
               PROMPTS, max_new_tokens=20, eos_token_id=[]).tokens
               for m, d, p in ((target, draft, plan), (resident, draft, plan), (target, None, None))]
        assert got[0] == got[1], (where, dtype, sampling)
        if sampling.temperature == 0:
            assert got[0] == got[2], (where, dtype)  # greedy Sequoia = plain decoding, offloaded
    linears = [m for m in target.modules() if type(m) is torch.nn.Linear]
    with use_packed_linears(target) as switched:
        assert switched == len(linears)
    layer_q = target.model.layers[0].self_attn.q_proj
    assert "_sequoia_packed_kept" not in layer_q.__dict__  # an offloaded weight: packed per forward, not kept
    assert machine_key(target, draft, torch.device("cpu"), dtype)["offload"] == where


def test_offload_device_map_and_bad_input(pair, tmp_path):
    root, _ = pair
    from transformers import AutoConfig

    dm = offload_device_map(AutoConfig.from_pretrained(root / "target"), "disk", "cpu")
    assert [dm[f"model.layers.{i}"] for i in range(3)] == ["disk"] * 3 and dm["lm_head"] == "cpu"
    with pytest.raises(ValueError, match="offload must be one of"):
        load_offloaded(str(root / "target"), dtype=torch.float32, device="cpu", where="nvme")
    from sequoia_decoding.loading import load_causal_lm

    for where in ("cpu", "disk", "stream"):  # under torchrun the CLI and demo ask for both: every rank refuses
        with pytest.raises(ValueError, match=f"offload '{where}' with tensor parallelism: not supported"):
            load_causal_lm(str(root / "target"), tensor_parallel=True, offload=where)


@pytest.mark.parametrize("served_from", ["checkpoint", "folder"])
def test_offload_files_vanishing_mid_call_raise_naming_the_layer(pair, served_from, tmp_path):
    """The file behind a disk-offloaded layer goes missing mid-call (at the 3rd forward of layer
    1): the call raises :class:`OffloadReadError` naming the layer, the weight and the path, before
    the module holding that weight computes; a target cache keeps its committed entries through such a failed forward; with the
    file back, the same generator decodes the next request as before. ``checkpoint``: the weights
    are read straight from the checkpoint's safetensors; ``folder``: from the offload folder
    (a ``.bin`` checkpoint, whose weights are written there at load, one file each)."""
    import re

    from transformers import AutoModelForCausalLM

    from sequoia_decoding.offload import OffloadReadError
    from sequoia_kernels.hf import SequoiaCache

    root, draft = pair
    ckpt, folder = tmp_path / "target", tmp_path / "w"
    resident = AutoModelForCausalLM.from_pretrained(root / "target")  # a copy the test may break
    if served_from == "checkpoint":
        resident.save_pretrained(ckpt)
    else:
        resident.config.save_pretrained(ckpt)
        torch.save(resident.state_dict(), ckpt / "pytorch_model.bin")
    target = load_offloaded(str(ckpt), dtype=torch.float32, device="cpu", where="disk", folder=str(folder))
    victim = ckpt / "model.safetensors" if served_from == "checkpoint" else folder
    assert victim.exists() and (served_from == "checkpoint" or any(folder.glob("*.safetensors")))
    gen = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2, 0.1], 8, 4), SamplingParams(), max_length=96,
                           packed_linears=True)
    before = gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]).tokens
    hidden, calls = tmp_path / "hidden", []

    def vanish(module, args):
        calls.append(1)
        if len(calls) == 3:
            victim.rename(hidden)

    handle = target.model.layers[1].register_forward_pre_hook(vanish)
    with pytest.raises(OffloadReadError, match=r"offloaded layer model\.layers\.1: cannot read its weight "
                                               r"model\.layers\.1\.\S+ from " + re.escape(str(victim))):
        gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[])
    handle.remove()
    # a cache through a forward that fails at layer 1: its committed entries and lengths as they were
    cache = SequoiaCache(target.config, batch_size=1, max_cache_len=32)
    hidden.rename(victim)
    target(torch.tensor([PROMPTS[0]]), **cache_kw(target, cache), use_cache=True)
    cache.commit(len(PROMPTS[0]))
    kept, lens = cache.tensor.clone(), cache.prefix_len.clone()
    victim.rename(hidden)
    with pytest.raises(OffloadReadError, match=r"model\.layers\.0"):
        target(torch.tensor([[4, 5]]), **cache_kw(target, cache), use_cache=True)
    assert torch.equal(cache.prefix_len, lens)
    assert torch.equal(cache.tensor[:, :, :, :len(PROMPTS[0])], kept[:, :, :, :len(PROMPTS[0])])
    hidden.rename(victim)
    assert gen.generate(PROMPTS, max_new_tokens=12, eos_token_id=[]).tokens == before
