#!/usr/bin/env python
"""Train an EAGLE-style feature head for SmolLM2-135M-Instruct (``FeatureHead``, EAGLE-1 layout,
read out through the target's frozen LM head over a reduced vocabulary).

Two subcommands; both resumable (rerun the same command after an interruption) and one-threaded
by default (run them ``nice``'d: ``nice -n 19 .venv/bin/python scripts/draft/train_head.py ...``):

``data --shards N``  The target's own chat answers: shard ``i`` takes training prompts
                     ``i * rows ...`` (chat instructions from general topics and the CPython
                     standard library, never a held-out prompt), answers them (Hugging Face
                     ``generate``, or ``--generator loop``: this package's loop without a draft;
                     temperature by shard: 0.7, 0, 0.7, 1.0; ``--bf16``: the bf16 target, fast
                     where the CPU has AMX), then
                     labels prompt + answer teacher-forced in one target forward: the feature of
                     every token (the final normed hidden state, fp16) and the target's top-32
                     logits + logsumexp of the next token. ``<data>/shard-NNNNN.npz``, atomic.
``corpus --shards N`` Windows of the CPython standard library's sources labelled the same way,
                     teacher-forced (no generation): ``<data>/shard-cNNNNN.npz``.
``relabel --from D`` Every shard of folder ``D`` with its features taken again (``--feature-layers``,
                     e.g. ``2,15,-1``: the states entering layers 2 and 15 besides the final
                     feature, the head's ``eagle_config``), the tokens and top-k labels kept.
``train``            The head on those shards: ``fc(cat(embedding of token p + 1, feature of
                     token p))`` -> one Llama layer (``--head-layers``: more; each initialised as
                     the target's last layer with its residual branches off, the identity) ->
                     the predicted feature of token p + 1 (smooth-L1 to the true one) -> the
                     target's LM head rows of the kept vocabulary (soft cross-entropy to the
                     target's top-32). Inputs get uniform feature noise (EAGLE's robustness to
                     its own predictions). ``--feature-layers``: what the shards hold (a head
                     reading earlier layers too; ``--init-from`` a head reading fewer starts as it,
                     the new layers' ``fc`` columns zero). Shard 0 is held out: top-1 agreement with the target
                     on its answer tokens is logged (the weights of its best in ``best.pt``: ``--export-best``).
                     Checkpoints every ``--ckpt-minutes``;
                     ``--export DIR`` writes the head (fp16, ``FeatureHead.save``).

Data and checkpoints live under ``~/.cache/sequoia-kernels/head-data`` / ``head-ckpt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python_api"))
sys.path.insert(0, str(REPO / "scripts" / "draft"))

import draft_data  # noqa: E402  (prompt templates, the CPython sources, top-k helpers)
from sequoia_decoding.feature_drafter import second_level, target_forward  # noqa: E402
from sequoia_decoding.modeling.feature_head import FeatureHead, eagle1_layers  # noqa: E402
from sequoia_decoding.modeling.smollm2 import CACHE_ROOT, load_target  # noqa: E402
from sequoia_decoding.profiles import cpu_name  # noqa: E402
from sequoia_decoding.prompts import prompt_ids, read_prompts  # noqa: E402

DATA_DIR, CKPT_DIR = CACHE_ROOT / "head-data", CACHE_ROOT / "head-ckpt"
VOCAB_FILE = REPO / "models" / "draft" / "smollm2-draft" / "draft_vocab.safetensors"  # by target mass


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S ") + msg, flush=True)


# ------------------------------------------------------------------ data


def training_prompts(seed: int, n: int, raw_frac: float = 0.0, task_frac: float = 0.0,
                     task_set: int = 1) -> list[dict]:
    """Prompts (deterministic): a share ``raw_frac`` of raw Python to continue (a run of whole
    lines of a CPython standard-library source, cut mid-line 40% of the time, as the held-out raw
    prompts are code to continue); the rest chat instructions: a share ``task_frac`` of them
    everyday tasks (``draft_data.task_prompt``: emails, recipes, how-tos, small programs, ...; from
    ``task_set`` 1 or 2),
    of the others 60% general topics x templates, 40% about documented functions of the
    standard library; held-out prompts excluded."""
    rng = random.Random(seed)
    topics = [t.strip() for t in draft_data.GENERAL_TOPICS.split("|") if t.strip()]
    files = draft_data.stdlib_files()
    items = list(draft_data.stdlib_items(files))
    held = {p["text"].strip() for p in read_prompts(draft_data.HELDOUT_REPO)}
    out = []
    while len(out) < n:
        if raw_frac and rng.random() < raw_frac:
            text = draft_data.excerpt(draft_data.read_text_file(rng.choice(files)), rng, 60, 400)
            if rng.random() < 0.4:  # end mid-line, like many real prompts
                words = text.rstrip("\n").split(" ")
                text = " ".join(words[:max(2, int(len(words) * rng.uniform(0.5, 0.95)))])
            if text.strip() and text.strip() not in held:
                out.append({"kind": "raw", "text": text})
            continue
        if task_frac and rng.random() < task_frac:
            text = draft_data.task_prompt(rng, task_set)
        elif rng.random() < 0.6:
            text = rng.choice(draft_data.GENERAL_TEMPLATES).format(t=rng.choice(topics))
        else:
            mod, qual, first, src = rng.choice(items)
            text = rng.choice(draft_data.STDLIB_TEMPLATES).format(mod=mod, qual=qual, first=first, src=src)
        if text.strip() not in held:
            out.append({"kind": "chat", "text": text})
    return out


def parse_layers(text: str) -> tuple[int, ...]:
    """``--feature-layers``: comma-separated hidden-state indices, the final feature -1 last
    (``eagle1_layers``' rule)."""
    try:
        return eagle1_layers(int(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@torch.no_grad()
def features(target, seq: list[int], layers: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """Teacher-forced features [L, k H] of ``seq``: the hidden states ``layers`` index, the final
    normed one (what the LM head reads) last."""
    return target_forward(target, torch.tensor([seq]), layers, logits=False)[1][0]


@torch.no_grad()
def label(target, seqs: list[list[int]], k: int = 32, layers: tuple[int, ...] = (-1,)) -> list[dict]:
    """Teacher-forced: per token its features (``features``, fp16) and the next token's top-k
    logits + logsumexp (fp32 logits)."""
    out = []
    for s in seqs:
        f = features(target, s, layers)  # [L, k H]
        ids, vals, lse = draft_data.hidden_to_topk(target, f[:, -target.config.hidden_size:])
        out.append({"tokens": np.asarray(s, np.uint16), "feats": f.float().numpy().astype(np.float16), "topk_ids": ids,
                    "topk_logits": vals, "lse": lse})
    return out


@torch.no_grad()
def answer(model, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
           suppress: list[int] | None = None) -> list[list[int]]:
    """The model's answers (Hugging Face ``generate``, left-padded batch), each cut after its EOS;
    ``suppress``: ids never generated."""
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), draft_data.PAD_ID, dtype=torch.long)  # [B, P]
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):], mask[b, P - len(p):] = torch.tensor(p), 1
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=temperature > 0,
                         temperature=temperature or None, top_k=None, top_p=None, pad_token_id=draft_data.PAD_ID,
                         eos_token_id=list(draft_data.EOS_IDS), suppress_tokens=suppress)[:, P:]
    answers = []
    for row in out.tolist():
        cut = next((k + 1 for k, t in enumerate(row) if t in draft_data.EOS_IDS), len(row))
        answers.append(row[:cut])
    return answers


