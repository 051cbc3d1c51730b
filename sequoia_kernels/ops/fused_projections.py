"""Fused projections: a Llama attention's q, k and v projections, and an MLP's gate and up, as
one ``packed_linear`` call over their weights concatenated (CPU, inside the decoding loop's
patching).

A SmolLM2-135M forward on the packed linears made 216 ``packed_linear`` calls, each with ~10 us
of fixed cost (the module call, the wrapper, the dispatch, the parallel region) next to ~3-10 us
of weight reading at one row: fused, 126. ``packed_linear`` computes every output feature as one
chain over k in a fixed order, whatever the call's other features, so each projection's values
are bitwise what its own call gives (``tests/test_fused_projections.py``), and the model's too.

Within :func:`use_fused_projections` an attention module whose ``forward`` is Llama's (the same
source: Hugging Face's "copied from" families qualify) computes q, k, v in one call, and an MLP
whose ``forward`` is Llama's computes gate and up in one (a bf16 MLP switched by
``fused_bf16.use_fused_bf16`` fuses through :func:`gate_up` too). The concatenated weight is packed
at the first call, repacked when a projection's weight changes, and kept with the module for later
blocks as the packed linears' copies are (``release_packed_linears`` frees both; the projections'
own packed copies are then never made); a call the packed path would not take (too many rows,
autograd, another device or dtype), a projection offloaded by accelerate or a tensor-parallel
shard runs the module's own code.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

import torch

from .fused_bf16 import llama_source_digest, rotary_reads_views
from .packed_linear import (_HOSTS, _offloaded, forwards_restored, linear_packed, pack_weight, packed_rows,
                            switch_keeping_own, weight_key)

__all__ = ["use_fused_projections", "fused_linear", "gate_up", "QKV", "GATE_UP"]

QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
_NAMES = {"_sequoia_cat_" + "_".join(n): n for n in (QKV, GATE_UP)}  # the fused copy's attribute -> projections
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# The Llama forwards mirrored below, by hashes of their source: transformers 5.4-5.23, and
# 5.24-5.25's attention (the cache's keyword renamed ``cache``, its update given the attention's
# keyword arguments); under another version whose LlamaAttention / LlamaMLP forward reads
# differently nothing is switched.
_MIRRORED = {"attention": ("9ec290e693aa2519", "bcb1c27cdcf3820f"), "mlp": ("58d86e5bebfbb415",)}


@functools.lru_cache(maxsize=None)
def _mirrors(kind: str) -> bool:
    return llama_source_digest(kind) in _MIRRORED[kind]


def cache_update(past_key_values, cache, key_states, value_states, layer_idx: int, kwargs: dict):
    """Write a layer's new keys and values as the mirrored attention does: into ``cache`` with
    the attention's ``kwargs`` (transformers 5.24 on), or ``past_key_values`` (before); None
    where there is no cache (its own keys and values are the layer's)."""
    if cache is not None:
        return cache.update(key_states, value_states, layer_idx, kwargs=kwargs)
    if past_key_values is not None:
        return past_key_values.update(key_states, value_states, layer_idx)
    return None


def _fusable(mod: torch.nn.Module, names: tuple[str, ...]) -> bool:
    """The projections ``names`` of ``mod``: plain host ``nn.Linear`` modules of one input width,
    dtype and bias kind, not offloaded, each switched to the packed path (``use_packed_linears``)."""
    lins = [getattr(mod, n, None) for n in names]
    if not all(type(lin) is torch.nn.Linear for lin in lins):
        return False
    w0 = lins[0].weight
    return all(type(lin.weight) in _PLAIN and lin.weight.device.type in _HOSTS and lin.weight.dtype == w0.dtype
               and lin.in_features == lins[0].in_features and (lin.bias is None) == (lins[0].bias is None)
               and "_sequoia_max_rows" in lin.__dict__ and not _offloaded(lin) for lin in lins)


def fused_linear(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [..., K] times the projections :func:`use_fused_projections` found fusable in ``mod``,
    concatenated, [..., sum N] (+ their biases), in one packed call; None outside such a block or
    where the packed path would not take the call (the caller runs the projections one by one).
    Per call only the cheap checks: the rows, and the weights' versions (modified in place: the
    concatenation is packed anew)."""
    spec = mod.__dict__.get("_sequoia_fuse")
    if spec is None:
        return None
    attr, weights, max_rows = spec
    rows = packed_rows(x, weights[0], max_rows)
    if rows is None:
        return None
    key = tuple(weight_key(w) for w in weights)
    got = mod.__dict__.get(attr)
    if got is None or got[0] != key:  # first call, or a weight modified: concatenated and packed anew
        lins = [getattr(mod, n) for n in _NAMES[attr]]
        w = torch.cat([w.detach() for w in weights])  # [sum N, K]
        b = torch.cat([lin.bias.detach() for lin in lins]) if lins[0].bias is not None else None
        got = (key, w.shape[0], b, pack_weight(w))
        mod.__dict__[attr] = got
    y = linear_packed(x, got[3], got[1], rows)
    if got[2] is not None:
        y += got[2]
    return y


def gate_up(mlp: torch.nn.Module, x: torch.Tensor, views: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLP's ``gate_proj(x), up_proj(x)``: one fused call where it can (:func:`fused_linear`),
    each contiguous as its own call's result is (an elementwise op on a strided view may take a
    scalar loop, with other roundings than the vectorised one: measured on SiLU in fp32), or with
    ``views`` the two halves of the fused output as they are (for a consumer that reads strided
    rows: the fused bf16 SiLU-and-multiply; ~6 us a copy saved, 2 per layer)."""
    gu = fused_linear(mlp, x)
    if gu is None:
        return mlp.gate_proj(x), mlp.up_proj(x)
    gate, up = gu.split((mlp.gate_proj.out_features, mlp.up_proj.out_features), -1)
    return (gate, up) if views else (gate.contiguous(), up.contiguous())


def _attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       past_key_values=None, cache=None, **kwargs):
    """Llama's ``LlamaAttention.forward`` (transformers 5.4-5.25: the cache named ``past_key_values``,
    from 5.24 on ``cache``) with q, k, v from one fused call."""
    qkv = fused_linear(self, hidden_states)
    if qkv is None:  # the cache is the 4th parameter of both
        return self._sequoia_fused_proj_fallback(hidden_states, position_embeddings, attention_mask,
                                                 cache if cache is not None else past_key_values, **kwargs)
    family = sys.modules[type(self).__module__]  # its module's rotary and attention functions
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    # each contiguous, as its own projection's result is: what follows sees the same strides (an
    # attention kernel may take another path for other strides, with other roundings); but for
    # the fused bf16 rotary, which reads any row strides and writes contiguous results
    cos, sin = position_embeddings
    q, k, v = qkv.split((self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features), -1)
    if not rotary_reads_views(family.apply_rotary_pos_emb, qkv, cos):
        q, k = q.contiguous(), k.contiguous()
    query_states, key_states, value_states = (t.view(hidden_shape).transpose(1, 2) for t in (q, k, v.contiguous()))
    query_states, key_states = family.apply_rotary_pos_emb(query_states, key_states, cos, sin)
    kv = cache_update(past_key_values, cache, key_states, value_states, self.layer_idx, kwargs)
    if kv is not None:
        key_states, value_states = kv
    attention_interface = family.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                       family.eager_attention_forward)
    attn_output, attn_weights = attention_interface(
        self, query_states, key_states, value_states, attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs)
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Llama's ``LlamaMLP.forward`` with gate and up from one fused call."""
    gate, up = gate_up(self, x)
    return self.down_proj(self.act_fn(gate) * up)


