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

from real_pair import ab_row, load_pair, one_round, pair_arguments, run_line, trees_of  # (the package on the path)


def main() -> int:
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, parse_acceptance
    from sequoia_decoding.planner import plan_tree

    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--trees", default="16:4,32:4,64:5", help="n:d,... (nodes, levels)")
    ap.add_argument("--temperatures", default="0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--offload", default=None, choices=[None, "cpu", "disk", "stream"])
    args = ap.parse_args()

    target, draft, prompts = load_pair(args, args.offload)
    trees = trees_of(args.trees)
    print(run_line(args, prompts, args.rounds, args.offload))
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
                one_round(gens[k], prompts, r, args.max_new_tokens, res[k])
        for n, d in trees:
            print(ab_row(temp, n, d, res[(n, d, False)], res[(n, d, True)]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