@torch.no_grad()
def answer_in_loop(model, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
                   group: int = 16) -> list[list[int]]:
    """``answer`` through this package's loop (plain decoding: ``SequoiaGenerator`` without a draft,
    the packed linears at every decoding step): the same distribution, other samples. The prompts
    go in groups of ``group`` by length (the loop once prefilled a batch padded to its longest
    prompt; kept: the shards' samples depend on the groups)."""
    from sequoia_decoding.generate import SequoiaGenerator
    from sequoia_decoding.outputs import SamplingParams

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for g in range(0, len(order), group):
        rows = order[g:g + group]
        gen = SequoiaGenerator(model, None, None, SamplingParams(temperature=temperature, seed=seed + g),
                               max_length=max(len(prompts[i]) for i in rows) + max_new + 2)
        out = gen.generate([prompts[i] for i in rows], max_new_tokens=max_new, eos_token_id=list(draft_data.EOS_IDS))
        for i, toks in zip(rows, out.tokens):
            answers[i] = toks
    return answers


def make_shard(model, tok, prompts, index: int, args) -> None:
    path = Path(args.data_dir) / f"shard-{index:05d}.npz"
    if path.exists():
        return
    t0 = time.time()
    chunk = prompts[index * args.rows:(index + 1) * args.rows]
    ids = [prompt_ids(tok, p)[-args.max_prompt:] for p in chunk]
    temperature = (0.7, 0.0, 0.7, 1.0)[index % 4]
    answers = (answer_in_loop if args.generator == "loop" else answer)(model, ids, args.max_new, temperature,
                                                                       seed=args.seed * 100_003 + index)
    n = write_shard(path, label(model, [p + a for p, a in zip(ids, answers)], layers=args.feature_layers),
                    [len(p) for p in ids], args.feature_layers)
    log(f"shard {index}: T={temperature} {sum(map(len, answers))} answer tokens, {n} labelled, "
        f"{time.time() - t0:.0f} s")


def write_shard(path: Path, recs: list[dict], prompt_lens: list[int], layers=(-1,)) -> int:
    """One shard (atomic): ``label``'s records concatenated, sequence offsets, prompt lengths,
    the feature layers. Returns the tokens written."""
    arrays = {k: np.concatenate([r[k] for r in recs]) for k in recs[0]}
    arrays["offsets"] = np.cumsum([0] + [len(r["tokens"]) for r in recs]).astype(np.int64)
    arrays["prompt_lens"] = np.asarray(prompt_lens, np.int64)
    arrays["feature_layers"] = np.asarray(layers, np.int64)
    draft_data.atomic_save_npz(path, **arrays)
    return len(arrays["tokens"])