@contextlib.contextmanager
def use_fused_projections(model: torch.nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within the block (inside ``use_packed_linears``, whose switched projections it fuses),
    ``model``'s Llama-family attention modules compute q, k, v in one packed call and its MLPs not
    already switched (``use_fused_bf16``) gate and up in one (module docstring). Yields how many
    modules were switched; restores them on exit (the fused packed weights stay with them)."""
    from .fused_bf16 import _is_llamas

    switched, marked = [], []
    for mod in model.modules() if enabled else ():
        if _is_llamas(type(mod), "attention") and _mirrors("attention") and _fusable(mod, QKV):
            fn, names = _attention_forward, QKV
        elif _is_llamas(type(mod), "mlp") and _mirrors("mlp") and _fusable(mod, GATE_UP):
            fn, names = _mlp_forward, GATE_UP
        else:
            continue
        if "_sequoia_fuse" in mod.__dict__:
            continue  # an enclosing block's
        lins = [getattr(mod, n) for n in names]
        mod._sequoia_fuse = ("_sequoia_cat_" + "_".join(names), tuple(lin.weight for lin in lins),
                             lins[0]._sequoia_max_rows)
        marked.append(mod)
        # None: patched by someone else (use_fused_bf16's MLP: it fuses through gate_up)
        if (done := switch_keeping_own(mod, fn, "_sequoia_fused_proj_fallback")) is not None:
            switched.append(done)
    try:
        with forwards_restored(switched, lambda mod: delattr(mod, "_sequoia_fused_proj_fallback")) as n:
            yield n
    finally:
        for mod in marked:
            del mod._sequoia_fuse
