"""packed_linear: y = x W^T for a few rows on the CPU, from a weight packed once.

The decoding loop's target and draft forwards on a CPU multiply few rows (1 token, or a tree
of n tokens) by every weight. A framework GEMM packs its operands on every call, which at
M = 2 .. 16 costs as much as the multiplication itself, so a tree of 8 tokens cost ~1.8x one
token although the weights are read once either way; with the weight packed once into
16-feature panels (:func:`pack_linear_weight`) the compiled kernel (``csrc/cpu/packed_linear.cpp``)
streams each weight once per call through a 6 x 16 register tile. Every output is one fp32 FMA
chain in k order, so a row's result does not depend on M or on the other rows (batch
invariance), unlike a framework GEMM's.

bf16 (``csrc/cpu/packed_linear_bf16.cpp``): the weight packed once in bf16 (half the bytes) in
panels of 16 features whose k run in pairs (:func:`pack_linear_weight_bf16`; one pair row is one
AVX-512 register, one row of an AMX B tile); every output is one fp32 chain over the pairs (odd
product, then even: vdpbf16ps's order; each product of two bf16 is exact in fp32), rounded to bf16
once, so bf16 models get batch invariance too. The instruction set is chosen per CPU, never per
call (AMX, AVX-512-BF16, AVX2+FMA, scalar); the AVX and scalar paths are that chain bitwise on
normal numbers, AMX (whose tile instruction rounds once per 32 products) agrees within one bf16
rounding and is batch invariant on its own.

Forms: ``packed_linear(x, w_packed, out_features)`` (fp32 or bf16 by ``x``'s dtype: the compiled
CPU kernel, or ``backend="reference"``: :func:`packed_linear_reference`, fp64 products rounded
once, and :func:`packed_linear_bf16_chain` for bf16, the kernel's chain in PyTorch, bitwise);
:func:`use_packed_linears` switches the ``nn.Linear`` modules of a model to it (and back).
Roofline: bytes = s N K (the weight, read once; s = 4 fp32, 2 bf16) + s M (K + N); FLOPs =
2 M N K. On AVX2 CPUs the few-row product is bound by the weight's read for M <~ 8 and by the
FMA units above; with AMX (bf16) M = 64 costs ~1.5x M = 1 (docs/bf16_cpu.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .._backend import compiled_op_available, cpuinfo, resolve_op_backend
from ..per_thread import for_this_thread

PANEL = 16  # output features per packed panel (csrc/cpu/packed_linear.cpp: kPanel)
GROUP = 4  # bf16: panels per group (csrc/cpu/packed_linear_bf16.cpp: kGroup; one AMX C tile each)
KBLOCK = 32  # bf16: k per block (one AMX tile of 16 pairs); K is padded to a multiple of it
MAX_ROWS = 64  # nn.Linear calls with more rows than this keep torch's GEMM (the prefill), but see packed_prefill_pays
ANY_ROWS = 1 << 62  # the row limit of a call that runs packed at any size
ISAS = {"auto": 0, "scalar": 1, "avx2": 2, "avx512_bf16": 3, "amx": 4, "avx512": 5,  # bf16 kernel's paths
        "amx_emulated": 6}  # the AMX path's code on software tiles (any x86-64 CPU, for tests; never "auto")


@torch.library.register_fake("sequoia_kernels::packed_linear")
def _packed_linear_fake(x, w_packed, out_features, out) -> None:
    return None


@torch.library.register_fake("sequoia_kernels::packed_linear_bf16")
def _packed_linear_bf16_fake(x, w_packed, out_features, out, isa, residual=None, rope_cos=None, rope_sin=None,
                             rope_cols=0, silu_out=None) -> None:
    return None


def bf16_isa(isa: str = "auto") -> str | None:
    """The instruction set a bf16 ``packed_linear`` call with ``isa`` runs on this CPU ("auto":
    the best: amx > avx512_bf16 > avx512 > avx2 > scalar), or None when this CPU (or build) lacks it.
    "amx_emulated" (any x86-64 build): the AMX path's code on software tiles, never "auto"'s
    choice; ``SEQUOIA_KERNELS_AMX=emulate`` makes "amx" itself that (read once per process)."""
    if isa not in ISAS:
        raise ValueError(f"packed_linear: unknown isa {isa!r}; choose one of {tuple(ISAS)}")
    if not compiled_op_available("cpu", "packed_linear_bf16"):
        return None
    code = torch.ops.sequoia_kernels.packed_linear_bf16_isa(ISAS[isa])
    return next((k for k, v in ISAS.items() if v == code and k != "auto"), None)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [ceil(N / 16), K, 16]
    """The panel layout the kernel reads: panel p holds output features 16p .. 16p + 15 for every
    k contiguously (zero padded past N). fp32, contiguous, a new tensor (the weight is untouched)."""
    if weight.dim() != 2:
        raise ValueError(f"pack_linear_weight: weight must be [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    P = -(-N // PANEL)
    out = torch.empty(P, K, PANEL, dtype=torch.float32, device=weight.device)
    w = weight.detach().to(torch.float32)
    if N != P * PANEL:  # zero padded past N
        w = torch.cat([w, w.new_zeros(P * PANEL - N, K)])
    out.permute(0, 2, 1).copy_(w.view(P, PANEL, K))  # one strided pass: out[p, k, f] = W[16 p + f, k]
    return out


def _bf16_packed_shape(N: int, K: int) -> tuple[int, int, int, int]:
    """[P, K2, 16, 2]: P = 4 ceil(N / 64) panels, K2 = 16 ceil(K / 32) k pairs."""
    return -(-N // (GROUP * PANEL)) * GROUP, -(-K // KBLOCK) * KBLOCK // 2, PANEL, 2


def pack_linear_weight_bf16(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] -> [P, K2, 16, 2], the bf16 layout the kernel reads: P = 4 ceil(N / 64) panels of 16
    features, K2 = 16 ceil(K / 32) k pairs; element [p, j, f, e] is W[16 p + f, 2 j + e] in bf16
    (zero padded past N and K). Contiguous; written into ``out`` when given (a buffer of that
    shape, reused: an offloaded layer is packed at every forward), else a new tensor. The weight
    is untouched."""
    if weight.dim() != 2:
        raise ValueError(f"pack_linear_weight_bf16: weight must be [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    P, K2, _, _ = _bf16_packed_shape(N, K)
    if out is None:
        out = torch.empty(P, K2, PANEL, 2, dtype=torch.bfloat16, device=weight.device)
    w = weight.detach().to(torch.bfloat16)
    if w.device.type == "cpu" and compiled_op_available("cpu", "pack_linear_weight_bf16"):
        torch.ops.sequoia_kernels.pack_linear_weight_bf16(w if w.stride(-1) == 1 else w.contiguous(), out)
        return out  # one pass, every core (an offloaded layer is packed per forward)
    if (N, K) != (P * PANEL, 2 * K2):  # zero padded past N and K
        w = torch.nn.functional.pad(w, (0, 2 * K2 - K, 0, P * PANEL - N))
    # one strided pass (an offloaded layer is packed at every forward): out[p, j, f, e] = W[16 p + f, 2 j + e]
    out.permute(0, 2, 1, 3).copy_(w.view(P, PANEL, K2, 2))
    return out


def unpack_linear_weight_bf16(w_packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [N, K] bf16 weight back from :func:`pack_linear_weight_bf16`."""
    P, K2 = w_packed.shape[:2]
    return w_packed.transpose(1, 2).reshape(P * PANEL, 2 * K2)[:out_features, :in_features]


def packed_linear_bf16_chain(x: torch.Tensor, w_packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """The bf16 kernel's arithmetic in PyTorch, bitwise (on normal numbers): per output, fp32
    acc += x[2j+1] w[2j+1], then acc += x[2j] w[2j], pair by pair (each product of two bf16 is
    exact in fp32, so each step rounds once, as an FMA), rounded to bf16 once."""
    M, K = x.shape
    W = unpack_linear_weight_bf16(w_packed, out_features, K).float()  # [N, K]
    xf = torch.nn.functional.pad(x.float(), (0, K % 2))
    W = torch.nn.functional.pad(W, (0, K % 2))
    acc = torch.zeros(M, out_features, dtype=torch.float32, device=x.device)
    for j in range(xf.shape[1] // 2):
        acc = acc + xf[:, 2 * j + 1, None] * W[:, 2 * j + 1]
        acc = acc + xf[:, 2 * j, None] * W[:, 2 * j]
    return acc.to(torch.bfloat16)


def packed_linear_reference(x: torch.Tensor, w_packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T with W unpacked from w_packed (fp32 or bf16 layout), products and sums in
    fp64, rounded once to x's dtype."""
    if w_packed.dim() == 4:
        W = unpack_linear_weight_bf16(w_packed, out_features, x.shape[1])
    else:
        P, K, _ = w_packed.shape
        W = w_packed.transpose(1, 2).reshape(P * PANEL, K)[:out_features]
    return (x.double() @ W.double().t()).to(x.dtype)


def packed_linear(
    x: torch.Tensor,  # [M, K] fp32 or bf16
    w_packed: torch.Tensor,  # fp32 [ceil(N / 16), K, 16] (pack_linear_weight) or bf16 [P, K2, 16, 2]
    out_features: int,
    *,
    out: torch.Tensor | None = None,  # [M, N], x's dtype
    backend: str | None = None,
    isa: str = "auto",  # bf16: the instruction set ("auto": this CPU's best; see ISAS)
    residual: torch.Tensor | None = None,  # bf16 [M, N]: added in the output store (torch's bf16 add, fused)
) -> torch.Tensor:  # [M, N], x's dtype
    bf16 = x.dtype == torch.bfloat16
    if residual is not None and (not bf16 or residual.dtype != torch.bfloat16 or residual.dim() != 2
                                 or tuple(residual.shape) != (x.shape[0], out_features)):
        raise ValueError(f"packed_linear: a residual is bf16 [M, N] = [{x.shape[0]}, {out_features}] for a bf16 x, "
                         f"got {residual.dtype} {tuple(residual.shape)} for {x.dtype} x")
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"packed_linear: x must be float32 or bfloat16 [M, K], got {x.dtype} {tuple(x.shape)}")
    N, K = out_features, x.shape[1]
    if bf16:
        want = _bf16_packed_shape(N, K)
        if w_packed.dtype != torch.bfloat16 or tuple(w_packed.shape) != want or N < 1:
            raise ValueError(f"packed_linear: a bf16 w_packed for N = {N}, K = {K} must be bfloat16 {want} "
                             f"(pack_linear_weight_bf16), got {w_packed.dtype} {tuple(w_packed.shape)}")
    else:
        if w_packed.dim() != 3 or w_packed.shape[1] != K or w_packed.shape[2] != PANEL:
            raise ValueError(f"packed_linear: w_packed must be [ceil(N / 16), K = {K}, 16], got "
                             f"{tuple(w_packed.shape)}")
        if not 0 < N <= w_packed.shape[0] * PANEL or N <= (w_packed.shape[0] - 1) * PANEL:
            raise ValueError(f"packed_linear: out_features = {N} does not fit {w_packed.shape[0]} panels")
    if x.device.type != "cpu" or w_packed.device != x.device:
        raise ValueError(f"packed_linear: a CPU op (x on {x.device}, w_packed on {w_packed.device}); GPUs use cuBLAS")
    backend = resolve_op_backend("packed_linear_bf16" if bf16 else "packed_linear", backend, x.device)
    if backend not in ("cpu", "reference"):
        raise ValueError(f"packed_linear: backend {backend!r} has no packed_linear; use 'cpu' or 'reference'")
    if bf16 and backend == "cpu" and bf16_isa(isa) is None:
        raise ValueError(f"packed_linear: isa {isa!r} is not available on this CPU (best: {bf16_isa()})")
    if backend == "reference":
        y = packed_linear_reference(x, w_packed, N)
        y = y if residual is None else y + residual
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
    if bf16:
        if residual is not None and N > 1 and residual.stride(1) != 1:
            residual = residual.contiguous()
        torch.ops.sequoia_kernels.packed_linear_bf16(x.contiguous(), w_packed, int(N), out, ISAS[isa], residual)
    else:
        torch.ops.sequoia_kernels.packed_linear(x.contiguous(), w_packed, int(N), out)
    return out


def packed_rows(x: torch.Tensor, w: torch.Tensor, max_rows: int) -> int | None:
    """The rows of ``x`` [..., K] when ``x W^T`` runs on packed_linear (a CPU call of at most
    ``max_rows`` rows in W's dtype, outside autograd), else None (torch's linear)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (rows > max_rows or x.dtype != w.dtype or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return None
    return rows


def weight_key(w: torch.Tensor) -> tuple[int, int]:
    """(version, storage) of a weight: changes when it is modified in place or moved. An inference
    tensor has no version counter (made under ``torch.inference_mode``): its storage alone."""
    return (-1 if w.is_inference() else w._version), w.data_ptr()


def _packs(kept, w: torch.Tensor) -> bool:
    """Whether ``kept`` (from :func:`packed_copy`) still packs ``w`` as it is now (not replaced,
    modified in place or moved)."""
    return kept is not None and kept[0] is w and kept[1] == weight_key(w)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` packed for :func:`linear_packed` (:func:`pack_linear_weight_bf16` or
    :func:`pack_linear_weight` by dtype)."""
    return pack_linear_weight_bf16(w) if w.dtype == torch.bfloat16 else pack_linear_weight(w)


def packed_copy(w: torch.Tensor, kept=None) -> tuple:
    """``(w, (version, storage), packed)``: ``kept`` while it still packs ``w``, else ``w``
    packed anew (:func:`pack_weight`)."""
    if _packs(kept, w):
        return kept
    return w, weight_key(w), pack_weight(w)


def linear_packed(x: torch.Tensor, packed: torch.Tensor, out_features: int, rows: int) -> torch.Tensor:
    """``x`` [..., K] times a packed weight (:func:`packed_rows` said ``rows``), the compiled op
    called directly: [..., out_features]."""
    K = x.shape[-1]
    x2 = x.reshape(rows, K)
    if K > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    y = x2.new_empty(rows, out_features)
    if x.dtype == torch.bfloat16:
        torch.ops.sequoia_kernels.packed_linear_bf16(x2, packed, out_features, y, 0)
    else:
        torch.ops.sequoia_kernels.packed_linear(x2, packed, out_features, y)
    return y.view(*x.shape[:-1], out_features)


def _packed_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward of a switched module (use_packed_linears): the compiled op, called
    directly (this runs ~200 times per model forward: no validation beyond the fast checks)."""
    w = module.weight
    rows = packed_rows(x, w, module._sequoia_max_rows)
    if rows is None:
        return torch.nn.functional.linear(x, w, module.bias)
    pk = module._sequoia_packed
    if not _packs(pk, w):  # replaced, modified in place or moved: repack
        if _offloaded(module):  # its weights arrive anew each forward: packed into a shared buffer, not kept
            pk = (w, None, pack_linear_weight_bf16(w, _scratch(w)) if w.dtype == torch.bfloat16 else pack_linear_weight(w))
        else:
            module._sequoia_packed = pk = packed_copy(w)
    y = linear_packed(x, pk[2], module.out_features, rows)
    if module.bias is not None:
        y += module.bias
    return y


def packed_linear_supported(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernel has a vector path here for ``dtype``: fp32 needs AVX2 and FMA (torch's
    CPU capability AVX2 or above); bf16 AVX2+FMA, AVX-512F, AVX-512-BF16 or AMX (:func:`bf16_isa`)."""
    try:
        if dtype == torch.bfloat16:
            return bf16_isa() not in (None, "scalar")
        if dtype != torch.float32 or not compiled_op_available("cpu", "packed_linear"):
            return False
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512", "AVX512_BF16", "AMX")
    except Exception:  # noqa: BLE001 - an unknown capability string or no compiled ops
        return False


def packed_linear_pays(dtype: torch.dtype = torch.float32) -> bool:
    """Whether the decoding loop's few-row linears of ``dtype`` are faster on packed_linear than
    on torch's GEMM on this CPU. fp32: on AVX2 CPUs (measured on an AMD EPYC Zen 3: 1.8x -> ~1.1x
    for an 8-token tree over one token), on AMD CPUs with AVX-512 (an AMD EPYC Zen 4,
    SmolLM2-135M's linears: 20-24 ms packed against 50-59 ms with torch's GEMM at one row, 47-50
    against 75-87 ms at 16) and on Intel CPUs with AVX-512 but no AMX (an Ice Lake Xeon: 30-40
    against 27-30 ms at one row, 52-78 against 141 ms at 16), not on Intel CPUs with AMX (a
    Sapphire Rapids-class Xeon, SmolLM2-135M fp32: one token 35-41 ms with torch's GEMM against
    42-48 ms packed, 8 tokens 64-70 against 72-78 ms, the draft alike). bf16: wherever supported
    (torch's bf16 GEMM re-packs its operands per call and is not batch invariant;
    docs/bf16_cpu.md has the measurements). The loop's and the profiler's default
    (``packed_linears=None``)."""
    try:
        if dtype == torch.bfloat16:
            return packed_linear_supported(dtype)
        intel_amx = cpuinfo("vendor_id") == "GenuineIntel" and "amx_tile" in cpuinfo("flags").split()
        return packed_linear_supported(dtype) and (torch.backends.cpu.get_cpu_capability() == "AVX2" or not intel_amx)
    except Exception:  # noqa: BLE001 - an unknown capability string
        return False


# oneDNN ISAs (its ONEDNN_MAX_CPU_ISA cap, DNNL_MAX_CPU_ISA before it) without bf16 dot products:
# capped to one of them, torch's bf16 GEMM converts its operands as on a CPU without them
_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def packed_prefill_pays(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether packed_linear beats torch's GEMM at many rows too (a prompt's prefill) for
    ``dtype`` on this CPU: bf16 where torch's bf16 GEMM has no bf16 instructions to run on (no
    AMX, no AVX-512-BF16, or oneDNN capped below them by ``ONEDNN_MAX_CPU_ISA``; oneDNN converts
    the operands per call). Measured on SmolLM2-135M's prefill of one prompt, an Ice Lake Xeon
    (AVX-512F): 331 against 952 ms at 256 tokens, 1.72 against 3.91 s at 1000; the same machine
    capped to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``): 0.50 against 2.48 s,
    2.40 against 8.72 s; a Zen 4 so capped, 4 ragged rows of 693 tokens: 1.05 against 4.13 s (two runs).
    fp32 never (torch's GEMM 1.07-1.3x faster there at 256-1000 tokens)."""
    if dtype != torch.bfloat16 or not packed_linear_supported(dtype):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    if cap.strip().upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return True
    try:
        flags = cpuinfo("flags").split()
    except Exception:  # noqa: BLE001 - no /proc/cpuinfo
        return False
    return "amx_bf16" not in flags and "avx512_bf16" not in flags


@contextlib.contextmanager
def use_packed_linears(model: torch.nn.Module, enabled: bool = True, max_rows: int = MAX_ROWS) -> Iterator[int]:
    """Within the block, every fp32 and bf16 CPU ``nn.Linear`` of ``model`` (where
    :func:`packed_linear_supported` for its dtype) computes calls of <= ``max_rows``
    rows with :func:`packed_linear` (weights packed at the first call, repacked if a weight is
    replaced, modified in place or given new storage); larger calls, other dtypes and devices,
    and autograd keep ``torch.nn.functional.linear``. ``max_rows``: the largest call whose rows
    must not depend on the other rows (the decoding loop: its batch times its largest tree; a
    longer prefill runs torch's GEMM). Yields how many modules were switched; restores their
    ``forward`` on exit. Where :func:`packed_prefill_pays` for a weight's dtype, calls of any
    size run packed (a longer prefill too: faster than torch's GEMM there, and its rows then
    never depend on the other rows either). Modules under an accelerate hook (device placement,
    offloading) are switched below the hook; an offloaded weight, brought in anew for each
    forward, is packed per call and not kept.

    The packed copies stay with the modules after the block and are reused by the next block
    while each weight is unchanged: packing is a copy of every weight (~0.4 s for SmolLM2-135M on
    a Zen 3 core pair), which used to be paid again by every ``generate`` call, inside its prefill.
    They cost one copy of each switched weight for as long as the model lives;
    :func:`release_packed_linears` frees them."""
    switched = []
    if enabled:
        dtypes = [d for d in (torch.float32, torch.bfloat16) if packed_linear_supported(d)]
        any_rows = {d: packed_prefill_pays(d) for d in dtypes}
        for mod in model.modules():
            if type(mod) is torch.nn.Linear and mod.weight.device.type in _HOSTS and mod.weight.dtype in dtypes:
                attr = _forward_attr(mod)
                if attr is None or hasattr(mod, "_sequoia_packed"):
                    continue  # already switched by an enclosing block, or patched by someone else
                mod._sequoia_packed = mod.__dict__.pop("_sequoia_packed_kept", (None, None, None))
                mod._sequoia_max_rows = ANY_ROWS if any_rows[mod.weight.dtype] else max(int(max_rows), 1)
                switched.append(switch_forward(mod, attr, _packed_forward))
    with forwards_restored(switched, _unswitch_packed) as n:
        yield n


def _unswitch_packed(mod: torch.nn.Module) -> None:
    del mod._sequoia_max_rows
    kept = mod.__dict__.pop("_sequoia_packed")
    if kept[2] is not None:
        mod._sequoia_packed_kept = kept


_HOSTS = ("cpu", "meta")  # meta: a layer accelerate offloaded (its weights arrive for each forward)


def _forward_attr(mod: torch.nn.Module) -> str | None:
    """The attribute to switch: ``forward`` on a plain module; ``_old_forward`` under an accelerate
    hook (device placement, offloading: the hook's ``forward`` brings the weights, then calls
    it); None where someone else patched ``forward``."""
    hook = getattr(mod, "_hf_hook", None)
    if hook is not None and "_old_forward" in mod.__dict__ and "forward" in mod.__dict__:
        return "_old_forward"
    return None if "forward" in mod.__dict__ else "forward"


def switch_forward(mod: torch.nn.Module, attr: str, fn) -> tuple:
    """Set ``mod``'s ``attr`` (:func:`_forward_attr`) to ``fn`` bound to ``mod`` for the calling
    thread: other threads' calls run the forward it replaces (``per_thread.for_this_thread``: a
    plain call on the model from another thread meanwhile runs the model's own code). Returns what
    :func:`forwards_restored` takes to undo it."""
    before = mod.__dict__.get(attr)
    plain = before if before is not None else getattr(type(mod), attr).__get__(mod)
    setattr(mod, attr, for_this_thread(fn.__get__(mod), plain))
    return mod, attr, before


def switch_keeping_own(mod: torch.nn.Module, fn, own: str) -> tuple | None:
    """:func:`switch_forward` of ``mod``'s forward (:func:`_forward_attr`) to ``fn``, the forward it
    had kept as ``mod.<own>`` (what ``fn`` falls back to; :func:`forwards_restored`'s undo deletes
    it). None where someone else patched ``forward`` (nothing switched)."""
    attr = _forward_attr(mod)
    if attr is None:
        return None
    setattr(mod, own, mod.__dict__.get(attr) or type(mod).forward.__get__(mod))
    return switch_forward(mod, attr, fn)


@contextlib.contextmanager
def forwards_restored(switched: list[tuple], undo) -> Iterator[int]:
    """Yields how many modules ``switched`` (:func:`switch_forward`'s results) holds; on exit puts
    each module's forward back as it was and calls ``undo(module)``."""
    try:
        yield len(switched)
    finally:
        for mod, attr, before in switched:
            if before is None:
                delattr(mod, attr)  # the class's forward again
            else:
                setattr(mod, attr, before)
            undo(mod)


_SCRATCH: dict[tuple, torch.Tensor] = {}  # offloaded weights' packing buffers, one per packed shape


def _scratch(w: torch.Tensor) -> torch.Tensor:
    """The reused buffer an offloaded bf16 weight of ``w``'s shape is packed into: one call at a
    time uses it (the layers run one after another), and its pages stay mapped (a fresh buffer per
    call cost a page fault per 4 KB)."""
    shape = _bf16_packed_shape(*w.shape)
    key = (shape, w.device)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(shape, dtype=torch.bfloat16, device=w.device)
    return _SCRATCH[key]


def _offloaded(mod: torch.nn.Module) -> bool:
    """Whether an accelerate hook offloads ``mod``'s weights (brought in anew for every forward)."""
    return bool(getattr(getattr(mod, "_hf_hook", None), "offload", False))


def release_packed_linears(model: torch.nn.Module) -> int:
    """Free the packed weight copies :func:`use_packed_linears` left on ``model``'s modules, and the
    fused projections' (``fused_projections``; the next block packs again). Returns how many were freed."""
    freed = 0
    for mod in model.modules():
        if mod.__dict__.pop("_sequoia_packed_kept", None) is not None:
            freed += 1
        for attr in [a for a in mod.__dict__ if a.startswith("_sequoia_cat_")]:
            del mod.__dict__[attr]
            freed += 1
    return freed