def corpus_tokens(tok, data: Path) -> np.ndarray:
    """The CPython standard library's sources, tokenized once (uint16, documents separated by
    <|endoftext|>), cached in the data folder."""
    path = data / "stdlib.tokens.npy"
    if not path.exists():
        ids = []
        for f in draft_data.stdlib_files():
            ids += draft_data.encode(tok, draft_data.read_text_file(f)) + [0]
        np.save(path.with_name(path.stem + ".tmp.npy"), np.asarray(ids, np.uint16))
        os.replace(path.with_name(path.stem + ".tmp.npy"), path)
    return np.load(path)


def make_corpus_shard(model, corpus: np.ndarray, index: int, args) -> None:
    """``corpus-NNNNN.npz``: ``args.windows`` random windows of ``args.window`` corpus tokens,
    labelled teacher-forced (no generation: ~10x cheaper per token than the answers)."""
    path = Path(args.data_dir) / f"shard-c{index:05d}.npz"
    if path.exists():
        return
    t0 = time.time()
    rng = np.random.default_rng(args.seed * 7919 + index)
    starts = rng.integers(0, len(corpus) - args.window, args.windows)
    recs = label(model, [corpus[a:a + args.window].astype(np.int64).tolist() for a in starts],
                 layers=args.feature_layers)
    n = write_shard(path, recs, [0] * len(recs), args.feature_layers)  # no prompt: every token is the target's
    log(f"corpus shard {index}: {n} labelled, {time.time() - t0:.0f} s")


def cmd_corpus(args) -> None:
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa")
    corpus = corpus_tokens(tok, data)
    for i in range(args.first, args.shards, args.every):
        make_corpus_shard(model, corpus, i, args)


def listed_prompts(data: Path, seed: int, n: int, raw_frac: float = 0.0, task_frac: float = 0.0,
                   task_set: int = 1) -> list[dict]:
    """``training_prompts(seed, >= n, raw_frac, task_frac, task_set)``, cached in the data folder (parsing
    the standard library takes minutes: once)."""
    listed = data / (f"prompts-{seed}" + (f"-raw{raw_frac:g}" if raw_frac else "")
                     + (f"-task{task_frac:g}" if task_frac else "")
                     + (f"-set{task_set}" if task_frac and task_set != 1 else "") + ".jsonl")
    prompts = [json.loads(line) for line in listed.read_text().splitlines()] if listed.exists() else []
    if len(prompts) < n:
        prompts = training_prompts(seed, max(4096, n), raw_frac, task_frac, task_set)
        # atomic: the data command runs as two processes, the second may read while the first writes
        draft_data.atomic_write_text(listed, "".join(json.dumps(p) + "\n" for p in prompts))
    return prompts


