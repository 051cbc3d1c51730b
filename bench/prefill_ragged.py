"""The loop's prefill of a ragged batch on the real target, interleaved: runs of rows against the
padded batch (``sequoia_decoding.prefill``), and, where long calls now run packed
(``packed_prefill_pays``), the padded batch on torch's GEMM above 64 rows as before.

    python bench/prefill_ragged.py                           # batches of 4 and 16, the demo's dtype
    python bench/prefill_ragged.py --dtype float32 --batches 2,8 --rounds 5

Row b of a batch is ``SPANS[b % 8]`` consecutive prompts of ``--prompts`` joined (chat prompts
through the chat template, raw ones as text), starting at prompt b: rows of ~1 to ~8 prompts, as
a server's batch mixes short questions and long contexts. Per round every way runs once, in a
rotating order: ``SequoiaGenerator(target, draft, plan).generate(batch, max_new_tokens=1)``'s
``prefill_s`` (the target and the draft reading every prompt but its last token). One row per
batch size and way: the tokens the target read, the median prefill, and the median over rounds
of the paired ratio to the runs (> 1: the runs faster).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))

SPANS = (1, 6, 2, 8, 3, 5, 1, 4)  # prompts joined per row


@contextlib.contextmanager
def way(name: str):
    """The prefill as ``name`` reads it: "runs" (today), "padded" (one forward of the padded
    batch), "padded, torch's GEMM" (and calls above 64 rows on torch's GEMM: before both)."""
    from sequoia_kernels.ops import packed_linear

    from sequoia_decoding import prefill

    saved = prefill.runs, packed_linear.packed_prefill_pays
    if name != "runs":
        prefill.runs = lambda lens: [(0, len(lens))]
    if name == "padded, torch's GEMM":
        packed_linear.packed_prefill_pays = lambda dtype: False
    try:
        yield
    finally:
        prefill.runs, packed_linear.packed_prefill_pays = saved


def main() -> int:
    from sequoia_kernels.ops.packed_linear import packed_prefill_pays
    from transformers import AutoTokenizer

    from sequoia_decoding import prefill
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
    prompts = load_prompt_ids(args.prompts, tok)
    gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2], 4, 2), SamplingParams(), max_length=1024)
    ways = ["runs", "padded"] + (["padded, torch's GEMM"] if packed_prefill_pays(getattr(torch, dtype)) else [])
    print(f"\nSmolLM2-135M-Instruct / {os.path.basename(args.draft.rstrip('/'))}, {cpu_name()}, "
          f"{torch.get_num_threads()} threads, {dtype}, {args.rounds} rounds\n")
    print("| B | prompt tokens (shortest - longest) | way | target read | prefill | vs runs |")
    print("|---:|---:|:---|---:|---:|---:|")
    for B in (int(b) for b in args.batches.split(",")):
        batch = [sum((prompts[(b + j) % len(prompts)] for j in range(SPANS[b % len(SPANS)])), []) for b in range(B)]
        lens = [len(p) - 1 for p in batch]
        times = {w: [] for w in ways}
        for r in range(args.rounds + 1):  # round 0: warm-up (weights packed, kernels loaded)
            for w in ways[r % len(ways):] + ways[:r % len(ways)]:
                with way(w):
                    t = gen.generate(batch, max_new_tokens=1).prefill_s
                if r:
                    times[w].append(t)
        read = {"runs": sum(max(lens[a:z]) * (z - a) for a, z in prefill.runs(lens))}
        for w in ways:
            ratio = statistics.median(p / q for p, q in zip(times[w], times["runs"]))
            print(f"| {B} | {sum(lens) + B} ({min(lens) + 1} - {max(lens) + 1}) | {w} | "
                  f"{read.get(w, B * max(lens))} | {statistics.median(times[w]) * 1e3:.0f} ms | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
