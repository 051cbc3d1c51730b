"""Counter-based random numbers for the samplers: Philox4x32-10, in plain torch integer ops.

Why a counter-based generator. Speculative decoding draws fresh random numbers every step
(reusing them across steps or across a node's children biases the output: see
``reference/verify_tree.py``), must be reproducible for a given seed, and must work inside a
captured CUDA graph, where a host-side generator state cannot advance between replays. Philox
(Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the Random123 library)
maps a 128-bit counter and a 64-bit key to 128 random bits with no state: the state is the
pair of *device* int64 tensors ``(seed, offset)``. An op that consumes random numbers reads
them and then advances ``offset`` in place (``offset += counters used``) with a device op, so
a captured graph gets fresh numbers on every replay, and the same ``(seed, offset)`` always
gives the same numbers, on any device and any backend.

Layout (the contract every backend follows, Triton kernels generate the same numbers in
their registers). For a request of ``n`` numbers at ``(seed, offset)``, element ``i``
(row-major flat index) is word ``i % 4`` of

    Philox4x32_10(counter = (lo32(offset + i // 4), hi32(offset + i // 4), 0, 0),
                  key     = (lo32(seed), hi32(seed)))

and the request uses ``ceil(n / 4)`` counters, so it advances ``offset`` by that much.
This is exactly ``tl.randint4x(seed, offset + i // 4)`` in Triton. A 32-bit word ``w``
becomes the float32

    u = (2 * (w >> 9) + 1) * 2**-24          in (0, 1): {1, 3, 5, ..., 2**24 - 1} / 2**24

(23 random bits, the midpoints of a 2**-23 grid: every value and ``1 - u`` exactly
representable, never 0 nor 1, so ``-log(u)`` is finite). Decisions ``r < a`` made with it
are off by at most 2**-24 (6e-8) in probability.

Everything here is elementwise torch integer arithmetic on int64 tensors holding values
below 2**48 (32 x 16-bit partial products, no signed overflow), so it runs on CPU and CUDA,
inside CUDA graphs, and needs nothing compiled.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "philox4x32",
    "philox_uniforms",
    "bits_to_uniform",
    "counters_used",
    "new_state",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
_MASK32 = 0xFFFFFFFF
_ROUNDS = 10


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * m for int64 tensors 0 <= a < 2**32, constant m < 2**32,
    with every intermediate below 2**49 (no int64 overflow)."""
    p_lo = a * (m & 0xFFFF)  # < 2**48
    p_hi = a * (m >> 16)  # < 2**48; a * m = p_hi * 2**16 + p_lo
    low = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2**49
    return (p_hi >> 16) + (low >> 32), low & _MASK32


