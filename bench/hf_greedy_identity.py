"""Greedy identity in fp32 and bf16: which decoders can promise plain ``generate()``'s tokens.

    python bench/hf_greedy_identity.py                      # demo prompts, fp32 and bf16
    python bench/hf_greedy_identity.py --prompts bench/prompts/creative.txt --dtypes bfloat16

A speculative decoder reads a token's logits out of a forward over several tokens; plain
``generate()`` reads them out of a one-token forward. Greedy output can equal plain ``generate()``'s
only where a row's logits do not depend on how many rows the forward has (batch invariance), or
where the differences never flip an argmax. Per dtype this prints:

* **Hugging Face's forward**: the last 8 prompt tokens' logits read by 8 one-token forwards (as
  ``generate()`` reads them) against one 8-token forward (as any verifier reads them): the largest
  difference over the prompts, and at how many of those positions the argmax differs.
* **Greedy output identical to plain ``generate()``**, new tokens each: Hugging Face's own
  speculative decoding (``prompt_lookup_num_tokens=8``: the same model and products, several tokens
  verified per forward), ``SequoiaDecoding(draft)`` and ``SequoiaDecoding(draft, budget=1)``
  (plain decoding through the package's loop), and ``SequoiaDecoding(draft)`` against
  ``budget=1`` (the package's promise: the tree never changes a greedy token of its own
  one-token decoding, whatever the dtype).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from transformers import DynamicCache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))
from hf_entry import demo_draft, log  # noqa: E402

from sequoia_kernels.hf import cache_kw  # noqa: E402


@torch.no_grad()
def forward_invariance(model, prompts, rows: int = 8) -> tuple[float, int, int]:
    """(largest |logit difference|, positions whose argmax differs, positions) between a prompt's
    last ``rows`` tokens read one per forward and read by one forward over all of them."""
    worst, flips, total = 0.0, 0, 0
    for p in (p for p in prompts if len(p) > rows):
        ids = torch.tensor([p])  # [1, S]
        head, tail = ids[:, :-rows], ids[:, -rows:]
        kv = DynamicCache()  # the prefix read once; the 8-token forward extends a copy
        model(head, **cache_kw(model, kv), use_cache=True)
        many = model(tail, **cache_kw(model, copy.deepcopy(kv))).logits[0].float()  # [rows, V]
        one = []
        for j in range(rows):
            out = model(tail[:, j:j + 1], **cache_kw(model, kv), use_cache=True)
            one.append(out.logits[0, 0].float())
        one = torch.stack(one)  # [rows, V]
        worst = max(worst, (one - many).abs().max().item())
        flips += int((one.argmax(-1) != many.argmax(-1)).sum())
        total += rows
    return worst, flips, total


def greedy(model, ids: torch.Tensor, n_new: int, **kw) -> list[int]:
    out = model.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, **kw)
    return out[0, ids.shape[1]:].tolist()


def main() -> int:
    from sequoia_decoding import SequoiaDecoding
    from sequoia_decoding.demo import DEFAULT_DRAFT, DEFAULT_HEAD, DEMO_PROMPTS
    from sequoia_decoding.loading import load_causal_lm
    from sequoia_decoding.modeling.smollm2 import ensure_target
    from sequoia_decoding.profiles import cpu_name
    from sequoia_decoding.prompts import load_prompt_ids
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", default=str(DEMO_PROMPTS))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    target_dir = ensure_target()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    n = len(prompts)
    print(f"\nSmolLM2-135M-Instruct, {cpu_name()}, {torch.get_num_threads()} threads, {n} prompts from "
          f"{os.path.basename(args.prompts)} x {args.max_new_tokens} greedy tokens\n")
    print("| dtype | HF forward: 1-token vs 8-token logits, max diff | argmax differs | prompt lookup = plain | "
          "SequoiaDecoding = plain | budget=1 = plain | SequoiaDecoding = budget=1 |")
    print("|---|---:|---:|:---:|:---:|:---:|:---:|")
    for dtype in args.dtypes.split(","):
        target = load_causal_lm(str(target_dir), dtype=dtype, device="cpu")
        folder, draft = demo_draft(target, dtype, [DEFAULT_DRAFT, DEFAULT_HEAD])
        log(f"{dtype}: draft {folder}")
        worst, flips, total = forward_invariance(target, prompts)
        same = {"lookup": 0, "seq": 0, "one": 0, "seq_one": 0}
        planned, plain_loop = SequoiaDecoding(draft), SequoiaDecoding(draft, budget=1)
        for p in prompts:
            ids = torch.tensor([p])
            ref = greedy(target, ids, args.max_new_tokens)
            seq = greedy(target, ids, args.max_new_tokens, custom_generate=planned)
            one = greedy(target, ids, args.max_new_tokens, custom_generate=plain_loop)
            same["lookup"] += greedy(target, ids, args.max_new_tokens, prompt_lookup_num_tokens=8) == ref
            same["seq"] += seq == ref
            same["one"] += one == ref
            same["seq_one"] += seq == one
        tree = f"{planned.last_plan.num_nodes}, {planned.last_plan.num_levels}"
        print(f"| {dtype} | {worst:.3g} | {flips}/{total} | {same['lookup']}/{n} | {same['seq']}/{n} (tree {tree}) | "
              f"{same['one']}/{n} | {same['seq_one']}/{n} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
