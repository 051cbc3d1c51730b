#!/usr/bin/env python
"""Evaluate the SmolLM2 draft against the target on held-out prompts.

Metrics (written as JSON to ``--out`` and printed):

* **greedy agreement** -- the fraction of the target's greedy tokens that the draft's argmax
  matches, teacher-forced on the target's *greedy* continuations of the held-out prompts
  (``models/draft/heldout_prompts.txt``; positions of the continuation only). Also reported on
  the temperature-0.6 continuations, and the "in-vocab ceiling" (fraction of target tokens
  the reduced-vocab draft can emit at all).
* **Sequoia acceptance vector** at temperature 0.6 on the T=0.6 continuations. At each
  position, p = softmax(target/T), q = softmax(draft/T) (q = 0 outside the kept vocab). Children
  are sampled from q without replacement and verified with the residual rule: child x is
  accepted if u * q(x) < p(x); otherwise p <- norm(max(p - q, 0)) and q <- q without x,
  renormalised. Reported (Monte Carlo over positions x ``--mc`` runs):
    ``acceptance_vector``[k-1] = P(the k-th child is the accepted one)  (Sequoia's p_k; the sum
        is the probability that one of the first K children is accepted), and
    ``acceptance_conditional``[k-1] = P(k-th child accepted | children 1..k-1 rejected).
* **step-time ratio** -- one draft token step / one target token step on this CPU: fp32, HF
  eager, 256-token prefix in the KV cache, median of repeated 1-token forwards, 1 and 2
  threads. The draft step includes DraftLM's id mapping and full-vocab logits.

The held-out continuations are generated once (batched, KV cache) and cached under
``<data-dir>/eval/``; the target logits used for the metrics are recomputed teacher-forced,
unpadded, fp32 eager.

Usage::

    nice -n 19 .venv/bin/python scripts/draft/eval_draft.py --draft ~/.cache/sequoia-kernels/draft-export
"""

from __future__ import annotations

import argparse
import json
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
from sequoia_decoding.modeling.draft import DraftLM  # noqa: E402
from sequoia_decoding.modeling.smollm2 import load_target  # noqa: E402
from sequoia_decoding.prompts import prompt_ids, read_prompts  # noqa: E402

EVAL_TEMPS = {"greedy": 0.0, "t06": 0.6}


# ---------------------------------------------------------------------------------------
# held-out continuations
# ---------------------------------------------------------------------------------------

def build_eval_sets(target, tok, data: Path, seed: int = 0, max_new: int = 256) -> None:
    """Target continuations of the held-out prompts, greedy and T=0.6 (cached shards)."""
    prompts = read_prompts(draft_data.HELDOUT_REPO)
    p_ids = [prompt_ids(tok, p) for p in prompts]
    (data / "eval").mkdir(parents=True, exist_ok=True)
    for name, temp in EVAL_TEMPS.items():
        path = data / "eval" / f"{name}.npz"
        if path.exists():
            continue
        t0 = time.time()
        gen = torch.Generator().manual_seed(seed * 7919 + 17)
        recs = []
        for i in range(0, len(p_ids), 25):
            recs += draft_data.generate_batch(target, p_ids[i:i + 25], [max_new] * len(p_ids[i:i + 25]), temp, gen)
        for p, r in zip(prompts, recs):
            r["meta"] = {"kind": p["kind"], "prompt_len": r["prompt_len"], "temperature": temp}
        draft_data.atomic_save_npz(path, **draft_data.pack_shard(recs))
        draft_data.log(f"eval set {name}: {sum(len(r['tokens']) - r['prompt_len'] for r in recs)} new tokens, "
                       f"{time.time() - t0:.0f}s")


def load_eval_set(path: Path) -> list[dict]:
    """Sequences: tokens [L] (full ids), prompt_len, teacher argmax per row [L] (from the cache)."""
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    off = z["offsets"]
    out = []
    for i, m in enumerate(meta):
        s, e = int(off[i]), int(off[i + 1])
        out.append({"tokens": z["tokens"][s:e].astype(np.int64), "prompt_len": m["prompt_len"],
                    "teacher_top": z["topk_ids"][s:e, 0].astype(np.int64), "kind": m["kind"]})
    return out


