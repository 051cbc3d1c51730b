"""Lean decoder layers: a Llama-family decoder layer's forward as direct calls of the packed and
fused ops (CPU, inside the decoding loop's patching), the same bits as the switched modules give.

With every part of a layer switched (``use_packed_linears``, ``use_fused_projections`` and, for
bf16, ``use_fused_bf16``), a one-token forward still spent ~7 of its ~20 ms outside the ops'
own time (SmolLM2-135M, bf16, 2-core Xeon with AMX): ~300 module calls a forward, each with its
wrapper's checks (rows, dtype, autograd, weight versions, strides), splits, views and output
allocations. Within :func:`use_lean_layers` a layer whose ``forward`` is Llama's (the same
source, as ``fused_projections`` checks its modules) runs :func:`_lean_forward`: the checks once
per layer call, then the ops themselves on the layer's packed weights (the fused q/k/v and
gate/up copies, o_proj's and down_proj's own): RMSNorm, one qkv product, the rotary, the cache
write and the attention function, o_proj, the residual add, RMSNorm, one gate-up product,
SiLU-and-multiply, down_proj, the residual add (bf16: both adds in the products' output stores,
``packed_linear_bf16``'s ``residual``, the rotary in the qkv product's, its rotary epilogue,
where the heads divide its groups of 64 columns, and SiLU-and-multiply in the gate-up product's,
its SiLU epilogue, where the MLP's width is a multiple of 32). The arithmetic is the switched modules' own
(``tests/test_lean_layers.py`` compares logits bitwise); only the Python around it goes: bf16
T(1) 20.4 -> 17.5 ms, T(32) 27.6 -> 24.4 ms (same machine, one process, 30 interleaved rounds).

An fp32 model whose linears stay on torch's GEMM (``packed_linear_pays``: Intel CPUs with
AVX-512) runs lean too, with Llama's own attention and MLP code inlined: the same torch linears,
norms and activation on the same tensors, without the module calls (one-token forward 31.6 ->
30.6 ms, same machine). bf16 runs lean only on the packed and fused ops.

A call the lean path does not take (more rows than the packed limit, autograd, training, another
dtype or device, a tensor subclass, a packed copy older than its weight: the switched modules
repack it) runs the layer's own forward. Layers with biases, accelerate hooks (offloading, device
placement), forward hooks on their parts (a lean call would skip them), tensor-parallel shards,
some projections switched and others not, or another transformers version's layer, attention or
MLP code are not switched.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Iterator, NamedTuple

import torch
from torch.nn import functional as F

from .fused_bf16 import _PLAIN, _is_llamas, _rotary_fast, llama_source_digest
from .fused_projections import _mirrors as _proj_mirrors, cache_update
from .packed_linear import _HOSTS, forwards_restored, switch_keeping_own, weight_key

__all__ = ["lean_block", "use_lean_layers"]

# LlamaDecoderLayer.forward as mirrored below, by hashes of its source: transformers 5.4-5.23, and
# 5.24-5.25 (the cache's keyword renamed ``cache``)
_MIRRORED = ("8c8727b7a2aac1a2", "953d3f186cbb7fe3")
_BF16 = torch.bfloat16
_OPS = torch.ops.sequoia_kernels


@functools.lru_cache(maxsize=None)
def _mirrors() -> bool:
    return llama_source_digest("layer") in _MIRRORED


class _Parts(NamedTuple):
    """A switched layer's parts, looked up once at the switch (each a module attribute lookup per
    call otherwise)."""

    attn: torch.nn.Module
    mlp: torch.nn.Module
    norm1: torch.nn.Module | None  # input_layernorm (None: a layer without one, an EAGLE-1 head's)
    norm2: torch.nn.Module  # post_attention_layernorm
    lins: tuple  # q, k, v, o, gate, up, down projections
    packed: bool  # on packed_linear, q/k/v and gate/up fused; else torch's linears (fp32, where packing does not pay)
    q_out: int
    k_out: int
    inter: int  # the MLP's width
    family: types.ModuleType  # the attention's modeling module (its rotary and attention functions)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # _Parts.lins


def _lean_parts(layer: torch.nn.Module) -> _Parts | None:
    """``layer``'s parts when it is a Llama-family decoder layer without biases or accelerate
    hooks whose projections are all switched to the packed path and fused (or, fp32, none
    switched: Llama's own attention and MLP code on torch's linears), its norms Llama's (bf16
    ones on the fused op) and its MLP's activation SiLU; else None. A layer may lack its input
    norm (an EAGLE-1 head's layer reads fc's output unnormalized)."""
    if not (_is_llamas(type(layer), "layer") and _mirrors()):  # first: a model's other modules cost one lookup
        return None
    at, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if None in (at, mlp, n2) or any("_hf_hook" in m.__dict__ for m in layer.modules()) or _hooks_would_miss(layer):
        return None
    norms = (n2,) if n1 is None else (n1, n2)
    lins = tuple(getattr(m, name, None) for m, name in zip((at,) * 4 + (mlp,) * 3, _PROJECTIONS))
    if any(type(lin) is not torch.nn.Linear for lin in lins):
        return None  # Llama's layer forward over other parts (Glm's gate_up_proj, Starcoder2's c_fc): their own
    w = lins[3].weight
    if any(lin.bias is not None or type(lin.weight) not in _PLAIN or lin.weight.dtype != w.dtype for lin in lins):
        return None
    packed = "_sequoia_fuse" in at.__dict__ and "_sequoia_fuse" in mlp.__dict__
    if packed != all("_sequoia_max_rows" in lin.__dict__ for lin in lins):
        return None  # some switched, some not
    if not packed and (w.dtype == _BF16 or not (_is_llamas(type(at), "attention") and _proj_mirrors("attention")
                                                and _is_llamas(type(mlp), "mlp") and _proj_mirrors("mlp"))
                       or any("forward" in m.__dict__ for m in (at, mlp, *norms, *lins))):
        return None
    if not all(_is_llamas(type(n), "norm") and n.weight.dtype == w.dtype and n.weight.is_contiguous() for n in norms):
        return None
    act = getattr(mlp, "act_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    fused = all("_sequoia_fused_fallback" in m.__dict__ for m in (*norms, mlp))  # use_fused_bf16's
    if not silu or (w.dtype == _BF16 and not fused) or w.device.type not in _HOSTS:
        return None
    return _Parts(at, mlp, n1, n2, lins, packed, at.q_proj.out_features, at.k_proj.out_features,
                  mlp.gate_proj.out_features, sys.modules[type(at).__module__])


def _hooks_would_miss(layer: torch.nn.Module) -> bool:
    """Whether a lean forward would skip a hook: forward (pre-)hooks on the layer's parts (not
    Hugging Face's output capturing, which records no attention weights from the loop's attention
    function), or global module hooks. Hooks added to the parts inside the block are not seen."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_pre_hooks or any(getattr(h, "__name__", "") != "output_capturing_hook"
                                           for h in m._forward_hooks.values())
               for m in layer.modules() if m is not layer)


