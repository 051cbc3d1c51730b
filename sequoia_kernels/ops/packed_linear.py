"""packed_linear: y = x W^T for a few rows on the CPU, from a weight packed once.

The decoding loop's target and draft forwards on a CPU multiply few rows (1 token, or a tree
of n tokens) by every weight. A framework GEMM packs its operands on every call, which at
M = 2 .. 16 costs as much as the multiplication itself, so a tree of 8 tokens cost ~1.8x one
token although the weights are read once either way; with the weight packed once into
16-feature panels (:func:`pack_linear_weight`) the compiled kernel (``csrc/cpu/packed_linear.cpp``)
streams each weight once per call through a 6 x 16 register tile. Every output is one fp32 FMA
chain in k order, so a row's result does not depend on M or on the other rows (batch
invariance), unlike a framework GEMM's.

Forms: ``packed_linear(x, w_packed, out_features)`` (the compiled CPU kernel, or
``backend="reference"``: :func:`packed_linear_reference`, fp64 products rounded once);
:func:`use_packed_linears` switches the ``nn.Linear`` modules of a model to it (and back).
Roofline: bytes = 4 N K (the weight, read once) + 4 M (K + N); FLOPs = 2 M N K. On AVX2 CPUs
the few-row product is bound by the weight's read for M <~ 8 and by the FMA units above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .._backend import compiled_op_available, resolve_op_backend

PANEL = 16  # output features per packed panel (csrc/cpu/packed_linear.cpp: kPanel)
MAX_ROWS = 64  # nn.Linear calls with more rows than this keep torch's GEMM (the prefill)


@torch.library.register_fake("sequoia_kernels::packed_linear")
def _packed_linear_fake(x, w_packed, out_features, out) -> None:
    return None


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), K, 16]
    """The panel layout the kernel reads: panel p holds output features 16p .. 16p + 15 for every
    k contiguously (zero padded past N). fp32, contiguous, a new tensor (the weight is untouched)."""
    if weight.dim() != 2:
        raise ValueError(f"pack_linear_weight: weight must be [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    P = -(-N // PANEL)
    w = torch.zeros(P * PANEL, K, dtype=torch.float32, device=weight.device)
    w[:N] = weight.detach().to(torch.float32)
    return w.view(P, PANEL, K).transpose(1, 2).contiguous()


def packed_linear_reference(x: torch.Tensor, w_packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T with W unpacked from w_packed, products and sums in fp64, rounded once."""
    P, K, _ = w_packed.shape
    W = w_packed.transpose(1, 2).reshape(P * PANEL, K)[:out_features]
    return (x.double() @ W.double().t()).to(torch.float32)


