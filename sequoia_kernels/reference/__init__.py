"""Pure-PyTorch references: one per op, readable, the specification the kernels are tested against."""

from .compact_kv import compact_kv_reference
from .sampling import sample_children_reference, sampling_probs_reference
from .tree_attention import pack_tree_mask, tree_attention_reference, unpack_tree_mask
from .verify_tree import verify_tree_reference

__all__ = [
    "compact_kv_reference",
    "tree_attention_reference",
    "pack_tree_mask",
    "unpack_tree_mask",
    "verify_tree_reference",
    "sampling_probs_reference",
    "sample_children_reference",
]
