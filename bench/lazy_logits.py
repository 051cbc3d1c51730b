"""The decoding loop's step time with the target's logits computed only where verification reads
them (``lazy_logits=True``) against the full LM head over every tree node (``False``).

    python bench/lazy_logits.py                                   # resident target, 16 / 32 / 64 nodes
    python bench/lazy_logits.py --offload stream --trees 32:4,64:5,128:6 --temperatures 0,0.6

The same static trees (planned from the draft's acceptance files), the same prompts and seeds,
both settings in every round with the order reversed every other round; the decode time of each
call (the prefill excluded) over its steps. Prints ms a step per setting, their ratio (lazy / full:
below 1 is faster) and whether the tokens were the same (they must be).
"""

from __future__ import annotations

import sys

from real_pair import pair_arguments  # (puts the package on the path)


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, load_causal_lm, load_draft, parse_acceptance
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.planner import plan_tree
    from sequoia_decoding.prompts import load_prompt_ids
    from sequoia_decoding.profiles import cpu_name

    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--trees", default="16:4,32:4,64:5", help="n:d,... (nodes, levels)")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offload", default=None, choices=[None, "cpu", "disk", "stream"])
    args = ap.parse_args()

    target_dir = ensure_target()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=args.dtype, offload=args.offload)
    draft = load_draft(args.draft, dtype=args.dtype)
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {args.dtype}, offload {args.offload or 'none'}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.rounds} rounds")
    print("| T | tree n, d | full ms/step | lazy ms/step | lazy / full | tokens/step | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for temp in (float(t) for t in args.temperatures.split(",")):
        acc = parse_acceptance(str(acceptance_file(args.draft, temp)))
        sampling = SamplingParams(temperature=temp, seed=5)
        gens = {(n, d, lazy): SequoiaGenerator(target, draft, plan_tree(acc, n, d), sampling, max_length=1024,
                                               lazy_logits=lazy) for n, d in trees for lazy in (False, True)}
        res = {k: [0.0, 0, 0, []] for k in gens}  # decode seconds, steps, tokens, token lists
        for r in range(args.rounds):
            for k in (list(gens) if r % 2 == 0 else list(gens)[::-1]):
                for i, p in enumerate(prompts):
                    gens[k].rand.generator.manual_seed(1000 * r + i)  # both settings draw the same numbers
                    out = gens[k].generate([p], max_new_tokens=args.max_new_tokens)
                    s = res[k]
                    s[0] += out.decode_s
                    s[1] += len(out.steps)
                    s[2] += len(out.tokens[0])
                    s[3].append(out.tokens[0])
        for n, d in trees:
            full, lazy = res[(n, d, False)], res[(n, d, True)]
            mf, ml = 1e3 * full[0] / full[1], 1e3 * lazy[0] / lazy[1]
            print(f"| {temp:g} | {n}, {d} | {mf:.1f} | {ml:.1f} | {ml / mf:.3f} | {full[2] / full[1]:.2f} | "
                  f"{'yes' if full[3] == lazy[3] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