def packed_linear(
    x: torch.Tensor,  # [M, K] fp32
    w_packed: torch.Tensor,  # [ceil(N / 16), K, 16] fp32 from pack_linear_weight
    out_features: int,
    *,
    out: torch.Tensor | None = None,  # [M, N] fp32
    backend: str | None = None,
) -> torch.Tensor:  # [M, N] fp32
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"packed_linear: x must be float32 [M, K], got {x.dtype} {tuple(x.shape)}")
    if w_packed.dim() != 3 or w_packed.shape[1] != x.shape[1] or w_packed.shape[2] != PANEL:
        raise ValueError(f"packed_linear: w_packed must be [ceil(N / 16), K = {x.shape[1]}, 16], got "
                         f"{tuple(w_packed.shape)}")
    if not 0 < out_features <= w_packed.shape[0] * PANEL or out_features <= (w_packed.shape[0] - 1) * PANEL:
        raise ValueError(f"packed_linear: out_features = {out_features} does not fit {w_packed.shape[0]} panels")
    if x.device.type != "cpu" or w_packed.device != x.device:
        raise ValueError(f"packed_linear: a CPU op (x on {x.device}, w_packed on {w_packed.device}); GPUs use cuBLAS")
    backend = resolve_op_backend("packed_linear", backend, x.device)
    if backend not in ("cpu", "reference"):
        raise ValueError(f"packed_linear: backend {backend!r} has no packed_linear; use 'cpu' or 'reference'")
    if backend == "reference":
        y = packed_linear_reference(x, w_packed, out_features)
        if out is None:
            return y
        out.copy_(y)
        return out
    if out is None:
        out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    torch.ops.sequoia_kernels.packed_linear(x.contiguous(), w_packed, int(out_features), out)
    return out


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward of a switched module (use_packed_linears): the compiled op, called
    directly (this runs ~200 times per model forward: no validation beyond the fast checks)."""
    K = x.shape[-1]
    rows = x.numel() // max(K, 1)
    if (rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    pk, w = module._sequoia_packed, module.weight
    if pk[0] is not w or pk[1] != (w._version, w.data_ptr()):  # replaced, modified in place or moved: repack
        module._sequoia_packed = pk = (w, (w._version, w.data_ptr()), pack_linear_weight(w))
    x2 = x.reshape(rows, K)
    if K > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x2.new_empty(rows, module.out_features)
    torch.ops.sequoia_kernels.packed_linear(x2, pk[2], module.out_features, y)
    if module.bias is not None:
        y += module.bias
    return y.view(*x.shape[:-1], module.out_features)


def packed_linear_supported() -> bool:
    """The kernel's fast path needs AVX2 and FMA (torch's CPU capability AVX2 or above)."""
    try:
        if not compiled_op_available("cpu", "packed_linear"):
            return False
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")
    except Exception:  # noqa: BLE001 - an unknown capability string or no compiled ops
        return False


def packed_linear_pays() -> bool:
    """Whether the decoding loop's few-row linears are faster on packed_linear than on torch's
    GEMM on this CPU: on AVX2 CPUs (measured on an AMD EPYC Zen 3: 1.8x -> ~1.1x for an 8-token
    tree over one token), not where torch's GEMM uses AVX-512 (measured on an Intel Xeon with
    AVX-512 and AMX, SmolLM2-135M fp32: one token 35-41 ms with torch's GEMM against 42-48 ms
    packed, 8 tokens 64-70 against 72-78 ms, the draft alike). The loop's and the profiler's
    default (``packed_linears=None``)."""
    try:
        return packed_linear_supported() and torch.backends.cpu.get_cpu_capability() == "AVX2"
    except Exception:  # noqa: BLE001 - an unknown capability string
        return False


@contextlib.contextmanager
def use_packed_linears(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, every fp32 CPU ``nn.Linear`` of ``model`` computes calls of <= MAX_ROWS
    rows with :func:`packed_linear` (weights packed at the first call, repacked if a weight is
    replaced, modified in place or given new storage); larger calls, other dtypes and devices,
    and autograd keep ``torch.nn.functional.linear``. Yields how many modules were switched;
    restores their ``forward`` on exit.

    The packed copies stay with the modules after the block and are reused by the next block
    while each weight is unchanged: packing is a copy of every weight (~0.4 s for SmolLM2-135M on
    a Zen 3 core pair), which used to be paid again by every ``generate`` call, inside its prefill.
    They cost one fp32 copy of each switched weight for as long as the model lives;
    :func:`release_packed_linears` frees them."""
    switched = []
    if enabled and packed_linear_supported():
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod.weight.device.type == "cpu" and mod.weight.dtype == torch.float32:
                if "forward" in mod.__dict__ or hasattr(mod, "_sequoia_packed"):
                    continue  # already switched by an enclosing block, or patched by someone else
                mod._sequoia_packed = mod.__dict__.pop("_sequoia_packed_kept", (None, None, None))
                mod.forward = _packed_forward.__get__(mod)
                switched.append(mod)
    try:
        yield len(switched)
    finally:
        for mod in switched:
            del mod.forward
            kept = mod.__dict__.pop("_sequoia_packed")
            if kept[2] is not None:
                mod._sequoia_packed_kept = kept


def release_packed_linears(model: torch.nn.Module) -> int:
    """Free the packed weight copies :func:`use_packed_linears` left on ``model``'s modules
    (the next block packs again). Returns how many were freed."""
    freed = 0
    for mod in model.modules():
        if mod.__dict__.pop("_sequoia_packed_kept", None) is not None:
            freed += 1
    return freed
