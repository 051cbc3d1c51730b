"""The one way the package patches models, for the duration of a block: the ``"sequoia_tree"``
attention implementation (our preallocated caches only work with it) and, where it pays, the
few-row linears on ``packed_linear`` (``sequoia_kernels.ops.packed_linear.use_packed_linears``:
the packed weights stay with the model for later blocks) and a bf16 model's RMSNorm and SiLU
MLPs on fused row ops (``sequoia_kernels.ops.fused_bf16.use_fused_bf16``), its attention's q / k / v
and its MLPs' gate / up projections in one packed call each (``fused_projections``), its rotary cos / sin
read from per-position tables (``rope_tables.use_rope_tables``, CPU), and its decoder layers, once all
their parts are switched, as direct calls of those ops (``sequoia_kernels.ops.lean_layers``: the same
bits without ~300 module calls a forward). Each model is restored on exit, so plain Hugging Face
calls on it behave afterwards exactly as before; the switches hold for the thread in the block
only (``sequoia_kernels.per_thread``): plain calls from other threads meanwhile run the model as
it was. One block at a time in a process: blocks entered from several threads take turns
(``PATCH_LOCK``), so that no thread restores a model another is decoding with. Used by the
decoding loop (``generate.SequoiaGenerator``) and the profiler (``tools.profile_latency``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Iterator

import torch

import sequoia_kernels.hf  # noqa: F401  (registers the "sequoia_tree" attention implementation)
from sequoia_kernels.hf import text_config
from sequoia_kernels.ops.fused_bf16 import use_fused_bf16  # noqa: E402
from sequoia_kernels.ops.fused_projections import use_fused_projections  # noqa: E402
from sequoia_kernels.ops.lean_layers import use_lean_layers  # noqa: E402
from sequoia_kernels.ops.packed_linear import MAX_ROWS, use_packed_linears  # noqa: E402
from sequoia_kernels.per_thread import use_tree_attention  # noqa: E402

from .logs import log
from .rope_tables import use_rope_tables

__all__ = ["sequoia_models", "PATCH_LOCK"]

# held by a thread within a sequoia_models block (re-entrant: a block may open another): a second
# thread's block waits (a server calling generate() from a thread per request: the calls take turns)
PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def sequoia_models(*models, packed_linears: bool, max_rows: int = MAX_ROWS) -> Iterator[None]:
    """Within the block every distinct model of ``models`` (None entries skipped) runs, for the
    calling thread, on ``"sequoia_tree"`` attention (``use_tree_attention``), its fp32 / bf16 CPU
    linears on ``packed_linear`` when ``packed_linears`` (calls of up to ``max_rows`` rows: the
    batch times the largest tree), and with them its bf16 CPU RMSNorm and SiLU MLPs on the fused
    row ops (``use_fused_bf16``) and its q / k / v and gate / up projections fused
    (``use_fused_projections``), its static RoPE from tables (``use_rope_tables``, CPU tensors) and
    its decoder layers lean (``use_lean_layers``); then each is switched back as it was. Holds
    ``PATCH_LOCK``."""
    with PATCH_LOCK:  # one block at a time: see the module docstring
        unique = []
        for m in models:
            if m is not None and all(m is not u for u in unique):
                unique.append(m)
        for m in unique:
            _check_layers(m)  # ValueError before any switch
            _check_weights(m)
        with contextlib.ExitStack() as packed:
            for m in unique:
                packed.enter_context(_uncompiled(m))
                packed.enter_context(use_tree_attention(m))
                packed.enter_context(use_packed_linears(m, packed_linears, max_rows))
                packed.enter_context(use_fused_bf16(m, packed_linears))
                packed.enter_context(use_fused_projections(m, packed_linears))
                packed.enter_context(use_rope_tables(m))
                packed.enter_context(use_lean_layers(m))
            yield


@contextlib.contextmanager
def _uncompiled(model) -> Iterator[None]:
    """The model's own (eager) forward within the block: a compiled one set aside
    (``model.forward = torch.compile(model.forward)``, ``model.compile()``), restored on exit.
    The tree loop changes its shapes every step and calls our ops in every layer: through the
    compiled forward a call ran 13x slower than eagerly, warm (guards failing, graphs breaking)."""
    forward = model.__dict__.get("forward")
    compiled_forward = forward is not None and hasattr(forward, "_torchdynamo_orig_callable")
    compiled_call = model.__dict__.get("_compiled_call_impl")
    if compiled_forward or compiled_call is not None:
        log.info("the model's compiled forward is set aside for the tree loop (eager with our kernels)")
    if compiled_forward:
        del model.forward  # the class's forward
    if compiled_call is not None:
        model._compiled_call_impl = None
    try:
        yield
    finally:
        if compiled_forward:
            model.forward = forward
        if compiled_call is not None:
            model._compiled_call_impl = compiled_call


def _check_weights(model) -> None:
    """ValueError naming the first layer whose weight is not a tensor: a module quantized by
    ``torch.ao.quantization.quantize_dynamic`` (its ``weight()`` a method) scales its input by
    the range of every row in the call, so a token's logits would depend on the tree verified
    with it, and the loop's switches (``packed_linear``, fused and lean layers) read tensors."""
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if w is not None and not isinstance(w, torch.Tensor):
            raise ValueError(f"{name or type(model).__name__} is a {type(mod).__module__}.{type(mod).__name__}, whose "
                             "weight is not a tensor: the tree loop runs models whose layers hold tensors (a "
                             "dynamically quantized linear scales its input by every row of the call, so a token's "
                             "logits would depend on the tree around it)")


ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")  # config.layer_types we verify with


