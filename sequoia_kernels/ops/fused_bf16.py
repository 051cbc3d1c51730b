"""Fused bf16 row ops of a Llama layer on the CPU: RMSNorm, SiLU-and-multiply, rotary.

In a bf16 forward of a few tokens on a CPU, Hugging Face's RMSNorm (8 torch ops: convert, square,
mean, add, rsqrt, multiply, convert, multiply) and the MLP's ``act_fn(gate) * up`` (2 ops) each
dispatch, allocate and convert on rows of 576-1536 values: ~15 ms of a 32-token SmolLM2-135M
forward whose linears take ~26 ms (torch's profiler, docs/bf16_cpu.md). The compiled ops
(``csrc/cpu/fused_bf16.cpp``) do each in one pass per row with the modules' own arithmetic (fp32
inside, the same roundings to bf16); the spec leaves the order of RMSNorm's fp32 sum of squares
free (the kernel fixes one: eight lanes, a fixed tree, the tail in order; :func:`rms_norm_bf16_chain`
is that order in PyTorch, bitwise) and exp's last ulp (the kernel's is within 1 ulp, like torch's).
A row's result never depends on the other rows (batch invariance). The rotary embedding
(``q * cos + rotate_half(q) * sin``: 10 torch ops a layer) is bitwise the module's: every product
of two bf16 is exact in fp32, so each step of the fused row is the one rounding torch makes.

:func:`use_fused_bf16` switches a model's Llama RMSNorm and SiLU MLP modules (those whose
``forward`` is Llama's, bf16 weights on the CPU) to them for a block, as the decoding loop and the
profiler do for bf16 CPU models (``sequoia_decoding.patching.sequoia_models``, with the packed
linears). Roofline: bytes 2 R H (x) + 2 H (w) + 2 R H (out), ~4 flops per element: bound by the
call overhead (~2 us) below a few thousand elements, by memory above.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import textwrap
import threading
from collections.abc import Iterator

import torch

from .._backend import compiled_op_available

__all__ = ["rms_norm_bf16", "silu_mul_bf16", "rotary_bf16", "rms_norm_reference", "rms_norm_bf16_chain",
           "silu_mul_reference", "rotary_reference", "fused_bf16_supported", "use_fused_bf16"]


@torch.library.register_fake("sequoia_kernels::rms_norm_bf16")
def _rms_norm_bf16_fake(x, weight, eps, out) -> None:
    return None


@torch.library.register_fake("sequoia_kernels::silu_mul_bf16")
def _silu_mul_bf16_fake(gate, up, out) -> None:
    return None


@torch.library.register_fake("sequoia_kernels::rotary_bf16")
def _rotary_bf16_fake(x, cos, sin, out) -> None:
    return None


def fused_bf16_supported() -> bool:
    """Whether the compiled CPU ops are available (every x86-64 or other CPU build has them)."""
    return all(compiled_op_available("cpu", op) for op in ("rms_norm_bf16", "silu_mul_bf16", "rotary_bf16"))


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of bf16 ``x [..., H]`` with bf16 ``weight [H]`` (the compiled CPU op)."""
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(x)
    torch.ops.sequoia_kernels.rms_norm_bf16(x, weight if weight.is_contiguous() else weight.contiguous(), eps, out)
    return out


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s rows as ``[R, I]``: a view where torch can make one whose rows are contiguous and do
    not overlap (the two halves of a fused gate-up output: the op reads them in place), else a
    contiguous copy."""
    r = t.reshape(t.shape[:-1].numel(), t.shape[-1])
    if (r.shape[1] > 1 and r.stride(1) != 1) or (r.shape[0] > 1 and r.stride(0) < r.shape[1]):
        r = r.contiguous()
    return r


def silu_mul_bf16(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``bf16(bf16(silu(gate)) * up)`` for bf16 ``gate, up [..., I]`` (the compiled CPU op); rows
    evenly spaced (the two halves of a fused gate-up output) are read in place. A contiguous result."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul_bf16: gate and up must have one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    g, u = _row_view(gate), _row_view(up)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    torch.ops.sequoia_kernels.silu_mul_bf16(g, u, out)
    return out.view(gate.shape)


def rotary_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for bf16 ``x [B, H, T, D]`` (any strides but the last) and
    ``cos, sin [B or 1, T, D]``, bitwise Hugging Face's bf16 ops; a contiguous result."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    torch.ops.sequoia_kernels.rotary_bf16(x, cos, sin, out)
    return out


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``apply_rotary_pos_emb`` on one tensor (``cos``, ``sin`` unsqueezed at dim 1)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's ``LlamaRMSNorm.forward`` (torch's sum order for the mean)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_bf16_chain(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch, bitwise: lanes j = 0..7 sum x[8 i + j]^2 in i order
    (each square rounded to fp32, then added: no FMA), the lanes summed as
    (l0 + l4 + (l2 + l6)) + (l1 + l5 + (l3 + l7)), the tail added in order; then the module's
    roundings."""
    H = x.shape[-1]
    sq = x.reshape(-1, H).to(torch.float32).square()
    full = H // 8 * 8
    lanes = torch.zeros(sq.shape[0], 8, dtype=torch.float32)
    for i in range(0, full, 8):
        lanes = lanes + sq[:, i:i + 8]
    s4 = lanes[:, :4] + lanes[:, 4:]
    s2 = s4[:, :2] + s4[:, 2:]
    s = s2[:, 0] + s2[:, 1]
    for i in range(full, H):
        s = s + sq[:, i]
    # the kernel's std::sqrt is IEEE's, correctly rounded; torch 2.14's fp32 sqrt on CPUs is not
    # (1 ulp off for 20% of values in [1e-6, 1e-3] on an AMD EPYC): fp64 then fp32 is (53 >= 2 * 24 + 2)
    v = s / float(H) + torch.tensor(eps, dtype=torch.float32)
    r = 1.0 / torch.sqrt(v.double()).float()
    y = (x.reshape(-1, H).to(torch.float32) * r[:, None]).to(torch.bfloat16)
    return (weight.to(torch.float32) * y.to(torch.float32)).to(torch.bfloat16).view(x.shape)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``act_fn(gate) * up`` with SiLU, in the inputs' dtype."""
    return torch.nn.functional.silu(gate) * up


