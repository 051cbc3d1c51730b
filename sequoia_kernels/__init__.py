"""sequoia-kernels: exact, fast kernels for Sequoia speculative decoding.

Every op has one public function with a ``backend`` argument in
{"reference", "cpu", "triton", "cuda"}; the default is the best backend available for the
tensors' device. See README.md.
"""

from . import _C  # noqa: F401  (registers torch.ops.sequoia_kernels.*)
from ._backend import available_backends, cuda_compiled
from .ops.compact_kv import compact_kv_

__all__ = ["compact_kv_", "available_backends", "cuda_compiled"]
__version__ = "0.1.0"
