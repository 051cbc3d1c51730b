"""Hugging Face causal LMs whose attention takes the ``AttentionInterface`` as Llama's does, each
with its own twist, decode through the loop as the model itself does: in fp32 token for token
Hugging Face's greedy decoding, in bf16 the tree's tokens plain decoding's through the same loop
(its kernels are batch invariant). The loop's CPU fast paths (packed linears, fused projections,
lean layers, RoPE tables) switch only what they mirror and leave the rest to the model's code.

Found by this sweep: a Glm or Starcoder2 target raised AttributeError ('gate_proj') in the lean
layers' switch (Llama's layer forward over another MLP), and a bf16 Olmo2 ran out of memory (its
rotary returns fp32 for bf16 inputs, and the RoPE table was remade twice as long every forward)."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import greedy_reference, tiny_llama

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.tree import chain_tree, kxd_tree

COMMON = dict(vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, eos_token_id=None, pad_token_id=0, bos_token_id=None)
FAMILIES = {  # the twist each brings
    "Qwen3": dict(head_dim=16),  # q / k norms in the attention
    "Phi3": dict(sliding_window=None),  # fused qkv_proj and gate_up_proj
    "Granite": dict(attention_multiplier=0.3, residual_multiplier=0.5, logits_scaling=2.0,
                    embedding_multiplier=3.0),  # scalings everywhere
    "Olmo2": {},  # norms after the attention and MLP, q / k norms, an fp32 rotary
    "Cohere": dict(logit_scale=0.5),  # a parallel block, LayerNorm, interleaved rotary
    "Gemma": dict(head_dim=16),  # a scaled embedding, (1 + w) norms, GELU
    "Glm": dict(head_dim=16),  # Llama's layer forward, a partial rotary, gate_up_proj
    "Starcoder2": dict(sliding_window=None),  # biases, LayerNorm, a c_fc / c_proj MLP
}
PROMPT = [3, 17, 5, 9, 22, 8]


def _family(name: str, seed: int, layers: int, dtype: torch.dtype):
    try:
        config = getattr(transformers, f"{name}Config")(**{**COMMON, **FAMILIES[name], "num_hidden_layers": layers})
    except Exception as e:  # noqa: BLE001  (transformers 5.4: Olmo2Config fails its own field validation)
        pytest.skip(f"transformers {transformers.__version__} cannot build a {name}Config: {e}")
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lm_head" in n or "embed" in n:
                p.mul_(4.0)  # peaked distributions: no near-ties in greedy decisions
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_decodes_as_the_model_does(name, dtype):
    if getattr(transformers, f"{name}ForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    target, draft = _family(name, 0, 2, dtype), _family(name, 1, 1, dtype)
    tree = SequoiaGenerator(target, draft, kxd_tree(2, 3), SamplingParams(), max_length=128)
    got = tree.generate([PROMPT], max_new_tokens=30, eos_token_id=[]).tokens[0]
    if dtype == torch.float32:
        want = greedy_reference(target, PROMPT, 30)
    else:
        plain = SequoiaGenerator(target, None, chain_tree(0), SamplingParams(), max_length=128)
        want = plain.generate([PROMPT], max_new_tokens=30, eos_token_id=[]).tokens[0]
    assert got == want


def test_a_family_whose_attention_it_does_not_compute_is_refused_and_left_as_found():
    """Gemma2 soft-caps its attention logits (``softcap``): the tree attention does not, so the call
    stops at the first forward with an error naming it, and the models are as they were found."""
    if getattr(transformers, "Gemma2ForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Gemma2")
    from sequoia_decoding import SequoiaDecoding

    config = dict(COMMON, head_dim=16, attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    target = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config)).eval()
    draft = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**dict(config, num_hidden_layers=1))).eval()
    ids = torch.tensor([PROMPT])
    found = [m.config._attn_implementation for m in (target, draft)]
    want = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    with pytest.raises(ValueError, match="soft-capping"):
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                        custom_generate=SequoiaDecoding(draft, budget=8, max_depth=3))
    assert [m.config._attn_implementation for m in (target, draft)] == found
    got = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)


def _llama4(seed: int, layers: int, chunk: int):
    config = transformers.Llama4TextConfig(**{**COMMON, "num_hidden_layers": layers}, head_dim=16,
                                           num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=128,
                                           attention_chunk_size=chunk)
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model


def test_llama4_decodes_within_its_attention_chunk_and_is_refused_past_it():
    """Llama 4's text model (a complex rotary, layers without RoPE, MoE) decodes as the model does
    while every position lies in the first attention chunk (``attention_chunk_size``: its chunked
    layers see only their own chunk's keys; the tree attention sees every earlier key). A request
    past the chunk is a ``ValueError`` naming it before anything runs, as past a sliding window
    (before: a ``ValueError`` from the rotary switch at the first forward, and once past that the
    chunk was not checked: other logits without a word)."""
    if getattr(transformers, "Llama4ForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Llama 4")
    from sequoia_decoding import SequoiaDecoding

    target, draft = _llama4(0, 4, 32), _llama4(1, 1, 8192)
    assert target.config.layer_types[:3] == ["chunked_attention"] * 3
    ids = torch.tensor([PROMPT])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
    want = target.generate(ids, max_new_tokens=16, **kw)
    assert torch.equal(target.generate(ids, max_new_tokens=16, custom_generate=SequoiaDecoding(
        draft, budget=6, max_depth=2), **kw), want)
    tree = SequoiaGenerator(target, draft, kxd_tree(2, 2), SamplingParams(), max_length=128)
    assert tree.generate([PROMPT], max_new_tokens=16, eos_token_id=[]).tokens[0] == want[0, len(PROMPT):].tolist()
    with pytest.raises(ValueError, match="chunks of 32 positions .config.attention_chunk_size.*needs"):
        tree.generate([PROMPT], max_new_tokens=30, eos_token_id=[])
    assert target.config._attn_implementation == "sdpa"
    assert torch.equal(target.generate(ids, max_new_tokens=16, **kw), want)


def _refused(name: str, layers: int, **config):
    config = {**COMMON, "num_hidden_layers": layers, **config}
    if config["num_key_value_heads"] is None:  # a config that has no such field (GPT-J, Falcon)
        del config["num_key_value_heads"]
    if name == "Lfm2":  # one short-convolution layer before the attention
        config["layer_types"] = ["conv"] * (layers - 1) + ["full_attention"]
    if name == "Qwen3Next":  # gated linear attention (a recurrent state) before the attention
        config["layer_types"] = ["linear_attention"] * (layers - 1) + ["full_attention"]
    torch.manual_seed(layers)
    return getattr(transformers, f"{name}ForCausalLM")(getattr(transformers, f"{name}Config")(**config)).eval()


OWN_CODE = "computes its attention in its own code"
REFUSED = {  # what each has that the tree attention cannot stand in for, and a config of it
    "GPTJ": (OWN_CODE, dict(n_embd=64, n_head=4, rotary_dim=8, num_key_value_heads=None)),
    "Falcon": (OWN_CODE, dict(num_key_value_heads=None)),
    "Lfm2": ("carry a recurrent state", {}),
    "Qwen3Next": ("carry a recurrent state", dict(head_dim=16)),
    "DeepseekV3": ("multi-latent attention", dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                                                  n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                                                  moe_intermediate_size=32, n_group=1, topk_group=1)),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_model_the_tree_attention_cannot_stand_in_for_is_refused_before_anything_runs(name):
    """A target (or draft) whose attention does not go through transformers' AttentionInterface
    (GPT-J decoded other tokens than its own without a word: its attention read the whole cache,
    no tree mask), whose layers carry a recurrent state (Mamba, linear attention, convolutions) or
    whose attention is multi-latent (raised deep in the first forward, about the caches): a
    ``ValueError`` naming it before anything runs; the models are left as found."""
    if getattr(transformers, f"{name}ForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    from sequoia_decoding import SequoiaDecoding
    from sequoia_decoding.patching import _takes_attention_interface

    what, config = REFUSED[name]
    try:
        target, draft = _refused(name, 2, **config), _refused(name, 1, **config)
    except Exception as e:  # noqa: BLE001  (an older transformers' config of another shape)
        pytest.skip(f"transformers {transformers.__version__} cannot build this {name}: {e}")
    ids = torch.tensor([PROMPT])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    found = [m.config._attn_implementation for m in (target, draft)]
    want = target.generate(ids, **kw)
    if what == OWN_CODE and _takes_attention_interface(target):  # this transformers routes it through the interface
        got = target.generate(ids, **kw, custom_generate=SequoiaDecoding(draft, budget=4, max_depth=2))
        assert torch.equal(got, want)  # (transformers 5.25: GPT-J and Falcon)
        return
    with pytest.raises(ValueError, match=what):
        target.generate(ids, **kw, custom_generate=SequoiaDecoding(draft, budget=4, max_depth=2))
    with pytest.raises(ValueError, match=what):  # as the draft of a model the loop runs
        SequoiaGenerator(tiny_llama(0, vocab=61), target, kxd_tree(2, 2), SamplingParams(),
                         max_length=64).generate([PROMPT], max_new_tokens=5, eos_token_id=[])
    assert [m.config._attn_implementation for m in (target, draft)] == found
    assert torch.equal(target.generate(ids, **kw), want)


def _multimodal(name: str, layers: int, seed: int):
    text = dict(COMMON, vocab_size=300, num_hidden_layers=layers, head_dim=16)
    if name == "Gemma3":  # Gemma 3 4B and larger: a vision tower beside the text model, soft-capped logits
        config = transformers.Gemma3Config(
            text_config=dict(text, sliding_window=512, final_logit_softcapping=2.0), mm_tokens_per_image=4,
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=32, patch_size=8), image_token_index=299, boi_token_index=298,
            eoi_token_index=297)
    else:  # Qwen2.5-VL: a multimodal RoPE (positions in three sections)
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        config = transformers.Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope), image_token_id=299, video_token_id=298,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64),
            vision_start_token_id=297)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    return model


def _head_for(target):
    """A random EAGLE-1 head over the target's decoder (its text config)."""
    from sequoia_decoding.modeling.feature_head import FeatureHead

    c = target.config.get_text_config()
    torch.manual_seed(1)
    head = FeatureHead(dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=c.vocab_size, rms_norm_eps=1e-6), "eagle1")
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return head.eval()


