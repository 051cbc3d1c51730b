"""Two or more adaptive configurations against each other and plain decoding, on the real pair, interleaved.

    python bench/adaptive_ab.py --prompts bench/prompts/multilingual.txt      # prior_doubt 0 vs 0.5
    python bench/adaptive_ab.py --configs "check_every=0;check_every=96" --num-prompts 8 --rounds 2
    python bench/adaptive_ab.py --configs "trees=planned;trees=any" --temperatures 0.6

For every setting of the demo (T = 0, 0.6 and 0.6 with top-p 0.9 by default) each prompt in turn runs
plain decoding through the loop (``ar``) and one adaptive generator per configuration of ``--configs``
(``AdaptiveConfig`` fields, ``name=value,...`` per configuration, ``;`` between them), in the demo's
rotating order (``tools.time_decoding_interleaved``), each starting from
the static plan the demo would pick, the cached loop calibration (``make demo`` writes it) as its first
cost model. One generator per method and setting serves every prompt and round, as in the demo, so the
estimate carries from request to request (``AdaptiveConfig.carry``). Printed per setting: each
method's tokens/s and its paired ratio to ``ar`` (median over the calls), and each configuration's
paired ratio to the first one: the direct answer to "does this configuration cost where the prior is right",
which the demo's columns (each against a different static or hindsight tree) answer only through
two noisy ratios. ``--out`` writes the figures as JSON (one file per run: runs are pooled later).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse() -> argparse.Namespace:
    from sequoia_decoding.demo import DEMO_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=str(DEMO_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--top-p-row", type=float, default=0.9)
    ap.add_argument("--configs", default="prior_doubt=0;prior_doubt=0.5",
                    help="AdaptiveConfig fields per configuration (name=value,...), ';' between configurations")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the demo's choice here)")
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    return ap.parse_args()


def parse_configs(text: str) -> dict[str, dict]:
    """``"a=1,b=2;c=0.5"`` -> {"a=1,b=2": {"a": 1, "b": 2}, "c=0.5": {"c": 0.5}} (ints stay ints)."""
    out = {}
    for part in (p.strip() for p in text.split(";") if p.strip()):
        kw = {}
        for item in part.split(","):
            k, v = item.split("=")
            kw[k.strip()] = _value(v.strip())
        out[part] = kw
    return out


def _value(text: str):
    """An int, a float, or else the text itself (``trees=planned``)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def generators(target, draft, prof: dict, setting: tuple, configs: dict[str, dict], max_len: int
               ) -> tuple[dict, object]:
    """{name: SequoiaGenerator} for one setting, and the static plan the adaptive ones start from."""
    from sequoia_decoding.adaptive import AdaptiveConfig
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.profiles import calibration_for, find_acceptance, plan_setting

    temp, top_k, top_p = setting
    acc = find_acceptance(draft, temp, top_k, top_p)[0]
    latency, overhead, _ = calibration_for(prof, setting)
    if latency is None:
        raise SystemExit("no loop calibration cached for this pair here: run `make demo` first")
    hp = plan_setting(acc, latency, overhead, max_depth=16)
    sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=0)
    gens = {"ar": SequoiaGenerator(target, None, None, sampling, max_length=max_len)}
    for name, kw in configs.items():
        cfg = AdaptiveConfig(latency=latency, overhead_s=overhead, **kw)
        gens[name] = SequoiaGenerator(target, draft, hp.plan, sampling, max_length=max_len, adaptive=cfg)
    return gens, hp


def main() -> int:
    from hf_entry import demo_draft
    from sequoia_decoding.demo import DEFAULT_DRAFT, DEFAULT_HEAD, demo_settings
    from sequoia_decoding.loading import load_causal_lm
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.profiles import cpu_name, find_cached_profile
    from sequoia_decoding.profiling import pick_dtype
    from sequoia_decoding.prompts import load_prompt_ids
    from sequoia_decoding.tools import paired_ratio, time_decoding_interleaved
    from transformers import AutoTokenizer

    args = parse()
    configs = parse_configs(args.configs)
    first_name = next(iter(configs))
    target_dir = ensure_target()
    dtype = args.dtype or pick_dtype(target_dir, torch.device("cpu"), log=log)[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=dtype, device="cpu")
    draft_dir, draft = demo_draft(target, dtype, [DEFAULT_DRAFT, DEFAULT_HEAD])
    prof = find_cached_profile(target, draft, torch.device("cpu"), getattr(torch, dtype))
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    largest = max(int(n) for n in prof["target_latency_s"])  # the largest tree a re-plan may pick
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + largest + 8
    title = (f"{os.path.basename(draft_dir.rstrip('/'))}, {cpu_name()}, {torch.get_num_threads()} threads, {dtype}, "
             f"{os.path.basename(args.prompts)}: {len(prompts)} prompts x {args.max_new_tokens} tokens x "
             f"{args.rounds} rounds")
    print(f"\n{title}\n\n| setting | static n, d | method | tok/s | vs ar | vs {first_name} | changes | checks |")
    print("|:---|---:|:---|---:|---:|---:|---:|---:|")
    out = {"title": title, "rows": []}
    for setting in demo_settings([float(t) for t in args.temperatures.split(",")], top_p_row=args.top_p_row):
        gens, hp = generators(target, draft, prof, setting, configs, max_len)
        runs = time_decoding_interleaved(gens, prompts, args.max_new_tokens, rounds=args.rounds)
        first = runs[first_name]
        name = f"T={setting[0]:g}" + (f" top-p {setting[2]:g}" if setting[2] < 1 else "")
        for method, run in runs.items():
            row = {"setting": list(setting), "static": [hp.budget, hp.max_depth], "method": method,
                   "tokens_per_s": run["tokens_per_s"], "vs_ar": paired_ratio(run, runs["ar"]),
                   "vs_first": paired_ratio(run, first) if method != "ar" else None,
                   "changes": sum(r.plan_changes for r in run["replan"]) if run["replan"] else None,
                   "checks": sum(r.cost_checks for r in run["replan"]) if run["replan"] else None,
                   "rates": run["prompt_tokens_per_s"]}
            out["rows"].append(row)
            print(f"| {name} | {hp.budget}, {hp.max_depth} | {method} | {row['tokens_per_s']:.1f} | "
                  f"{row['vs_ar']:.3f}x | {'-' if row['vs_first'] is None else format(row['vs_first'], '.3f') + 'x'} | "
                  f"{'-' if row['changes'] is None else row['changes']} | "
                  f"{'-' if row['checks'] is None else row['checks']} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