def _check_layers(model) -> None:
    """ValueError naming what the tree attention cannot stand in for: an attention computed in the
    model's own code, not through transformers' ``AttentionInterface`` (Bloom, MPT, CodeGen; GPT-J
    and Falcon before transformers 5.25: a GPT-J target decoded other tokens than its own without a
    word), layers that carry a recurrent state from token to token (Mamba, gated linear attention,
    short convolutions: Jamba, Qwen3-Next, LFM2; a tree's branches cannot share one state), or
    multi-latent attention (DeepSeek-V2 / V3: keys and values of other widths than the cache's
    heads; these two raised deep in the first forward before, with messages about the caches)."""
    if not _takes_attention_interface(model):
        raise ValueError(f"{type(model).__name__} computes its attention in its own code ({type(model).__module__}), "
                         "not through transformers' AttentionInterface: the tree attention cannot take its place "
                         "(its tokens would not see the tree's mask)")
    config = text_config(getattr(model, "config", None))
    kinds = sorted({str(t) for t in getattr(config, "layer_types", None) or ()} - set(ATTENTION_LAYERS))
    if kinds or getattr(model, "_is_stateful", False):
        what = f"its {', '.join(kinds)} layers carry" if kinds else "its layers carry"
        raise ValueError(f"{type(model).__name__}: {what} a recurrent state from token to token (Mamba, linear "
                         "attention, convolutions), which the branches of a tree cannot share: the tree loop "
                         "verifies models whose layers are attention layers")
    if getattr(config, "v_head_dim", None) is not None and getattr(config, "kv_lora_rank", None) is not None:
        keys = getattr(config, "qk_head_dim", "?")
        raise ValueError(f"{type(model).__name__}: multi-latent attention (keys of {keys} and values of "
                         f"{config.v_head_dim} per head) is not supported by the tree loop's caches and "
                         "attention")


def _takes_attention_interface(model) -> bool:
    """Whether a transformers model's attention goes through ``ALL_ATTENTION_FUNCTIONS`` (where the
    ``"sequoia_tree"`` implementation plugs in): its class says so (``_supports_attention_backend``),
    or a module of its class hierarchy calls it (StableLM does without saying). Other modules (our
    feature heads, wrappers) are not judged here."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or getattr(model, "_supports_attention_backend", False):
        return True
    return _modules_call_attention_interface(type(model))


@functools.lru_cache(maxsize=None)
def _modules_call_attention_interface(model_class: type) -> bool:
    from transformers import PreTrainedModel

    for cls in model_class.__mro__:
        if not issubclass(cls, PreTrainedModel) or cls.__module__.startswith("transformers.modeling_utils"):
            continue
        try:
            if "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[cls.__module__]):
                return True
        except (KeyError, OSError, TypeError):  # no source to read: not ours to refuse
            return True
    return False