def continuation_rows(seq: dict) -> slice:
    """Rows whose next token is a continuation token (row t predicts token t+1). The cache
    drops each sequence's final sampled token but keeps the row predicting it."""
    return slice(seq["prompt_len"] - 1, len(seq["tokens"]))


@torch.no_grad()
def quick_agreement(draft: DraftLM, eval_set: list[dict]) -> dict:
    """Greedy agreement vs the cached teacher argmax (used during training)."""
    hit = n = inv = 0
    for seq in eval_set:
        ids = torch.as_tensor(seq["tokens"])[None]  # [1, L]
        logits = draft.draft_forward(ids, use_cache=False).logits[0]  # [L, V+1]
        rows = continuation_rows(seq)
        pred = draft.draft_to_full[logits[rows, : draft.num_kept].argmax(-1)]  # [n]
        top = torch.as_tensor(seq["teacher_top"][rows])
        hit += int((pred == top).sum())
        inv += int((draft.full_to_draft[top] != draft.unk_id).sum())
        n += top.numel()
    return {"agreement": hit / max(n, 1), "positions": n, "ceiling": inv / max(n, 1)}


# ---------------------------------------------------------------------------------------
# full evaluation
# ---------------------------------------------------------------------------------------

@torch.no_grad()
def teacher_forced_logits(model, seq: dict) -> torch.Tensor:
    """Continuation-row logits [n, V_full] of a full-vocab causal LM on one sequence."""
    ids = torch.as_tensor(seq["tokens"])[None]  # [1, L]
    return model(ids, use_cache=False).logits[0, continuation_rows(seq)].float()