def cmd_data(args) -> None:
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    # bf16 where the CPU has AMX (several times faster; the demo decodes in bf16 there too)
    model, tok = load_target(dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa")
    prompts = listed_prompts(data, args.seed, args.shards * args.rows, args.raw_frac, args.task_frac,
                             args.task_set)
    for i in range(args.first, args.shards, args.every):
        make_shard(model, tok, prompts, i, args)


def cmd_drafted(args) -> None:
    """``shard-dNNNNN.npz``: the standalone draft answers training prompts (its own prompt set:
    seed + 1), the target labels prompt + answer teacher-forced. The text is the draft's, the
    labels (features, next-token distributions) are the target's: ~3.5x the answer tokens per
    CPU-second of the target's own answers (measured: ~100 against ~28 answer tokens/s per core)."""
    from sequoia_decoding.modeling.draft import DraftLM

    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    data.mkdir(parents=True, exist_ok=True)
    model, tok = load_target(dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa")
    draft = DraftLM.load(args.draft, attn_implementation="sdpa")
    prompts = listed_prompts(data, args.seed + 1, args.shards * args.rows)
    for i in range(args.first, args.shards, args.every):
        path = data / f"shard-d{i:05d}.npz"
        if path.exists():
            continue
        t0 = time.time()
        ids = [prompt_ids(tok, p)[-args.max_prompt:] for p in prompts[i * args.rows:(i + 1) * args.rows]]
        temperature = (0.6, 0.0, 0.6, 0.8)[i % 4]  # cooler than the target's shards: the draft drifts sooner
        drafted = answer(draft.llama, [draft.to_draft_ids(torch.tensor(p)).tolist() for p in ids], args.max_new,
                         temperature, seed=args.seed * 100_003 + i, suppress=[draft.unk_id])
        answers = [draft.draft_to_full[torch.tensor(a, dtype=torch.long)].tolist() for a in drafted]
        n = write_shard(path, label(model, [p + a for p, a in zip(ids, answers)], layers=args.feature_layers),
                        [len(p) for p in ids], args.feature_layers)
        log(f"drafted shard {i}: T={temperature} {sum(map(len, answers))} answer tokens, {n} labelled, "
            f"{time.time() - t0:.0f} s")


def shard_layers(z) -> tuple[int, ...]:
    return tuple(int(x) for x in z["feature_layers"]) if "feature_layers" in z else (-1,)


def cmd_relabel(args) -> None:
    """Each shard of ``args.source`` again with ``args.feature_layers``' features (same file name
    under ``--data-dir``, atomic, skipped when there); tokens, prompts and top-k labels kept."""
    torch.set_num_threads(args.threads)
    data, src = Path(args.data_dir), Path(args.source)
    if data.resolve() == src.resolve():
        raise SystemExit("relabel writes a new folder: --data-dir must differ from --from")
    data.mkdir(parents=True, exist_ok=True)
    model, _ = load_target(dtype=torch.bfloat16 if args.bf16 else torch.float32, attn_implementation="sdpa")
    paths = sorted(src.glob("shard-*.npz"))
    for path in paths[args.first::args.every]:
        out = data / path.name
        if out.exists():
            continue
        t0 = time.time()
        z = dict(np.load(path))
        off = z["offsets"]
        z["feats"] = np.concatenate([features(model, z["tokens"][a:b].astype(np.int64).tolist(), args.feature_layers)
                                     .float().numpy().astype(np.float16) for a, b in zip(off[:-1], off[1:])])
        z["feature_layers"] = np.asarray(args.feature_layers, np.int64)
        draft_data.atomic_save_npz(out, **z)
        log(f"relabelled {path.name}: {len(z['tokens'])} tokens, {time.time() - t0:.0f} s")


# ------------------------------------------------------------------ training


class Windows:
    """Every shard's sequences; random windows of ``length`` tokens (with their labels)."""

    def __init__(self, paths: list[Path], full_to_draft: torch.Tensor, layers: tuple[int, ...] = (-1,)):
        self.seqs = []
        for p in paths:
            z = np.load(p)
            if shard_layers(z) != tuple(layers):
                raise SystemExit(f"{p} holds the features of layers {list(shard_layers(z))}, the head reads "
                                 f"{list(layers)}: relabel (train_head.py relabel --feature-layers ...)")
            off, pl = z["offsets"], z["prompt_lens"]
            tids = full_to_draft[torch.from_numpy(z["topk_ids"].astype(np.int64))]  # [N, K] draft ids, -1 not kept
            answer = torch.zeros(len(z["tokens"]), dtype=torch.bool)  # [N]: tokens the target wrote
            for i in range(len(off) - 1):
                answer[off[i] + pl[i]:off[i + 1]] = True
            arr = dict(tokens=torch.from_numpy(z["tokens"].astype(np.int64)), feats=torch.from_numpy(z["feats"]),
                       tids=tids, tlog=torch.from_numpy(z["topk_logits"]).float(), lse=torch.from_numpy(z["lse"]),
                       answer=answer)
            for i in range(len(off) - 1):
                if off[i + 1] - off[i] > 3:
                    self.seqs.append((arr, int(off[i]), int(off[i + 1]), int(pl[i])))
        self.tokens, self.shards = sum(e - s for _, s, e, _ in self.seqs), len(paths)

    def batch(self, rng: random.Random, rows: int, length: int) -> dict:
        parts = []
        for _ in range(rows):
            arr, s, e, _ = rng.choice(self.seqs)
            a = rng.randrange(s, max(s + 1, e - length))
            parts.append({k: v[a:min(e, a + length)] for k, v in arr.items()})
        L = max(len(p["tokens"]) for p in parts)
        return {k: torch.stack([F.pad(p[k], [0, 0] * (p[k].dim() - 1) + [0, L - len(p[k])],
                                      value=-1 if k in ("tids", "tokens") else 0) for p in parts])
                for k in parts[0]}


def _stack(a: dict, b: dict) -> dict:
    """Two batches as one (padded to the longer)."""
    L = max(a["tokens"].shape[1], b["tokens"].shape[1])

    def pad(x, k):
        return F.pad(x, [0, 0] * (x.dim() - 2) + [0, L - x.shape[1]], value=-1 if k in ("tids", "tokens") else 0)
    return {k: torch.cat([pad(a[k], k), pad(b[k], k)]) for k in a}


def draw_rows(pools: list, rng: random.Random, rows: int, length: int) -> dict:
    """One batch of ``rows`` windows, each from a pool drawn by its share (at least one row from
    the first pool, the target's answers)."""
    counts = [0] * len(pools)
    for _ in range(rows):
        u, k = rng.random(), 0
        while k < len(pools) - 1 and u >= pools[k][2]:
            u, k = u - pools[k][2], k + 1
        counts[k] += 1
    if counts[0] == 0:
        counts[counts.index(max(counts))] -= 1
        counts[0] = 1
    b = None
    for (_, w, _), n in zip(pools, counts):
        if n:
            part = w.batch(rng, n, length)
            b = part if b is None else _stack(b, part)
    return b


def weights(b: dict, valid: torch.Tensor, prompt_weight: float) -> torch.Tensor:  # [R, L - 2]
    """Slots predicting a token the target wrote count 1, slots inside the prompt (the chat
    template's boilerplate repeats in every sample) ``prompt_weight``."""
    return valid * torch.where(b["answer"][:, 2:], 1.0, prompt_weight)


def head_losses(head, b: dict, noise: float, second: bool = False):
    """Per slot [R, L - 2]: feature smooth-L1, soft cross-entropy, top-1 agreement, and whether
    the slot is real. Slot j reads (feature of token j, token j + 1) and predicts token j + 1's
    feature and the token after it (label row j + 1). ``second=True``: the same four for slots
    j >= 1 read as a tree's second level reads them ([R, L - 3] each, after the first four): the
    head's own prediction of token j's feature (from slot j - 1) instead of the target's, the
    true slots before it as context (``feature_drafter.second_level``: what
    ``measure-acceptance --head-level 2`` reads)."""
    tokens, feats = b["tokens"], b["feats"].float()  # [R, L], [R, L, F]
    valid = (tokens[:, 2:] >= 0)  # [R, L - 2]: slot j has a label row j + 1 with a real next token
    x = feats[:, :-2]
    if noise:
        x = x + (torch.rand_like(x) - 0.5) * 2 * noise
    R, S = x.shape[:2]
    pos = torch.arange(S)[None].expand(R, -1)
    ids = tokens[:, 1:-1].clamp(min=0)
    h = head(ids, x, fused=False, position_ids=pos)  # [R, S, H]
    out = _slot_losses(head, h, b, 0) + (valid,)
    if second and S > 1:
        out = out + _slot_losses(head, second_level(head, ids, x, h, pos), b, 1) + (valid[:, 1:],)
    return out


def _slot_losses(head, h: torch.Tensor, b: dict, first: int):
    """Smooth-L1, soft CE and agreement of predictions h [R, n, H] for slots first .. first + n - 1."""
    rows = slice(1 + first, 1 + first + h.shape[1])
    final = b["feats"][:, rows, -h.shape[-1]:]  # [R, n, H]: the final feature (what the head predicts)
    reg = F.smooth_l1_loss(h.float(), final.float(), reduction="none").mean(-1)
    logq = torch.log_softmax(head.draft_logits(h).float(), -1)  # [R, n, Vd]
    tids, p = b["tids"][:, rows], torch.exp(b["tlog"][:, rows] - b["lse"][:, rows, None])  # [R, n, K]
    kept = tids >= 0
    ce = -(p * kept * logq.gather(-1, tids.clamp(min=0))).sum(-1)
    agree = (logq.argmax(-1) == tids[..., 0]) & kept[..., 0]
    return reg, ce, agree


def mean(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    w = weight.float()
    return (x.float() * w).sum() / w.sum().clamp(min=1e-9)


def draft_index(head: FeatureHead) -> torch.Tensor:  # [V] int64
    """The draft id of every target token (-1 outside the head's vocabulary): what ``Windows``
    maps the labels' token ids with."""
    index = torch.full((head.full_vocab_size,), -1, dtype=torch.int64)
    index[head.token_ids()] = torch.arange(head.draft_vocab_size)
    return index


def build_head(target, vocab: int, layers: tuple[int, ...] = (-1,), own_readout: bool = False,
               head_layers: int = 1) -> FeatureHead:
    from safetensors.torch import load_file

    c = target.config
    kept = load_file(str(VOCAB_FILE))["draft_to_full"].long()[:vocab]
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings,
               rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters), draft_vocab_size=len(kept),
               hidden_act=c.hidden_act, bias=True, num_hidden_layers=head_layers)
    head = FeatureHead(cfg, "eagle1", feature_layers=layers, own_readout=own_readout)
    H, last = c.hidden_size, target.model.layers[-1]
    with torch.no_grad():
        head.d2t.copy_(kept - torch.arange(len(kept)))
        for layer in head.layers:  # each starts as the target's last layer with both residual
            missing, unexpected = layer.load_state_dict(last.state_dict(), strict=False)  # branches off
            if missing or set(unexpected) - {"input_layernorm.weight"}:  # (layer 0 has no input norm)
                raise ValueError(f"the head's layer does not match the target's: {missing} {unexpected}")
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head.fc.weight[:, :H].normal_(0, 0.02)
        head.fc.weight[:, H:-H] = 0.0  # the earlier layers' columns: learnt from zero
        head.fc.weight[:, -H:] = torch.eye(H)  # so the untrained head's h = the input feature
        head.fc.bias.zero_()
        if own_readout:  # rows of its own, starting as the target's rows of the kept tokens
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[kept])
    head.bind(target)
    return head