@pytest.mark.parametrize("name", ["Gemma3", "Qwen2_5_VL"])
def test_a_multimodal_model_decodes_text_as_it_does(name):
    """A multimodal model used for text (``AutoModelForCausalLM`` loads Gemma 3 4B and larger so):
    its layers' fields live in ``config.text_config`` (the loop read ``config.num_attention_heads``
    and raised AttributeError; binding a feature head to it too), Qwen2.5-VL's RoPE takes positions
    in three sections (the RoPE table raised IndexError). Greedy calls give its own tokens, with a
    standalone draft or a feature head; sampled, the lazy logits give the full logits' tokens (Gemma
    3's multimodal class does not soft-cap, its text model does). An image is refused (it was
    ignored: the answer of the text alone)."""
    if getattr(transformers, f"{name}ForConditionalGeneration", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    from sequoia_decoding import SequoiaDecoding

    try:
        target, draft = _multimodal(name, 2, 0), _multimodal(name, 1, 1)
    except Exception as e:  # noqa: BLE001  (an older transformers' config of another shape)
        pytest.skip(f"transformers {transformers.__version__} cannot build this {name}: {e}")
    ids = torch.tensor([PROMPT, [5, 4, 3, 2, 1, 7]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    want = target.generate(ids, **kw)
    assert torch.equal(target.generate(ids, **kw, custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3)), want)
    assert torch.equal(target.generate(ids, **kw, custom_generate=SequoiaDecoding(_head_for(target), budget=6,
                                                                               max_depth=3)), want)  # a feature head
    if name == "Gemma3":  # an image: generate() runs the vision tower, the loop would read the text alone
        with pytest.raises(ValueError, match="(mm_encoder_outputs|pixel_values) would be ignored"):  # (5.4: as given)
            target.generate(ids[:1], max_new_tokens=4, pixel_values=torch.zeros(1, 3, 32, 32),
                            custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
    got = [SequoiaGenerator(target, draft, kxd_tree(2, 2), SamplingParams(temperature=1.0, seed=2), max_length=64,
                            lazy_logits=lazy).generate([PROMPT] * 3, max_new_tokens=16, eos_token_id=[]).tokens
           for lazy in (False, True)]
    assert got[0] == got[1]
