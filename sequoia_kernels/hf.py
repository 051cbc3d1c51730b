"""Hugging Face transformers (5.x) drop-in: tree attention for unmodified Llama models.

Importing this module registers the attention implementation ``"sequoia_tree"``::

    import sequoia_kernels.hf as skhf

    model.set_attn_implementation("sequoia_tree")  # or from_pretrained(..., attn_implementation=...)
    cache = skhf.SequoiaCache(model.config, batch_size=B, max_cache_len=S_max, dtype=model.dtype,
                              device=model.device)
    # prompt prefill: a plain causal forward (no tree_mask), then advance the prefix
    model(prompt_ids, position_ids=cache.prefix_len[:, None] + torch.arange(P), **skhf.cache_kw(model, cache))
    cache.commit(P)                        # int, or a [B] tensor when rows have different lengths
    # one Sequoia verification step over a tree of T nodes (depth [T], mask bool [T, T] or [B, T, T])
    logits = model(tree_ids, **skhf.cache_kw(model, cache), **cache.tree_inputs(depth, mask)).logits
    cache.accept(accepted_nodes, num_accepted)   # compact_kv_ + advance, or compact_kv_(cache.tensor, ...)

(``cache_kw``: the cache's keyword, ``past_key_values`` before transformers 5.24, ``cache`` from it on.)

Calling convention (transformers 5.4-5.25): every decoder layer calls
``fn(module, query [B, Hq, T, D], key, value, attention_mask, dropout=..., scaling=..., **kwargs)``
where key/value are what the cache's ``update(k, v, layer_idx)`` returned and ``kwargs``
are the extra keyword arguments given to ``model(...)`` (forwarded unchanged through
``LlamaModel`` and every ``LlamaDecoderLayer``), plus ``position_ids``. It returns
``(attn_output [B, T, Hq, D], None)``. The fn reads:

* ``tree_mask``: packed int32 ``[Bm, T, W]`` (``pack_tree_mask``, pack once per tree) or bool
  ``[T, T]`` / ``[B, T, T]``; absent: a plain causal forward (lower-triangular mask).
* ``sequoia_cache``: the SequoiaCache of the call (``tree_inputs`` passes it): its
  ``prefix_len``, backend and split workspace. Absent (a plain forward such as the prefill):
  the cache whose layer view ``key`` is (``SequoiaCache.update`` returns views that name their
  cache through a weak reference); with another cache (or none) keys are assumed dense.
* ``prefix_len``: int32 ``[B]``; absent: the SequoiaCache's own ``prefix_len``; with no
  SequoiaCache, prefix = S - T (dense keys).
* ``tree_len``: the number of tree keys when the queries are only the newest ``T`` of
  ``tree_len`` tree nodes (a draft growing the tree level by level; ``cache.tree_inputs(...,
  offset=...)`` sets it and where the new keys are written); absent: ``T``.
* ``sequoia_backend``: optional backend override (default: the cache's ``backend``, else the
  op's default for the device).

No dense mask is built: ``"sequoia_tree"`` is deliberately *not* registered in
``AttentionMaskInterface``, so ``create_causal_mask`` returns ``None`` for it (custom
implementations without a mask function get no mask; a 4-D mask passed by the caller is
rejected). Causal forwards longer than ``CAUSAL_CHUNK`` queries (prompt prefill) are run as
chunks of at most ``CAUSAL_CHUNK`` queries, each a causal "tree" after a longer prefix, so the
kernels only ever see T <= 256.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
import transformers
from packaging.version import Version
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

#: the oldest transformers whose Llama-family models this module's cache and attention serve (docs/build.md:
#: the versions tested; before 5.4 the model asks the cache for one sequence length on every forward,
#: which a batch of rows at different lengths does not have)
MIN_TRANSFORMERS = "5.4"
if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
    raise ImportError(f"sequoia_kernels.hf needs transformers >= {MIN_TRANSFORMERS}, found {transformers.__version__}: "
                      f"pip install 'transformers>={MIN_TRANSFORMERS}'")

from .ops.compact_kv import compact_kv_
from .ops.tree_attention import TreeAttentionWorkspace, _tree_attention, tree_attention, tree_attention_workspace
from .per_thread import ATTN_IMPLEMENTATION
from .tree_mask import pack_tree_mask

__all__ = ["ATTN_IMPLEMENTATION", "CAUSAL_CHUNK", "SequoiaCache", "cache_kw", "sequoia_tree_attention", "register",
           "sliding_window_of", "attention_span_of", "text_config"]

CAUSAL_CHUNK = 256  # the largest T the kernels are written for
_SLICE_ROWS = 8  # CPU: batches up to this many rows write new keys with slice copies, not a scatter
_FAST_LAUNCHES = 16  # checked CPU attention launches a cache keeps for replay (one per packed mask in use)
_FAST_SCRATCH_BYTES = 64 << 20  # ... and the scratch they hold at most (large batches of large trees keep fewer)

_CAUSAL_BITS: dict[tuple[int, torch.device], torch.Tensor] = {}


def cache_kw(model: torch.nn.Module, cache) -> dict:
    """``{keyword: cache}`` for ``model(...)``: the keyword ``model``'s forward takes its KV cache by,
    ``cache`` from transformers 5.24 on, ``past_key_values`` before it and wherever a model's own
    code still names it so (remote code, the project's draft and feature head). transformers 5.24
    renamed it, warning about the old name until 5.40, after which a cache passed by it would land
    in ``**kwargs`` and go unread: a forward without its prefix."""
    return {_cache_keyword(type(model)): cache}


@functools.lru_cache(maxsize=None)
def _cache_keyword(cls: type) -> str:
    named = _forward_parameters(cls)
    if not named & {"cache", "past_key_values"}:  # a wrapper's forward (*args, **kwargs): this transformers' name
        from transformers.models.llama.modeling_llama import LlamaModel

        named = _forward_parameters(LlamaModel)
    return "cache" if "cache" in named else "past_key_values"


def text_config(config):
    """The decoder's config of a model's config: its text config where it has one (a multimodal
    model used for text, e.g. ``Gemma3ForConditionalGeneration``: the layers' fields live in
    ``config.text_config``), else the config itself (None stays None)."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def sliding_window_of(config) -> int | None:
    """The sliding attention window of a model's layers, or None: ``config.sliding_window`` where a
    layer slides (Mistral, Phi-3; Qwen2 / Qwen3 with ``use_sliding_window``). The ``"sequoia_tree"``
    attention sees every earlier key, which is such a model's own attention exactly while no query
    position is ``window`` or more past a key: in caches of at most ``window`` positions."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and not any("sliding" in str(t) for t in types):
        return None
    return int(window)


def attention_span_of(config) -> tuple[int, str] | None:
    """(positions, what limits them) within which a model's own attention is what ``"sequoia_tree"``
    computes (every earlier key), or None where it has no such limit: the sliding window
    (:func:`sliding_window_of`), or the chunks of Llama 4's chunked layers (``attention_chunk_size``:
    a query sees the keys of its own chunk of absolute positions, so all of them while every position
    lies in the first chunk), whichever is smaller. ``what`` names it for error messages."""
    spans, config = [], text_config(config)
    window = sliding_window_of(config)
    if window is not None:
        spans.append((window, f"slides a window of {window} tokens (config.sliding_window)"))
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and any("chunked" in str(t) for t in (getattr(config, "layer_types", None) or ())):
        spans.append((int(chunk), f"attends within chunks of {chunk} positions (config.attention_chunk_size)"))
    return min(spans) if spans else None


def _check_attention_kwargs(key: torch.Tensor, kwargs: dict) -> None:
    """A ``ValueError`` for what a model asks of its attention that ``"sequoia_tree"`` does not
    compute (it would return another attention silently): a sliding window that the keys
    (``S``: the cache's length, or the dense keys') exceed, logit soft-capping, attention sinks."""
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise ValueError(f"sequoia_tree attention: the model's attention slides a window of {window} tokens, which "
                         f"it does not implement: it is exact while the keys fit in the window, and there are "
                         f"{key.shape[2]} (a SequoiaCache of at most {window} positions keeps it exact)")
    for name, what in (("softcap", "logit soft-capping"), ("s_aux", "attention sinks")):
        if kwargs.get(name) is not None:
            raise ValueError(f"sequoia_tree attention does not implement {what} (the model passes {name}=...)")


def _forward_parameters(cls: type) -> set[str]:
    try:
        return set(inspect.signature(cls.forward).parameters)
    except (AttributeError, TypeError, ValueError):  # no forward, or one without a signature
        return set()


def _causal_bits(T: int, device: torch.device) -> torch.Tensor:
    key = (T, device)
    bits = _CAUSAL_BITS.get(key)
    if bits is None:
        bits = pack_tree_mask(torch.ones(T, T, dtype=torch.bool, device=device).tril())
        _CAUSAL_BITS[key] = bits
    return bits


def _scratch_bytes(launch) -> int:
    """The bytes of a kept CPU attention launch's scratch (its split partials)."""
    return sum(t.numel() * t.element_size() for t in (launch.partial_out, launch.partial_lse))


