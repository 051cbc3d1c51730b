"""The streamed target (``offload="stream"``, its layers read from disk per forward) with its
reads two layers deep (``buffers=2``, the stream before 2026-12-05) against the default depth.

    python bench/stream_buffers.py                         # plain decoding and a 64-node tree, T = 0
    python bench/stream_buffers.py --trees 1:1,32:4,64:5 --temperature 0.6 --rounds 3
    python bench/stream_buffers.py --buffers 8,16 --trees 1:1,128:5   # any two depths

Both targets loaded side by side from the same stream file, the same head, prompts and seeds;
every round runs each (target, tree) on every prompt, the order reversed every other round.
Prints ms a decoding step (the prefill excluded), tokens/s and the ratio of the second depth's to the
first's per tree (``--buffers A,B``; ``default`` is ``LayerStream``'s own).
"""

from __future__ import annotations

import sys

from real_pair import pair_arguments  # (puts the package on the path)


def main() -> int:
    import torch
    from transformers import AutoTokenizer

    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, load_draft, parse_acceptance
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.offload import _default_folder
    from sequoia_decoding.planner import plan_tree
    from sequoia_decoding.prompts import load_prompt_ids
    from sequoia_decoding.profiles import cpu_name
    from sequoia_decoding.streaming import load_streamed, stream_of
    from sequoia_decoding.tree import chain_tree

    ap = pair_arguments(__doc__.splitlines()[0])
    ap.add_argument("--trees", default="1:1,64:5", help="n:d,... (1:1 is plain decoding)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--buffers", default="2,default", help="the two depths compared: A,B (layer buffers or 'default')")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    path = str(ensure_target())
    tok = AutoTokenizer.from_pretrained(path)
    depths = [None if b == "default" else int(b) for b in args.buffers.split(",")]
    if len(depths) != 2 or len(set(depths)) != 2:
        ap.error("--buffers takes two different depths, e.g. 2,default or 8,16")
    targets = {b: load_streamed(path, dtype=dtype, folder=_default_folder(path, dtype), buffers=b) for b in depths}
    draft = load_draft(args.draft, dtype=args.dtype)
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    acc = parse_acceptance(str(acceptance_file(args.draft, args.temperature)))
    sampling = SamplingParams(temperature=args.temperature, seed=5)
    trees = [tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")]
    gens = {(b, n, d): SequoiaGenerator(targets[b], draft if n > 1 else None, plan_tree(acc, n, d) if n > 1
                                        else chain_tree(0), sampling, max_length=1024)
            for b in targets for n, d in trees}
    res = {k: [0.0, 0, 0] for k in gens}  # decode seconds, steps, tokens
    for r in range(args.rounds):
        for k in (list(gens) if r % 2 == 0 else list(gens)[::-1]):
            for i, p in enumerate(prompts):
                gens[k].rand.generator.manual_seed(1000 * r + i)
                out = gens[k].generate([p], max_new_tokens=args.max_new_tokens)
                res[k][0] += out.decode_s
                res[k][1] += len(out.steps)
                res[k][2] += len(out.tokens[0])
    a, b = (f"{stream_of(targets[x]).k} buffers" for x in depths)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {args.dtype}, T = {args.temperature:g}, {len(prompts)} prompts "
          f"x {args.max_new_tokens} tokens, {args.rounds} rounds")
    print(f"| tree n, d | {a}: ms/step, tok/s | {b}: ms/step, tok/s | {b} / {a} (ms/step) |")
    print("|---:|---:|---:|---:|")
    for n, d in trees:
        x, y = res[(depths[0], n, d)], res[(depths[1], n, d)]
        mx, my = 1e3 * x[0] / x[1], 1e3 * y[0] / y[1]
        print(f"| {n}, {d} | {mx:.1f}, {x[2] / x[0]:.2f} | {my:.1f}, {y[2] / y[0]:.2f} | {my / mx:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
