"""How often a draft's node is accepted at each depth of a chain, in the decoding loop.

    python bench/chain_depth_acceptance.py                          # the head, T = 0, held-out prompts
    python bench/chain_depth_acceptance.py --temperature 0.6 --depth 6 --num-prompts 50

The planner prices the root's children with a draft's first-level acceptance vector and every
deeper node with ``deep_acceptance`` (measured teacher-forced, one prediction deep), each level
independent of the others. Here the real pair decodes with a chain of ``--depth`` draft tokens
per step; a step's accepted length says, per depth k, whether the node at depth k was accepted
given that the one above it was: P(accept at k | reached k). Against the offline vectors this
shows whether acceptance decays with depth (predictions of predictions) and whether the loop's
steps accept as often as the offline positions do (a step starts after every rejection, so hard
stretches of text are visited by more steps than easy ones).
"""

from __future__ import annotations

import collections
import os
import sys

from real_pair import pair_arguments  # (puts the package on the path)


def main() -> int:
    from transformers import AutoTokenizer

    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, load_causal_lm, load_draft, parse_acceptance
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.prompts import load_prompt_ids
    from sequoia_decoding.tree import LevelAcceptance, chain_tree

    ap = pair_arguments(__doc__.splitlines()[0], prompts="heldout_prompts.txt", num_prompts=50, max_new_tokens=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--depth", type=int, default=6)
    args = ap.parse_args()

    path = ensure_target()
    tok = AutoTokenizer.from_pretrained(str(path))
    target = load_causal_lm(str(path), dtype=args.dtype)
    draft = load_draft(args.draft, dtype=args.dtype)
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    gen = SequoiaGenerator(target, draft, chain_tree(args.depth), SamplingParams(temperature=args.temperature, seed=0),
                           max_length=max(map(len, prompts)) + args.max_new_tokens + args.depth + 2)
    lengths = collections.Counter()  # accepted draft tokens per step
    for p in prompts:
        for s in gen.generate([p], max_new_tokens=args.max_new_tokens).steps:
            if s.accepted:
                lengths[s.accepted[0]] += 1
    steps = sum(lengths.values())
    offline = acceptance_file(args.draft, args.temperature)
    print(f"{os.path.basename(args.draft)}, T = {args.temperature:g}, a chain of {args.depth}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, {steps} steps; tokens a step "
          f"{1 + sum(k * v for k, v in lengths.items()) / steps:.3f}")
    if offline.is_file():
        vec = parse_acceptance(str(offline))
        print(f"offline (teacher-forced, {offline.name}): first child {vec[0]:.3f}"
              + (f", deeper {vec.deep[0]:.3f}" if isinstance(vec, LevelAcceptance) else ""))
    reached = steps
    for k in range(1, args.depth + 1):
        ok = sum(v for n, v in lengths.items() if n >= k)
        print(f"depth {k}: accepted {ok / reached if reached else float('nan'):.3f} of {reached} steps that reached it")
        reached = ok
    return 0


if __name__ == "__main__":
    sys.exit(main())