def _cache_of(key: torch.Tensor, kwargs: dict) -> "SequoiaCache | None":
    """The SequoiaCache behind this call: the ``sequoia_cache`` keyword argument (``tree_inputs``
    passes it), else the one whose layer view ``key`` is (a plain forward, e.g. the prefill:
    ``SequoiaCache.update`` returns its layer views, which name their cache)."""
    cache = kwargs.get("sequoia_cache")
    if cache is None:
        ref = getattr(key, "sequoia_cache", None)
        cache = ref() if ref is not None else None
    return cache


def sequoia_tree_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, Hq, T, D]
    key: torch.Tensor,  # [B, Hkv, S, D] (SequoiaCache: the whole layer view, S = S_max)
    value: torch.Tensor,  # [B, Hkv, S, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"sequoia_tree"`` attention function (see the module docstring)."""
    if dropout:
        raise ValueError("sequoia_tree attention does not implement dropout (use model.eval())")
    if attention_mask is not None:
        raise ValueError("sequoia_tree attention takes visibility from tree_mask / prefix_len; "
                         "do not pass a 4-D attention_mask")
    _check_attention_kwargs(key, kwargs)
    B, Hq, T, D = query.shape
    S = key.shape[2]
    cache = _cache_of(key, kwargs)
    prefix_len = kwargs.get("prefix_len")
    tree_mask = kwargs.get("tree_mask")
    tree_len = kwargs.get("tree_len")
    backend = kwargs.get("sequoia_backend") or (cache.backend if cache is not None else None)
    validate = False
    if prefix_len is None:
        if cache is not None:
            prefix_len = cache.prefix_len  # validated once per forward by cache.update
        else:  # dense keys (HF DynamicCache or no cache): the new tokens are the last T
            prefix_len = torch.full((B,), S - T, dtype=torch.int32, device=query.device)
    else:
        validate = cache is None or prefix_len is not cache.prefix_len
    if not validate and cache is not None and tree_mask is None and 1 < T <= CAUSAL_CHUNK:
        # every row's prompt from s = 0 (the prefill): torch's causal attention over [0, T), as
        # Hugging Face's "sdpa" computes it. A one-token step takes tree_attention below, as a
        # tree step does: a token's attention output is then the same bits in both (the CPU
        # kernel's batch invariance), so greedy Sequoia decoding emits plain decoding's tokens.
        if cache._common_start() == 0:
            o = torch.nn.functional.scaled_dot_product_attention(
                query, key[:, :, :T], value[:, :, :T], scale=scaling, is_causal=True,
                enable_gqa=Hq != key.shape[1])
            return o.transpose(1, 2), None  # [B, T, Hq, D]
    out = torch.empty(B, T, Hq, D, dtype=query.dtype, device=query.device)  # HF's layout
    if tree_mask is not None or T <= CAUSAL_CHUNK:
        mask = tree_mask if tree_mask is not None else _causal_bits(T, query.device)
        tl = tree_len if tree_mask is not None else None
        fast = cache is not None and not validate and query.device.type == "cpu"
        if fast:  # a checked launch replayed: every layer after the first, and later forwards with this mask
            sig = (query.shape, query.dtype, query.stride(), key.shape, key.stride(), value.stride(), scaling, tl,
                   backend)
            memo = cache._attn_fast.get(id(mask))
            if memo is not None and memo[0] is mask and memo[1] == sig:
                memo[2].run(query, key, value, prefix_len, out.transpose(1, 2))
                return out, None
        workspace = cache.workspace(B, Hq, T, D) if cache is not None else None
        _, launch = _tree_attention(query, key, value, prefix_len, mask, scale=scaling, backend=backend,
                                    out=out.transpose(1, 2), workspace=workspace, validate=validate, tree_len=tl)
        if fast and launch is not None:
            kept = cache._attn_fast
            if len(kept) >= _FAST_LAUNCHES or sum(_scratch_bytes(m[2]) for m in kept.values()) > _FAST_SCRATCH_BYTES:
                kept.clear()
            kept[id(mask)] = (mask, sig, launch)  # (holding the mask: its id stays its own)
        return out, None
    for c0 in range(0, T, CAUSAL_CHUNK):  # long causal forward: chunks after a growing prefix
        c1 = min(T, c0 + CAUSAL_CHUNK)
        ws = cache.workspace(B, Hq, c1 - c0, D) if cache is not None else None
        tree_attention(query[:, :, c0:c1], key, value, prefix_len + c0, _causal_bits(c1 - c0, query.device),
                       scale=scaling, backend=backend, out=out[:, c0:c1].transpose(1, 2), workspace=ws,
                       validate=validate)
    return out, None


