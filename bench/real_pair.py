"""What the real-pair benchmark scripts share (``bench/lazy_logits.py``, ``step_buffers.py``,
``stream_buffers.py``, ``chain_depth_acceptance.py``): the package on the path, the pair's common
arguments, loading it, and the header line of a run."""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))


def pair_arguments(description: str, *, prompts: str = "demo_prompts.txt", num_prompts: int = 3,
                   max_new_tokens: int = 32) -> argparse.ArgumentParser:
    """A parser with ``--draft`` (default: the shipped feature head), ``--prompts`` (a file of
    ``models/draft``), ``--num-prompts``, ``--max-new-tokens`` and ``--dtype`` (bfloat16)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--draft", default=os.path.join(ROOT, "models", "draft", "smollm2-eagle"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "models", "draft", prompts))
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--dtype", default="bfloat16")
    return ap


def load_pair(args, offload: str | None = None) -> tuple:
    """(target, draft, prompts' ids) as ``args`` (``pair_arguments``) says; the target converted once."""
    from transformers import AutoTokenizer

    from sequoia_decoding.loading import load_causal_lm, load_draft
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.prompts import load_prompt_ids

    target_dir = str(ensure_target())
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = load_causal_lm(target_dir, dtype=args.dtype, offload=offload)
    return target, load_draft(args.draft, dtype=args.dtype), load_prompt_ids(args.prompts, tok, args.num_prompts)


def trees_of(text: str) -> list[tuple[int, ...]]:
    """``"32:4,64:5"`` -> [(32, 4), (64, 5)] (nodes, levels)."""
    return [tuple(int(x) for x in t.split(":")) for t in text.split(",")]


def run_line(args, prompts, rounds: int, offload: str | None = None) -> str:
    """The machine and the run's sizes, for a table's first line."""
    import torch

    from sequoia_decoding.profiles import cpu_name

    return (f"{cpu_name()}, {torch.get_num_threads()} threads, {args.dtype}, offload {offload or 'none'}, "
            f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {rounds} rounds")


def one_round(gen, prompts, round_no: int, max_new_tokens: int, tally: list) -> None:
    """``gen`` over each prompt, its random numbers seeded by the round and the prompt (the ways a
    benchmark compares draw the same numbers); adds to ``tally`` [decode seconds, steps, tokens,
    token lists] (the prefill excluded)."""
    for i, p in enumerate(prompts):
        gen.rand.generator.manual_seed(1000 * round_no + i)
        out = gen.generate([p], max_new_tokens=max_new_tokens)
        tally[0] += out.decode_s
        tally[1] += len(out.steps)
        tally[2] += len(out.tokens[0])
        tally[3].append(out.tokens[0])


def ab_row(temp: float, n: int, d: int, a: list, b: list) -> str:
    """A table row of two ways' tallies (``one_round``): ms a step each, b / a, tokens a step, same tokens."""
    ma, mb = 1e3 * a[0] / a[1], 1e3 * b[0] / b[1]
    return (f"| {temp:g} | {n}, {d} | {ma:.1f} | {mb:.1f} | {mb / ma:.3f} | {b[2] / b[1]:.2f} | "
            f"{'yes' if a[3] == b[3] else 'NO'} |")
