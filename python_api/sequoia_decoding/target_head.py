"""The target's logits from its final hidden states, as its own forward makes them.

Two paths of the loop run the target's decoder and apply the LM head themselves: verification
that computes logits only at the rows it reads (``lazy_logits``) and a feature head's steps (the
target's features and logits from one decoder pass). A ``...ForCausalLM`` forward may do more
after its LM head, and the distribution sampled from is then another: Cohere multiplies the logits
by ``logit_scale`` (0.0625 by default), Granite divides them by ``config.logits_scaling``, Gemma 2
/ 3 soft-cap them (``config.final_logit_softcapping``: 30 in Gemma 2). Greedy decoding does not see
it (each is increasing), sampling does: a Granite target sampled at T = 1 through those paths was
0.71 away in total variation from its own distribution. :class:`TargetHead` applies the same
operations in the same order as the model's forward (the same bits), and
``tests/test_target_head.py`` checks the installed transformers for LM heads followed by anything
else.
"""

from __future__ import annotations

import functools
import inspect

import torch

from sequoia_kernels.hf import text_config

__all__ = ["OPERATIONS", "TargetHead"]


# what a forward may do after its LM head (the config field or model attribute holding it), in order
OPERATIONS = ("output_multiplier", "logit_scale", "logits_scaling", "final_logit_softcapping")


class TargetHead:
    """``target``'s LM head followed by what its forward applies to the logits (module docstring):
    called on final normed hidden states [..., H], returns logits [..., V] as ``target(...).logits``
    holds them. An operation applies where the class's forward names it and the model has its
    value (Gemma 3's text model soft-caps, the multimodal class around it does not, although both
    read the same text config). ``weight``: the LM head's (its rows are the vocabulary)."""

    def __init__(self, target):
        self.lm_head = target.get_output_embeddings()
        self.weight = self.lm_head.weight
        named = _forward_names(type(target))  # (none for most: nothing read then; a loop builds one a step)
        text = text_config(getattr(target, "config", None)) if named else None
        values = {}
        for op in named:
            value = getattr(target, op, None) if op == "logit_scale" else getattr(text, op, None)  # Cohere: the model's
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values[op] = float(value)
        self.multiply = values.get("output_multiplier")  # Muse Glimmer
        self.scale = values.get("logit_scale")  # Cohere
        self.divide = values.get("logits_scaling")  # Granite
        self.cap = values.get("final_logit_softcapping")  # Gemma 2 / 3 (the text model)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.multiply is not None:
            logits = logits * self.multiply
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


@functools.lru_cache(maxsize=None)
def _forward_names(cls: type) -> frozenset[str]:
    """The :data:`OPERATIONS` that ``cls.forward``'s source names (all of them where it has no
    source to read: then the model's values alone decide)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError, AttributeError):
        return frozenset(OPERATIONS)
    return frozenset(op for op in OPERATIONS if op in source)