def philox4x32(counter: tuple[torch.Tensor, ...], key: tuple[torch.Tensor, torch.Tensor],
               rounds: int = _ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with ``rounds`` rounds (10 = Philox4x32-10) on int64 tensors holding uint32
    values: ``counter`` = (c0, c1, c2, c3), ``key`` = (k0, k1), all broadcastable. Returns the
    four output words as int64 tensors in [0, 2**32)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def bits_to_uniform(w: torch.Tensor) -> torch.Tensor:
    """uint32 words (in an int64 tensor) -> float32 uniforms (2 * (w >> 9) + 1) * 2**-24 in (0, 1)."""
    return ((w >> 9) * 2 + 1).to(torch.float32) * (2.0 ** -24)


def counters_used(numel: int) -> int:
    """Philox counters (blocks of 4 numbers) a request of ``numel`` numbers consumes."""
    return (int(numel) + 3) // 4


def _as_state(t: torch.Tensor, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int64 torch.Tensor with one element, got {type(t).__name__}")
    if t.dtype != torch.int64 or t.numel() != 1:
        raise ValueError(f"{name} must be an int64 tensor with one element, got {t.dtype} of shape {tuple(t.shape)}")
    return t.reshape(())


def check_state(seed: torch.Tensor, offset: torch.Tensor, device: torch.device, op: str) -> None:
    """Layout checks of a (seed, offset) pair: one-element int64 tensors on `device` (no sync)."""
    for name, t in (("seed", seed), ("offset", offset)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a one-element int64 torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or t.numel() != 1:
            raise ValueError(f"{op}: {name} must be a one-element int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        if t.device != torch.device(device):
            raise ValueError(f"{op}: {name} is on {t.device} but the inputs are on {device}")


def _triton_available() -> bool:
    from ._backend import triton_importable

    return triton_importable()


def _philox_uniforms_torch(seed: torch.Tensor, off: torch.Tensor, n: int) -> torch.Tensor:
    """[n] uniforms with torch integer ops (any device)."""
    nctr = counters_used(n)
    ctr = off + torch.arange(nctr, dtype=torch.int64, device=seed.device)  # [nctr]
    c0 = ctr & _MASK32
    c1 = (ctr >> 32) & _MASK32
    zero = torch.zeros_like(c0)
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    words = torch.stack(philox4x32((c0, c1, zero, zero), key), dim=1)  # [nctr, 4]
    return bits_to_uniform(words.reshape(-1)[:n])


def philox_uniforms(seed: torch.Tensor, offset: torch.Tensor, shape, *, advance: bool = False) -> torch.Tensor:
    """float32 uniforms in (0, 1) of the given shape from the Philox stream at (seed, offset).

    ``seed``, ``offset``: one-element int64 tensors on the device where the numbers are made
    (no host sync; safe inside CUDA-graph capture). Element ``i`` (row-major) is word
    ``i % 4`` of counter ``offset + i // 4`` (see the module docstring). With
    ``advance=True`` ``offset`` is increased in place by :func:`counters_used` so the next
    request gets fresh numbers; the ops that take (seed, offset) always advance it.
    """
    seed = _as_state(seed, "seed")
    off = _as_state(offset, "offset")
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)))
    n = math.prod(shape)
    device = seed.device
    if n == 0:
        return torch.empty(shape, dtype=torch.float32, device=device)
    nctr = counters_used(n)
    if device.type == "cuda" and _triton_available():
        # one fused launch instead of ~300 elementwise ones; bitwise the same numbers
        from .triton_kernels.sampling import philox_uniforms_triton

        out = philox_uniforms_triton(seed, off, n).reshape(shape)
    else:
        out = _philox_uniforms_torch(seed, off, n).reshape(shape)
    if advance:
        offset.add_(nctr)
    return out


def new_state(seed: int, device: torch.device | str = "cpu", offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh ``(seed, offset)`` pair of one-element int64 tensors on ``device``."""
    return (torch.tensor([int(seed)], dtype=torch.int64, device=device),
            torch.tensor([int(offset)], dtype=torch.int64, device=device))


def check_random_source(uniforms, seed, offset, device: torch.device, op: str) -> None:
    """The one rule of every op that draws random numbers: ``uniforms``, or ``(seed, offset)``
    (a device Philox state), or neither (torch's default generator); never both."""
    if uniforms is not None and (seed is not None or offset is not None):
        raise ValueError(f"{op}: pass either uniforms or (seed, offset), not both")
    if (seed is None) != (offset is None):
        raise ValueError(f"{op}: seed and offset go together")
    if seed is not None:
        check_state(seed, offset, device, op)


def draw_uniforms(shape, device: torch.device, *, seed: torch.Tensor | None = None,
                  offset: torch.Tensor | None = None, generator: torch.Generator | None = None,
                  open_low: bool = False) -> torch.Tensor:
    """Fresh fp32 uniforms ``[*shape]`` from the random source every op and the decoding loop
    choose the same way: the Philox stream ``(seed, offset)`` when given (``offset`` advanced in
    place: no host sync, CUDA-graph safe), else ``generator`` (torch's default when None).
    Philox numbers lie in (0, 1); torch's in [0, 1), or (0, 1] with ``open_low`` (for
    ``-log(u)``)."""
    if seed is not None:
        return philox_uniforms(seed, offset, tuple(shape), advance=True)
    u = torch.rand(tuple(shape), dtype=torch.float32, device=device, generator=generator)
    return 1.0 - u if open_low else u
