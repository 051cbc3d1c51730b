"""The decoding loop's step time with a tree step's [B, T, V] tensors kept across steps
(``step_buffers.KeptRows``: lazy verification's p, a sampling draft's q) against a new tensor each
step (the code before them).

    python bench/step_buffers.py                                  # 32 / 64 / 128 / 256 nodes, T = 0 and 0.6
    python bench/step_buffers.py --trees 64:5,256:5 --temperatures 0.6 --rounds 5

The same static trees (planned from the draft's acceptance files), prompts and seeds, both ways in
every round with the order reversed every other round; the decode time of each call (the prefill
excluded) over its steps. Prints ms a step per way, their ratio (kept / fresh: below 1 is faster)
and whether the tokens were the same (they must be).
"""

from __future__ import annotations

import sys

from real_pair import ab_row, load_pair, one_round, pair_arguments, run_line, trees_of  # (the package on the path)


def main() -> int:
    import torch

    from sequoia_decoding import step_buffers
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, parse_acceptance
    from sequoia_decoding.planner import plan_tree

    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--trees", default="32:4,64:5,128:5,256:5", help="n:d,... (nodes, levels)")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    kept = step_buffers.KeptRows.rows

    def fresh(self, B, T, V, device):  # a new tensor every step, as before
        return torch.full((B, T, V), 1.0 / V if self.fill is None else self.fill, dtype=torch.float32, device=device)

    target, draft, prompts = load_pair(args)
    trees = trees_of(args.trees)
    print(run_line(args, prompts, args.rounds))
    print("| T | tree n, d | fresh ms/step | kept ms/step | kept / fresh | tokens/step | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for temp in (float(t) for t in args.temperatures.split(",")):
        acc = parse_acceptance(str(acceptance_file(args.draft, temp)))
        for n, d in trees:
            gen = SequoiaGenerator(target, draft, plan_tree(acc, n, d), SamplingParams(temperature=temp, seed=5),
                                   max_length=1024)
            gen.generate([prompts[0]], max_new_tokens=4)  # warm-up: the caches, launches and buffers made once
            res = {way: [0.0, 0, 0, []] for way in ("fresh", "kept")}  # decode seconds, steps, tokens, token lists
            for r in range(args.rounds):
                for way in (("fresh", "kept") if r % 2 == 0 else ("kept", "fresh")):
                    step_buffers.KeptRows.rows = kept if way == "kept" else fresh
                    one_round(gen, prompts, r, args.max_new_tokens, res[way])
            step_buffers.KeptRows.rows = kept
            print(ab_row(temp, n, d, res["fresh"], res["kept"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
