"""sequoia_decoding: the Python side of sequoia-kernels (tree planning, the decoding loop, the
Hugging Face entry point ``SequoiaDecoding``, CLI).

Importing this package is cheap: it needs numpy only; torch, the compiled
``sequoia_kernels`` extension and transformers are imported by the parts that use them
(``SequoiaDecoding`` is imported on first access).
"""

from .planner import (
    DEFAULT_ACCEPTANCE,
    HardwarePlan,
    PlanCandidate,
    TreePlan,
    choose_plan,
    expected_tokens,
    load_latency,
    plan_tree,
    validate_acceptance,
)

__all__ = [
    "SequoiaDecoding",
    "DEFAULT_ACCEPTANCE",
    "HardwarePlan",
    "PlanCandidate",
    "TreePlan",
    "choose_plan",
    "expected_tokens",
    "load_latency",
    "plan_tree",
    "validate_acceptance",
]


def __getattr__(name: str):
    if name == "SequoiaDecoding":  # torch and transformers only when asked for
        from .hf_generate import SequoiaDecoding

        return SequoiaDecoding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
