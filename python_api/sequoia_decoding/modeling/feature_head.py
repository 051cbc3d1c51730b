"""Feature-conditioned draft heads: a decoder layer (or a few) that reads the target's own hidden states
(EAGLE, arXiv 2401.15077; EAGLE-2, 2406.16858; EAGLE-3, 2503.01840), in the published layouts.

A head at draft position ``p`` takes the target's feature of token ``x_p`` (or, deeper in a
tree, its own prediction of it) and the embedding of token ``x_{p+1}``, predicts the feature of
``x_{p+1}`` and reads the next token's logits out of it. Two layouts, the state-dict key names
and config fields of the published checkpoints:

* **EAGLE-1/2** (``kind="eagle1"``): feature = the target's last hidden state after its final
  norm (what its LM head reads). ``fc`` ``[H, 2H]`` (+ bias) over ``cat(embedding, feature)``,
  then ``layers.0`` (a Llama decoder layer without its input norm); the predicted feature is read
  out through the *target's* LM head (frozen, shared). Keys: ``fc.*``, ``layers.0.self_attn.*``,
  ``layers.0.mlp.*``, ``layers.0.post_attention_layernorm.weight`` (``embed_tokens.weight``
  optional). This project's own heads use this layout plus a ``d2t`` map (below), and may read
  more of the target (``eagle_config.eagle_aux_hidden_state_layer_ids`` ending in ``-1``, e.g.
  ``[2, 15, -1]``): ``fc`` ``[H, H + k H]`` over ``cat(embedding, RMS-normalized earlier states,
  final feature)`` (the earlier states are the raw residual stream, with outliers in the
  thousands: each is scaled to unit RMS, no weight). Deeper levels feed the head's own
  prediction as the final feature and zeros for the earlier ones (:meth:`FeatureHead.own_features`).
  Such a head may also read out through rows of its own (``lm_head.weight`` ``[Vd, H]``, no norm:
  trained from the target's rows of its tokens) instead of borrowing the target's, and may stack
  more layers after ``layers.0`` (``layers.1`` ..., Llama decoder layers with their input norms;
  ``num_hidden_layers`` in its config, counted from the weights at :meth:`load`).
* **EAGLE-3** (``kind="eagle3"``): the target's feature = its hidden states entering three
  layers (``eagle_config.eagle_aux_hidden_state_layer_ids``; default ``[2, L // 2, L - 3]``),
  fused by ``fc`` ``[H, 3 H_t]``; ``midlayer`` attends over ``cat(input_layernorm(embedding),
  hidden_norm(feature))`` (q/k/v ``[*, 2H]``), and reads out through its own ``norm`` and
  ``lm_head`` over a reduced vocabulary. Deeper levels feed the head's own output (already
  ``H`` wide, no ``fc``).

Vocabulary maps (both layouts): ``d2t`` ``[Vd]`` int64 offsets, draft id ``i`` is target id
``i + d2t[i]`` (EAGLE-3's convention; ``t2d`` is read and checked, not needed). Logits are
returned over the target's vocabulary, ``-inf`` outside the draft's tokens (q = 0 there: exact
verification handles it, those tokens stay in the residual).

Feature indices (``feature_layers``) index Hugging Face's ``output_hidden_states`` tuple:
``i`` = the state entering decoder layer ``i``, ``-1`` = the final normed state.

A head is :meth:`bind`-ed to its target once (shapes checked, ``ValueError`` naming both sides,
nothing changed on failure): it borrows the target's embedding (unless it has its own) and,
for EAGLE-1 without rows of its own, the target's LM head rows of its vocabulary.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from sequoia_kernels.hf import text_config
from sequoia_kernels.ops.lean_layers import lean_block

__all__ = ["EAGLE1", "EAGLE3", "FeatureHead", "eagle1_layers", "is_feature_head_folder"]

EAGLE1, EAGLE3 = "eagle1", "eagle3"
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def eagle1_layers(layers) -> tuple[int, ...]:
    """``layers`` as an EAGLE-1 head's feature layers (a tuple), or ``ValueError``: they must be
    distinct and end with the final feature -1, which the head predicts."""
    layers = tuple(layers)
    if not layers or layers[-1] != -1 or len(set(layers)) != len(layers):
        raise ValueError(f"an EAGLE-1 head's feature layers must be distinct and end with the final feature -1 "
                         f"(what it predicts), got {list(layers)}")
    return layers


def _layer_config(config: dict, kind: str):
    from transformers import LlamaConfig

    keep = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "eagle_config")}
    n = int(config.get("num_hidden_layers", 1)) if kind == EAGLE1 else 1
    if n < 1:
        raise ValueError(f"FeatureHead: num_hidden_layers must be >= 1, got {n}")
    keep.update(num_hidden_layers=n, attn_implementation=config.get("attn_implementation", "sdpa"))
    return LlamaConfig(**keep)


class FeatureHead(nn.Module):
    """One EAGLE-style draft head (module docstring). ``config``: the layer's ``LlamaConfig``
    fields as a dict (``hidden_size``, heads, ``intermediate_size``, ``rms_norm_eps``, RoPE,
    ``vocab_size`` = the target's vocabulary; EAGLE-3 also ``draft_vocab_size`` and optionally
    ``target_hidden_size``); ``feature_layers``: the target's hidden-state indices it reads
    (EAGLE-1: ``(-1,)`` unless given, ending in ``-1``; EAGLE-3 None = the default three, fixed
    at :meth:`bind`)."""

    def __init__(self, config: dict, kind: str = EAGLE1, *, feature_layers=None, bias: bool | None = None,
                 own_embedding: bool = False, own_readout: bool = False):
        super().__init__()
        if kind not in (EAGLE1, EAGLE3):
            raise ValueError(f"FeatureHead: kind must be {EAGLE1!r} or {EAGLE3!r}, got {kind!r}")
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer, LlamaRMSNorm,
                                                              LlamaRotaryEmbedding)

        self.kind, self.raw_config = kind, dict(config)
        self.config = _layer_config(config, kind)
        H, V = self.config.hidden_size, self.config.vocab_size
        Ht = int(config.get("target_hidden_size") or H)
        bias = bool(config.get("bias", kind == EAGLE1)) if bias is None else bias
        self.feature_layers = tuple(feature_layers) if feature_layers else ((-1,) if kind == EAGLE1 else None)
        if kind == EAGLE1:
            eagle1_layers(self.feature_layers)
        elif own_readout:
            raise ValueError("FeatureHead: own_readout is for EAGLE-1 heads (an EAGLE-3 head always has its own)")
        self.target_hidden_size = Ht
        vd = int(config.get("draft_vocab_size") or V)
        if own_embedding:
            self.embed_tokens = nn.Embedding(V, H)
        if kind == EAGLE1:
            self.fc = nn.Linear(H + len(self.feature_layers) * H, H, bias=bias)
            layers = [LlamaDecoderLayer(self.config, i) for i in range(self.config.num_hidden_layers)]
            del layers[0].input_layernorm  # EAGLE-1's layer 0 reads fc's output unnormalized
            self.layers = nn.ModuleList(layers)  # this project's extension: more layers, Llama's own
            if own_readout:  # this project's extension: rows of its own in place of the target's LM head's
                self.lm_head = nn.Linear(H, vd, bias=False)
        else:
            self.fc = nn.Linear(3 * Ht, H, bias=bias)
            layer = LlamaDecoderLayer(self.config, 0)
            a, hd = layer.self_attn, layer.self_attn.head_dim
            a.q_proj = nn.Linear(2 * H, self.config.num_attention_heads * hd, bias=self.config.attention_bias)
            a.k_proj = nn.Linear(2 * H, self.config.num_key_value_heads * hd, bias=self.config.attention_bias)
            a.v_proj = nn.Linear(2 * H, self.config.num_key_value_heads * hd, bias=self.config.attention_bias)
            layer.hidden_norm = LlamaRMSNorm(H, eps=self.config.rms_norm_eps)
            self.midlayer = layer
            self.norm = LlamaRMSNorm(H, eps=self.config.rms_norm_eps)
            self.lm_head = nn.Linear(H, vd, bias=False)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))  # draft id i -> target id i + d2t[i]
        self.rotary = LlamaRotaryEmbedding(self.config)
        self._embed_weight = None  # set by bind: the embedding rows [V, H] (the target's unless own)
        self._readout = None  # set by bind (EAGLE-1): the target head's rows of the draft tokens [Vd, H]
        self._readout_packed = None  # packed_copy of the readout, made at the first packed call
        self._scatter_ids = None  # set by bind: target ids of the draft ids [Vd] (None: the identity map)
        self._bound_dtype = None  # the head's dtype when bound (the readout rows are in it)
        self._bound_to = None

    # -- the parts the decoding loop sees ----------------------------------------------------

    @property
    def full_vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def feature_width(self) -> int:
        """Width of the target features the head reads (EAGLE-3: three layers concatenated)."""
        return len(self.feature_layers or (0, 0, 0)) * self.target_hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.numel())

    @property
    def vocab_map(self) -> torch.Tensor | None:
        """[Vd] int64, once bound: the target id of each of :meth:`draft_logits`' columns; None
        when they are the target's whole vocabulary in order (no map)."""
        return self._scatter_ids

    def token_ids(self) -> torch.Tensor:  # [Vd] int64: the target id of each draft id
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def set_attn_implementation(self, impl: str) -> None:
        self.config._attn_implementation = impl

    def get_output_embeddings(self):
        return None

    def bind(self, target) -> None:
        """Check this head against ``target`` (``ValueError`` naming both sides; nothing changes
        on failure) and borrow what it reads from it. Idempotent for the same target."""
        dtype = self.fc.weight.dtype
        if self._bound_to is not None and self._bound_to() is target and self._bound_dtype == dtype:
            return
        tc = text_config(target.config)  # a multimodal target's decoder
        L, Ht, V = int(tc.num_hidden_layers), int(tc.hidden_size), _target_vocab(target)
        layers = self.feature_layers or (2, L // 2, L - 3)
        if V != self.full_vocab_size:
            raise ValueError(f"draft head vocabulary {self.full_vocab_size} != target vocabulary {V}")
        if Ht != self.target_hidden_size:
            raise ValueError(f"draft head reads target features of width {self.target_hidden_size}, the target's "
                             f"hidden size is {Ht}")
        if any(not (-1 <= i <= L - 1) for i in layers) or (self.kind == EAGLE3 and len(layers) != 3):
            raise ValueError(f"draft head feature layers {list(layers)} do not fit a target of {L} layers "
                             f"(indices 0..{L - 1}, -1 the final feature; EAGLE-3 reads three)")
        ids = self.token_ids()
        if int(ids.min()) < 0 or int(ids.max()) >= V or torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"draft head vocabulary map (d2t, {ids.numel()} tokens) does not fit the target "
                             f"vocabulary of {V} tokens (ids out of range or repeated)")
        if hasattr(self, "embed_tokens"):
            embed = self.embed_tokens.weight
        else:
            embed = _whole(target.get_input_embeddings().weight)  # [V, Ht]
            if embed.shape[1] != self.config.hidden_size:
                raise ValueError(f"draft head width {self.config.hidden_size} != the target embedding's "
                                 f"{embed.shape[1]} (and the head has no embedding of its own)")
        identity = ids.numel() == V and bool((self.d2t == 0).all())
        readout = None
        if self.kind == EAGLE1 and not self.own_readout:
            head = _whole(target.get_output_embeddings().weight)  # [V, Ht]
            if head.shape[1] != self.config.hidden_size:
                raise ValueError(f"draft head width {self.config.hidden_size} != the target LM head's {head.shape[1]}")
            readout = head if identity else head[ids.to(head.device)]
        self.feature_layers = tuple(layers)
        self._scatter_ids = None if identity else ids
        # plain tensors, borrowed (never parameters of the head): views of the target's when the
        # dtypes agree, else one copy in the head's dtype (a head may run in fp32 beside a bf16 target)
        self._embed_weight = embed.detach()
        self._readout = readout.detach().to(dtype) if readout is not None else None
        self._bound_dtype = dtype
        self._bound_to = weakref.ref(target)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor, *, fused: bool, position_ids: torch.Tensor,
                past_key_values=None, **attn_kwargs) -> torch.Tensor:
        """ids [B, T] (target vocabulary), feats [B, T, F]: the feature of each token's
        predecessor (``fused=False``: the target's raw features, ``len(feature_layers) x H_t``
        wide; ``True``: the head's own predictions, ``H`` wide) -> predicted features [B, T, H]."""
        from sequoia_kernels.hf import cache_kw

        if self._embed_weight is None:
            raise ValueError("FeatureHead: bind(target) first (it borrows the target's embedding)")
        feats = feats.to(self.fc.weight.dtype)
        emb = F.embedding(ids, self._embed_weight).to(feats.dtype)  # [B, T, H]
        pe = self.rotary(emb, position_ids)
        attn = (self.midlayer if self.kind == EAGLE3 else self.layers[0]).self_attn  # its keyword for the cache
        kw = dict(position_embeddings=pe, attention_mask=attn_kwargs.pop("attention_mask", None),
                  **cache_kw(attn, past_key_values), position_ids=position_ids, **attn_kwargs)
        if self.kind == EAGLE3:
            layer = self.midlayer
            x = feats if fused else self.fc(feats)
            h = x + layer.self_attn(torch.cat([layer.input_layernorm(emb), layer.hidden_norm(x)], -1), **kw)[0]
            return h + layer.mlp(layer.post_attention_layernorm(h))
        # own predictions: zeros for the earlier layers, which the scaling would leave zero
        x = self.fc(torch.cat([emb, self.own_features(feats) if fused else self._normed(feats)], -1))  # [B, T, H]
        lean_kw = dict(attn_kwargs, position_ids=position_ids)
        for layer in self.layers:
            out = lean_block(layer, x, pe, kw["attention_mask"], past_key_values, lean_kw)
            if out is None:  # not inside the loop's patching (where the ops run it: the same bits)
                norm = getattr(layer, "input_layernorm", None)  # layer 0 has none
                h = x + layer.self_attn(x if norm is None else norm(x), **kw)[0]
                out = h + layer.mlp(layer.post_attention_layernorm(h))
            x = out
        return x

    def own_features(self, h: torch.Tensor) -> torch.Tensor:  # EAGLE-1: [..., H] -> [..., F]
        """The raw-feature input standing for the head's own prediction ``h`` (a tree's deeper
        levels): ``h`` as the final feature, zeros for the earlier layers an EAGLE-1 head reads."""
        extra = self.feature_width - h.shape[-1]
        return F.pad(h, (extra, 0)) if extra else h

    def _normed(self, feats: torch.Tensor) -> torch.Tensor:
        """EAGLE-1 features [..., k H] with each earlier layer's state scaled to unit RMS (fp32
        statistics; zeros stay zeros), the final feature as it is."""
        k = len(self.feature_layers)
        if k == 1:
            return feats
        parts = feats.unflatten(-1, (k, -1))  # [..., k, H]
        early = parts[..., :-1, :].float()
        early = early * torch.rsqrt(early.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return torch.cat([early.to(feats.dtype), parts[..., -1:, :]], -2).flatten(-2)

    @property
    def own_readout(self) -> bool:
        """Whether an EAGLE-1 head reads out through rows of its own (``lm_head``, trained; the
        predicted feature read as the target's final normed feature, no norm) instead of the
        target's LM head rows of its tokens."""
        return self.kind == EAGLE1 and hasattr(self, "lm_head")

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., Vd]
        if self.own_readout:
            return self.lm_head(h)  # an nn.Linear: packed inside the loop's blocks like the layer's
        if self.kind == EAGLE1:
            return self._readout_logits(h)
        return self.lm_head(self.norm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] over the target's vocabulary
        d = self.draft_logits(h)
        if self._scatter_ids is None:
            return d
        full = d.new_full(d.shape[:-1] + (self.full_vocab_size,), float("-inf"))
        return full.index_copy_(-1, self._scatter_ids, d)

    def _readout_logits(self, h: torch.Tensor) -> torch.Tensor:  # EAGLE-1: [..., H] -> [..., Vd]
        """The borrowed readout rows, on ``packed_linear`` while the head's own linears are
        (``sequoia_models``: the loop and the profiler; the same rows limit), else torch's
        linear. One step's few-row readout was the head's costliest op on torch's GEMM (bf16,
        [1 .. 2, 576] x [576, 8192]: ~1.2 ms on a 2-core AMD EPYC)."""
        from sequoia_kernels.ops.packed_linear import linear_packed, packed_copy, packed_rows

        w = self._readout
        rows = packed_rows(h, w, getattr(self.fc, "_sequoia_max_rows", 0))
        if rows is None:
            return F.linear(h, w.to(h.dtype))
        self._readout_packed = packed_copy(w, self._readout_packed)  # repacked if the rows changed
        return linear_packed(h, self._readout_packed[2], w.shape[0], rows)

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, folder, extra: dict | None = None, dtype: torch.dtype = torch.float16) -> Path:
        """The EAGLE layout: ``config.json`` (+ ``sequoia`` provenance) and ``model.safetensors``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
                 for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        save_file(state, str(folder / "model.safetensors"))
        cfg = dict(self.raw_config, draft_vocab_size=self.draft_vocab_size, bias=self.fc.bias is not None)
        cfg["architectures"] = ["LlamaForCausalLMEagle3" if self.kind == EAGLE3 else "EagleHead"]
        if self.kind == EAGLE3 or len(self.feature_layers) > 1:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers or ())}
        cfg["sequoia"] = dict(extra or {})
        (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return folder

    @classmethod
    def load(cls, folder, dtype: torch.dtype = torch.float32) -> "FeatureHead":
        """A published EAGLE-1/2 or EAGLE-3 checkpoint folder, or one written by :meth:`save`."""
        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        state = _read_state(folder)
        kind = EAGLE3 if any(k.startswith("midlayer.") for k in state) else EAGLE1
        if kind == EAGLE1 and "fc.weight" not in state:
            raise ValueError(f"{folder}: neither an EAGLE-1 (fc.*, layers.0.*) nor an EAGLE-3 (midlayer.*) head")
        layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if "d2t" in state:
            cfg["draft_vocab_size"] = int(state["d2t"].numel())
        if kind == EAGLE1:  # the layers its weights hold (a published config may name the target's count)
            cfg["num_hidden_layers"] = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("layers.")),
                                               default=0)
        head = cls(cfg, kind, feature_layers=layers, bias="fc.bias" in state,
                   own_embedding="embed_tokens.weight" in state,
                   own_readout=kind == EAGLE1 and "lm_head.weight" in state)
        if "t2d" in state:
            t2d = state.pop("t2d").bool()
            if "d2t" in state and not torch.equal(t2d.nonzero().flatten(), torch.arange(len(state["d2t"])) +
                                                 state["d2t"].long()):
                raise ValueError(f"{folder}: t2d and d2t name different draft vocabularies")
        if "d2t" not in state:
            state["d2t"] = torch.zeros(head.draft_vocab_size, dtype=torch.int64)
        state = {k: v.long() if k == "d2t" else v for k, v in state.items()}
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"{folder}: weights do not match the {kind} layout (missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]})")
        return head.to(dtype).eval()


def _target_vocab(target) -> int:
    emb = target.get_output_embeddings()
    return int(emb.weight.shape[0]) if emb is not None else int(text_config(target.config).vocab_size)


def _read_state(folder: Path) -> dict:
    for name in _WEIGHT_FILES:
        f = folder / name
        if f.exists():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return dict(load_file(str(f)))
            return dict(torch.load(f, map_location="cpu", weights_only=True))
    raise ValueError(f"{folder}: no {' or '.join(_WEIGHT_FILES)}")


def is_feature_head_folder(folder) -> bool:
    """Whether ``folder`` holds an EAGLE-style head (a config.json and weights, no standalone
    draft's ``draft_config.json``, no full model's ``model.embed_tokens``)."""
    folder = Path(folder)
    if not (folder / "config.json").exists() or (folder / "draft_config.json").exists():
        return False
    cfg = json.loads((folder / "config.json").read_text())
    arch = " ".join(cfg.get("architectures") or [])
    return "Eagle" in arch or "draft_vocab_size" in cfg or cfg.get("num_hidden_layers") == 1 and \
        any((folder / n).exists() for n in _WEIGHT_FILES) and "fc.weight" in _read_state(folder)


def _whole(w: torch.Tensor) -> torch.Tensor:
    """A target weight as one plain tensor: a tensor-parallel target's DTensor gathered whole (a
    collective: every rank binds its replica of the head), any other weight as it is."""
    return w.full_tensor() if hasattr(w, "full_tensor") else w
