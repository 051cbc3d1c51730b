"""The Hugging Face entry point against plain ``generate()``, on the real pair, interleaved.

    python bench/hf_entry.py                                  # the demo's dtype, T = 0 and 0.6
    python bench/hf_entry.py --dtype float32 --temperatures 0,0.6 --num-prompts 4 --max-new-tokens 48
    python bench/hf_entry.py --sweep 2,4,8,16:2,3,4     # + fixed trees: the planned one against the best of them
    python bench/hf_entry.py --sweep 2,4,8,16:2,3,4 --confirm 4   # + the best swept re-measured out of sample

For every temperature, each prompt in turn runs every method: plain ``target.generate``,
``target.generate(custom_generate=SequoiaDecoding(draft))`` with no budget (the planned tree;
re-planned online on greedy CPU calls, the default),
``SequoiaDecoding(draft, budget=1)`` (plain decoding through our loop), and what ``--adaptive``
and ``--sweep`` add; ``--rounds`` times over the prompts. The methods' order rotates from one
turn to the next, every other cycle reversed (``tools.turn_order``, as the demo's timing; in a
fixed order the planned tree read 0.89x against the same tree swept). One row per method: tokens/s
over all calls, the ratio to plain ``generate`` (the median over the calls of plain's time on the
same prompt and round against the method's: this VM's speed drifts by 10-30% between calls,
which paired ratios cancel), the tree the entry point used, and at T = 0 whether every output equals
plain ``generate``'s token for token. The last column is the per-call cost of ``SequoiaDecoding``
outside the decoding loop (planning, building the generator, switching attention, packing,
allocating caches: its wall time minus the loop's prefill and decode), median over the calls.
A short warm-up call of each method comes first (weights packed, kernels loaded).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def demo_draft(target, dtype: str, candidates) -> tuple[str, object]:
    """(folder, loaded draft) of the candidate whose cached profile (this machine, ``dtype``)
    holds the demo's loop calibration: the draft ``make demo`` chose here; else the first one."""
    from sequoia_decoding.loading import load_draft
    from sequoia_decoding.modeling.feature_head import FeatureHead
    from sequoia_decoding.profiles import find_cached_profile

    first = None
    for folder in (c for c in candidates if (c / "config.json").is_file()):
        draft = load_draft(str(folder), dtype=dtype, device="cpu")
        if isinstance(draft, FeatureHead):
            draft.bind(target)
        prof = find_cached_profile(target, draft, torch.device("cpu"), getattr(torch, dtype))
        if prof is not None and prof.get("calibration"):
            return str(folder), draft
        first = first or (str(folder), draft)
    return first


def parse() -> argparse.Namespace:
    from sequoia_decoding.demo import DEMO_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the demo's choice here)")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts", default=str(DEMO_PROMPTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft", default=None, help="draft folder (a standalone draft or a feature head; default: "
                    "the one the demo calibrated here for this dtype, else the standalone draft)")
    ap.add_argument("--sweep", default="", help="fixed trees to run beside the planned one, 'budgets:depths' "
                    "(e.g. 2,4,8,16:2,3,4): SequoiaDecoding(draft, budget=n, max_depth=d) for each pair, and "
                    "the planned tree's ratio to the best of them")
    ap.add_argument("--adaptive", action="store_true", help="also SequoiaDecoding(draft, adaptive=True): the tree "
                    "re-planned online (its 'tree n, d' column: the last call's last tree)")
    ap.add_argument("--confirm", type=int, default=0, metavar="ROUNDS",
                    help="with --sweep: this many more rounds of the planned tree against the best swept one "
                         "alone (and --adaptive's), out of sample: the sweep's best cell reads high in the turns "
                         "that picked it")
    return ap.parse_args()