@torch.no_grad()
def acceptance_vector(p_logits: torch.Tensor, q_logits: torch.Tensor, kept: torch.Tensor, temperature: float,
                      k_max: int, runs: int, gen: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Monte Carlo Sequoia acceptance counts.

    p_logits, q_logits: [N, V_full] (q is -inf outside the draft vocab); kept: [V] the draft's
    target ids. Exact reduction: q is zero outside ``kept`` so those tokens are never drafted
    and never change under the residual update; they are tracked as one aggregated mass.
    Returns (accepted_at [k_max]: runs in which child k was accepted,
             tried_at [k_max]: runs in which child k was drafted, i.e. children < k rejected)."""
    acc = np.zeros(k_max)
    tried = np.zeros(k_max)
    p_full = torch.softmax(p_logits / temperature, -1)  # [N, V_full]
    p0 = p_full[:, kept]  # [N, V]
    out0 = (1.0 - p0.sum(-1)).clamp_min(0.0)  # [N] target mass on non-kept tokens
    q0 = torch.softmax(q_logits[:, kept] / temperature, -1)  # [N, V]
    for _ in range(runs):
        p, out, q = p0.clone(), out0.clone(), q0.clone()
        alive = torch.ones(p.shape[0], dtype=torch.bool)  # no child accepted yet
        for k in range(k_max):
            qs = q.sum(-1)  # [N]
            live = alive & (qs > 1e-12)
            if not live.any():
                break
            idx = live.nonzero()[:, 0]
            qn = q[idx] / qs[idx, None]  # [n, V]
            x = torch.multinomial(qn, 1, generator=gen)[:, 0]  # [n]
            px = p[idx].gather(1, x[:, None])[:, 0]
            qx = qn.gather(1, x[:, None])[:, 0]
            u = torch.rand(idx.numel(), generator=gen)
            ok = u * qx < px  # [n]
            tried[k] += idx.numel()
            acc[k] += int(ok.sum())
            alive[idx[ok]] = False
            rej = idx[~ok]
            if rej.numel():
                r = (p[rej] - qn[~ok]).clamp_min(0)  # [m, V] residual on kept tokens
                z = r.sum(-1) + out[rej]  # [m] normaliser (non-kept mass unchanged)
                good = z > 0
                zs = z.clamp_min(1e-30)
                p[rej] = torch.where(good[:, None], r / zs[:, None], p[rej])
                out[rej] = torch.where(good, out[rej] / zs, out[rej])
                q[rej] = qn[~ok].scatter(1, x[~ok, None], 0.0)
    return acc, tried


@torch.no_grad()
def step_time(model, threads: int, vocab: int = 49152, prefix: int = 256, reps: int = 40) -> float:
    """Median seconds of one 1-token forward with a ``prefix``-token KV cache."""
    from transformers import DynamicCache

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, prefix), generator=gen)  # [1, P]
    cache = DynamicCache()
    model(ids, past_key_values=cache, use_cache=True)
    x = torch.randint(0, vocab, (1, 1), generator=gen)  # [1, 1]
    pos = torch.tensor([[prefix]])
    ts = []
    for _ in range(reps + 5):
        t = time.perf_counter()
        model(x, position_ids=pos, past_key_values=cache, use_cache=True)
        ts.append(time.perf_counter() - t)
        cache.crop(-1)
    torch.set_num_threads(old)
    return float(np.median(ts[5:]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="folder written by DraftLM.save / train_draft.py --export")
    ap.add_argument("--data-dir", default=str(draft_data.DATA_DIR))
    ap.add_argument("--out", default=None, help="JSON results (default: <draft>/eval.json)")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--k-max", type=int, default=16)
    ap.add_argument("--mc", type=int, default=4, help="Monte Carlo runs per position")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = Path(args.data_dir)

    target, tok = load_target()  # fp32, eager
    if not (data / "eval" / "greedy.npz").exists() or not (data / "eval" / "t06.npz").exists():
        sdpa_target, _ = load_target(attn_implementation="sdpa")
        build_eval_sets(sdpa_target, tok, data, args.seed)
        del sdpa_target
    draft = DraftLM.load(args.draft)
    res = {"draft": str(args.draft), "kept_vocab": draft.num_kept}
    gen = torch.Generator().manual_seed(args.seed)
    acc_tot = np.zeros(args.k_max)
    tried_tot = np.zeros(args.k_max)
    for name in EVAL_TEMPS:
        seqs = load_eval_set(data / "eval" / f"{name}.npz")
        hit = n = inv = 0
        for seq in seqs:
            p_log = teacher_forced_logits(target, seq)  # [n, V_full]
            q_log = teacher_forced_logits(draft, seq)  # [n, V_full]
            top = p_log.argmax(-1)
            hit += int((q_log.argmax(-1) == top).sum())
            inv += int(torch.isfinite(q_log.gather(1, top[:, None])).sum())
            n += top.numel()
            if name == "t06":
                for i in range(0, p_log.shape[0], 128):
                    a, t = acceptance_vector(p_log[i:i + 128], q_log[i:i + 128], draft.draft_to_full,
                                             args.temperature, args.k_max, args.mc, gen)
                    acc_tot += a
                    tried_tot += t
        res[f"agreement_{name}"] = hit / max(n, 1)
        res[f"ceiling_{name}"] = inv / max(n, 1)
        res[f"positions_{name}"] = n
        draft_data.log(f"{name}: agreement {hit / max(n, 1):.4f} over {n} positions (in-vocab {inv / max(n, 1):.4f})")
    runs = tried_tot[0]
    res["acceptance_temperature"] = args.temperature
    res["acceptance_vector"] = (acc_tot / max(runs, 1)).round(4).tolist()
    res["acceptance_conditional"] = (acc_tot / np.maximum(tried_tot, 1)).round(4).tolist()
    res["acceptance_runs"] = int(runs)
    draft_data.log(f"acceptance vector (T={args.temperature}): {res['acceptance_vector']}")
    draft_data.log(f"conditional: {res['acceptance_conditional']}")

    if not args.no_timing:
        for th in (1, 2):
            tt = step_time(target, th)
            td = step_time(draft, th)
            res[f"target_step_ms_{th}t"] = tt * 1e3
            res[f"draft_step_ms_{th}t"] = td * 1e3
            res[f"step_ratio_{th}t"] = td / tt
            draft_data.log(f"{th} thread(s): target {tt * 1e3:.1f} ms, draft {td * 1e3:.2f} ms, "
                           f"ratio {td / tt:.3f} (1/{tt / td:.1f})")
        res["loadavg"] = os.getloadavg()
    out = Path(args.out) if args.out else Path(args.draft) / "eval.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