def register() -> str:
    """Register ``"sequoia_tree"`` in transformers' AttentionInterface (done on import)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, sequoia_tree_attention)
    return ATTN_IMPLEMENTATION


class SequoiaCacheLayer(CacheLayerMixin):
    """One layer of a SequoiaCache: views of the shared tensor, written at prefix_len."""

    def __init__(self, owner: "SequoiaCache", layer_idx: int):
        super().__init__()
        self._owner = weakref.proxy(owner)
        self.layer_idx = layer_idx
        self.bind(owner)
        self.dtype, self.device = owner.tensor.dtype, owner.tensor.device
        self.batch_size, self.num_heads = owner.tensor.shape[1], owner.tensor.shape[2]
        self.is_initialized = True

    def bind(self, owner: "SequoiaCache") -> None:
        """Views of the owner's tensor: keys/values [B, Hkv, S_max, D], each naming its cache
        (a weak reference) so that the attention function can find it from its key argument."""
        self.keys = owner.tensor[2 * self.layer_idx]
        self.values = owner.tensor[2 * self.layer_idx + 1]
        self.keys.sequoia_cache = self.values.sequoia_cache = weakref.ref(owner)
        self.batch_size = owner.tensor.shape[1]

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner._write(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner._max_len, 0

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length()

    def get_max_length(self) -> int:
        return self._owner._max_len

    get_max_cache_shape = get_max_length  # transformers < 5.13's name of it (abstract there)

    def reset(self) -> None:
        self._owner.reset()

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("SequoiaCache does not support beam search reordering")


class SequoiaCache(Cache):
    """A preallocated KV cache in the compact_kv_ layout plus per-row prefix lengths.

    ``tensor``: ``[2 x layers, B, Hkv, S_max, D]`` (``tensor[2l]`` = layer l's keys,
    ``tensor[2l + 1]`` its values), the cache ``compact_kv_`` compacts in place.
    ``prefix_len``: int32 ``[B]`` on the cache's device: the committed length of each row.
    A forward of T tokens writes them at ``prefix_len[b] .. prefix_len[b] + T - 1`` of every
    layer (a scatter with device indices: no host sync) and leaves ``prefix_len`` alone; the
    caller then advances it (``commit``) or compacts the accepted tree nodes (``accept``).

    ``validate=True`` checks ``prefix_len + T <= S_max`` once per forward (one host sync, at
    layer 0's update); captured loops pass ``validate=False``.
    ``backend``: the tree_attention backend (None: the op's default for the device).
    """

    def __init__(
        self,
        config=None,
        *,
        batch_size: int,
        max_cache_len: int,
        num_layers: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        num_heads: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: str | None = None,
        validate: bool = True,
        max_splits: int = 16,
    ):
        if config is not None:
            config = text_config(config)
            num_layers = num_layers or config.num_hidden_layers
            num_heads = num_heads or config.num_attention_heads
            num_kv_heads = num_kv_heads or getattr(config, "num_key_value_heads", None) or num_heads
            head_dim = head_dim or getattr(config, "head_dim", None) or config.hidden_size // num_heads
        if None in (num_layers, num_kv_heads, head_dim):
            raise ValueError("SequoiaCache: pass a model config or num_layers, num_kv_heads and head_dim")
        self._span = attention_span_of(config)  # (the positions the layers' attention is exact in, why), or None
        self._check_span(max_cache_len)
        device = torch.device(device if device is not None else "cpu")
        self.tensor = torch.zeros(2 * num_layers, batch_size, num_kv_heads, max_cache_len, head_dim,
                                  dtype=dtype, device=device)
        self.prefix_len = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._max_len = int(max_cache_len)
        self.num_heads = num_heads
        self.backend = backend
        self.validate = validate
        self.max_splits = max_splits
        self._index = None  # [B, Hkv, T, D] int64 write positions of the current forward
        self._host_pos = None  # CPU: the rows' first write positions of the current forward (a list)
        self._offset = 0  # new keys go to prefix_len + _offset + [0, T): see tree_inputs
        self._ws: TreeAttentionWorkspace | None = None
        self._ws_key = None
        # id(mask) -> (mask, signature, CpuLaunch): CPU attention launches checked by a forward's
        # first layer, which its other layers and later forwards with the same packed mask object,
        # shapes and strides repeat (a drafter's fixed level masks: each head forward is a first
        # layer); see the attention function
        self._attn_fast: dict = {}
        super().__init__(layers=[SequoiaCacheLayer(self, l) for l in range(num_layers)])

    def _check_span(self, max_cache_len: int) -> None:
        if self._span is not None and max_cache_len > self._span[0]:
            span, what = self._span
            raise ValueError(f"SequoiaCache: the model's attention {what}, which the sequoia_tree attention does not "
                             f"implement; a cache of at most {span} positions keeps it exact, got max_cache_len = "
                             f"{max_cache_len}")

    def _tensor_replaced(self) -> None:
        """After ``tensor`` was replaced (rows kept, room grown): the layers' views of the new one,
        nothing remembered of the old (write indices, checked attention launches)."""
        for layer in self.layers:
            layer.bind(self)
        self._index = None
        self._host_pos = None
        self._attn_fast = {}

    # -- writing ------------------------------------------------------------------------

    def _write(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        L2, B, H, S, D = self.tensor.shape
        if key_states.dim() != 4 or key_states.shape[0] != B or key_states.shape[1] != H or key_states.shape[3] != D \
                or value_states.shape != key_states.shape:
            raise ValueError(f"SequoiaCache.update: key/value states must be [B={B}, Hkv={H}, T, D={D}], got "
                             f"{tuple(key_states.shape)} and {tuple(value_states.shape)}")
        T = key_states.shape[2]
        if T > S:
            raise ValueError(f"SequoiaCache.update: {T} new tokens do not fit in max_cache_len = {S}")
        if layer_idx == 0 or self._index is None or self._index.shape[2] != T:
            end = self._offset + T
            if self.validate:
                p = self.prefix_len.long()
                if bool(((p < 0) | (p + end > S)).any()):
                    raise ValueError(f"SequoiaCache.update: prefix_len + {T} new tokens exceed max_cache_len = {S} "
                                     f"(prefix_len = {self.prefix_len.tolist()}); the cache was not modified")
            pos = self.prefix_len.long()[:, None] + torch.arange(self._offset, end, device=self.tensor.device)  # [B, T]
            self._index = pos[:, None, :, None].expand(B, H, T, D)
            # on the CPU the start positions are read once per forward (no device to sync with):
            # a few rows are written with slice copies, ~4x cheaper than the scatter at T = 1
            starts = pos[:, 0].tolist() if self.tensor.device.type == "cpu" and B <= _SLICE_ROWS else None
            self._host_pos = starts if starts is not None and all(0 <= s0 <= S - T for s0 in starts) else None
        keys, values = self.layers[layer_idx].keys, self.layers[layer_idx].values
        if self._host_pos is not None:
            for b, s0 in enumerate(self._host_pos):
                keys[b, :, s0:s0 + T].copy_(key_states[b])
                values[b, :, s0:s0 + T].copy_(value_states[b])
        else:
            keys.scatter_(2, self._index, key_states.to(keys.dtype))
            values.scatter_(2, self._index, value_states.to(values.dtype))
        return keys, values

    def _common_start(self) -> int | None:
        """On the CPU, in a forward whose rows all write at the same position ``s`` with nothing
        of a tree before them (offset 0): ``s``; else None."""
        pos = self._host_pos
        if pos is None or self._offset != 0 or any(p != pos[0] for p in pos):
            return None
        return pos[0]

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs=None, *args, **kwargs):
        """Write the T new keys/values of layer ``layer_idx`` at prefix_len[b] .. prefix_len[b] + T - 1
        and return the layer's full ``[B, Hkv, S_max, D]`` K and V views."""
        return self._write(layer_idx, key_states, value_states)

    # -- advancing ------------------------------------------------------------------------

    def commit(self, num_tokens: int | torch.Tensor) -> None:
        """After a plain (chain or causal) forward: keep the first ``num_tokens`` new tokens
        (an int, or a ``[B]`` tensor per row) by advancing prefix_len in place."""
        self._offset = 0
        if isinstance(num_tokens, torch.Tensor):
            self.prefix_len.add_(num_tokens.to(device=self.prefix_len.device, dtype=torch.int32))
        else:
            self.prefix_len.add_(int(num_tokens))

    def accept(self, accepted_nodes: torch.Tensor, num_accepted: torch.Tensor, *, validate: bool | None = None) -> None:
        """After a tree forward: move the accepted tree nodes' K/V (tree node indices
        ``accepted_nodes [B, M]``, increasing, the first ``num_accepted[b]`` used) right after
        the prefix with ``compact_kv_`` and advance prefix_len by ``num_accepted``. No host
        sync with ``validate=False``."""
        validate = self.validate if validate is None else validate
        self._offset = 0
        src = self.prefix_len.long()[:, None] + accepted_nodes.to(device=self.prefix_len.device, dtype=torch.int64)
        num = num_accepted.to(device=self.prefix_len.device, dtype=torch.int32)
        compact_kv_(self.tensor, src, self.prefix_len, num, validate=validate)
        self.prefix_len.add_(num)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (int64 [B'] on the cache's device), e.g. when
        sequences finish: later forwards cost nothing for the dropped rows. Copies the kept rows."""
        self.tensor = self.tensor[:, rows].contiguous()
        self.prefix_len = self.prefix_len[rows].contiguous()
        self._ws = None
        self._tensor_replaced()

    def grow(self, max_cache_len: int) -> None:
        """Room for ``max_cache_len`` positions (no change where it has them): a larger zeroed
        tensor holding the positions it had (a loop grows its caches as its rows lengthen, rather
        than zero a whole request's worth up front). Views from :meth:`rows` keep the old storage."""
        L2, B, H, S, D = self.tensor.shape
        if max_cache_len <= S:
            return
        self._check_span(max_cache_len)
        tensor = self.tensor.new_zeros(L2, B, H, max_cache_len, D)  # [2 L, B, Hkv, S_max, D]
        tensor[:, :, :, :S].copy_(self.tensor)
        self.tensor, self._max_len = tensor, int(max_cache_len)
        self._tensor_replaced()

    def rows(self, start: int, stop: int) -> "SequoiaCache":
        """The batch rows ``start .. stop - 1`` as a cache of their own that shares this one's
        storage: its tensor and ``prefix_len`` are views, so a forward through it writes those
        rows' keys and values here and its ``commit`` / ``accept`` advance their prefix lengths
        here (e.g. a ragged batch's prompts prefilled a few rows at a time, without padding)."""
        if not 0 <= start < stop <= self.tensor.shape[1]:
            raise ValueError(f"SequoiaCache.rows: rows {start}..{stop - 1} are not rows of a batch of "
                             f"{self.tensor.shape[1]}")
        view = object.__new__(SequoiaCache)
        view.__dict__.update({k: v for k, v in self.__dict__.items() if k != "layers"})
        view.tensor, view.prefix_len = self.tensor[:, start:stop], self.prefix_len[start:stop]
        view._index = view._host_pos = view._ws = view._ws_key = None
        view._attn_fast = {}
        view._offset = 0
        view.layers = [SequoiaCacheLayer(view, l) for l in range(len(self.layers))]
        return view

    def tree_inputs(self, depth: torch.Tensor, tree_mask: torch.Tensor, *, offset: int = 0,
                    tree_len: int | None = None) -> dict:
        """Keyword arguments of a tree forward: ``position_ids = prefix_len + depth`` ([B, T]),
        the packed mask and this cache's prefix_len. ``depth``: ``[T]`` or ``[B, T]``;
        ``tree_mask``: bool ``[T, tree_len]`` / ``[B, T, tree_len]`` (packed here) or already packed.

        A level-by-level forward (the draft growing a tree in BFS order) passes only the newest
        nodes ``offset .. offset + T - 1`` of a ``tree_len = offset + T`` node tree: their keys are
        written at ``prefix_len + offset + i`` (until the next ``commit``/``accept``) and they
        see the tree keys their ``[T, tree_len]`` mask rows allow."""
        depth = depth.to(self.prefix_len.device)
        packed = pack_tree_mask(tree_mask) if tree_mask.dtype == torch.bool else tree_mask
        T = depth.shape[-1]
        tree_len = offset + T if tree_len is None else int(tree_len)
        if offset < 0 or tree_len != offset + T:
            raise ValueError(f"SequoiaCache.tree_inputs: the queries must be the last T = {T} of tree_len = "
                             f"{tree_len} nodes (offset = {offset})")
        self._offset = int(offset)
        self._index = None
        self._host_pos = None
        return {
            "position_ids": self.prefix_len.long()[:, None] + depth.long().view(-1, depth.shape[-1]),
            "tree_mask": packed.to(self.prefix_len.device),
            "prefix_len": self.prefix_len,
            "tree_len": tree_len,
            "sequoia_cache": self,
        }

    # -- scratch -------------------------------------------------------------------------

    def workspace(self, B: int, Hq: int, T: int, D: int) -> TreeAttentionWorkspace | None:
        """Split buffers shared by all layers, grown (never shrunk) on demand; GPU only."""
        if self.tensor.device.type != "cuda":
            return None
        need = B * Hq * T * self.max_splits
        if self._ws is None or self._ws_key[0] < need or self._ws_key[1] != D:
            self._ws = tree_attention_workspace(B, Hq, T, D, self.max_splits, self.tensor.device)
            self._ws_key = (need, D)
        return self._ws

    # -- transformers Cache API ----------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The common prefix length (one host sync). transformers calls this only when
        ``position_ids`` is not passed; rows of different lengths need explicit position_ids."""
        lens = self.prefix_len.tolist()
        if len(set(lens)) > 1:
            raise ValueError(f"SequoiaCache: rows have different prefix lengths {lens}; pass position_ids "
                             "(e.g. cache.prefix_len[:, None] + depth) to the model")
        return int(lens[0]) if lens else 0

    @property
    def max_cache_len(self) -> int:  # transformers' Cache deprecates it; kept without the warning
        return self._max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._max_len, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_len

    def reset(self) -> None:
        """Forget everything: prefix_len = 0 (the tensor's bits are left as they are)."""
        self.prefix_len.zero_()
        self._index = None
        self._host_pos = None

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("SequoiaCache: set prefix_len (or use accept) instead of crop")

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("SequoiaCache does not support beam search reordering")


register()