def training_pools(args, full_to_draft: torch.Tensor):
    """The held-out windows, their shard paths and the training pools ``(name, windows, share of
    the rows)``: the answer shards, the drafted ones (``--drafted-frac``), the corpus the rest."""
    paths = sorted(Path(args.data_dir).glob("shard-0*.npz"))  # the target's answers
    held_paths = [p for p in paths if int(p.stem[6:]) in args.held_out]
    train_paths = [p for p in paths if p not in held_paths]
    corpus = sorted(Path(args.data_dir).glob("shard-c*.npz"))  # labelled corpus windows
    if len(held_paths) != len(args.held_out) or not train_paths:
        raise SystemExit(f"need the held-out shards {args.held_out} and at least one more in {args.data_dir}")
    drafted = sorted(Path(args.data_dir).glob("shard-d*.npz"))  # the draft's answers, the target's labels
    fl = args.feature_layers
    held = Windows(held_paths, full_to_draft, fl)
    pools = [("answers", Windows(train_paths, full_to_draft, fl), args.chat_frac)]
    if drafted and args.drafted_frac > 0:
        pools.append(("drafted", Windows(drafted, full_to_draft, fl), args.drafted_frac))
    if corpus:
        pools.append(("corpus", Windows(corpus, full_to_draft, fl), 1.0 - sum(f for *_, f in pools)))
    if sum(f for *_, f in pools) < 1.0 - 1e-9 or any(f < 0 for *_, f in pools):
        raise SystemExit(f"row shares {[f for *_, f in pools]} must be >= 0 and sum to 1 (no corpus shards: "
                         "--chat-frac + --drafted-frac = 1)")
    log("train: " + ", ".join(f"{n}: {w.tokens} tokens in {len(w.seqs)} sequences ({f:.0%} of rows)"
                              for n, w, f in pools) + f"; held out: {held.tokens}")
    return held, held_paths, pools


