"""End-to-end decoding benchmark: autoregressive vs chain vs SpecInfer-style k x d tree vs
Sequoia's DP tree, all through the same loop (SequoiaGenerator), plus HF `generate` as the
autoregressive reference, at several temperatures.

    python bench/e2e.py --tiny                        # built-in random pair (CPU smoke run)
    python bench/e2e.py --target T --draft D --prompts prompts.txt --budget 16
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
from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, chain_tree, kxd_tree, plan_tree  # noqa: E402


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


def hf_generate_tps(target, prompt_ids, max_new_tokens, temperature, device) -> float:
    target.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt_ids], device=device)
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
              pad_token_id=0)
    if temperature > 0:
        kw.update(temperature=temperature, top_k=0, top_p=1.0)
    with torch.no_grad():
        target.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t0)


def run(target, draft, prompts, *, budget, max_depth, acceptance, temperatures, max_new_tokens, device,
        max_length, hf_reference=True):
    k = max(1, int(round((budget - 1) ** 0.5)))
    methods = {
        "autoregressive": (None, chain_tree(0)),
        f"chain k={budget - 1}": (draft, chain_tree(budget - 1)),
        f"SpecInfer {k}x{(budget - 1) // k}": (draft, kxd_tree(k, (budget - 1) // k)),
        f"Sequoia n={budget} d<={max_depth}": (draft, plan_tree(acceptance, budget, max_depth)),
    }
    rows = []
    for temp in temperatures:
        base = None
        if hf_reference:
            tps = sum(hf_generate_tps(target, p, max_new_tokens, temp, device) for p in prompts) / len(prompts)
            rows.append(("HF generate (sdpa)", temp, 1.0, tps, None, None, None))
        for name, (d, plan) in methods.items():
            gen = SequoiaGenerator(target, d, plan, SamplingParams(temperature=temp, seed=0), max_length=max_length)
            gen.generate([prompts[0]], max_new_tokens=4, eos_token_id=[])  # warm-up
            n_tok = steps = 0
            decode = other = 0.0
            for p in prompts:
                res = gen.generate([p], max_new_tokens=max_new_tokens, eos_token_id=[])
                n_tok += len(res.tokens[0])
                steps += len(res.steps)
                decode += res.decode_s
                other += sum(s.other_s for s in res.steps)
            tps = n_tok / decode
            if name == "autoregressive":
                base = tps
            rows.append((name, temp, n_tok / steps, tps, tps / base if base else None, other / decode,
                         plan.expected_tokens if d is not None else 1.0))
    return rows


def print_table(rows, title):
    print(f"\n### {title}\n")
    print("| method | T | tokens/step | planner's E | tokens/s | speedup vs AR | time outside forwards |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, temp, tps_step, tps, speedup, other, pred in rows:
        sp = f"{speedup:.2f}x" if speedup is not None else "-"
        ot = f"{100 * other:.0f}%" if other is not None else "-"
        pe = f"{pred:.2f}" if pred is not None else "-"
        print(f"| {name} | {temp} | {tps_step:.2f} | {pe} | {tps:.1f} | {sp} | {ot} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true")
    src.add_argument("--gpu-shapes", action="store_true")
    src.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts", help="text file, one prompt per line (needs --target's tokenizer)")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--max-depth", type=int, default=8)
    ap.add_argument("--acceptance", default=None, help="comma list (default: the built-in vector)")
    ap.add_argument("--temperatures", default="0,0.6,1.0")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    acceptance = tuple(float(x) for x in args.acceptance.split(",")) if args.acceptance else DEFAULT_ACCEPTANCE
    temps = [float(t) for t in args.temperatures.split(",")]
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
        from sequoia_decoding.cli import load_causal_lm
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
        target = load_causal_lm(args.target, device=args.device)
        draft = load_causal_lm(args.draft, device=args.device)
        lines = [ln.strip() for ln in open(args.prompts, encoding="utf-8") if ln.strip()][: args.num_prompts]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in lines]
        title = f"{args.target} / {args.draft}, {device}"
    max_length = max(len(p) for p in prompts) + args.max_new_tokens + args.budget + 8
    rows = run(target, draft, prompts, budget=args.budget, max_depth=args.max_depth, acceptance=acceptance,
               temperatures=temps, max_new_tokens=args.max_new_tokens, device=device, max_length=max_length)
    print_table(rows, title)


if __name__ == "__main__":
    main()
