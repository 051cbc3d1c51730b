"""End-to-end decoding benchmark: autoregressive vs chain vs SpecInfer-style k x d tree vs
Sequoia's DP tree, all through the same loop (SequoiaGenerator), plus HF `generate` as the
autoregressive reference, at several temperatures.

    python bench/e2e.py --tiny                        # built-in random pair (CPU smoke run)
    python bench/e2e.py --target T --draft D --prompts prompts.txt --profile latency.json --budgets 16,64
    python bench/e2e.py --gpu-shapes                  # Llama-2-7B-shaped target, 68M-shaped draft,
                                                      # random weights (timing only), on the GPU

Prints a markdown table: method, temperature, tokens/step, tokens/s, speedup over our
autoregressive loop, and the share of decode time outside the two models' forwards.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_api"))

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator  # noqa: E402
from sequoia_kernels.ops.sampling import check_sampling_params  # noqa: E402
from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, chain_tree, kxd_tree, plan_tree  # noqa: E402
from sequoia_decoding.tools import time_decoding  # noqa: E402


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


def measure(target, draft, plan, prompts, temp, max_new_tokens, max_length, top_k=0, top_p=1.0):
    """Tokens/s, tokens per step, share of decode time outside the forwards (no EOS stop)."""
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=0),
                           max_length=max_length)
    r = time_decoding(gen, prompts, max_new_tokens, eos_token_id=[])
    return r["tokens_per_s"], r["tokens_per_step"], r["other_share"]


def run(target, draft, prompts, *, settings, max_new_tokens, device, max_length, hf_reference=True, top_k=0,
        top_p=1.0):
    """``settings``: ``[(temperature, acceptance, [(budget, depth), ...]), ...]``. Rows: method,
    T, tokens/step, planner's E, tokens/s, speedup over our AR loop, share of time outside forwards.
    ``top_k`` / ``top_p`` filter every sampled (T > 0) run, HF's reference rows included."""
    rows = []
    for temp, acceptance, budgets in settings:
        flt = dict(top_k=top_k, top_p=top_p)
        if hf_reference:
            tps = sum(hf_generate_tps(target, p, max_new_tokens, temp, device, **flt) for p in prompts) / len(prompts)
            rows.append(("HF generate (sdpa)", temp, 1.0, tps, None, None, None))
        base, _, other = measure(target, None, chain_tree(0), prompts, temp, max_new_tokens, max_length, **flt)
        rows.append(("autoregressive", temp, 1.0, base, 1.0, other, 1.0))
        for budget, depth in budgets:
            for name, (d, plan) in methods_at(draft, budget, depth, acceptance).items():
                tps, per_step, other = measure(target, d, plan, prompts, temp, max_new_tokens, max_length, **flt)
                rows.append((name, temp, per_step, tps, tps / base, other, plan.expected_tokens))
    return rows


