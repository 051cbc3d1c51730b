"""The target's logits from its final hidden states (``sequoia_decoding.target_head``): bitwise what
the model's own forward returns, for the families whose forward does more after the LM head
(Cohere's ``logit_scale``, Granite's ``logits_scaling``, Gemma's final soft-capping), through both
loop paths that apply the head themselves (``lazy_logits`` and a feature head's target forward).

Found: those paths applied the bare LM head; greedy decoding did not see it (each operation is
increasing), sampling did (a Granite target at T = 1 was 0.71 away in total variation from its
own distribution through the lazy path, a Gemma 2 target with soft-capping 0.98)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import transformers

from sequoia_decoding.feature_drafter import target_forward
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.target_head import OPERATIONS, TargetHead
from sequoia_decoding.tree import kxd_tree

COMMON = dict(vocab_size=61, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              eos_token_id=None, pad_token_id=0, bos_token_id=None)
FAMILIES = {  # what each does after its LM head (a value far from 1, so that a missing one shows)
    "Cohere": dict(logit_scale=0.25),
    "Granite": dict(logits_scaling=4.0),
    "Gemma2": dict(head_dim=16, final_logit_softcapping=2.0, attn_logit_softcapping=None),
    "Gemma3Text": dict(head_dim=16, final_logit_softcapping=2.0, sliding_window=512),
    "Llama": {},  # nothing
}
PROMPT = [3, 17, 5, 9, 22, 8]


def _model(name: str, layers: int, seed: int, dtype=torch.float32):
    cls = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config = getattr(transformers, f"{name}Config")(**{**COMMON, "num_hidden_layers": layers, **FAMILIES[name]})
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # peaked: the operations change the distribution much
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_head_gives_the_models_own_logits(name, dtype):
    model = _model(name, 2, 0, dtype)
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = TargetHead(model)(model.get_decoder()(ids).last_hidden_state)
        features = target_forward(model, ids, (-1,))[0]  # a feature head's path
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(features, want)
    assert TargetHead(model).weight is model.get_output_embeddings().weight


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_lazy_verification_samples_what_full_logits_sample(name):
    """The lazy path (logits at the rows verification reads) returns the full logits' path, length
    and bonus with the same random numbers: the same tokens, seed for seed."""
    target, draft = _model(name, 2, 0), _model(name, 1, 1)
    got = []
    for lazy in (False, True):
        gen = SequoiaGenerator(target, draft, kxd_tree(2, 2), SamplingParams(temperature=1.0, seed=3), max_length=64,
                               lazy_logits=lazy)
        got.append(gen.generate([PROMPT] * 4, max_new_tokens=24, eos_token_id=[]).tokens)
    assert got[0] == got[1]


# what transformers' causal LMs do after the LM head, beyond what TargetHead applies, and why the
# loop need not: a tripwire for a transformers version that adds another
ENCODER_DECODER = "an encoder-decoder: not a model the loop runs"
NOT_APPLIED = {
    **{f"{name}ForConditionalGeneration": ENCODER_DECODER  # final_logits_bias, the decoder's soft-capping
       for name in ("Bart", "BigBirdPegasus", "Blenderbot", "BlenderbotSmall", "PLBart", "ProphetNet", "T5Gemma",
                    "T5Gemma2")},
    "InklingForConditionalGeneration": "as InklingForCausalLM",
    "InklingForCausalLM": "its logits cut to config.unpadded_vocab_size: not a model the loop runs (a vocabulary "
                          "other than its head's rows)",
    "ProphetNetForCausalLM": "an n-gram stream decoder (its logits the first stream's): not a model the loop runs",
    "Inkling2ForCausalLM": "as Inkling's (transformers 5.25), then a soft-capping module: not a model the loop runs",
    "Inkling2LoopForCausalLM": "as Inkling2ForCausalLM",
    "Inkling2ForConditionalGeneration": "as Inkling2ForCausalLM",
    "Inkling2LoopForConditionalGeneration": "as Inkling2ForCausalLM",
    "MoshiForCausalLM": "an audio codebook decoder (transformers 5.4): not a model the loop runs",
    "RecurrentGemmaForCausalLM": "recurrent layers: refused by the loop (patching._check_layers)",
    "xLSTMForCausalLM": "recurrent layers: refused by the loop (patching._check_layers)",
}


def test_every_operation_after_an_lm_head_in_transformers_is_applied_or_explained():
    root = pathlib.Path(transformers.__file__).parent / "models"
    classes = re.compile(r"^class (\w+(?:ForCausalLM|LMHeadModel|ForConditionalGeneration))\b.*?(?=^class |\Z)",
                         re.S | re.M)
    unknown = []
    for path in sorted(root.glob("*/modeling_*.py")):
        for cls in classes.finditer(path.read_text()):
            body = cls.group(0)
            at = body.find("= self.lm_head(")
            if at < 0 or cls.group(1) in NOT_APPLIED:
                continue
            after = body[at:].split("\n")[1:12]
            ops = [line.strip() for line in after if re.match(r"\s*(lm_)?logits\s*[-+*/]?=\s", line)
                   and not re.match(r"\s*logits = logits\.float\(\)", line)]  # a cast loses nothing
            left = [op for op in ops if not any(word in op for word in OPERATIONS)
                    and op != "logits = torch.tanh(logits)"]  # (soft-capping's middle step)
            if left:
                unknown.append(f"{path.parent.name}.{cls.group(1)}: {left}")
    assert not unknown, "LM heads followed by operations TargetHead does not apply:\n" + "\n".join(unknown)
