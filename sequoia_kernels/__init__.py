"""sequoia-kernels: exact, fast kernels for Sequoia speculative decoding.

Every op has one public function with a ``backend`` argument in
{"reference", "cpu", "triton", "cuda"}; the default is the best backend available for the
tensors' device. See README.md.
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.sequoia_kernels.*)
from ._backend import available_backends, cuda_compiled
from . import random
from .ops.compact_kv import compact_kv_
from .ops.sampling import sample_children, sampling_probs
from .ops.tree_attention import (
    TreeAttentionWorkspace,
    pack_tree_mask,
    tree_attention,
    tree_attention_workspace,
    unpack_tree_mask,
)
from .ops.verify_tree import verify_tree

__all__ = [
    "compact_kv_",
    "tree_attention",
    "tree_attention_workspace",
    "TreeAttentionWorkspace",
    "pack_tree_mask",
    "unpack_tree_mask",
    "verify_tree",
    "sampling_probs",
    "sample_children",
    "random",
    "available_backends",
    "cuda_compiled",
]
__version__ = "0.1.0"
