"""Sequoia where Hugging Face users already are: ``model.generate(..., custom_generate=SequoiaDecoding(draft))``.

Transformers (>= 5.4 for this package) accepts a callable as ``custom_generate``: ``generate()`` validates the
``GenerationConfig``, prepares the inputs (left padding, attention mask, position ids), the
logits processors and the stopping criteria, and then calls it instead of its own decoding loop::

    from sequoia_decoding import SequoiaDecoding

    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=128,
                          custom_generate=SequoiaDecoding(draft))                  # greedy: == plain generate
    out = target.generate(input_ids, attention_mask=mask, do_sample=True, temperature=0.6, top_p=0.9,
                          custom_generate=SequoiaDecoding(draft))                  # exact sampling

``SequoiaDecoding.__call__`` runs the tree loop (``SequoiaGenerator``) over each row's real tokens
(the left padding removed) and returns what ``generate()`` returns: the ``[B, L + new]`` LongTensor
of prompts and new tokens, rows that end early padded with ``pad_token_id`` (or a
``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate=True``). Greedy output is token for
token HF's greedy output; sampled output follows the same distribution (temperature, top-k, top-p
applied exactly; Sequoia's verification is lossless).

Supported ``GenerationConfig`` options: ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``max_new_tokens`` / ``max_length``, ``min_new_tokens`` / ``min_length``, ``eos_token_id``,
``pad_token_id``, ``num_return_sequences``, ``return_dict_in_generate`` (``sequences`` only),
``stopping_criteria`` (any: evaluated after every token), a streamer and stop strings (see below).
Anything that changes the distribution in a way the verifier cannot reproduce exactly (beam search,
repetition penalty, min-p, typical-p, bad words, logits processors passed by the caller, ...) and the outputs
we do not produce (``output_scores``, ``output_logits``, attentions, hidden states) raise a
``ValueError`` naming the option.

Streaming: transformers hands ``streamer=`` to its own loops but strips it from a callable
``custom_generate`` (after putting the prompt into it). Give the streamer to ``SequoiaDecoding``
instead: ``target.generate(ids, custom_generate=SequoiaDecoding(draft, streamer=s))`` puts the
prompt once, then the tokens of every step as they are accepted, then calls ``end()`` (batch 1, as
HF's streamers require). The repository form streams with the usual argument:
``target.generate(ids, streamer=s, custom_generate="path/to/sequoia-kernels", trust_remote_code=True,
draft_model=draft)`` (``custom_generate/generate.py`` at the repository root).

Stop strings: transformers does not hand ``tokenizer=`` on to a callable ``custom_generate`` and
refuses ``stop_strings`` without one (also those of the model's generation config). Pass them as
``stopping_criteria=StoppingCriteriaList([StopStringCriteria(tok, strings)])`` (with
``stop_strings=None`` where the model's generation config has some); the repository form takes
``stop_strings=..., tokenizer=tok`` as plain ``generate()`` does and builds that criterion itself.

The tree: ``budget=None`` plans it exactly as ``sequoia-kernels demo`` does (one planner call,
``profiles.plan_setting``): from the draft folder's acceptance vector (``acceptance-T<t>.json``
next to the draft's weights, the temperature nearest to the one in use; with top-k / top-p the
vector measured with those filters, ``acceptance-T0.6-topp0.9.json``, when the folder has it)
and this machine's cached latency profile *calibrated on the decoding loop* (the demo stores the
calibration with the profile: T(n) as the loop runs it and the time outside the forwards, per
sampling setting; the calibrated setting of the same kind nearest to the one in use). Where this
machine has no calibrated profile of the pair, it decodes without speculation (a 1-node plan:
plain decoding through the loop, measured at parity with ``generate()``, docs/hf_entry_point.md)
and says so once in the ``sequoia_decoding`` log: run
``make demo`` once to profile and calibrate. ``acceptance`` (a list of floats or a JSON file)
overrides the draft folder's vector; ``budget`` fixes the node count (``max_depth`` levels at
most, default 8). On a CPU the planned tree is re-planned online (``adaptive=None``, the default;
``SequoiaDecoding``'s docstring): greedy calls freely, sampled calls among trees of its size to
one level deeper, and plain decoding.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Sequence

import torch

from .adaptive import AdaptiveConfig, default_config
from .generate import SamplingParams, SequoiaGenerator
from .logs import say_once
from .planner import plan_tree
from .profiles import calibrated_plan, find_acceptance, find_cached_profile, typical_context
from .tensor_parallel import rank0s, tensor_parallel_of
from .tree import DEFAULT_ACCEPTANCE, TreePlan

__all__ = ["SequoiaDecoding"]

DEFAULT_MAX_DEPTH = 8

# GenerationConfig options behind the logits processors we cannot apply exactly, by class name
_PROCESSOR_OPTION = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinPLogitsWarper": "min_p",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "TopHLogitsWarper": "top_h",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}
# outputs we do not produce
_OUTPUT_OPTIONS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


class SequoiaDecoding:
    """A ``custom_generate`` callable: Sequoia tree speculation with ``draft_model`` inside
    ``target.generate(...)`` (module docstring: options, streaming, tree choice).

    ``draft_model``: a causal LM sharing the target's tokenizer (its vocabulary the target's, or
    padded to within 256 ids of it, as Qwen2's are). ``budget``: tree nodes, root included (None:
    planned, see the module docstring). ``max_depth``: most tree levels. ``acceptance``: the
    draft's acceptance vector (floats, or a JSON file of ``sequoia-kernels measure-acceptance``).
    ``streamer``: an HF streamer (batch 1).
    ``backend``: kernel backend override. ``adaptive`` (True or an ``AdaptiveConfig``): re-plan the
    tree online from the live acceptance and step times (``SequoiaGenerator``'s ``adaptive``: True
    re-plans sampled calls among trees of the planned size (to one level deeper) and plain
    decoding, an ``AdaptiveConfig()`` any tree; the planned tree is the first step's; the next
    call continues from where the last one ended). ``None`` (the default): on a CPU with the
    planned tree (no ``budget`` or ``max_depth`` fixed, a calibrated profile), greedy calls
    re-plan freely (the loop's CPU products give a row the same result in any tree) and sampled
    calls among trees of the planned size (to one level deeper) and plain decoding, from acceptance
    alone (``adaptive.default_config`` without live costs): where the tree keeps winning a call
    runs exactly its steps, where its levels do not pay a shallower tree takes over (a deeper one
    where acceptance pays one more level), where it loses to plain decoding it is dropped; a
    seeded call on a fresh ``SequoiaDecoding`` reproduces its tokens (later calls start from the
    earlier ones' evidence, as Hugging Face's heuristic assistant schedule carries its length).
    Not on GPUs. After each call ``last_plan`` holds the (first) tree used and ``last_output`` the
    loop's ``GenerationOutput`` (tokens per step, timings, ``replan``).
    """

    def __init__(self, draft_model, budget: int | None = None, max_depth: int | None = None,
                 acceptance: Sequence[float] | str | os.PathLike | None = None, *, streamer=None,
                 backend: str | None = None, adaptive: bool | AdaptiveConfig | None = None):
        if draft_model is None or not callable(draft_model):
            raise ValueError("SequoiaDecoding needs a draft model (a causal LM sharing the target's tokenizer)")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be an int >= 1 (tree nodes, root included) or None, got {budget!r}")
        if max_depth is not None and (isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1):
            raise ValueError(f"max_depth must be an int >= 1 or None, got {max_depth!r}")
        self.draft = draft_model
        self.budget, self.max_depth, self.acceptance = budget, max_depth, acceptance
        if adaptive is not None and not isinstance(adaptive, (bool, AdaptiveConfig)):
            raise ValueError(f"adaptive must be True, False, an AdaptiveConfig or None, got {adaptive!r}")
        self.streamer, self.backend, self.adaptive = streamer, backend, adaptive
        self.last_plan: TreePlan | None = None
        self.last_output = None
        self._plans: dict[tuple, tuple] = {}  # (target's weakref, plan_for's answer) by (target id, setting, context)
        self._adaptive_runs: dict[tuple, object] = {}  # adaptive: the last generator by (target, setting)

    # ------------------------------------------------------------------ the tree

    def _adapts(self, plan: TreePlan, sampling, device: torch.device) -> bool | AdaptiveConfig:
        """How this call re-plans online (False: not at all): ``adaptive`` when given; else on a
        CPU with a planned tree, greedy calls freely and sampled ones among trees of its size (at
        most its depth) and plain decoding, from acceptance alone (not the step times: a call whose
        tree keeps winning runs exactly the static plan's steps; class docstring, docs/hf_entry_point.md)."""
        if self.adaptive is not None:
            return self.adaptive
        if not (device.type == "cpu" and self.budget is None and self.max_depth is None and plan.num_nodes > 1):
            return False
        return True if sampling.greedy else default_config(sampling, live_costs=False)

    def _acceptance(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[tuple[float, ...], bool]:
        """(the acceptance vector for this setting, whether it was measured with these filters):
        ``acceptance`` when given, else the draft's (``profiles.find_acceptance``: its folder,
        then what the demo measured for it), else ``DEFAULT_ACCEPTANCE``."""
        from .loading import parse_acceptance

        if self.acceptance is not None:
            if isinstance(self.acceptance, (str, os.PathLike)):
                return tuple(parse_acceptance(os.fspath(self.acceptance))), False
            return tuple(float(x) for x in self.acceptance), False
        found, own, _ = find_acceptance(self.draft, temperature, top_k, top_p)
        return (found, own) if found is not None else (tuple(DEFAULT_ACCEPTANCE), False)

    def plan_for(self, target, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 context: int | None = None) -> TreePlan:
        """The tree this callable uses with ``target`` at ``temperature`` and these filters (module
        docstring); ``context``: the tokens a step typically sees (the cached profile nearest to it).
        Without ``budget``: the demo's plan (``profiles.calibrated_plan``) from this machine's
        cached, loop-calibrated profile, else plain decoding (a 1-node plan), said once in the log."""
        acc, own = self._acceptance(temperature, top_k, top_p)
        if self.budget is not None:
            return plan_tree(acc, self.budget, self.max_depth or DEFAULT_MAX_DEPTH)
        key = (id(target), float(temperature), int(top_k), float(top_p), context)
        hit = self._plans.get(key)  # the profile is read once per target, setting and context
        if hit is not None and hit[0]() is target:  # (not another model at a freed target's address)
            return hit[1]
        # the demo's rule (demo.plan_inputs): a filtered setting's own vector with its own overhead,
        # else the temperature's unfiltered vector and overhead
        setting = (float(temperature), int(top_k), float(top_p)) if own else (float(temperature), 0, 1.0)
        prof = find_cached_profile(target, self.draft, next(target.parameters()).device,
                                   next(target.parameters()).dtype, prefix=context)
        hp, note = calibrated_plan(acc, prof, setting, max_depth=self.max_depth or 16)
        if hp is None:
            say_once(f"SequoiaDecoding: {note}: decoding without speculation (plain decoding through the loop); "
                      "`sequoia-kernels demo` (or `make demo`) profiles and calibrates this machine once, after "
                      "which trees are planned")
            plan = plan_tree(acc, 1, 1)  # the root alone: plain decoding
        else:
            plan = hp.plan
            say_once(f"SequoiaDecoding: T={temperature:g} top-k {top_k} top-p {top_p:g}: planned n={hp.budget}, "
                      f"d={hp.max_depth} (predicted {hp.speedup:.2f}x; calibration of {note})", level=logging.INFO)
        self._plans[key] = (weakref.ref(target), plan)
        return plan

    # ------------------------------------------------------------------ generate()'s decoding loop

    @staticmethod
    def _sampling(generation_config, logits_processor, prompt_width: int) -> tuple[SamplingParams, int]:
        """(SamplingParams, min_new_tokens) from what generate() prepared; ValueError naming any
        option whose effect the tree loop cannot reproduce exactly."""
        from transformers.generation.logits_process import (
            LogitNormalization,
            MinLengthLogitsProcessor,
            MinNewTokensLengthLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        cfg = generation_config
        if (cfg.num_beams or 1) > 1 or (getattr(cfg, "num_beam_groups", 1) or 1) > 1:
            raise ValueError("SequoiaDecoding: num_beams > 1 (beam search) is not supported; use num_beams=1")
        if getattr(cfg, "penalty_alpha", None):
            raise ValueError("SequoiaDecoding: penalty_alpha (contrastive search) is not supported")
        if getattr(cfg, "dola_layers", None) is not None:  # another distribution (contrasting layers' logits)
            raise ValueError("SequoiaDecoding: dola_layers (DoLa decoding) is not supported")
        for name in _OUTPUT_OPTIONS:
            if getattr(cfg, name, False):
                raise ValueError(f"SequoiaDecoding: {name}=True is not supported (it returns sequences only)")
        temperature, top_k, top_p, min_new = 1.0, 0, 1.0, 0
        for proc in logits_processor or []:
            if isinstance(proc, TemperatureLogitsWarper):
                temperature = float(proc.temperature)
            elif isinstance(proc, TopKLogitsWarper):
                top_k = int(proc.top_k)
            elif isinstance(proc, TopPLogitsWarper):
                if int(proc.min_tokens_to_keep) != 1:
                    raise ValueError("SequoiaDecoding: top_p with min_tokens_to_keep != 1 is not supported")
                top_p = float(proc.top_p)
            elif isinstance(proc, MinNewTokensLengthLogitsProcessor):
                min_new = max(min_new, int(proc.min_new_tokens) - (prompt_width - int(proc.prompt_length_to_skip)))
            elif isinstance(proc, MinLengthLogitsProcessor):
                min_new = max(min_new, int(proc.min_length) - prompt_width)
            elif isinstance(proc, LogitNormalization):
                continue  # log-softmax: the distribution is unchanged
            else:
                name = type(proc).__name__
                option = _PROCESSOR_OPTION.get(name, f"a logits processor ({name})")
                raise ValueError(f"SequoiaDecoding: {option} is not supported: the tree verifier samples exactly "
                                 "from temperature / top-k / top-p filtered distributions only")
        if not cfg.do_sample:
            return SamplingParams(temperature=0.0), min_new
        if not (temperature > 0):
            raise ValueError(f"SequoiaDecoding: do_sample=True needs temperature > 0, got {temperature}")
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p), min_new

    @torch.no_grad()  # not inference mode (the loop inside is): what this returns is a plain tensor
    def __call__(self, model, input_ids: torch.Tensor, logits_processor=None, stopping_criteria=None,
                 generation_config=None, synced_gpus: bool = False, streamer=None, **model_kwargs) -> Any:
        """Called by ``model.generate()`` with what it prepared (input_ids [B, L], left padded;
        model_kwargs["attention_mask"] [B, L] or None when nothing is padded)."""
        from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

        if synced_gpus:
            raise ValueError("SequoiaDecoding: synced_gpus=True is not supported")
        if model_kwargs.get("inputs_embeds") is not None:  # generate() then hands over input_ids [B, 0]
            raise ValueError("SequoiaDecoding: inputs_embeds is not supported (the draft needs the prompt's token "
                             "ids): pass input_ids")
        streamer = self.streamer if self.streamer is not None else streamer
        B, L = input_ids.shape
        if streamer is not None and B != 1:
            raise ValueError(f"SequoiaDecoding: a streamer needs batch size 1, got {B}")
        sampling, min_new = self._sampling(generation_config, logits_processor, L)
        max_new = int(generation_config.max_length) - L
        if max_new < 1:
            raise ValueError(f"SequoiaDecoding: max_length {generation_config.max_length} leaves no room after a "
                             f"{L}-token prompt")
        prompts = _unpadded(input_ids, model_kwargs.get("attention_mask"))
        _check_model_inputs(model_kwargs, [len(p) for p in prompts])
        _note_a_filled_cache(model_kwargs)
        eos_t = generation_config._eos_token_tensor
        eos = [] if eos_t is None else [int(x) for x in eos_t.reshape(-1).tolist()]
        pad_t = generation_config._pad_token_tensor
        extra = [c for c in (stopping_criteria or []) if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]

        temperature = sampling.temperature
        plan = self.last_plan = rank0s(self.plan_for(model, temperature, sampling.top_k, sampling.top_p,
                                                     context=typical_context(prompts, max_new)),
                                       tensor_parallel_of(model))  # a TP target's ranks grow the same trees
        adaptive = self._adapts(plan, sampling, input_ids.device)
        gen = SequoiaGenerator(model, self.draft if plan.num_nodes > 1 or adaptive else None, plan, sampling,
                               max_length=None, backend=self.backend, device=input_ids.device,
                               adaptive=adaptive)  # caches as each call needs, re-planned trees included
        run_key = (id(model), temperature, sampling.top_k, sampling.top_p)  # the generator keeps `model` alive
        if adaptive and run_key in self._adaptive_runs:  # the re-planning goes on from the last call's
            gen.continue_adaptive(self._adaptive_runs[run_key])
        rows = input_ids.tolist()

        def stop(b: int, new: list[int]) -> int | None:
            """The caller's stopping criteria, after every token (HF checks after each one)."""
            if not extra:
                return None
            for j in range(len(new)):
                seq = torch.tensor([rows[b] + new[: j + 1]], device=input_ids.device)
                done = any(bool(torch.as_tensor(c(seq, None)).reshape(-1)[0]) for c in extra)
                if done:
                    return j + 1
            rows[b] = rows[b] + new
            return None

        def put(b: int, new: list[int]) -> None:
            if new:
                streamer.put(torch.tensor(new, dtype=torch.long))

        if streamer is not None:
            streamer.put(input_ids.cpu())
        out = gen.generate(prompts, max_new_tokens=max_new, eos_token_id=eos, min_new_tokens=min_new,
                           stop=stop if extra else None, callback=put if streamer is not None else None)
        if streamer is not None:
            streamer.end()
        self.last_output = out
        if adaptive:
            self._adaptive_runs[run_key] = gen

        width = max(len(t) for t in out.tokens)
        if any(len(t) < width for t in out.tokens) and pad_t is None:
            raise ValueError("SequoiaDecoding: rows ended at different lengths and there is no pad_token_id "
                             "(set generation_config.pad_token_id)")
        pad = int(pad_t) if pad_t is not None else 0
        new = torch.tensor([t + [pad] * (width - len(t)) for t in out.tokens], dtype=input_ids.dtype,
                           device=input_ids.device).reshape(B, width)
        sequences = torch.cat([input_ids, new], dim=1)
        if generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences


# what generate() hands over beside the prompt's ids that the loop has no use for or reads itself
_KEPT_INPUTS = {"attention_mask", "position_ids", "logits_to_keep", "past_key_values", "cache", "use_cache",
                "cache_position", "return_dict", "output_attentions", "output_hidden_states"}


def _check_model_inputs(model_kwargs: dict, lens: list[int]) -> None:
    """ValueError for a model input the loop would not feed the target: images, audio (``pixel_values``,
    the vision tower's ``mm_encoder_outputs`` that generate() computed from them, ...; they were
    ignored: the answer of the text alone), and ``position_ids`` other than each prompt's 0 .. n - 1
    (the loop numbers positions itself). ``lens``: the prompts' lengths (left padded)."""
    def given(v) -> bool:
        return not (v is None or v is False or (isinstance(v, (dict, list, tuple)) and not v)
                    or (isinstance(v, torch.Tensor) and v.numel() == 0))

    ignored = sorted(k for k, v in model_kwargs.items() if k not in _KEPT_INPUTS and given(v))
    if ignored:
        raise ValueError(f"SequoiaDecoding decodes text from input_ids alone: {', '.join(ignored)} would be ignored "
                         "(images, audio and other model inputs are not supported)")
    pos = model_kwargs.get("position_ids")
    if isinstance(pos, torch.Tensor) and pos.dim() >= 2:  # [B, L], or [sections, B, L] (a multimodal RoPE)
        L = pos.shape[-1]
        for b, n in enumerate(lens):
            if not bool((pos[..., b, L - n:] == torch.arange(n, device=pos.device)).all()):
                raise ValueError(f"SequoiaDecoding: position_ids must number each prompt's tokens 0, 1, ... (the "
                                 f"loop numbers positions itself); row {b} differs")


def _note_a_filled_cache(model_kwargs: dict) -> None:
    """Say once that a cache the caller handed to ``generate()`` holding tokens (a chat's earlier
    turns) is neither read nor extended: the loop prefills its own caches from ``input_ids`` (the
    same tokens; the prefill paid again, and the caller's cache left as it was)."""
    for name in ("past_key_values", "cache"):
        cache = model_kwargs.get(name)
        held = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        if held:
            say_once("SequoiaDecoding: the cache handed to generate() holds tokens; the tree loop neither reads nor "
                     "extends it (it prefills its own caches from input_ids: the same tokens, the prompt's prefill "
                     "computed again, the cache left as it was)")


def _unpadded(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[list[int]]:
    """The prompts of a left-padded batch [B, L] (``mask`` None: nothing is padded)."""
    if mask is None:
        return input_ids.tolist()
    B, L = input_ids.shape
    if mask.shape != input_ids.shape:
        raise ValueError(f"SequoiaDecoding: attention_mask {tuple(mask.shape)} must match input_ids {(B, L)}")
    keep = mask.to(torch.bool)
    n = keep.sum(1)
    bad = (keep != (torch.arange(L, device=keep.device)[None, :] >= (L - n)[:, None])).any(1)  # [B]
    if bool(bad.any()):
        raise ValueError(f"SequoiaDecoding: the attention mask must be left padding (pad tokens first, then the "
                         f"prompt), not in row(s) {bad.nonzero()[:, 0].tolist()}: use the tokenizer with "
                         "padding_side='left' (without an attention_mask, transformers masks every pad_token_id "
                         "in the prompts: pass one)")
    return [row[L - int(k):] for row, k in zip(input_ids.tolist(), n.tolist())]
