#!/usr/bin/env python
"""Distil the SmolLM2-135M-Instruct target into the small draft (see models/draft/README.md).

One process does everything, one heavy thing at a time (the machine's 2 cores are shared):
in rounds of ``--steps-per-round`` training steps it first makes sure the data shards this
round needs exist (generating target continuations / labelling corpus windows with
``scripts/draft/draft_data.py``'s functions, in-process), then trains. How many shards a round
needs depends only on the step number, so the run is deterministic given ``--seed`` (one
thread) and resumes exactly from any checkpoint.

Objective: distillation on the draft vocabulary (V kept tokens + UNK). The teacher's cached
top-K logits and logsumexp give p over the full vocab; kept tokens keep their probability,
the rest (non-kept top-K tokens + the mass outside the top-K) goes to the UNK bucket.
loss = KL(p || q) [+ --ce-weight * CE(next token)], q = softmax of the draft's V+1 logits.

Checkpoints (atomic) every ``--ckpt-minutes`` to ``--ckpt-dir`` (default
``~/.cache/sequoia-kernels/draft-ckpt/``); a restart with the same command resumes from the
newest one. Log: ``<ckpt-dir>/train.log``. ``--export DIR`` writes the fp16 DraftLM (EMA
weights) after every round and at the end; ``--export-only`` just exports the latest
checkpoint.

Typical (background) use::

    nohup nice -n 19 .venv/bin/python scripts/draft/train_draft.py \\
        --export ~/.cache/sequoia-kernels/draft-export >> ~/.cache/sequoia-kernels/draft-train.out 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "python_api"))
sys.path.insert(0, str(REPO / "scripts" / "draft"))

import draft_data  # noqa: E402
from sequoia_decoding.modeling.draft import (  # noqa: E402
    FULL_VOCAB, DraftLM, build_draft_llama, init_embeddings_from_target)
from sequoia_decoding.modeling.smollm2 import CACHE_ROOT, load_target  # noqa: E402

CKPT_DIR = CACHE_ROOT / "draft-ckpt"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--data-dir", default=str(draft_data.DATA_DIR))
    a("--ckpt-dir", default=str(CKPT_DIR))
    a("--export", default=None, help="folder for the fp16 DraftLM (EMA weights)")
    a("--export-only", action="store_true", help="export the latest checkpoint and exit")
    a("--seed", type=int, default=0)
    a("--threads", type=int, default=1)
    # architecture (see sequoia_decoding.modeling.draft.DEFAULT_ARCH)
    a("--vocab-size", type=int, default=14336, help="kept target tokens (UNK is added)")
    a("--hidden", type=int, default=384)
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=6)
    a("--kv-heads", type=int, default=2)
    a("--ffn", type=int, default=1024)
    a("--final-norm-init", type=float, default=0.1)
    # optimisation
    a("--rows", type=int, default=12, help="packed rows per step")
    a("--seq-len", type=int, default=512, help="tokens per packed row")
    a("--lr", type=float, default=1.5e-3)
    a("--min-lr", type=float, default=1e-4)
    a("--warmup", type=int, default=300)
    a("--total-steps", type=int, default=8000, help="cosine horizon; training continues at --min-lr after it")
    a("--max-steps", type=int, default=10**9, help="stop after this many steps")
    a("--weight-decay", type=float, default=0.01)
    a("--grad-clip", type=float, default=1.0)
    a("--ema", type=float, default=0.999)
    a("--ce-weight", type=float, default=0.0, help="weight of hard-label CE on the next token")
    a("--gen-frac", type=float, default=0.6, help="fraction of sequences drawn from generated data")
    a("--bf16", type=int, default=1, help="bf16 autocast for the draft's matmuls (AMX)")
    # data schedule: shards required before training step s (deterministic in s)
    a("--gen-initial", type=int, default=8)
    a("--lab-initial", type=int, default=16)
    a("--gen-per-round", type=int, default=4)
    a("--lab-per-round", type=int, default=6)
    a("--steps-per-round", type=int, default=200)
    a("--max-gen-shards", type=int, default=1200)
    a("--max-lab-shards", type=int, default=600)
    a("--take-existing", action="store_true",
      help="at each round also use shards beyond the schedule that already exist (e.g. made by a parallel "
           "`draft_data.py generate` process); the data then depends on timing, and the log records it")
    # bookkeeping
    a("--ckpt-minutes", type=float, default=5.0)
    a("--keep-ckpts", type=int, default=3)
    a("--log-every", type=int, default=20)
    a("--eval-every", type=int, default=1000, help="agreement on the cached held-out eval set (0: off)")
    return ap.parse_args(argv)


def log(fh, msg):
    line = time.strftime("%Y-%m-%d %H:%M:%S ") + msg
    print(line, flush=True)
    fh.write(line + "\n")
    fh.flush()


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------

class ShardPool:
    """All loaded shards of one kind, with top-K ids mapped to draft ids."""

    def __init__(self, full_to_draft: np.ndarray):
        self.f2d = full_to_draft  # [V_full] int64
        self.loaded: list[str] = []
        self.seqs: list[tuple[int, int, int]] = []  # (shard, start, end)
        self.arrays: list[dict] = []

    def add(self, path: Path):
        z = np.load(path)
        arr = {
            "tokens": self.f2d[z["tokens"].astype(np.int64)].astype(np.int32),  # [N] draft ids
            "tids": self.f2d[z["topk_ids"].astype(np.int64)].astype(np.int16),  # [N, K] draft ids
            "tlog": z["topk_logits"],  # [N, K] fp16
            "lse": z["lse"],  # [N] fp32
        }
        off = z["offsets"]
        si = len(self.arrays)
        self.arrays.append(arr)
        self.seqs += [(si, int(off[i]), int(off[i + 1])) for i in range(len(off) - 1) if off[i + 1] - off[i] > 1]
        self.loaded.append(path.name)

    def sync(self, paths: list[Path]):
        have = set(self.loaded)
        for p in paths:
            if p.name not in have:
                self.add(p)

    def ntokens(self):
        return sum(e - s for _, s, e in self.seqs)


def make_batch(pools: dict, rng: np.random.Generator, rows: int, seq_len: int, gen_frac: float, unk: int):
    """Pack random sequences into ``rows`` x ``seq_len`` (positions restart per sequence, so the
    model's packed-sequence mask keeps them apart). Returns numpy arrays:
    ids [R, L] int64, pos [R, L] int64, valid [R, L] bool (row has a teacher label),
    tids [R, L, K] int64, tlog [R, L, K] f32, lse [R, L] f32, nxt [R, L] int64 (-1: none)."""
    K = pools["gen"].arrays[0]["tids"].shape[1] if pools["gen"].arrays else pools["lab"].arrays[0]["tids"].shape[1]
    ids = np.full((rows, seq_len), unk, np.int64)
    pos = np.zeros((rows, seq_len), np.int64)
    valid = np.zeros((rows, seq_len), bool)
    tids = np.full((rows, seq_len, K), unk, np.int64)
    tlog = np.full((rows, seq_len, K), -1e4, np.float32)
    lse = np.zeros((rows, seq_len), np.float32)
    nxt = np.full((rows, seq_len), -1, np.int64)
    for r in range(rows):
        fill = 0
        while seq_len - fill >= 32:
            use_gen = pools["gen"].seqs and (not pools["lab"].seqs or rng.random() < gen_frac)
            pool = pools["gen"] if use_gen else pools["lab"]
            si, s, e = pool.seqs[int(rng.integers(len(pool.seqs)))]
            space = seq_len - fill
            n = e - s
            if n > space:
                if fill == 0 and rng.random() < 0.5:  # a long sequence alone: sometimes a later window
                    s = int(rng.integers(s, e - space + 1))
                n = space
            a = pool.arrays[si]
            sl = slice(fill, fill + n)
            ids[r, sl] = a["tokens"][s:s + n]
            pos[r, sl] = np.arange(n)
            valid[r, sl] = True
            tids[r, sl] = a["tids"][s:s + n]
            tlog[r, sl] = a["tlog"][s:s + n]
            lse[r, sl] = a["lse"][s:s + n]
            nxt[r, fill:fill + n - 1] = a["tokens"][s + 1:s + n]
            fill += n
        pos[r, fill:] = np.arange(seq_len - fill)  # padding: its own (ignored) sequence
    return ids, pos, valid, tids, tlog, lse, nxt


def teacher_targets(tids, tlog, lse, unk):
    """Teacher distribution over draft classes from cached top-K.
    tids [N, K] draft ids, tlog [N, K], lse [N] -> (ids [N, K], probs [N, K], p_unk [N]);
    non-kept entries get probability 0 in ``probs`` and their mass moves to ``p_unk``."""
    p = torch.exp(tlog - lse[:, None])  # [N, K]
    resid = (1.0 - p.sum(1)).clamp_min(0.0)  # [N] mass outside the top-K
    is_unk = tids == unk  # [N, K]
    p_unk = resid + (p * is_unk).sum(1)  # [N]
    p = p.masked_fill(is_unk, 0.0)
    return tids, p, p_unk


def distill_loss(logits, tids, p, p_unk, unk):
    """logits [N, V+1]; returns (soft CE [N], KL [N], log q [N, V+1])."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, V+1]
    ce = -(p * logq.gather(1, tids)).sum(1) - p_unk * logq[:, unk]  # [N]
    ent = -(torch.xlogy(p, p).sum(1) + torch.xlogy(p_unk, p_unk))  # [N]
    return ce, ce - ent, logq


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------

def latest_ckpt(ckpt_dir: Path) -> Path | None:
    c = sorted(ckpt_dir.glob("ckpt-*.pt"))
    return c[-1] if c else None


def save_ckpt(ckpt_dir: Path, state: dict, keep: int) -> Path:
    path = ckpt_dir / f"ckpt-{state['step']:08d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(ckpt_dir.glob("ckpt-*.pt"))[:-keep]:
        old.unlink()
    return path


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, args.total_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * t))