def _packed(lin: torch.nn.Module) -> tuple[int, torch.Tensor] | None:
    """(N, packed) of a switched linear while its packed copy is the weight as it is, else None."""
    pk, w = lin._sequoia_packed, lin.weight
    return (lin.out_features, pk[2]) if pk[0] is w and pk[1] == weight_key(w) else None


def _fused(mod: torch.nn.Module) -> tuple[int, torch.Tensor] | None:
    """(N, packed) of a module's fused projections while current (``fused_linear``'s copy)."""
    attr, weights, _ = mod._sequoia_fuse
    got = mod.__dict__.get(attr)
    if got is None or got[0] != tuple(weight_key(w) for w in weights):
        return None
    return got[1], got[3]


def _weights(layer, p: _Parts, x: torch.Tensor, position_embeddings) -> tuple | None:
    """What a lean call's products read: packed, (qkv, o, gate-up, down) as (N, packed) pairs
    and packed tensors; else the 7 projections' weights. None where this call takes the layer's
    own forward (module docstring)."""
    o = p.lins[3]
    w = o.weight
    if (type(x) is not torch.Tensor or x.dtype != w.dtype or x.device.type != "cpu" or x.dim() != 3
            or not x.is_contiguous() or position_embeddings is None or layer.training
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        return None
    if not p.packed:
        return tuple(lin.weight for lin in p.lins)
    if x.numel() // max(x.shape[-1], 1) > o._sequoia_max_rows:
        return None
    parts = (_fused(p.attn), _packed(o), _fused(p.mlp), _packed(p.lins[6]))
    return None if any(part is None for part in parts) else parts  # (`None in parts` calls Tensor.__eq__)


def _linear(x2: torch.Tensor, w, residual: torch.Tensor | None = None) -> torch.Tensor:  # [R, K] -> [R, N]
    """``x2`` times a packed weight ``w = (N, packed)``, or torch's linear with a weight tensor;
    plus ``residual`` [R, N] (Llama's ``residual + hidden_states``): bf16 packed, added in the
    product's output store (the same two roundings as torch's add), else torch's add."""
    if isinstance(w, torch.Tensor):
        y = F.linear(x2, w)
        return y if residual is None else residual + y
    n, packed = w
    y = x2.new_empty(x2.shape[0], n)
    if x2.dtype == _BF16:
        _OPS.packed_linear_bf16(x2, packed, n, y, 0, residual)
        return y
    _OPS.packed_linear(x2, packed, n, y)
    return y if residual is None else residual + y


def _norm(mod: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor:
    if x2.dtype != _BF16:
        return mod.forward(x2)  # Llama's own code (fp32 norms are not switched)
    out = torch.empty_like(x2)
    _OPS.rms_norm_bf16(x2, mod.weight, mod.variance_epsilon, out)
    return out


def _rotary_op_on_views(p: _Parts, x: torch.Tensor, position_embeddings) -> bool:
    """Whether the bf16 rotary op rotates the fused product's q and k (``_rotary_fast``'s op, on
    their views of the product): bf16 on the packed path with Llama's rotary switched to the op."""
    cos, sin = position_embeddings
    return (p.packed and p.family.apply_rotary_pos_emb is _rotary_fast and x.dtype == cos.dtype == _BF16
            and type(cos) is torch.Tensor and type(sin) is torch.Tensor)


def _rope_in_product(p: _Parts, x2: torch.Tensor, B: int, T: int, position_embeddings) -> bool:
    """Whether the fused qkv product rotates q and k itself (``packed_linear_bf16``'s rotary
    epilogue: the rotary op's arithmetic on each group of 64 columns just stored): where the op
    would rotate the product's views, heads dividing 64 columns, q and k 64-column multiples,
    cos / sin one [B or 1, T, D] table each with contiguous rows."""
    cos, sin = position_embeddings
    D = p.attn.head_dim
    return (_rotary_op_on_views(p, x2, position_embeddings) and sin.dtype == _BF16
            and cos.dim() == 3 and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(2) == 1
            and cos.shape[0] in (1, B) and cos.shape[1] == T and cos.shape[2] == D and 64 % D == 0 and D % 2 == 0
            and (p.q_out + p.k_out) % 64 == 0 and cos.device.type == "cpu")


def _qkv_rotated(p: _Parts, h1: torch.Tensor, qkv_w, position_embeddings) -> torch.Tensor:  # [R, H] -> [R, q+k+v]
    n, packed = qkv_w
    y = h1.new_empty(h1.shape[0], n)
    _OPS.packed_linear_bf16(h1, packed, n, y, 0, None, *position_embeddings, p.q_out + p.k_out)
    return y


def _attention(p: _Parts, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, B: int, T: int, position_embeddings,
               attention_mask, past_key_values, kwargs: dict, rotated: bool = False, cache=None) -> torch.Tensor:
    """Llama's attention (as ``fused_projections`` switches it, or its own) from the projections'
    outputs q, k, v [B T, *] on (``rotated``: q and k already through the rotary): -> [B T, Hq D]
    before o_proj. The cache: ``past_key_values``, or ``cache`` (transformers 5.24 on)."""
    at, family = p.attn, p.family
    D = at.head_dim
    cos, sin = position_embeddings
    views = _rotary_op_on_views(p, q, position_embeddings)  # (true wherever ``rotated`` is)
    if not views:  # each contiguous as its own projection's output is (no copy after torch's linears)
        q, k = q.contiguous(), k.contiguous()
    if past_key_values is None and cache is None:  # (a cache copies v's rows from the fused product's view)
        v = v.contiguous()
    q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    if views and not rotated:  # the rotary reads the fused product's q and k in place (_rotary_fast's op)
        qo, ko = torch.empty(q.shape, dtype=_BF16), torch.empty(k.shape, dtype=_BF16)
        _OPS.rotary_bf16(q, cos, sin, qo)
        _OPS.rotary_bf16(k, cos, sin, ko)
        q, k = qo, ko
    elif not views:
        q, k = family.apply_rotary_pos_emb(q, k, cos, sin)
    kv = cache_update(past_key_values, cache, k, v, at.layer_idx, kwargs)
    if kv is not None:
        k, v = kv
    attend = family.ALL_ATTENTION_FUNCTIONS.get_interface(at.config._attn_implementation,
                                                          family.eager_attention_forward)
    o, _ = attend(at, q, k, v, attention_mask, dropout=0.0, scaling=at.scaling, **kwargs)  # [B, T, Hq, D]
    return o.reshape(B * T, p.q_out)


def _mlp(p: _Parts, h2: torch.Tensor, gate_w, up_w) -> torch.Tensor:  # [R, H] -> [R, I] (before down_proj)
    """SiLU(gate) * up: fused, from one gate-up product (``gate_w`` the pair, ``up_w`` None), else
    from the two torch products as Llama's MLP computes them."""
    if up_w is not None:
        return p.mlp.act_fn(_linear(h2, gate_w)) * _linear(h2, up_w)
    i = p.inter
    if h2.dtype == _BF16 and isinstance(gate_w, tuple) and gate_w[0] == 2 * i and i % 32 == 0:
        return _gate_up_silu(h2, gate_w[1], i)
    gu = _linear(h2, gate_w)  # [R, 2 I]: gate, then up
    if gu.dtype == _BF16:
        out = gu.new_empty(gu.shape[0], i)
        _OPS.silu_mul_bf16(gu[:, :i], gu[:, i:], out)
        return out
    gate, up = gu.split((i, gu.shape[1] - i), -1)
    return p.mlp.act_fn(gate.contiguous()) * up.contiguous()


def _gate_up_silu(h2: torch.Tensor, packed: torch.Tensor, i: int) -> torch.Tensor:  # [R, H] -> [R, I]
    """SiLU(gate) * up in the fused gate-up product's store (``packed_linear_bf16``'s SiLU
    epilogue: ``silu_mul_bf16``'s arithmetic on each group's gate and up columns while they are
    in L1; no pass over the rows of its own); ``i`` a multiple of 32."""
    gu, out = h2.new_empty(h2.shape[0], 2 * i), h2.new_empty(h2.shape[0], i)
    _OPS.packed_linear_bf16(h2, packed, 2 * i, gu, 0, None, None, None, 0, out)
    return out


def lean_block(layer: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, attention_mask,
               past_key_values, attn_kwargs: dict, cache=None) -> torch.Tensor | None:
    """``layer``'s residual block (its input norm where it has one, attention, MLP) on the ops
    directly, [B, T, H] -> [B, T, H], for a layer :func:`use_lean_layers` marked; None where this
    call is not lean (the caller runs its own code). ``attn_kwargs``: what the layer's attention
    passes on to the attention function (``position_ids``, the tree's ``prefix_len`` ...); the KV
    cache: ``past_key_values``, or ``cache`` as transformers 5.24 on names it (its update then
    gets ``attn_kwargs``, as Llama's attention gives them)."""
    p = layer.__dict__.get("_sequoia_lean")
    w = _weights(layer, p, hidden_states, position_embeddings) if p is not None else None
    if w is None:
        return None
    B, T, H = hidden_states.shape
    x = hidden_states.view(B * T, H)
    h1 = x if p.norm1 is None else _norm(p.norm1, x)
    rotated = _rope_in_product(p, h1, B, T, position_embeddings)
    if p.packed:
        (qkv_w, o_w, gate_w, down_w), up_w = w, None
        qkv = _qkv_rotated(p, h1, qkv_w, position_embeddings) if rotated else _linear(h1, qkv_w)
        q, k, v = qkv.split((p.q_out, p.k_out, p.k_out), -1)
    else:
        wq, wk, wv, o_w, gate_w, up_w, down_w = w
        q, k, v = _linear(h1, wq), _linear(h1, wk), _linear(h1, wv)
    a = _attention(p, q, k, v, B, T, position_embeddings, attention_mask, past_key_values, attn_kwargs, rotated,
                   cache)
    h = _linear(a, o_w, residual=x)
    m = _mlp(p, _norm(p.norm2, h), gate_w, up_w)
    return _linear(m, down_w, residual=h).view(B, T, H)


def _lean_forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                  use_cache=False, position_embeddings=None, cache=None, **kwargs) -> torch.Tensor:
    """Llama's ``LlamaDecoderLayer.forward`` (transformers 5.4-5.25: the cache named ``past_key_values``,
    from 5.24 on ``cache``) on the ops directly (module docstring)."""
    out = lean_block(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                     dict(kwargs, position_ids=position_ids, use_cache=use_cache), cache)
    if out is not None:
        return out
    named = ({"cache": cache} if cache is not None else {"past_key_values": past_key_values}
             if past_key_values is not None else {})  # as the caller named it (5.24 on: the old name warns)
    return self._sequoia_lean_fallback(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                       use_cache=use_cache, position_embeddings=position_embeddings, **named, **kwargs)


@contextlib.contextmanager
def use_lean_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block (inside ``use_packed_linears``, ``use_fused_projections`` and, for bf16,
    ``use_fused_bf16``, whose switched parts it reads), ``model``'s qualifying decoder layers run
    :func:`_lean_forward` (module docstring); a qualifying layer without an input norm (not
    Llama's layer forward: an EAGLE-1 head's, whose owner calls :func:`lean_block`) is only
    marked. Yields how many layers were switched or marked; restores them on exit."""
    switched, marked = [], []
    for mod in model.modules() if enabled else ():
        if "_sequoia_lean" in mod.__dict__ or (parts := _lean_parts(mod)) is None:
            continue  # an enclosing block's, or not a layer the lean forward mirrors
        if parts.norm1 is None:
            marked.append(mod)
        elif (done := switch_keeping_own(mod, _lean_forward, "_sequoia_lean_fallback")) is not None:
            switched.append(done)
        else:
            continue  # its forward patched by someone else
        mod._sequoia_lean = parts
    try:
        with forwards_restored(switched, lambda mod: delattr(mod, "_sequoia_lean_fallback")) as n:
            yield n + len(marked)
    finally:
        for mod in marked + [s[0] for s in switched]:
            del mod._sequoia_lean
