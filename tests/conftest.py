import os

import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Must be set before triton is
# imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A same-width integer view, so that comparisons are bitwise and NaN == NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, msg
    eq = bits(a) == bits(b)
    if not bool(eq.all()):
        idx = (~eq).nonzero()[:5].tolist()
        raise AssertionError(f"{msg}: {int((~eq).sum())} elements differ, first at {idx}")