# ---------------------------------------------------------------- switching a model's modules

_LLAMA_SOURCES: dict[str, str] = {}
_MATCHES: dict[tuple[type, str], bool] = {}


def _llama_source(kind: str) -> str:
    """The source of Llama's RMSNorm / MLP / attention / decoder-layer forward in this transformers."""
    if not _LLAMA_SOURCES:
        from transformers.models.llama import modeling_llama as ml

        _LLAMA_SOURCES.update(norm=_body(ml.LlamaRMSNorm.forward), mlp=_body(ml.LlamaMLP.forward),
                              attention=_body(ml.LlamaAttention.forward), layer=_body(ml.LlamaDecoderLayer.forward))
    return _LLAMA_SOURCES[kind]


def llama_source_digest(kind: str) -> str:
    """A short hash of :func:`_llama_source`: what a module mirroring that forward pins its version by."""
    return hashlib.sha1(_llama_source(kind).encode()).hexdigest()[:16]


def _is_llamas(cls: type, kind: str) -> bool:
    """Whether ``cls.forward`` is Llama's RMSNorm / MLP / attention / decoder-layer forward (the same source:
    Hugging Face's "copied from" modules of other Llama-family models qualify; Gemma's ``1 + weight`` does not)."""
    key = (cls, kind)
    if key not in _MATCHES:
        try:
            _MATCHES[key] = _body(cls.forward) == _llama_source(kind)
        except (OSError, TypeError):  # no source (built in, compiled): not switched
            _MATCHES[key] = False
    return _MATCHES[key]


def _body(fn) -> str:
    return textwrap.dedent(inspect.getsource(fn))


# These run ~120 times a forward, each on a few rows: every Python-level torch call costs 2-6 us
# on the CPUs measured (docs/bf16_cpu.md), so the fast path makes as few as it can.
def _norm_forward(module, hidden_states: torch.Tensor) -> torch.Tensor:
    w = module.weight
    if hidden_states.dtype is not _BF16 or w.dtype is not _BF16 or not hidden_states.is_cpu \
            or type(hidden_states) not in _PLAIN or type(w) not in _PLAIN \
            or (torch.is_grad_enabled() and (hidden_states.requires_grad or w.requires_grad)):
        return module._sequoia_fused_fallback(hidden_states)
    return rms_norm_bf16(hidden_states, w, module.variance_epsilon)


