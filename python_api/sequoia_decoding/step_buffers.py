"""The [B, T, V] tensors of a tree step, kept across steps on a CPU.

torch's CPU allocator caches nothing: a tensor above glibc's ``mmap`` threshold (adjusted at run
time, at most 32 MB) is mapped, faulted in page by page and unmapped again every time. Two tensors
of a tree step are [B, T, V] fp32, 50 MB at 256 nodes of SmolLM2's 49152 tokens: lazy
verification's p (``lazy_logits.py``, its rows not computed a placeholder) and a sampling draft's
q (``drafters.draw_children``, the rows its expanded nodes sample from). Made afresh each step they
made a step at 128-256 nodes 1.07-1.18x slower on a 2-core Xeon with AMX (``bench/step_buffers.py``,
``docs/decoding_loop.md``).

Each is read only where the step writes it: verification reads p at the rows it computed (a pass
that reads another row is discarded) and q at the expanded nodes (a leaf's q, and a
first-child acceptance read at a leaf, are never used), so a buffer kept across steps serves: the
rows a step does not write keep what an earlier step wrote, distributions all (the kernels read
them as such). Columns nothing writes keep their fill: a feature head's q is 0 off its own tokens.
On CUDA a step allocates as before (torch's caching allocator keeps freed blocks; a CUDA graph
captures its own). A buffer lives for one ``generate`` call (``KeptRows.held``, the drafters made
per call): an idle generator holds none (at a batch of 16 and 256 nodes one is 0.8 GB)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["KeptRows"]


class KeptRows:
    """[B, T, V] fp32 views of one buffer kept across steps (module docstring). ``fill``: the value
    of a new buffer's entries; None: 1 / V (every row a distribution). The buffer is made anew (and
    filled) when a step needs more rows than it has, or another V or device."""

    def __init__(self, fill: float | None = None) -> None:
        self.fill = fill
        self._buf: torch.Tensor | None = None  # [rows, V]

    def rows(self, B: int, T: int, V: int, device: torch.device | str) -> torch.Tensor:  # [B, T, V]
        device = torch.device(device)
        value = 1.0 / V if self.fill is None else self.fill
        if device.type != "cpu":
            return torch.full((B, T, V), value, dtype=torch.float32, device=device)
        buf = self._buf
        if buf is None or buf.shape[0] < B * T or buf.shape[1] != V or buf.device != device:
            buf = self._buf = torch.full((B * T, V), value, dtype=torch.float32, device=device)
        return buf[:B * T].view(B, T, V)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The buffer kept through the block (a call's steps) and freed after it, error or not."""
        try:
            yield
        finally:
            self._buf = None