def call(target, dec, ids: torch.Tensor, max_new: int, kw: dict):
    """One timed ``target.generate`` (``dec``: its ``custom_generate``, None: plain): (new tokens,
    wall seconds, seconds inside our loop or None)."""
    gc.collect()  # untimed: a full collection (~200 ms here) would land on whichever call tripped it
    t0 = time.perf_counter()
    out = target.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, **kw,
                          **({} if dec is None else {"custom_generate": dec}))
    wall = time.perf_counter() - t0
    inside = None
    if dec is not None and dec.last_output is not None:
        inside = dec.last_output.prefill_s + dec.last_output.decode_s
    return out[0, ids.shape[1]:].tolist(), wall, inside


def run_turns(target, methods: dict, prompts, rounds: int, n_new: int, kw: dict) -> dict:
    """Every method on every prompt, ``rounds`` times, the order rotating per turn: per method its
    tokens, seconds, outputs, walls, time outside the loop and paired ratios to plain generate."""
    from sequoia_decoding.tools import turn_order

    for dec in methods.values():  # warm-up
        call(target, dec, torch.tensor([prompts[0]]), 4, kw)
    res = {name: {"tokens": 0, "s": 0.0, "outs": [], "outside": [], "walls": [], "changes": 0} for name in methods}
    for turn, p in enumerate(p for _ in range(rounds) for p in prompts):
        ids = torch.tensor([p])
        for name in turn_order(methods, turn):  # no method always first, or always after the same one
            torch.manual_seed(0)
            toks, wall, inside = call(target, methods[name], ids, n_new, kw)
            r = res[name]
            r["tokens"] += len(toks)
            r["s"] += wall
            r["outs"].append(toks)
            r["walls"].append(wall)
            if inside is not None:
                r["outside"].append(wall - inside)
                replan = methods[name].last_output.replan
                r["changes"] += replan.plan_changes if replan is not None else 0
    for r in res.values():  # paired with plain generate() on the same (round, prompt)
        r["ratios"] = [a / b for a, b in zip(res["plain generate"]["walls"], r["walls"])]
    return res


def report(temp: float, methods: dict, res: dict, sweep: list) -> None:
    """The table rows of one temperature; with a sweep, the planned tree against the best swept one."""
    for name, dec in methods.items():
        r = res[name]
        tps = r["tokens"] / r["s"]
        ratio = statistics.median(r["ratios"])
        plan = "1, 1 (plain)" if dec is None else f"{dec.last_plan.num_nodes}, {dec.last_plan.num_levels}"
        same = "-" if temp > 0 else f"{sum(a == b for a, b in zip(r['outs'], res['plain generate']['outs']))}" \
                                    f"/{len(r['outs'])}"
        outside = f"{1e3 * statistics.median(r['outside']):.0f} ms" if r["outside"] else "-"
        print(f"| {temp:g} | {name} | {plan} | {tps:.1f} | {ratio:.2f}x | {same} | {outside} |", flush=True)
    if sweep:
        best = best_swept(methods, res)
        planned = statistics.median(res["SequoiaDecoding(draft)"]["ratios"])
        same = methods[best].last_plan.parents == methods["SequoiaDecoding(draft)"].last_plan.parents
        changes = res["SequoiaDecoding(draft)"]["changes"]
        note = ("" if not same else " (the same tree: the difference is this machine's noise)" if not changes
                else f" (the same first tree, {changes} re-planned changes over the calls)")
        print(f"\nT = {temp:g}: the planned tree against the best swept ({best}): "
              f"{planned / statistics.median(res[best]['ratios']):.3f}x{note}", flush=True)
        for name in [n for n in methods if "adaptive=True" in n or "budget=1)" in n]:
            print(f"T = {temp:g}: {name} against the best swept: "
                  f"{statistics.median(res[name]['ratios']) / statistics.median(res[best]['ratios']):.3f}x",
                  flush=True)
        print(flush=True)


def best_swept(methods: dict, res: dict) -> str:
    """The swept fixed tree of the highest median ratio to plain generate."""
    swept = [name for name in methods if "max_depth=" in name]
    return max(swept, key=lambda name: statistics.median(res[name]["ratios"]))