def start(head: FeatureHead, args, ck: Path):
    """The optimizer and where training stands: resumed from ``ck`` (its step, data order and the
    decoder layers it inherited), else a warm start from ``--init-from`` (another run's weights,
    this run's optimizer and schedule), else a fresh head. The layers a warm start added beyond
    those it inherited learn at ``--added-lr`` (a param group of their own; default ``--lr``)."""
    state = torch.load(ck, weights_only=False) if ck.exists() else None
    inherited = state.get("inherited") if state else None
    if state is None and args.init_from:
        inherited = init_from(head, Path(args.init_from))
        log(f"initialised from {args.init_from}")
    added = {id(p) for layer in head.layers[inherited:] for p in layer.parameters()} \
        if inherited and args.added_lr else set()
    params = [p for p in head.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) not in added], "scale": 1.0}]
    if added:
        groups.append({"params": [p for p in params if id(p) in added], "scale": args.added_lr / args.lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, rng = 0, random.Random(args.seed)
    if state is not None:
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
        log(f"resumed at step {step}")
    return opt, params, step, rng, inherited


def cmd_train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    target, _ = load_target(attn_implementation="sdpa")
    for p in target.parameters():
        p.requires_grad_(False)
    head = build_head(target, args.vocab, args.feature_layers, args.own_readout, args.head_layers)
    held, held_paths, pools = training_pools(args, draft_index(head))
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ck = ckpt_dir / "last.pt"
    opt, params, step, rng, inherited = start(head, args, ck)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    t_ck, t0, seen = time.time(), time.time(), 0
    while step < args.steps:
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr * g.get("scale", 1.0)  # a checkpoint of before --added-lr: one group
        b = draw_rows(pools, rng, args.rows, args.length)
        with amp:
            out = head_losses(head, b, args.noise, second=args.second_level > 0)
            reg, ce, agree, valid = out[:4]
            w = weights(b, valid, args.prompt_weight)
            reg, ce, agree = mean(reg, w), mean(ce, w), mean(agree, valid & b["answer"][:, 2:])
            loss = args.reg_weight * reg + ce
            if len(out) > 4:  # the second level's terms (its slots are the first level's from slot 1)
                reg2, ce2, _, valid2 = out[4:]
                w2 = weights({"answer": b["answer"][:, 1:]}, valid2, args.prompt_weight)
                loss = loss + args.second_level * (args.reg_weight * mean(reg2, w2) + mean(ce2, w2))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, seen = step + 1, seen + int((b["tokens"] >= 0).sum())
        if step % args.log_every == 0 or step == args.steps:
            ev = evaluate(head, held, amp)
            log(f"step {step}/{args.steps} lr {lr:.2e} reg {reg.item():.4f} ce {ce.item():.3f} train-agree "
                f"{agree.item():.3f} held-out agree {ev:.3f} ({seen / (time.time() - t0):.0f} tok/s)")
            keep_best(head, ckpt_dir / "best.pt", step, ev)
        if time.time() - t_ck > args.ckpt_minutes * 60 or step == args.steps:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng,
                        "inherited": inherited}, ck.with_suffix(".tmp"))
            os.replace(ck.with_suffix(".tmp"), ck)
            t_ck = time.time()
    if args.export:
        export(head, target, args, ckpt_dir, step, held_paths, {n: w.tokens for n, w, _ in pools}, amp)


def export(head: FeatureHead, target, args, ckpt_dir: Path, step: int, held_paths: list[Path], tokens: dict,
           amp) -> None:
    """``head`` (or its best held-out step's weights, ``--export-best``) into ``--export`` with the
    first ``--export-vocab`` draft tokens, its held-out agreement measured again with them."""
    if args.export_best and (ckpt_dir / "best.pt").exists():  # the weights of the best held-out agreement
        best = torch.load(ckpt_dir / "best.pt", weights_only=False)
        head.load_state_dict(best["head"])
        step = best["step"]
        log(f"exporting step {step}'s weights (held-out agreement {best['held_out']:.3f})")
    # the layer predicts features: any prefix of the kept tokens (by target mass) serves, read out
    # through the target's rows of them or the head's own
    vocab = args.export_vocab or args.vocab
    head.d2t = head.d2t[:vocab].clone()
    if head.own_readout:
        head.lm_head.weight = torch.nn.Parameter(head.lm_head.weight.detach()[:vocab].clone())
        head.lm_head.out_features = vocab
    head._bound_to = None
    head.bind(target)
    agree = evaluate(head, Windows(held_paths, draft_index(head), args.feature_layers), amp)
    head.save(args.export, extra={"steps": step, "train_tokens": tokens, "args": vars(args),
                                  "held_out_agreement": agree, "cpu": cpu_name()})
    log(f"exported to {args.export} ({vocab} draft tokens, held-out agreement {agree:.3f})")


