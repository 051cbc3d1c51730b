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

import torch

__all__ = ["TargetHead"]


class TargetHead:
    """``target``'s LM head followed by what its forward applies to the logits (module docstring):
    called on final normed hidden states [..., H], returns logits [..., V] as ``target(...).logits``
    holds them. ``weight``: the LM head's (its rows are the vocabulary)."""

    def __init__(self, target):
        self.lm_head = target.get_output_embeddings()
        self.weight = self.lm_head.weight
        config = getattr(target, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = getattr(target, "logit_scale", None)  # Cohere: the model's attribute, from its config
        self.scale = float(scale) if isinstance(scale, (int, float)) else None
        divide = getattr(text, "logits_scaling", None)  # Granite
        self.divide = float(divide) if isinstance(divide, (int, float)) else None
        cap = getattr(text, "final_logit_softcapping", None)  # Gemma 2 / 3
        self.cap = float(cap) if isinstance(cap, (int, float)) else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.scale is not None:
            logits = logits * self.scale
        if self.divide is not None:
            logits = logits / self.divide
        if self.cap is not None:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits
