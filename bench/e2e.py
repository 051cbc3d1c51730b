"""End-to-end decoding benchmark: autoregressive vs chain vs SpecInfer-style k x d tree vs
Sequoia's DP tree, all through the same loop (SequoiaGenerator), plus HF `generate` as the
autoregressive reference, at several temperatures.

    python bench/e2e.py --tiny                        # built-in random pair (CPU smoke run)
    python bench/e2e.py --target T --draft D --prompts prompts.txt --profile latency.json --budgets 16,64
    python bench/e2e.py --gpu-shapes                  # Llama-2-7B-shaped target, 68M-shaped draft,
                                                      # random weights (timing only), on the GPU

Prints a markdown table with, for every row, the measured and the *predicted* figures side by
side: tokens per step against the planner's E, milliseconds per step (the draft's forwards +
the target's forward + the rest: sampling, verification, compaction, bookkeeping) against the
planner's charge for it, and the speedup over our autoregressive loop against the planner's
prediction. The cost model is calibrated on the loop as `sequoia-kernels demo` does it
(`demo.calibrate_on_loop`: the profile's T(n) and draft step rescaled to the loop's own
forwards), and each row is charged the time outside the forwards that the loop measured for
that row's own tree (`tools.measure_step_overhead`, a random prompt of the typical context):
the planner's cost formula, with no fitted factor. Without --profile the latency profile is
this machine's cached one (the demo's cache: measured once, refused when noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_api"))

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator  # noqa: E402
from sequoia_kernels.ops.sampling import check_sampling_params  # noqa: E402
from sequoia_decoding.planner import (DEFAULT_ACCEPTANCE, chain_tree, kxd_tree,  # noqa: E402
                                      plan_step_s, plan_tree)
from sequoia_decoding.tools import measure_step_overhead, profile_latency, time_decoding_interleaved  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def random_llama(vocab, hidden, inter, layers, heads, kv_heads, *, seed, dtype, device, max_pos=4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def tiny_pair(device):
    """A small random target and a 'truncated target' draft (its first layer, same embeddings and
    head), so that the draft agrees with the target often enough for speculation to show."""
    target = random_llama(512, 256, 512, 4, 8, 2, seed=0, dtype=torch.float32, device=device)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    draft = random_llama(512, 256, 512, 1, 8, 2, seed=0, dtype=torch.float32, device=device)
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())
    return target, draft


def hf_generate_tps(target, prompt_ids, max_new_tokens, temperature, device, top_k=0, top_p=1.0) -> float:
    target.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt_ids], device=device)
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
              pad_token_id=0)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=top_k, top_p=top_p)
    with torch.no_grad():
        target.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def best_kxd(budget, acceptance):
    """The SpecInfer-style k x d tree (k >= 2 branches) with the most expected tokens per step
    within ``budget`` nodes, by the planner's formula on ``acceptance``; None below 3 nodes."""
    shapes = [(k, (budget - 1) // k) for k in range(2, budget)]
    trees = [kxd_tree(k, d, acceptance) for k, d in shapes if d >= 1]
    return max(trees, key=lambda t: t.expected_tokens, default=None)


def methods_at(draft, budget, depth, acceptance):
    """Chain, best k x d and Sequoia's DP tree, all of ``budget`` nodes (root included)."""
    out = {f"chain n={budget}": (draft, chain_tree(budget - 1, acceptance))}
    kxd = best_kxd(budget, acceptance)
    if kxd is not None:
        k = len(kxd.children(0))
        out[f"SpecInfer {k}x{(kxd.num_nodes - 1) // k} n={kxd.num_nodes}"] = (draft, kxd)
    out[f"Sequoia n={budget} d={depth}"] = (draft, plan_tree(acceptance, budget, depth))
    return out


def charged_budget(num_nodes: int, lat: dict[int, float]) -> int:
    """The profiled size a tree of ``num_nodes`` is charged at: the smallest one >= it."""
    return min((n for n in lat if n >= num_nodes), default=max(lat))


def predict(plan, profile, oh_ar, oh_row):
    """The planner's charge for one step of ``plan`` (phases in seconds: the draft's forwards, the
    target's, the rest) and its predicted speedup over plain decoding, given the loop's measured
    time outside the forwards for plain decoding (``oh_ar``) and for this tree (``oh_row``)."""
    lat = {int(k): float(v) for k, v in profile["target_latency_s"].items()}
    overhead = {1: oh_ar} if plan.num_nodes == 1 else {1: oh_ar, plan.num_nodes: oh_row}
    return plan_step_s(plan, charged_budget(plan.num_nodes, lat), profile["draft_step_s"], lat, overhead,
                       profile.get("draft_latency_s"))


@dataclass
class Row:
    name: str
    temp: float
    tokens_per_step: float
    expected_tokens: float | None
    tokens_per_s: float
    speedup: float | None = None
    predicted_speedup: float | None = None
    step_ms: float | None = None
    phase_ms: tuple | None = None  # measured: draft forwards, target, rest
    predicted_phase_ms: tuple | None = None


def run(target, draft, prompts, *, settings, max_new_tokens, device, max_length, profile, overhead_ar, prefix,
        hf_reference=True, top_k=0, top_p=1.0):
    """``settings``: ``[(temperature, acceptance, [(budget, depth), ...]), ...]``; ``profile``: the
    calibrated latency profile; ``overhead_ar``: per temperature, the loop's time outside the
    forward at n = 1. Each method's own tree is timed on the loop first (the overhead it is
    charged), then all methods decode the prompts in turns. ``top_k`` / ``top_p`` filter every
    sampled (T > 0) run, HF's reference rows included."""
    rows = []
    for temp, acceptance, budgets in settings:
        flt = dict(top_k=top_k, top_p=top_p) if temp > 0 else {}
        if hf_reference:
            tps = sum(hf_generate_tps(target, p, max_new_tokens, temp, device, **flt) for p in prompts) / len(prompts)
            rows.append(Row("HF generate (sdpa)", temp, 1.0, None, tps))
        methods = {"autoregressive": (None, chain_tree(0))}
        for budget, depth in budgets:
            methods.update(methods_at(draft, budget, depth, acceptance))
        sampling = SamplingParams(temperature=temp, seed=0, **flt)
        charge = {}
        for name, (d, plan) in methods.items():  # each tree's own time outside the forwards, on the loop
            oh = overhead_ar[temp] if plan.num_nodes == 1 else measure_step_overhead(
                target, d, {plan.num_nodes: plan}, sampling, prefix=prefix)[plan.num_nodes]
            charge[name] = predict(plan, profile, overhead_ar[temp], oh)
        # all methods decode the prompts in turns (a slow spell of the machine hits them alike)
        gens = {name: SequoiaGenerator(target, d, plan, sampling, max_length=max_length)
                for name, (d, plan) in methods.items()}
        runs = time_decoding_interleaved(gens, prompts, max_new_tokens, eos_token_id=[])
        base = runs["autoregressive"]["tokens_per_s"]
        for name, (d, plan) in methods.items():
            r, (phases, pred) = runs[name], charge[name]
            ph = r["phase_s"]
            measured = None if ph is None else tuple(1e3 * ph[k] for k in ("draft_forward_s", "target_s", "other_s"))
            rows.append(Row(name, temp, r["tokens_per_step"], plan.expected_tokens, r["tokens_per_s"],
                            r["tokens_per_s"] / base, pred, 1e3 * r["step_s"], measured,
                            tuple(1e3 * x for x in phases)))
            log(f"T={temp:g} {name}: {r['tokens_per_s']:.1f} tok/s, {rows[-1].speedup:.2f}x (predicted {pred:.2f}x)")
    return rows


def print_table(rows, title):
    print(f"\n### {title}\n")
    print("| method | T | tokens/step | planner's E | ms/step: draft + target + rest | predicted ms/step "
          "| tokens/s | speedup vs AR | predicted | measured / predicted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def split(ph, total=None):
        if ph is None:
            return "-" if total is None else f"{total:.1f}"
        return f"{ph[0]:.1f} + {ph[1]:.1f} + {ph[2]:.1f} = {sum(ph) if total is None else total:.1f}"

    for r in rows:
        pe = f"{r.expected_tokens:.2f}" if r.expected_tokens is not None else "-"
        sp = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        pp = f"{r.predicted_speedup:.2f}x" if r.predicted_speedup is not None else "-"
        ratio = f"{r.speedup / r.predicted_speedup:.3f}" if r.predicted_speedup else "-"
        measured = split(r.phase_ms, r.step_ms) if r.step_ms is not None else "-"
        predicted = split(r.predicted_phase_ms) if r.predicted_phase_ms is not None else "-"
        print(f"| {r.name} | {r.temp:g} | {r.tokens_per_step:.2f} | {pe} | {measured} | {predicted} | "
              f"{r.tokens_per_s:.1f} | {sp} | {pp} | {ratio} |")


def load_acceptance(draft, temp, top_k=0, top_p=1.0):
    """The draft's acceptance vector for this setting (``profiles.find_acceptance``: its folder, then
    what the demo measured for it): the one measured with the filters when there is one, else the
    temperature's unfiltered one (with a note)."""
    from sequoia_decoding.profiles import find_acceptance

    found, _, _ = find_acceptance(draft, temp, top_k, top_p, nearest=False)
    if found is None and (top_k or top_p < 1.0):
        log(f"no acceptance vector measured with top-k {top_k} / top-p {top_p:g} at T={temp:g}: using the "
            "unfiltered one")
        found, _, _ = find_acceptance(draft, temp, nearest=False)
    if found is None:
        raise SystemExit(f"no acceptance vector for T={temp:g} (run sequoia-kernels measure-acceptance)")
    return found


def budget_settings(acceptance, budgets, max_depth, profile, step_overhead_s=None):
    """[(budget, depth)]: the planner's choice on the calibrated ``profile`` first (its budget and
    depth; none when it chooses plain decoding), then each extra budget at the depth (>= 2: a
    tree) the planner favours for it (or ``max_depth`` when the profile has no such size)."""
    from sequoia_decoding.profiles import plan_setting

    hp = plan_setting(acceptance, profile, step_overhead_s, max_depth=max_depth)  # every entry point's planner call
    out = [(hp.budget, hp.max_depth)] if hp.plan.num_nodes > 1 else []
    for b in budgets:
        trees = [c for c in hp.candidates if c.budget == b and c.num_nodes > 1]
        if b not in (x for x, _ in out):
            out.append((b, min(trees, key=lambda c: c.seconds_per_token).max_depth if trees else max_depth))
    return out, hp


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true")
    src.add_argument("--gpu-shapes", action="store_true")
    src.add_argument("--target")
    ap.add_argument("--draft", help="draft folder; a comma list (e.g. a standalone draft and a feature head) runs "
                    "the benchmark once per draft, each at the planner's choice")
    ap.add_argument("--prompts", help="prompt file (one per line, or ### chat / ### raw blocks)")
    ap.add_argument("--skip-prompts", type=int, default=0, help="start at this prompt of the file")
    ap.add_argument("--budgets", default="16", help="comma list of tree budgets (nodes, root included)")
    ap.add_argument("--profile", help="latency JSON of `sequoia-kernels profile` (default: with --target, the "
                    "demo's cached profile of this machine; otherwise measured now)")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--acceptance", default=None, help="comma list (default: with --tiny measured on its prompts, "
                    "with --target the draft folder's acceptance-T<t>[-topk<k>][-topp<p>].json per temperature, "
                    "with --gpu-shapes the built-in vector)")
    ap.add_argument("--temperatures", default="0,0.6,1.0")
    ap.add_argument("--top-k", type=int, default=0, help="top-k filter of the sampled rows (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p filter of the sampled rows (1 = off)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate reference rows")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="with --target: the models' dtype")
    return ap.parse_args(argv)


def setup(args, device: torch.device, temps: list[float]):
    """(target, draft, prompts, acceptance per temperature, title) for ``--tiny``, ``--gpu-shapes``
    or ``--target``."""
    acceptance = {t: (tuple(float(x) for x in args.acceptance.split(",")) if args.acceptance else DEFAULT_ACCEPTANCE)
                  for t in temps}
    g = torch.Generator().manual_seed(0)
    if args.tiny:
        target, draft = tiny_pair(device)
        prompts = [torch.randint(0, 512, (24,), generator=g).tolist() for _ in range(args.num_prompts)]
        title = f"tiny random pair (4 vs 1 layers, hidden 256), {device}"
        if not args.acceptance:  # this pair's own vectors (the built-in one is a real pair's), on these prompts
            from sequoia_decoding.tools import measure_acceptance

            acceptance = {t: tuple(measure_acceptance(target, draft, prompts, temperature=t, width=16,
                                                      max_new_tokens=args.max_new_tokens, progress=False,
                                                      top_k=args.top_k, top_p=args.top_p,
                                                      eos_token_id=[])["acceptance"])  # the runs ignore EOS too
                          for t in temps}
    elif args.gpu_shapes:
        dt = torch.float16
        target = random_llama(32000, 4096, 11008, 32, 32, 32, seed=0, dtype=dt, device=device)  # Llama-2-7B
        draft = random_llama(32000, 768, 3072, 2, 12, 12, seed=1, dtype=dt, device=device)  # 68M-shaped
        prompts = [torch.randint(0, 32000, (128,), generator=g).tolist() for _ in range(args.num_prompts)]
        title = f"Llama-2-7B-shaped target, 68M-shaped draft, random weights (timing only), {device}"
    else:
        from sequoia_decoding.loading import load_causal_lm, load_draft
        from sequoia_decoding.modeling.feature_head import FeatureHead
        from sequoia_decoding.prompts import load_prompt_ids
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
        target = load_causal_lm(args.target, device=args.device, dtype=args.dtype)
        draft = load_draft(args.draft, device=args.device, dtype=args.dtype)  # a standalone draft or a feature head
        if isinstance(draft, FeatureHead):
            draft.bind(target)
        prompts = load_prompt_ids(args.prompts, tok, args.num_prompts, skip=args.skip_prompts)
        if not args.acceptance:
            acceptance = {t: load_acceptance(draft, t, args.top_k, args.top_p) for t in temps}
        title = (f"{os.path.basename(args.target.rstrip('/'))} / {os.path.basename(args.draft.rstrip('/'))}, "
                 f"{device} {args.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    return target, draft, prompts, acceptance, title


def latency(args, target, draft, device: torch.device, prefix: int, budgets: list[int]) -> dict:
    """The latency profile: ``--profile``'s, the demo's cached one (``--target``), or measured now."""
    from sequoia_decoding.profiles import PROFILE_SIZES, machine_key
    from sequoia_decoding.profiling import cached_profile

    if args.profile:
        import json

        with open(args.profile, encoding="utf-8") as f:
            profile = json.load(f)
    elif args.target:  # the demo's cache: this machine's profile of the pair, measured once
        from sequoia_decoding.modeling.smollm2 import CACHE_ROOT

        key = machine_key(target, draft, device, next(target.parameters()).dtype)
        profile, path, cached = cached_profile(target, draft, cache_dir=CACHE_ROOT / "profiles", key=key,
                                               prefix=prefix, log=log)
        log(f"profile ({'cached' if cached else 'measured'}): {path}")
    else:
        sizes = [n for n in PROFILE_SIZES if n < max(budgets)] + [max(budgets)]  # up to the largest budget
        profile = profile_latency(target, draft, sizes=sizes, prefix=prefix, repeats=5, progress=False)
    if max(budgets) > max(int(n) for n in profile["target_latency_s"]):
        raise SystemExit(f"the latency profile stops below budget {max(budgets)}: profile larger trees")
    return profile


def main(argv=None):
    args = parse(argv)
    if args.draft and "," in args.draft:  # one benchmark per draft, the same prompts and settings
        argv = list(sys.argv[1:] if argv is None else argv)
        at = next(i for i, a in enumerate(argv) if a == "--draft" or a.startswith("--draft="))
        rest = argv[:at] + argv[at + (1 if "=" in argv[at] else 2):]
        for d in args.draft.split(","):
            main(rest + ["--draft", d])
        return
    check_sampling_params(1.0, args.top_k, args.top_p, "--top-k / --top-p")
    device = torch.device(args.device)
    temps = [float(t) for t in args.temperatures.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    target, draft, prompts, acceptance, title = setup(args, device, temps)
    from sequoia_decoding.demo import calibrate_on_loop
    from sequoia_decoding.profiles import typical_context, with_level_cost

    prefix = typical_context(prompts, args.max_new_tokens)
    # the planner's costs calibrated on the loop, as the demo does: T(n), the draft step, and the time
    # outside the forwards of plain decoding (each tree row is charged its own, measured below)
    flt = (args.top_k, args.top_p)
    setting_of = {t: (t, *flt) if t > 0 else (t, 0, 1.0) for t in temps}
    profile, overhead, _, levels = calibrate_on_loop(target, draft, latency(args, target, draft, device, prefix,
                                                                            budgets),
                                                     acceptance, sorted(set(setting_of.values())), prefix=prefix,
                                                     log=log)
    settings = []
    for t in temps:  # the planner charges a draft level its sampling too (each row's tree: its own overhead)
        bs, hp = budget_settings(acceptance[t], budgets, args.max_depth, with_level_cost(profile, levels[(t, 0, 1.0)]),
                                 overhead[(t, 0, 1.0)])
        log(f"T={t:g}: the planner's choice n={hp.budget}, d={hp.max_depth}, predicted {hp.speedup:.2f}x")
        settings.append((t, acceptance[t], bs))
    max_length = (max(len(p) for p in prompts) + args.max_new_tokens
                  + max([b for _, _, bs in settings for b, _ in bs] + [1]) + 8)
    rows = run(target, draft, prompts, settings=settings, max_new_tokens=args.max_new_tokens, device=device,
               max_length=max_length, hf_reference=not args.no_hf, top_k=args.top_k, top_p=args.top_p,
               profile=profile, overhead_ar={t: overhead[setting_of[t]][1] for t in temps}, prefix=prefix)
    if args.top_k or args.top_p < 1.0:
        title += f", sampled rows with top-k {args.top_k}, top-p {args.top_p:g}"
    print_table(rows, title)


if __name__ == "__main__":
    main()