def keep_best(head: FeatureHead, path: Path, step: int, held_out: float) -> None:
    """``path``: the head's weights at the best held-out agreement seen (atomic; kept across
    resumes: a resumed run compares with what is there)."""
    if path.exists() and torch.load(path, weights_only=False)["held_out"] >= held_out:
        return
    torch.save({"head": head.state_dict(), "step": step, "held_out": held_out}, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def init_from(head: FeatureHead, path: Path) -> int | None:
    """``head``'s trained weights (``fc``, the layer; readout rows of its own where both have
    them) from another run: its checkpoint
    (``last.pt``) or an exported head folder (``FeatureHead.save``: fp16, and its vocabulary may be
    a prefix of this run's, which the readout rows of the target decide, not the weights). A head
    reading fewer layers (a subset, the final feature last) gives ``head`` the same function:
    its ``fc`` columns where its layers sit, zeros for the others; so does a head of fewer decoder
    layers (its layers first, the others as :func:`build_head` made them: the identity). Returns
    the decoder layers it set (None from a checkpoint: all of them)."""
    if path.is_dir():
        other = FeatureHead.load(path)
        state = {k: v.float() for k, v in other.state_dict().items() if k.startswith(("fc.", "layers."))}
        if other.own_readout and head.own_readout:  # its rows of the tokens both keep (a prefix of this run's)
            n = min(other.draft_vocab_size, head.draft_vocab_size)
            if not torch.equal(other.token_ids()[:n], head.token_ids()[:n]):
                raise SystemExit(f"{path}: its readout rows are for other tokens than this run's first {n}")
            state["lm_head.weight"] = torch.cat([other.lm_head.weight.detach()[:n].float(),
                                                 head.lm_head.weight.detach()[n:]])
        if len(other.layers) > len(head.layers):
            raise SystemExit(f"{path} has {len(other.layers)} decoder layers, this run's head {len(head.layers)}")
        missing = [k for k in head.state_dict() if k.startswith(("fc.", "layers.")) and k not in state
                   and not (k.startswith("layers.") and int(k.split(".")[1]) >= len(other.layers))]
        if missing:
            raise SystemExit(f"{path} is not a head of this layout: no {missing[:3]}")
        state["fc.weight"] = widened_fc(state["fc.weight"], other.feature_layers, head.feature_layers)
        head.load_state_dict(state, strict=False)
        return len(other.layers)
    head.load_state_dict(torch.load(path, weights_only=False)["head"])
    return None


def widened_fc(w: torch.Tensor, have: tuple[int, ...], want: tuple[int, ...]) -> torch.Tensor:
    """An EAGLE-1 ``fc`` weight [H, H + len(have) H] as [H, H + len(want) H]: the embedding's and
    each layer's columns where ``want`` puts them, zeros for layers ``have`` lacks."""
    if tuple(have) == tuple(want):
        return w
    if not set(have) <= set(want):
        raise SystemExit(f"cannot start a head reading layers {list(want)} from one reading {list(have)}")
    H = w.shape[0]
    out = w.new_zeros(H, H + len(want) * H)
    out[:, :H] = w[:, :H]
    for i, layer in enumerate(have):
        j = want.index(layer)
        out[:, H + j * H:H + (j + 1) * H] = w[:, H + i * H:H + (i + 1) * H]
    return out


@torch.no_grad()
def evaluate(head, held: Windows, amp) -> float:
    """Top-1 agreement with the target on the held-out shards' answer tokens (true features;
    at most 48 sequences a shard: all of a 32-row shard)."""
    agree = total = 0.0
    for arr, s, e, plen in held.seqs[:48 * held.shards]:
        with amp:
            _, _, a, valid = head_losses(head, {k: v[s:e][None] for k, v in arr.items()}, 0.0)[:4]
        answer = valid & (torch.arange(valid.shape[1]) >= plen - 2)  # slots predicting answer tokens
        agree, total = agree + float((a & answer).sum()), total + float(answer.sum())
    return agree / max(total, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=str(DATA_DIR))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("--shards", type=int, required=True)
    d.add_argument("--rows", type=int, default=32)
    d.add_argument("--max-new", type=int, default=160)
    d.add_argument("--bf16", action="store_true", help="the bf16 target answers and labels (fast with AMX)")
    d.add_argument("--first", type=int, default=0, help="with --every: this process's shards (two processes: 0/1)")
    d.add_argument("--every", type=int, default=1)
    d.add_argument("--max-prompt", type=int, default=384)
    d.add_argument("--generator", choices=("hf", "loop"), default="hf", help="who answers: Hugging Face "
                   "`generate` (the earlier runs) or this package's loop (plain decoding on the packed linears: "
                   "several times faster on a CPU without AMX, in fp32)")
    d.add_argument("--raw-frac", type=float, default=0.0, help="share of the prompts that are raw Python to continue "
                   "(standard-library excerpts); the rest chat")
    d.add_argument("--task-frac", type=float, default=0.0, help="share of the chat prompts that are everyday tasks "
                   "(emails, recipes, how-tos, small programs, queries; draft_data.TASK_TEMPLATES)")
    d.add_argument("--task-set", type=int, choices=(1, 2), default=1, help="2: the tasks also from "
                   "draft_data.TASK_TEMPLATES_MORE")
    dr = sub.add_parser("drafted", help="the standalone draft answers, the target labels (cheap chat-domain data)")
    dr.add_argument("--shards", type=int, required=True)
    dr.add_argument("--rows", type=int, default=32)
    dr.add_argument("--max-new", type=int, default=160)
    dr.add_argument("--bf16", action="store_true", help="the bf16 target labels (fast with AMX)")
    dr.add_argument("--first", type=int, default=0)
    dr.add_argument("--every", type=int, default=1)
    dr.add_argument("--max-prompt", type=int, default=384)
    dr.add_argument("--draft", default=str(REPO / "models" / "draft" / "smollm2-draft"))
    c = sub.add_parser("corpus", help="label CPython standard-library windows teacher-forced (no generation)")
    c.add_argument("--shards", type=int, required=True)
    c.add_argument("--windows", type=int, default=32)
    c.add_argument("--window", type=int, default=256)
    c.add_argument("--bf16", action="store_true")
    c.add_argument("--first", type=int, default=0)
    c.add_argument("--every", type=int, default=1)
    t = sub.add_parser("train")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--held-out", type=lambda s: sorted({int(x) for x in s.split(",")}), default=[0],
                   help="answer shards held out for the agreement measured during training (comma-separated "
                   "indices; default 0)")
    t.add_argument("--rows", type=int, default=8)
    t.add_argument("--length", type=int, default=256)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--reg-weight", type=float, default=1.0)
    t.add_argument("--prompt-weight", type=float, default=0.3, help="loss weight of slots inside the prompt")
    t.add_argument("--second-level", type=float, default=0.0, help="weight of the loss on slots read as a tree's "
                   "second level reads them (the head's own predicted feature; EAGLE-3's training-time test)")
    t.add_argument("--chat-frac", type=float, default=0.6, help="share of rows from the answer shards (the rest: "
                   "corpus windows, where there are any)")
    t.add_argument("--drafted-frac", type=float, default=0.0, help="share of rows from the drafted shards (the "
                   "standalone draft's answers, labelled by the target)")
    t.add_argument("--vocab", type=int, default=14336)
    t.add_argument("--head-layers", type=int, default=1, help="decoder layers of the head (more: --init-from a "
                   "head of fewer starts as it, the added layers the identity)")
    t.add_argument("--added-lr", type=float, default=None, help="peak learning rate of the layers --init-from "
                   "added (default: --lr)")
    t.add_argument("--bf16", action="store_true", help="autocast to bf16 (fast with AMX)")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--ckpt-minutes", type=float, default=5.0)
    t.add_argument("--ckpt-dir", default=str(CKPT_DIR))
    t.add_argument("--init-from", default=None, help="start from another run's checkpoint (its last.pt) or an "
                   "exported head folder: the head's weights only; a run resuming from its own --ckpt-dir ignores this")
    t.add_argument("--export", default=None, help="write the head here when done (rerun with the same --steps: "
                   "export only)")
    t.add_argument("--export-best", action="store_true", help="export the weights of the best held-out "
                   "agreement logged (best.pt in --ckpt-dir) instead of the last step's")
    t.add_argument("--own-readout", action="store_true", help="train rows of the head's own for its readout "
                   "(starting as the target's LM head rows of its tokens; exported as lm_head.weight) instead of "
                   "reading out through the target's frozen rows")
    t.add_argument("--export-vocab", type=int, default=None, help="draft tokens of the exported head (a prefix of "
                   "the kept set; default --vocab)")
    rl = sub.add_parser("relabel", help="the shards of --from with the features of --feature-layers")
    rl.add_argument("--from", dest="source", required=True)
    rl.add_argument("--bf16", action="store_true")
    rl.add_argument("--first", type=int, default=0)
    rl.add_argument("--every", type=int, default=1)
    for p in (d, dr, c, t, rl):
        p.add_argument("--feature-layers", type=parse_layers, default=(-1,), help="the target's hidden states the head "
                       "reads, comma-separated, -1 (the final normed feature) last; e.g. 2,15,-1")
    args = ap.parse_args(argv)
    {"data": cmd_data, "drafted": cmd_drafted, "corpus": cmd_corpus, "train": cmd_train,
     "relabel": cmd_relabel}[args.cmd](args)


if __name__ == "__main__":
    main()