def print_table(rows, title):
    print(f"\n### {title}\n")
    print("| method | T | tokens/step | planner's E | measured / E | tokens/s | speedup vs AR | time outside forwards |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, temp, tps_step, tps, speedup, other, pred in rows:
        sp = f"{speedup:.2f}x" if speedup is not None else "-"
        ot = f"{100 * other:.0f}%" if other is not None else "-"
        pe = f"{pred:.2f}" if pred is not None else "-"
        ratio = f"{tps_step / pred:.3f}" if pred else "-"
        print(f"| {name} | {temp:g} | {tps_step:.2f} | {pe} | {ratio} | {tps:.1f} | {sp} | {ot} |")


def load_acceptance(folder, temp):
    from sequoia_decoding.loading import parse_acceptance
    from sequoia_decoding.loading import acceptance_file

    path = acceptance_file(folder, temp)
    if not path.is_file():
        raise SystemExit(f"no acceptance vector for T={temp:g}: {path} (run sequoia-kernels measure-acceptance)")
    return parse_acceptance(str(path))


def budget_settings(acceptance, budgets, max_depth, profile):
    """[(budget, depth)]: with a latency ``profile``, the profiler's choice first (its budget and
    depth), then each extra budget at the depth the profile favours for it; without one, each
    budget at ``max_depth``."""
    if profile is None:
        return [(b, max_depth) for b in budgets]
    from sequoia_decoding.planner import choose_plan

    hp = choose_plan(acceptance, profile["draft_step_s"], profile["target_latency_s"], max_depth=max_depth)
    best = hp.best_per_budget()
    out = [(hp.budget, hp.max_depth)] if hp.budget > 1 else []
    for b in budgets:
        if b not in (x for x, _ in out):
            out.append((b, best[b].max_depth if b in best else max_depth))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true")
    src.add_argument("--gpu-shapes", action="store_true")
    src.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="prompt file (one per line, or ### chat / ### raw blocks)")
    ap.add_argument("--skip-prompts", type=int, default=0, help="start at this prompt of the file")
    ap.add_argument("--budgets", default="16", help="comma list of tree budgets (nodes, root included)")
    ap.add_argument("--profile", help="latency JSON of `sequoia-kernels profile`: adds the profiler's choice")
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--acceptance", default=None, help="comma list (default: the built-in vector, or with "
                    "--target the draft folder's acceptance-T<t>.json per temperature)")
    ap.add_argument("--temperatures", default="0,0.6,1.0")
    ap.add_argument("--top-k", type=int, default=0, help="top-k filter of the sampled rows (0 = off)")
    ap.add_argument("--top-p", type=float, default=1.0, help="top-p filter of the sampled rows (1 = off)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate reference rows")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="with --target: the models' dtype")
    args = ap.parse_args(argv)
    check_sampling_params(1.0, args.top_k, args.top_p, "--top-k / --top-p")
    device = torch.device(args.device)
    temps = [float(t) for t in args.temperatures.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    acceptance = {t: (tuple(float(x) for x in args.acceptance.split(",")) if args.acceptance else DEFAULT_ACCEPTANCE)
                  for t in temps}
    g = torch.Generator().manual_seed(0)
    if args.tiny:
        target, draft = tiny_pair(device)
        prompts = [torch.randint(0, 512, (24,), generator=g).tolist() for _ in range(args.num_prompts)]
        title = f"tiny random pair (4 vs 1 layers, hidden 256), {device}"
    elif args.gpu_shapes:
        dt = torch.float16
        target = random_llama(32000, 4096, 11008, 32, 32, 32, seed=0, dtype=dt, device=device)  # Llama-2-7B
        draft = random_llama(32000, 768, 3072, 2, 12, 12, seed=1, dtype=dt, device=device)  # 68M-shaped
        prompts = [torch.randint(0, 32000, (128,), generator=g).tolist() for _ in range(args.num_prompts)]
        title = f"Llama-2-7B-shaped target, 68M-shaped draft, random weights (timing only), {device}"
    else:
        from sequoia_decoding.loading import load_causal_lm
        from sequoia_decoding.prompts import load_prompt_ids
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
        target = load_causal_lm(args.target, device=args.device, dtype=args.dtype)
        draft = load_causal_lm(args.draft, device=args.device, dtype=args.dtype)
        prompts = load_prompt_ids(args.prompts, tok, args.num_prompts, skip=args.skip_prompts)
        if not args.acceptance:
            acceptance = {t: load_acceptance(args.draft, t) for t in temps}
        title = (f"{os.path.basename(args.target.rstrip('/'))} / {os.path.basename(args.draft.rstrip('/'))}, "
                 f"{device} {args.dtype}, {torch.get_num_threads()} threads, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    profile = None
    if args.profile:
        import json

        with open(args.profile, encoding="utf-8") as f:
            profile = json.load(f)
    settings = [(t, acceptance[t], budget_settings(acceptance[t], budgets, args.max_depth, profile)) for t in temps]
    max_length = (max(len(p) for p in prompts) + args.max_new_tokens
                  + max(b for _, _, bs in settings for b, _ in bs) + 8)
    rows = run(target, draft, prompts, settings=settings, max_new_tokens=args.max_new_tokens, device=device,
               max_length=max_length, hf_reference=not args.no_hf, top_k=args.top_k, top_p=args.top_p)
    if args.top_k or args.top_p < 1.0:
        title += f", sampled rows with top-k {args.top_k}, top-p {args.top_p:g}"
    print_table(rows, title)


if __name__ == "__main__":
    main()