def _mlp_forward(module, x: torch.Tensor) -> torch.Tensor:
    from .fused_projections import gate_up

    gate, up = gate_up(module, x, views=True)  # one packed call where the projections are packed
    if gate.dtype is not _BF16 or up.dtype is not _BF16 or not gate.is_cpu \
            or type(gate) not in _PLAIN or type(up) not in _PLAIN \
            or (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return module.down_proj(module.act_fn(gate.contiguous()) * up.contiguous())
    return module.down_proj(silu_mul_bf16(gate, up))  # the halves of one output read in place


_BF16 = torch.bfloat16
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not a tensor subclass such as a DTensor (a TP shard): the module's code


_ROTARY = {"depth": 0, "original": None}
_ROTARY_LOCK = threading.Lock()


def _compiled_rotary_takes(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the compiled rotary runs on ``x`` (a query or key, or the projection output they
    are views of) with ``cos``: bf16 on the CPU, plain tensors, no autograd."""
    return x.dtype is _BF16 and cos.dtype is _BF16 and x.is_cpu and type(x) in _PLAIN and type(cos) in _PLAIN \
        and not (torch.is_grad_enabled() and x.requires_grad)


def _rotary_fast(q, k, cos, sin, unsqueeze_dim=1):
    """``modeling_llama.apply_rotary_pos_emb`` while a :func:`use_fused_bf16` block is open: the
    compiled op for bf16 CPU tensors (the same bits), the original for everything else."""
    if unsqueeze_dim != 1 or q.dim() != 4 or type(sin) not in _PLAIN \
            or not (_compiled_rotary_takes(q, cos) and _compiled_rotary_takes(k, cos)):
        return _ROTARY["original"](q, k, cos, sin, unsqueeze_dim)
    return rotary_bf16(q, cos, sin), rotary_bf16(k, cos, sin)


def rotary_reads_views(apply_rotary, x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether ``apply_rotary`` (a model family's ``apply_rotary_pos_emb``) is :func:`_rotary_fast`
    and takes its compiled path for a projection output ``x`` (bf16 on the CPU, plain tensors, no
    autograd): the op reads any strides and writes contiguous results, the same bits, so q and k
    need no copy before it."""
    return apply_rotary is _rotary_fast and _compiled_rotary_takes(x, cos)


@contextlib.contextmanager
def _fast_rotary() -> Iterator[None]:
    """Llama's module-level ``apply_rotary_pos_emb`` replaced for the block (nested blocks share
    one replacement; the outermost restores it). Process-wide, but bitwise the original's results."""
    from transformers.models.llama import modeling_llama as ml

    with _ROTARY_LOCK:
        if _ROTARY["depth"] == 0:
            _ROTARY["original"] = ml.apply_rotary_pos_emb
            ml.apply_rotary_pos_emb = _rotary_fast
        _ROTARY["depth"] += 1
    try:
        yield
    finally:
        with _ROTARY_LOCK:
            _ROTARY["depth"] -= 1
            if _ROTARY["depth"] == 0:
                ml.apply_rotary_pos_emb = _ROTARY["original"]


def _silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


@contextlib.contextmanager
def use_fused_bf16(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block, ``model``'s Llama RMSNorm modules and SiLU MLPs with bf16 weights on the
    CPU (or offloaded by accelerate: switched below its hook) compute bf16 CPU inputs with
    :func:`rms_norm_bf16` / :func:`silu_mul_bf16` (other inputs and autograd: the module's own
    code), and Llama's ``apply_rotary_pos_emb`` runs :func:`rotary_bf16` on bf16 CPU tensors
    (bitwise its own result). Yields how many modules were switched; restores everything on exit."""
    from .packed_linear import _HOSTS, forwards_restored, switch_keeping_own

    switched = []
    if enabled and fused_bf16_supported():
        for mod in model.modules():
            if "_sequoia_fused_fallback" in mod.__dict__:
                continue  # switched by an enclosing block
            w = getattr(mod, "weight", None) if hasattr(mod, "variance_epsilon") else None
            if isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16 and w.device.type in _HOSTS \
                    and _is_llamas(type(mod), "norm"):
                fn = _norm_forward
            elif all(isinstance(getattr(mod, n, None), torch.nn.Module) for n in ("gate_proj", "up_proj", "down_proj")) \
                    and _silu(getattr(mod, "act_fn", None)) and mod.gate_proj.weight.dtype == torch.bfloat16 \
                    and mod.gate_proj.weight.device.type in _HOSTS and _is_llamas(type(mod), "mlp"):
                fn = _mlp_forward
            else:
                continue
            # None: patched by someone else
            if (done := switch_keeping_own(mod, fn, "_sequoia_fused_fallback")) is not None:
                switched.append(done)
    with contextlib.ExitStack() as rotary:
        if switched:  # a bf16 Llama-family model: its attention's rotary too
            rotary.enter_context(_fast_rotary())
        with forwards_restored(switched, lambda mod: delattr(mod, "_sequoia_fused_fallback")) as n:
            yield n
