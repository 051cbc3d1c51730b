"""Pure-PyTorch references: one per op, readable, the specification the kernels are tested against."""

from .compact_kv import compact_kv_reference

__all__ = ["compact_kv_reference"]
