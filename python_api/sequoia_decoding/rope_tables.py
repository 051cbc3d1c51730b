"""RoPE tables: a model's rotary cos / sin read from a per-position table instead of computed in
every forward.

A Hugging Face Llama-family model computes the cos and sin of every position in every forward:
a ``[B, D/2, 1] x [B, 1, T]`` product, a concatenation, cos, sin, two scalings, two casts. In the
decoding loop on a CPU that is ~90 us of the target's one-token forward and ~150 us of a feature
head's draft step (2-core AMD EPYC Zen 5, bf16: these small ops run with cold caches right after
the target's forward; ~30 us warm), every step. Within :func:`use_rope_tables` a rotary module
with a static frequency table (``rope_type`` in :data:`STATIC_ROPE`: its ``inv_freq`` never
changes with the sequence length) looks positions up in a table that its own ``forward`` made
over positions ``0 .. N - 1`` (grown by doubling when a position reaches ``N``): bitwise what it
computes per call, since each entry is one fp32 product ``inv_freq[i] * position`` followed by the
same elementwise ops (``tests/test_rope_tables.py``). CPU tensors only (growing the table reads the
largest position on the host: a sync that a CUDA graph cannot hold; there the ops are a few
launches in the graph); other inputs run the module's own code, as do positions that are not
``[B, T]`` (a multimodal RoPE's ``[3, B, T]`` sections: Qwen2.5-VL's).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.nn import functional as F

from sequoia_kernels.ops.packed_linear import forwards_restored, switch_keeping_own

__all__ = ["STATIC_ROPE", "use_rope_tables"]

STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at init (not "dynamic", "longrope")
MIN_POSITIONS = 256  # the first table's positions


def _static_rope(mod: torch.nn.Module) -> bool:
    return (isinstance(getattr(mod, "inv_freq", None), torch.Tensor) and hasattr(mod, "attention_scaling")
            and getattr(mod, "rope_type", None) in STATIC_ROPE)


def _table(mod: torch.nn.Module, x: torch.Tensor, positions: int) -> tuple[torch.Tensor, ...]:
    """What the module's own forward returns for an ``x`` of this dtype (cos, sin [N, D] each: x's
    dtype, or fp32 where it computes in fp32 and does not cast back, Olmo2's; or one tensor, Llama 4's
    complex ``freq_cis`` [N, D / 2]) for positions 0 .. N - 1, N >= ``positions``; kept on the
    module for the block, keyed by x's dtype."""
    got = mod.__dict__.get("_sequoia_rope")  # (*the tables, the dtype of the x they are for)
    if got is None or got[0].shape[0] < positions or got[-1] != x.dtype:
        grow = got is not None and got[0].shape[0] < positions  # doubling: a table made O(log N) times
        n = max(MIN_POSITIONS, positions, 2 * got[0].shape[0] if grow else 0)
        out = mod._sequoia_rope_fallback(x[:0], torch.arange(n, device=x.device)[None])  # [1, n, ...] each
        mod._sequoia_rope = got = (*(t[0] for t in (out if isinstance(out, tuple) else (out,))), x.dtype)
    return got[:-1]


def _table_forward(mod: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor):
    """The switched rotary ``forward(x, position_ids)``: (cos, sin) [B, T, D] (or Llama 4's one
    ``freq_cis``), as the module's own."""
    if x.device.type != "cpu" or position_ids.device.type != "cpu" or position_ids.numel() == 0 \
            or position_ids.dim() != 2:  # [3, B, T]: a multimodal RoPE's sections (Qwen2.5-VL): its own code
        return mod._sequoia_rope_fallback(x, position_ids)
    tables = _table(mod, x, int(position_ids.max()) + 1)
    looked_up = tuple(F.embedding(position_ids, t) for t in tables)
    return looked_up if len(looked_up) > 1 else looked_up[0]


@contextlib.contextmanager
def use_rope_tables(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, ``model``'s rotary modules with a static RoPE (module docstring) read cos
    and sin from per-position tables on CPU tensors. Yields how many modules were switched; restores
    their ``forward`` and drops the tables on exit."""
    switched = []
    for mod in model.modules():
        if not _static_rope(mod) or "_sequoia_rope_fallback" in mod.__dict__:
            continue  # not a static RoPE, or switched by an enclosing block
        # None: patched by someone else
        if (done := switch_keeping_own(mod, _table_forward, "_sequoia_rope_fallback")) is not None:
            switched.append(done)
    with forwards_restored(switched, _unswitch) as n:
        yield n


def _unswitch(mod: torch.nn.Module) -> None:
    del mod._sequoia_rope_fallback
    mod.__dict__.pop("_sequoia_rope", None)
