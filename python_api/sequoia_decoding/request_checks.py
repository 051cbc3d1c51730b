"""Checks of a decoding request, made once per ``generate`` call before anything runs: prompts
of integer token ids in the vocabulary, lengths that fit the caches, the end-of-text ids."""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

from sequoia_kernels.hf import attention_span_of, text_config

from .logs import say_once

__all__ = ["vocab_size", "check_draft_vocab", "check_request", "cache_length", "call_room", "make_room",
           "attention_spans"]

# a standalone draft whose vocabulary is the target's padded to another size (Qwen2 / Qwen2.5: 151,665
# tokens padded to 151,936 rows in the small models, 152,064 in the large): at most this many ids apart
VOCAB_PADDING_SLACK = 256


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _as_prompts(input_ids) -> list[list[int]]:
    """``input_ids`` (a list of prompts, each a sequence of int token ids, or a [B, L] integer
    tensor) as lists of ints; a clear ``ValueError`` for anything else (float ids, a flat list)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids as a tensor must be [batch, length], got shape {tuple(input_ids.shape)} "
                             "(a single prompt: input_ids[None])")
        return input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise ValueError(f"input_ids must be a list of prompts (lists of token ids) or a [batch, length] tensor, "
                         f"got {type(input_ids).__name__}")
    if len(input_ids) and all(_is_token_id(t) for t in input_ids):
        raise ValueError("input_ids must be a list of prompts, got a flat list of token ids: pass [ids] for one prompt")
    prompts = []
    for i, p in enumerate(input_ids):
        if isinstance(p, torch.Tensor):
            if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool or p.dim() != 1:
                raise ValueError(f"prompt {i}: a tensor prompt must be 1-D with integer token ids, "
                                 f"got {p.dtype} of shape {tuple(p.shape)}")
            p = p.tolist()
        elif isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ValueError(f"prompt {i} must be a sequence of token ids, got {type(p).__name__}")
        for t in p:
            if not _is_token_id(t):
                raise ValueError(f"prompt {i}: token ids must be integers, got {t!r} ({type(t).__name__})")
        prompts.append([int(t) for t in p])
    return prompts


def vocab_size(model) -> int:
    """The vocabulary the model's logits cover (a reduced-vocabulary draft declares the full
    one it maps back to as ``full_vocab_size``)."""
    if getattr(model, "full_vocab_size", None) is not None:
        return int(model.full_vocab_size)
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and isinstance(getattr(emb, "weight", None), torch.Tensor):
        return int(emb.weight.shape[0])
    return int(text_config(model.config).vocab_size)


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(x) for x in eos_token_id]


def attention_spans(**models) -> list[tuple[str, int, str]]:
    """(name, the positions its attention is exact in, what limits them) of each model given that has
    such a limit (``hf.attention_span_of``: a sliding window, Llama 4's chunks; ``None``: absent)."""
    return [(name, *s) for name, m in models.items() if (s := attention_span_of(getattr(m, "config", None)))]


def cache_length(need: int, max_length: int | None, model) -> int:
    """A call's cache length for ``model``: its ``need`` positions rounded up to 64, at most
    ``max_length`` and the model's attention span (``check_request``: ``need`` fits in both)."""
    span = attention_span_of(getattr(model, "config", None))
    caps = (max_length, span[0] if span else None)
    return min([-(-need // 64) * 64, *(c for c in caps if c)])


FIRST_ROOM = 256  # new tokens a call's caches hold at first; they grow (doubling) as rows lengthen


def call_room(prompts: list[list[int]], max_new_tokens: int, tree_nodes: int, *, all_at_once: bool) -> tuple[int, int]:
    """(the cache positions a call can write, those its caches hold at first): room for
    ``FIRST_ROOM`` new tokens, grown by :func:`make_room`; ``all_at_once`` (a CUDA graph's
    caches, whose addresses it keeps): everything."""
    need = positions_needed(prompts, max_new_tokens, tree_nodes)
    return need, need if all_at_once else min(need, positions_needed(prompts, FIRST_ROOM, tree_nodes))


def make_room(tcache, drafter, need: int, prefix: int, tree_nodes: int, max_length: int | None, target,
              draft) -> None:
    """Grow the target's cache and the drafter's (doubling, to at most a call's ``need``) where a
    step of ``tree_nodes`` after the longest row's ``prefix`` cached positions would pass their
    end: a call asking for far more new tokens than it makes (``max_new_tokens=32768`` "until
    EOS") zeroed caches for all of them up front (0.4 s per call for the SmolLM2 pair in fp32)."""
    if prefix + tree_nodes > tcache.max_cache_len:
        size = min(need, max(prefix + tree_nodes, 2 * tcache.max_cache_len))
        tcache.grow(cache_length(size, max_length, target))
        drafter.reserve(cache_length(size, max_length, draft))


def positions_needed(prompts: list[list[int]], max_new_tokens: int, tree_nodes: int) -> int:
    """The cache positions a call can write: all but the last token of the longest prompt, all but
    the last of its new tokens, and a tree of ``tree_nodes`` after them."""
    return max(len(p) for p in prompts) + max_new_tokens + tree_nodes - 2


def check_draft_vocab(draft, vocab: int) -> None:
    """ValueError unless ``draft``'s logits cover the target's ``vocab`` ids: the same size, or a
    standalone draft's padded to within ``VOCAB_PADDING_SLACK`` ids of it (the ids both have are
    taken as the same tokens; the draft proposes none past the target's, and q is 0 at the
    target's ids past the draft's, which only the residual emits: exact, as with any q; a
    reduced-vocabulary draft counts its ``full_vocab_size``). A feature head declares the
    target's size."""
    from .modeling.feature_head import FeatureHead

    v = vocab_size(draft)
    if v != vocab and (isinstance(draft, FeatureHead) or abs(v - vocab) > VOCAB_PADDING_SLACK):
        raise ValueError(f"draft and target vocabularies differ ({v} vs {vocab}): they must share a tokenizer (a "
                         f"standalone draft's may be padded to within {VOCAB_PADDING_SLACK} ids of the target's, as "
                         "Qwen2's 151,936 and 152,064 are)")


def check_request(input_ids, max_new_tokens, min_new_tokens, eos_token_id, *, target, vocab: int, tree_nodes: int,
                  max_length: int | None, cuda_graphs: bool, draft=None) -> tuple[list[list[int]], list[int]]:
    """(prompts as lists of ints, the end-of-text ids) of a ``SequoiaGenerator.generate`` call, or
    a ``ValueError`` naming what is wrong (nothing has run yet). The request's cache positions must
    fit in the models' attention spans, where they have one (a sliding window: ``hf.attention_span_of``)."""
    prompts = _as_prompts(input_ids)
    if not prompts:
        raise ValueError("every prompt needs at least one token (no prompts given)")
    empty = [b for b, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"every prompt needs at least one token: row(s) {empty} are empty (an attention mask "
                         "row of padding only?)")
    if not _is_token_id(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r} ({type(max_new_tokens).__name__})")
    if not _is_token_id(min_new_tokens) or min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r} ({type(min_new_tokens).__name__})")
    if min_new_tokens and cuda_graphs:
        raise ValueError("min_new_tokens is not supported with cuda_graphs=True")
    if any(t < 0 or t >= vocab for p in prompts for t in p):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    need = positions_needed(prompts, max_new_tokens, tree_nodes)
    if max_length is not None and need > max_length:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens + {max_new_tokens} new tokens + a "
                         f"{tree_nodes}-node tree needs {need} cache positions; max_length is {max_length}")
    for name, span, what in attention_spans(target=target, draft=draft):
        if need > span:
            within = "decoding is exact" if name == "target" else "the draft runs as the model it is"
            raise ValueError(f"the {name}'s attention {what}, which the tree attention does not implement: {within} "
                             f"within {span} positions, "
                             f"and a prompt of {max(len(p) for p in prompts)} tokens + {max_new_tokens} new tokens + a "
                             f"{tree_nodes}-node tree needs {need}")
    _past_positions(target, max(len(p) for p in prompts), max_new_tokens)
    eos = _eos_ids(target, eos_token_id)
    if any(not 0 <= t < vocab for t in eos):
        raise ValueError(f"eos_token_id must lie in [0, {vocab}), got {eos}")
    return prompts, eos


def _past_positions(target, prompt: int, max_new_tokens: int) -> None:
    """Say once (a warning in the log) where a request may run past the target's
    ``max_position_embeddings``: as Hugging Face's ``generate()`` does, it decodes on."""
    limit = getattr(text_config(getattr(target, "config", None)), "max_position_embeddings", None)
    if _is_token_id(limit) and prompt + max_new_tokens > limit:
        say_once(f"a request of up to {prompt + max_new_tokens} tokens runs past the target's {limit} positions "
                 f"(config.max_position_embeddings): the model's output may degrade past them; it decodes on, as "
                 "plain generate() does")
