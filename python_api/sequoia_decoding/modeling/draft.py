"""The Sequoia draft model for SmolLM2-135M-Instruct.

No smaller model with the SmolLM2 tokenizer is available offline, so the draft is ours: a
small, *unmodified* ``transformers.LlamaForCausalLM`` (so attention plugins written for Llama
work on it) whose vocabulary is the ``V`` most frequent target tokens plus one UNK slot,
distilled from the target by ``scripts/draft/train_draft.py``.

Why a reduced vocabulary: the target's output head (49152 x 576) alone is ~20% of a target
step, so a draft that keeps the full head can never be cheap. Tokens outside the kept set get
q = 0 (logit -inf) and are never drafted; Sequoia's verification handles that exactly (the
residual distribution still contains them).

:class:`DraftLM` wraps the inner Llama and speaks the full target vocabulary:

* input ids (full vocab) -> draft ids; ids outside the kept set map to UNK;
* draft logits -> full-vocab logits: kept tokens get their logit, every other token (and the
  UNK slot, which is never a draftable output) gets -inf.

Draft ids: ``0 .. V-1`` are the kept tokens (``draft_to_full[k]`` is the target id of draft id
``k``), ``V`` is UNK. The inner model's ``vocab_size`` is ``V + 1``.

Saved layout (``DraftLM.save(dir)``)::

    dir/config.json, dir/model.safetensors   inner LlamaForCausalLM, fp16 (save_pretrained)
    dir/draft_vocab.safetensors              int32 "draft_to_full" [V]
    dir/draft_config.json                    full_vocab_size, unk_id, provenance
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

FULL_VOCAB = 49152  # SmolLM2 tokenizer
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
DRAFT_CONFIG_FILE = "draft_config.json"

# Default architecture (see models/draft/README.md for the measured cost and size):
# 4 layers, width 384, 6 query heads / 2 KV heads of 64, SwiGLU 1024, tied embeddings.
DEFAULT_ARCH = dict(
    hidden_size=384,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
)


def build_draft_llama(num_kept: int, eos_draft_id: int | None = None, bos_draft_id: int | None = None,
                      max_position_embeddings: int = 8192, rope_theta: float = 100000.0, **arch):
    """A fresh ``LlamaForCausalLM`` with ``num_kept + 1`` tokens (the last one is UNK).

    ``arch`` overrides :data:`DEFAULT_ARCH`. RoPE base and RMSNorm eps follow the target.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(DEFAULT_ARCH)
    kw.update(arch)
    config = LlamaConfig(
        vocab_size=num_kept + 1,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_draft_id,
        eos_token_id=eos_draft_id,
        pad_token_id=eos_draft_id,
        unk_token_id=num_kept,
        **kw,
    )
    return LlamaForCausalLM(config)


