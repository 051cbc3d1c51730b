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

from real_pair import pair_arguments  # (puts the package on the path)


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from sequoia_decoding import step_buffers
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, load_causal_lm, load_draft, parse_acceptance
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.planner import plan_tree
    from sequoia_decoding.prompts import load_prompt_ids
    from sequoia_decoding.profiles import cpu_name

    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--trees", default="32:4,64:5,128:5,256:5", help="n:d,... (nodes, levels)")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    kept = step_buffers.KeptRows.rows

    def fresh(self, B, T, V, device):  # a new tensor every step, as before
        return torch.full((B, T, V), 1.0 / V if self.fill is None else self.fill, dtype=torch.float32, device=device)

    target_dir = ensure_target()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=args.dtype)
    draft = load_draft(args.draft, dtype=args.dtype)
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")]
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {args.dtype}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {args.rounds} rounds")
    print("| T | tree n, d | fresh ms/step | kept ms/step | kept / fresh | tokens/step | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for temp in (float(t) for t in args.temperatures.split(",")):
        acc = parse_acceptance(str(acceptance_file(args.draft, temp)))
        for n, d in trees:
            gen = SequoiaGenerator(target, draft, plan_tree(acc, n, d), SamplingParams(temperature=temp, seed=5),
                                   max_length=1024)
            res = {way: [0.0, 0, 0, []] for way in ("fresh", "kept")}  # decode seconds, steps, tokens, token lists
            for r in range(args.rounds):
                for way in (("fresh", "kept") if r % 2 == 0 else ("kept", "fresh")):
                    step_buffers.KeptRows.rows = kept if way == "kept" else fresh
                    for i, p in enumerate(prompts):
                        gen.rand.generator.manual_seed(1000 * r + i)  # both ways draw the same numbers
                        out = gen.generate([p], max_new_tokens=args.max_new_tokens)
                        s = res[way]
                        s[0], s[1], s[2] = s[0] + out.decode_s, s[1] + len(out.steps), s[2] + len(out.tokens[0])
                        s[3].append(out.tokens[0])
            step_buffers.KeptRows.rows = kept
            f, k = res["fresh"], res["kept"]
            mf, mk = 1e3 * f[0] / f[1], 1e3 * k[0] / k[1]
            print(f"| {temp:g} | {n}, {d} | {mf:.1f} | {mk:.1f} | {mk / mf:.3f} | {k[2] / k[1]:.2f} | "
                  f"{'yes' if f[3] == k[3] else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