def export(ckpt: dict, folder: Path, note: dict | None = None) -> Path:
    llama = build_draft_llama(len(ckpt["draft_to_full"]), **ckpt["arch"])
    llama.load_state_dict(ckpt["ema"])
    llama.tie_weights()
    model = DraftLM(llama, torch.as_tensor(ckpt["draft_to_full"]))
    extra = {"step": ckpt["step"], "weights": "EMA", "train_args": ckpt["args"]}
    extra.update(note or {})
    return model.save(folder, extra=extra)


# ---------------------------------------------------------------------------------------
# main loop
# ---------------------------------------------------------------------------------------

def required_shards(step: int, args) -> tuple[int, int]:
    r = step // args.steps_per_round
    return (min(args.max_gen_shards, args.gen_initial + r * args.gen_per_round),
            min(args.max_lab_shards, args.lab_initial + r * args.lab_per_round))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fh = open(ckpt_dir / "train.log", "a")

    last = latest_ckpt(ckpt_dir)
    if args.export_only:
        if last is None:
            raise SystemExit(f"no checkpoint in {ckpt_dir}")
        print(export(torch.load(last, weights_only=False), Path(args.export)))
        return

    if not (data / "prompts-train.jsonl").exists():
        raise SystemExit(f"run `python scripts/draft/draft_data.py corpus` first ({data} has no prompts)")

    target = tok = None

    def get_target():
        nonlocal target, tok
        if target is None:
            target, tok = load_target(attn_implementation="sdpa")
        return target, tok

    def ensure_data(step):
        need_gen, need_lab = required_shards(step, args)
        for i in range(need_gen):
            if not (data / "gen" / f"shard-{i:05d}.npz").exists():
                m, t = get_target()
                draft_data.make_generation_shard(m, t, data, i, args.seed)
        for i in range(need_lab):
            if not (data / "lab" / f"shard-{i:05d}.npz").exists():
                m, _ = get_target()
                draft_data.make_label_shard(m, data, i, args.seed)
        if args.take_existing:
            while (data / "gen" / f"shard-{need_gen:05d}.npz").exists() and need_gen < args.max_gen_shards:
                need_gen += 1
            while (data / "lab" / f"shard-{need_lab:05d}.npz").exists() and need_lab < args.max_lab_shards:
                need_lab += 1
        return ([data / "gen" / f"shard-{i:05d}.npz" for i in range(need_gen)],
                [data / "lab" / f"shard-{i:05d}.npz" for i in range(need_lab)])

    arch = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                intermediate_size=args.ffn)

    if last is not None:
        ckpt = torch.load(last, weights_only=False)
        draft_to_full = np.asarray(ckpt["draft_to_full"], np.int64)
        arch = ckpt["arch"]
        step = ckpt["step"]
        log(fh, f"resuming from {last} (step {step})")
    else:
        ckpt = None
        step = 0
        ensure_data(0)
        vpath = data / f"vocab-{args.vocab_size}.npy"
        if not vpath.exists():
            kept, stats = draft_data.build_vocab(data, args.vocab_size)
            np.save(vpath, kept)
            draft_data.atomic_write_text(data / f"vocab-{args.vocab_size}.json", json.dumps(stats, indent=2))
            log(fh, f"vocab {args.vocab_size}: {json.dumps(stats)}")
        draft_to_full = np.load(vpath).astype(np.int64)

    V = len(draft_to_full)
    unk = V
    full_to_draft = np.full(FULL_VOCAB, unk, np.int64)
    full_to_draft[draft_to_full] = np.arange(V)
    d2f = torch.as_tensor(draft_to_full)
    inv = {v: k for k, v in enumerate(draft_to_full.tolist())}
    eos, bos = inv.get(2), inv.get(1)
    arch_kw = dict(arch, eos_draft_id=eos, bos_draft_id=bos)

    torch.manual_seed(args.seed)
    llama = build_draft_llama(V, **arch_kw)
    llama.config._attn_implementation = "sdpa"
    if ckpt is None:
        m, _ = get_target()
        init_embeddings_from_target(llama, m.model.embed_tokens.weight, d2f)
        llama.tie_weights()
        with torch.no_grad():  # small final-norm gain: start from a near-uniform q, not random peaks
            llama.model.norm.weight.fill_(args.final_norm_init)
    decay, no_decay = [], []
    for n, p_ in llama.named_parameters():
        (decay if p_.ndim == 2 and "embed" not in n else no_decay).append(p_)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    ema = {k: v.detach().clone() for k, v in llama.state_dict().items()}
    if ckpt is not None:
        llama.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        ema = ckpt["ema"]
    n_params = sum(p_.numel() for p_ in llama.parameters())
    log(fh, f"draft: {arch} V={V}+UNK params={n_params / 1e6:.2f}M (fp16 {n_params * 2 / 1e6:.1f} MB); "
            f"args={json.dumps(vars(args))}")

    eval_set = None
    if args.eval_every:
        import eval_draft
        eval_path = data / "eval" / "greedy.npz"
        if not eval_path.exists():
            m, t = get_target()
            eval_draft.build_eval_sets(m, t, data, args.seed)
        eval_set = eval_draft.load_eval_set(eval_path)

    pools = {"gen": ShardPool(full_to_draft), "lab": ShardPool(full_to_draft)}

    def state():
        return {"step": step, "model": llama.state_dict(), "opt": opt.state_dict(), "ema": ema,
                "draft_to_full": draft_to_full.tolist(), "arch": arch, "args": vars(args)}

    def run_eval():
        import eval_draft
        out = []
        for name, weights in (("ema", ema), ("raw", llama.state_dict())):
            llama_e = build_draft_llama(V, **arch_kw)
            llama_e.load_state_dict(weights)
            llama_e.tie_weights()
            res = eval_draft.quick_agreement(DraftLM(llama_e, d2f).eval(), eval_set)
            out.append(f"{name} {res['agreement']:.4f}")
        log(fh, f"eval step {step}: heldout greedy agreement {', '.join(out)} on {res['positions']} "
                f"positions; in-vocab ceiling {res['ceiling']:.4f}")

    last_ckpt_t = time.time()
    t0, tok_count, acc = time.time(), 0, {"kl": 0.0, "ce": 0.0, "agree": 0.0, "n": 0}
    while step < args.max_steps:
        if step % args.steps_per_round == 0 or not pools["gen"].seqs:
            gen_paths, lab_paths = ensure_data(step)
            pools["gen"].sync(gen_paths)
            pools["lab"].sync(lab_paths)
            log(fh, f"step {step}: data gen {len(pools['gen'].loaded)} shards / {pools['gen'].ntokens()} tok, "
                    f"lab {len(pools['lab'].loaded)} shards / {pools['lab'].ntokens()} tok")
            t0, tok_count = time.time(), 0
        rng = np.random.default_rng([args.seed, step])
        ids, pos, valid, tids, tlog, lse, nxt = make_batch(pools, rng, args.rows, args.seq_len, args.gen_frac, unk)
        ids_t, pos_t = torch.from_numpy(ids), torch.from_numpy(pos)  # [R, L]
        vmask = torch.from_numpy(valid)  # [R, L]
        t_ids, t_p, t_unk = teacher_targets(torch.from_numpy(tids)[vmask], torch.from_numpy(tlog)[vmask],
                                            torch.from_numpy(lse)[vmask], unk)  # [N, K], [N, K], [N]
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        llama.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(args.bf16)):
            hidden = llama.model(input_ids=ids_t, position_ids=pos_t, use_cache=False).last_hidden_state  # [R, L, d]
            logits = llama.lm_head(hidden[vmask])  # [N, V+1]
        ce, kl, logq = distill_loss(logits, t_ids, t_p, t_unk, unk)
        loss = kl.mean()
        if args.ce_weight > 0:
            nx = torch.from_numpy(nxt)[vmask]  # [N]
            has = nx >= 0
            hard = -logq[has].gather(1, nx[has, None]).mean()
            loss = loss + args.ce_weight * hard
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(llama.parameters(), args.grad_clip)
        opt.step()
        with torch.no_grad():
            beta = min(args.ema, (1 + step) / (10 + step))  # EMA warm-up
            for k, v in llama.state_dict().items():
                if v.dtype.is_floating_point:
                    ema[k].mul_(beta).add_(v.detach(), alpha=1 - beta)
            pred = logq[:, :unk].argmax(1)  # [N] never UNK
            teacher_top = torch.from_numpy(tids)[vmask][:, 0]
            acc["agree"] += (pred == teacher_top).float().sum().item()
            acc["kl"] += kl.sum().item()
            acc["ce"] += ce.sum().item()
            acc["n"] += kl.numel()
        step += 1
        tok_count += int(valid.sum())
        if step % args.log_every == 0:
            n = max(acc["n"], 1)
            log(fh, f"step {step} lr {lr:.2e} kl {acc['kl'] / n:.4f} softce {acc['ce'] / n:.4f} "
                    f"train-agree {acc['agree'] / n:.4f} tok/s {tok_count / (time.time() - t0):.0f}")
            acc = {"kl": 0.0, "ce": 0.0, "agree": 0.0, "n": 0}
        if eval_set is not None and step % args.eval_every == 0:
            run_eval()
        round_end = step % args.steps_per_round == 0
        if round_end or time.time() - last_ckpt_t > args.ckpt_minutes * 60 or step >= args.max_steps:
            path = save_ckpt(ckpt_dir, state(), args.keep_ckpts)
            last_ckpt_t = time.time()
            if round_end or step >= args.max_steps:
                log(fh, f"checkpoint {path.name}")
                if args.export:
                    export(state(), Path(args.export))
    if args.export:
        log(fh, f"exported {export(state(), Path(args.export))}")


if __name__ == "__main__":
    main()