class DraftLM(nn.Module):
    """A reduced-vocabulary ``LlamaForCausalLM`` that reads and writes full-vocab tokens.

    Args:
        llama: the inner model; its ``vocab_size`` must be ``len(draft_to_full) + 1``.
        draft_to_full: ``[V]`` int tensor, target id of each kept draft id (all distinct).
        full_vocab_size: size of the target vocabulary (49152).
    """

    def __init__(self, llama, draft_to_full: torch.Tensor, full_vocab_size: int = FULL_VOCAB):
        super().__init__()
        draft_to_full = torch.as_tensor(draft_to_full, dtype=torch.long).flatten()  # [V]
        num_kept = draft_to_full.numel()
        if llama.config.vocab_size != num_kept + 1:
            raise ValueError(f"inner vocab {llama.config.vocab_size} != kept {num_kept} + UNK")
        if torch.unique(draft_to_full).numel() != num_kept or int(draft_to_full.max()) >= full_vocab_size:
            raise ValueError("draft_to_full must hold distinct ids < full_vocab_size")
        self.llama = llama
        self.full_vocab_size = full_vocab_size
        self.num_kept = num_kept
        self.unk_id = num_kept
        full_to_draft = torch.full((full_vocab_size,), num_kept, dtype=torch.long)  # [V_full]
        full_to_draft[draft_to_full] = torch.arange(num_kept)
        self.register_buffer("draft_to_full", draft_to_full, persistent=False)  # [V]
        self.register_buffer("full_to_draft", full_to_draft, persistent=False)  # [V_full]

    # -- HF-like surface -------------------------------------------------------------------
    @property
    def config(self):
        """The inner Llama config (its vocab is the draft vocab, ``V + 1``)."""
        return self.llama.config

    @property
    def device(self):
        return self.llama.device

    @property
    def dtype(self):
        return self.llama.dtype

    def set_attn_implementation(self, attn_implementation: str) -> None:
        """Switch the inner Llama's attention (e.g. to ``"sequoia_tree"`` for the decoding loop)."""
        self.llama.set_attn_implementation(attn_implementation)

    def to_draft_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocab ids ``[...]`` -> draft ids ``[...]`` (non-kept -> UNK)."""
        return self.full_to_draft[input_ids]

    def to_full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., V+1]`` -> full-vocab logits ``[..., V_full]``.

        Kept tokens get their logit; all other tokens get -inf (UNK is never drafted).
        """
        shape = draft_logits.shape[:-1] + (self.full_vocab_size,)
        full = draft_logits.new_full(shape, float("-inf"))  # [..., V_full]
        full.index_copy_(-1, self.draft_to_full, draft_logits[..., : self.num_kept])
        return full

    def draft_forward(self, input_ids, position_ids=None, past_key_values=None, attention_mask=None, **kw):
        """Inner forward on full-vocab ``input_ids`` ``[B, T]``; logits stay in draft vocab
        ``[B, T, V+1]`` (for training, or samplers that map ids themselves)."""
        from sequoia_kernels.hf import cache_kw  # (the inner model's keyword for it: transformers 5.24 renamed it)

        return self.llama(
            input_ids=self.to_draft_ids(input_ids),
            position_ids=position_ids,
            **cache_kw(self.llama, past_key_values),
            attention_mask=attention_mask,
            **kw,
        )

    def forward(self, input_ids, position_ids=None, past_key_values=None, attention_mask=None, **kw):
        """Like ``LlamaForCausalLM.forward`` on full-vocab ids ``[B, T]``.

        Returns the inner model's output with ``logits`` replaced by full-vocab logits
        ``[B, T', V_full]`` (``T'`` = T, or ``logits_to_keep`` if given); ``past_key_values``
        is the inner model's cache (pass it back on the next call).
        """
        out = self.draft_forward(input_ids, position_ids, past_key_values, attention_mask, **kw)
        out.logits = self.to_full_logits(out.logits)
        return out

    # -- persistence -----------------------------------------------------------------------
    def save(self, folder, dtype: torch.dtype = torch.float16, extra: dict | None = None) -> Path:
        """Write fp16 safetensors weights + config.json + id map to ``folder`` (atomic)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            inner = copy.deepcopy(self.llama).to(dtype)
            inner.save_pretrained(tmp, safe_serialization=True)
            save_file({"draft_to_full": self.draft_to_full.to(torch.int32).contiguous()},
                      str(tmp / DRAFT_VOCAB_FILE))
            meta = {"full_vocab_size": self.full_vocab_size, "num_kept": self.num_kept,
                    "unk_id": self.unk_id, "target": "SmolLM2-135M-Instruct"}
            meta.update(extra or {})
            (tmp / DRAFT_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            for f in tmp.iterdir():
                os.chmod(f, 0o644)
            os.chmod(tmp, 0o755)
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return folder

    @classmethod
    def load(cls, folder, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"):
        """Load a folder written by :meth:`save` (weights upcast to ``dtype``), eval mode."""
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        folder = Path(folder)
        meta = json.loads((folder / DRAFT_CONFIG_FILE).read_text())
        draft_to_full = load_file(str(folder / DRAFT_VOCAB_FILE))["draft_to_full"].long()
        llama = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
        model = cls(llama, draft_to_full, meta["full_vocab_size"])
        return model.eval()


def init_embeddings_from_target(llama, target_embed: torch.Tensor, draft_to_full: torch.Tensor) -> None:
    """Initialise the draft's (tied) embedding from the target's embedding rows.

    ``target_embed`` ``[V_full, D_t]``; the kept rows are projected onto their top ``d``
    principal directions (``d`` = draft width; if ``d >= D_t`` they are copied and zero-padded)
    and rescaled to the target's per-element std. The UNK row is the projected mean of the
    rows that were not kept.
    """
    emb = llama.get_input_embeddings().weight  # [V+1, d]
    d = emb.shape[1]
    E = target_embed.detach().float()  # [V_full, D_t]
    kept = E[draft_to_full]  # [V, D_t]
    rest_mask = torch.ones(E.shape[0], dtype=torch.bool)
    rest_mask[draft_to_full] = False
    mean = kept.mean(0, keepdim=True)  # [1, D_t]
    if d >= E.shape[1]:
        proj = torch.eye(E.shape[1], d)  # [D_t, d]
    else:
        _, _, vh = torch.linalg.svd(kept - mean, full_matrices=False)  # vh: [D_t, D_t]
        proj = vh[:d].T  # [D_t, d]
    new = (kept - mean) @ proj  # [V, d]
    unk = ((E[rest_mask].mean(0, keepdim=True) if rest_mask.any() else mean) - mean) @ proj  # [1, d]
    scale = kept.std() / new.std().clamp_min(1e-8)
    with torch.no_grad():
        emb[: draft_to_full.numel()] = new * scale
        emb[draft_to_full.numel():] = unk * scale
