"""What the decoding loop takes and returns: the sampling settings (:class:`SamplingParams`), one
step's statistics (:class:`StepStats`) and decisions (:class:`StepResult`), a call's output
(:class:`GenerationOutput`), and the error for non-finite logits. Re-exported by ``generate``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from sequoia_kernels.ops.sampling import check_sampling_params

__all__ = ["SamplingParams", "StepStats", "StepResult", "GenerationOutput", "NonFiniteLogitsError"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed None = torch's default generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling_params(self.temperature, self.top_k, self.top_p, "SamplingParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class StepStats:
    """One decoding step. Phase times in seconds (exact only with ``generate(profile=True)``,
    which syncs the device at each phase boundary); a step replayed from a CUDA graph has no
    phase times (``timed`` False, the times None): only ``total_s``."""

    emitted: list[int]  # tokens emitted this step per active row (accepted + bonus, after stops)
    accepted: list[int]  # tree nodes accepted per active row, root excluded (= emitted - 1 before stops)
    draft_s: float | None = 0.0
    target_s: float | None = 0.0
    verify_s: float | None = 0.0
    compact_s: float | None = 0.0
    total_s: float = 0.0
    draft_forward_s: float | None = 0.0  # the draft's model calls alone (draft_s also holds its sampling)
    # the draft's first level (pending tokens, catch-up, the root's children): all of it, and its forward
    first_level_s: float | None = 0.0
    first_forward_s: float | None = 0.0
    timed: bool = True
    clock: Callable[[], float] | None = field(default=None, repr=False, compare=False)  # phase boundaries

    @classmethod
    def untimed(cls) -> "StepStats":
        """A step replayed from a CUDA graph: no phase boundaries inside it."""
        return cls([], [], draft_s=None, target_s=None, verify_s=None, compact_s=None, draft_forward_s=None,
                   first_level_s=None, first_forward_s=None, timed=False)

    def now(self) -> float:
        """A phase boundary's time (the clock syncs the device when profiling)."""
        return self.clock() if self.clock is not None else 0.0

    def first_level_done(self, since: float) -> None:
        """A drafter's first level drafted (``since``: when its ``propose`` began): the draft's
        later levels are its time after this (``tools.measure_step_overhead``)."""
        self.first_level_s, self.first_forward_s = self.now() - since, self.draft_forward_s

    @property
    def other_s(self) -> float | None:
        """Time outside the two model forwards (sampling, verification, compaction, bookkeeping)."""
        return self.total_s - self.draft_forward_s - self.target_s if self.timed else None


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # the new tokens of each input row
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    replan: Any = None  # adaptive: the call's ``adaptive.ReplanStats`` (re-plans, plan changes, their cost)

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per sequence-step (accepted + bonus), before EOS/length stops."""
        n = sum(len(s.accepted) for s in self.steps)
        return sum(a + 1 for s in self.steps for a in s.accepted) / n if n else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class StepResult:
    """What one step decided, for the rows of its batch (device tensors: read by the host once)."""

    tokens: torch.Tensor  # [B, T] int64: the tree's tokens (-1: absent node)
    path: torch.Tensor  # [B, T] int64: accepted nodes from the root, then -1
    num: torch.Tensor  # [B] int64: path length (root included)
    bonus: torch.Tensor  # [B] int64: the token drawn after the path (the next root)
    bad: torch.Tensor  # [2] bool: the draft's / the target's logits held NaN or +inf
    seen: tuple[torch.Tensor, torch.Tensor] | None = None  # a peek: its star's played-out path [B, T] and length [B]
    first: torch.Tensor | None = None  # [B, T] adaptive, sampling: first-child acceptance at the observed path's nodes


class NonFiniteLogitsError(ValueError):
    """A model returned NaN or +inf logits (or a row without a finite logit) during decoding."""