def confirm(target, methods: dict, res: dict, prompts, rounds: int, n_new: int, kw: dict, temp: float) -> None:
    """The best swept tree picked, its ratio re-measured out of sample: ``rounds`` fresh rounds of
    plain generate, the planned tree, the best swept one (and the adaptive entry point) alone. The
    best of many noisy cells reads high in the turns that picked it (the larger the sweep, the more);
    in turns of their own the two trees' walls pair call by call."""
    best = best_swept(methods, res)
    keep = ["plain generate", "SequoiaDecoding(draft)", best] + [n for n in methods if "adaptive=True" in n]
    again = run_turns(target, {name: methods[name] for name in dict.fromkeys(keep)}, prompts, rounds, n_new, kw)
    for name in keep[1:]:
        if name == best:
            continue
        paired = statistics.median(b / a for a, b in zip(again[name]["walls"], again[best]["walls"]))
        same = methods[name].last_plan.parents == methods[best].last_plan.parents
        note = "" if not same else f" (the same first tree, {again[name]['changes']} re-planned changes)" \
            if again[name]["changes"] else " (the same tree)"
        print(f"T = {temp:g}, {rounds} more rounds out of sample: {name} against the best swept ({best}): "
              f"{paired:.3f}x{note} (paired call by call; {statistics.median(again[name]['ratios']):.2f}x against "
              f"{statistics.median(again[best]['ratios']):.2f}x plain generate)", flush=True)
    print(flush=True)


def main() -> int:
    from sequoia_decoding import SequoiaDecoding
    from sequoia_decoding.demo import DEFAULT_DRAFT, DEFAULT_HEAD
    from sequoia_decoding.loading import load_causal_lm, load_draft
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.profiles import cpu_name
    from sequoia_decoding.profiling import pick_dtype
    from sequoia_decoding.prompts import load_prompt_ids
    from transformers import AutoTokenizer

    args = parse()
    sweep = []
    if args.sweep:
        budgets, depths = (part.split(",") for part in args.sweep.split(":"))
        sweep = [(int(n), int(d)) for n in budgets for d in depths]
    device = torch.device("cpu")
    target_dir = ensure_target()
    dtype = args.dtype or pick_dtype(target_dir, device, log=log)[0]
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=dtype, device="cpu")
    if args.draft is None:
        args.draft, draft = demo_draft(target, dtype, [DEFAULT_DRAFT, DEFAULT_HEAD])
    else:
        draft = load_draft(args.draft, dtype=dtype, device="cpu")
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    n_new = args.max_new_tokens
    print(f"\nSmolLM2-135M-Instruct / {os.path.basename(args.draft.rstrip('/'))}, {cpu_name()}, {torch.get_num_threads()} threads, {dtype}, "
          f"{len(prompts)} prompts x {n_new} new tokens x {args.rounds} rounds, methods interleaved prompt by prompt\n")
    print("| T | method | tree n, d | tok/s | vs plain generate | identical to plain | "
          "per-call cost outside the loop |")
    print("|---:|:---|---:|---:|---:|:---:|---:|")
    for temp in [float(t) for t in args.temperatures.split(",")]:
        kw = dict(do_sample=True, temperature=temp, top_k=0, top_p=1.0) if temp > 0 else dict(do_sample=False)
        methods = {"plain generate": None, "SequoiaDecoding(draft)": SequoiaDecoding(draft),
                   "SequoiaDecoding(draft, budget=1)": SequoiaDecoding(draft, budget=1),
                   **({"SequoiaDecoding(draft, adaptive=True)": SequoiaDecoding(draft, adaptive=True)}
                      if args.adaptive else {}),
                   **{f"SequoiaDecoding(draft, budget={n}, max_depth={d})": SequoiaDecoding(draft, budget=n, max_depth=d)
                      for n, d in sweep}}

        res = run_turns(target, methods, prompts, args.rounds, n_new, kw)
        report(temp, methods, res, sweep)
        if sweep and args.confirm:
            confirm(target, methods, res, prompts, args.confirm, n_new, kw, temp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
