"""The loop's prefill of a ragged batch: runs of rows (``sequoia_decoding.prefill``) against the
padded batch, on the real target, interleaved.

    python bench/prefill_ragged.py                           # batches of 4 and 16 held-out prompts, the demo's dtype
    python bench/prefill_ragged.py --dtype float32 --batches 2,8 --rounds 5

Each batch is the next ``B`` prompts of ``--prompts`` (chat prompts through the chat template, raw
ones as text: their lengths as they come). Per round both ways run one after the other (the order
alternates): ``SequoiaGenerator(target, draft, plan).generate(batch, max_new_tokens=1)`` and its
``prefill_s`` (the target and the draft reading every prompt but its last token, nothing else),
the padded way with ``prefill.runs`` patched to one run of every row. One row per batch size:
the tokens the target read each way, the median prefill of each, and the median over rounds of
the paired ratio padded / runs (> 1: the runs faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))


def main() -> int:
    from transformers import AutoTokenizer

    from sequoia_decoding import prefill as prefill_mod
    from sequoia_decoding.demo import DEFAULT_HEAD
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import load_causal_lm, load_draft
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.planner import plan_tree
    from sequoia_decoding.profiles import cpu_name
    from sequoia_decoding.profiling import pick_dtype
    from sequoia_decoding.prompts import load_prompt_ids

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the demo's choice here)")
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", default=os.path.join(ROOT, "models", "draft", "heldout_prompts.txt"))
    ap.add_argument("--draft", default=str(DEFAULT_HEAD))
    args = ap.parse_args()
    target_dir = ensure_target()
    dtype = args.dtype or pick_dtype(target_dir, torch.device("cpu"))[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=dtype, device="cpu")
    draft = load_draft(args.draft, dtype=dtype, device="cpu")
    sizes = [int(b) for b in args.batches.split(",")]
    prompts = load_prompt_ids(args.prompts, tok, sum(sizes))
    gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2], 4, 2), SamplingParams(), max_length=1024)
    print(f"\nSmolLM2-135M-Instruct / {os.path.basename(args.draft.rstrip('/'))}, {cpu_name()}, "
          f"{torch.get_num_threads()} threads, {dtype}, {args.rounds} rounds\n")
    print("| B | prompt tokens (shortest - longest) | read: runs / padded | prefill runs | prefill padded | "
          "padded / runs |")
    print("|---:|---:|---:|---:|---:|---:|")
    start = 0
    for B in sizes:
        batch, start = prompts[start:start + B], start + B
        lens = [len(p) - 1 for p in batch]
        gen.generate(batch, max_new_tokens=1)  # warm-up: weights packed, kernels loaded
        times = {"runs": [], "padded": []}
        for r in range(args.rounds):
            for way in (("runs", "padded") if r % 2 == 0 else ("padded", "runs")):
                saved = prefill_mod.runs
                if way == "padded":
                    prefill_mod.runs = lambda lens_: [(0, len(lens_))]
                try:
                    times[way].append(gen.generate(batch, max_new_tokens=1).prefill_s)
                finally:
                    prefill_mod.runs = saved
        ratio = statistics.median(p / q for p, q in zip(times["padded"], times["runs"]))
        read = sum(max(lens[a:z]) * (z - a) for a, z in prefill_mod.runs(lens))
        print(f"| {B} | {sum(lens) + B} ({min(lens) + 1} - {max(lens) + 1}) | {read} / {B * max(lens)} | "
              f"{statistics.median(times['runs']) * 1e3:.0f} ms | {statistics.median(times['padded']) * 1e3:.0f} ms "
              f"| {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
