"""sequoia_decoding: the Python side of sequoia-kernels (tree planning, CLI).

Importing this package is cheap: it needs numpy only; torch, the compiled
``sequoia_kernels`` extension and transformers are imported by the parts that use them.
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
