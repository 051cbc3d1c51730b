"""Backend names and the rule that picks the default one for a device.

Backends: "reference" (pure PyTorch, the spec), "cpu" (C++ in sequoia_kernels._C),
"triton" (GPU, or CPU under TRITON_INTERPRET=1), "cuda" (CUDA in sequoia_kernels._C).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("reference", "cpu", "triton", "cuda")


@functools.lru_cache(maxsize=None)
def cuda_compiled() -> bool:
    """True when sequoia_kernels._C was built with its CUDA kernels."""
    from . import _C  # noqa: F401

    return torch._C._dispatch_has_kernel_for_dispatch_key("sequoia_kernels::compact_kv_", "CUDA")


@functools.lru_cache(maxsize=None)
def cpuinfo(field: str) -> str:
    """The value of the first ``field`` line of /proc/cpuinfo ('' where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on tensors of `device`, best first."""
    device = torch.device(device)
    out = []
    if device.type == "cuda":
        if cuda_compiled():
            out.append("cuda")
        if triton_importable():
            out.append("triton")
    elif device.type == "cpu":
        out.append("cpu")
        if triton_importable() and triton_interpreted():
            out.append("triton")
    out.append("reference")
    return out


def resolve_backend(backend: str | None, device: torch.device, op: str) -> str:
    """The backend to run `op` with; raises ValueError when `backend` cannot run on `device`."""
    if backend is None:
        return available_backends(device)[0]
    if backend not in BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend not in available_backends(device):
        hint = ""
        if backend == "triton" and device.type == "cpu":
            hint = " (set TRITON_INTERPRET=1 before importing triton to run Triton kernels on the CPU)"
        elif backend == "cuda" and device.type == "cuda":
            hint = " (sequoia_kernels._C was built without CUDA)"
        raise ValueError(f"{op}: backend {backend!r} is not available for {device} tensors{hint}")
    return backend


def compiled_op_available(device: torch.device | str | None, op: str) -> bool:
    """True when sequoia_kernels._C registers torch.ops.sequoia_kernels.<op> (with a kernel for
    ``device``'s dispatch key when a device is given). Asked by every op call to pick its
    default backend, so the answer is cached per (device type, op): the extension registers its
    kernels once, when it is imported."""
    if device is None:
        return _compiled_op_available(None, op)
    return _compiled_op_available(device.type if isinstance(device, torch.device) else torch.device(device).type, op)


@functools.lru_cache(maxsize=None)
def _compiled_op_available(device_type: str | None, op: str) -> bool:
    from . import _C  # noqa: F401

    if not hasattr(torch.ops.sequoia_kernels, op):
        return False
    if device_type is None:
        return True
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(f"sequoia_kernels::{op}", key)


# Default backend on CUDA tensors by evidence: an op listed here defaults to its Triton kernel
# even when the extension has a CUDA kernel for it, because no GPU run has yet shown that CUDA
# kernel correct and at least as fast as the Triton one. Remove an op from this table only
# together with that evidence (bench/gpu_check.sh output: its GPU tests passing and its
# bench/gpu_bench.py rows at least matching Triton's).
TRITON_FIRST_ON_CUDA = {
    "tree_attention": "the tensor-core CUDA kernel (csrc/kernels/tree_attention.cuh) is checked statically "
                      "(tests/test_sm90_static.py) but has not yet run on a GPU",
    "verify_tree": "the cluster CUDA kernel (csrc/kernels/verify_tree.cuh) is checked statically "
                   "(tests/test_sm90_static_sampler.py) and against torch models of it, but has not yet run on a GPU",
    "sampling_probs": "the CUDA kernel (csrc/kernels/sampling.cuh) has not yet run on a GPU",
    "sample_children": "the CUDA kernel (csrc/kernels/sampling.cuh) has not yet run on a GPU",
}


def resolve_op_backend(op: str, backend: str | None, device: torch.device | str) -> str:
    """Like :func:`resolve_backend` for an op that may have no compiled kernel (only reference and
    Triton forms). Default: the compiled kernel for the device when there is one, else Triton on
    CUDA, else the reference; Triton's CPU interpreter is never a default (it is a test tool).
    Ops in TRITON_FIRST_ON_CUDA default to Triton on CUDA tensors (see there why)."""
    device = torch.device(device)
    compiled = compiled_op_available(device, op)
    if backend is None:
        if device.type == "cuda" and op in TRITON_FIRST_ON_CUDA and "triton" in available_backends(device):
            return "triton"
        for cand in available_backends(device):
            if cand in ("cpu", "cuda") and not compiled:
                continue
            if cand == "triton" and device.type != "cuda":
                continue
            return cand
        return "reference"
    backend = resolve_backend(backend, device, op)
    if backend in ("cpu", "cuda") and not compiled:
        raise ValueError(f"{op}: backend {backend!r} needs torch.ops.sequoia_kernels.{op}, which this build "
                         f"of sequoia_kernels._C does not have; use 'reference' or 'triton'")
    return backend
