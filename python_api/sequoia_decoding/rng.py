"""The decoding loop's random source."""

from __future__ import annotations

import torch

from sequoia_kernels.random import draw_uniforms, new_state

__all__ = ["Uniforms"]


class Uniforms:
    """The loop's random source: fresh uniforms in (0, 1) at every call. Eagerly torch's
    generator (seeded, or torch's default); for CUDA graphs a device-resident Philox
    (seed, offset) that advances on the device, so a replayed graph draws new numbers with no
    host sync."""

    def __init__(self, device: torch.device, seed: int | None, on_device: bool):
        self.device, self.on_device = device, on_device
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        if on_device:
            self.philox = new_state(seed if seed is not None else int(torch.randint(0, 2**62, (1,))), device)

    def __call__(self, *shape: int) -> torch.Tensor:  # fp32 [*shape] in (0, 1)
        if self.on_device:
            return draw_uniforms(shape, self.device, seed=self.philox[0], offset=self.philox[1])
        return draw_uniforms(shape, self.device, generator=self.generator).clamp_(min=1e-12)
