"""One short answer through ``generate()`` with ``max_new_tokens`` 64 and 32768, with
``SequoiaDecoding`` and plain, interleaved: whether a large limit ("until EOS", as servers set it)
costs a Sequoia call more than it costs plain ``generate()``.

    python bench/large_max_new_tokens.py float32     # the demo's pair (target converted by make demo)

The prompt ("What is the capital of France?" through the chat template) ends at EOS after 8 tokens
in fp32 (in bf16 the loop's greedy answer starts at a near-tie and does not end: use fp32), so every
call makes the same tokens. Prints the new tokens of each and the median time of 5 calls (a first
round discarded), one run: compare the rows of one run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from sequoia_decoding import SequoiaDecoding
from sequoia_decoding.loading import load_draft

REPO = Path(__file__).resolve().parents[1]
TARGET = Path.home() / ".cache/sequoia-kernels/smollm2-135m-instruct"


def main() -> None:
    dtype = getattr(torch, sys.argv[1] if len(sys.argv) > 1 else "float32")
    tok = AutoTokenizer.from_pretrained(TARGET)
    target = LlamaForCausalLM.from_pretrained(TARGET, dtype=dtype).eval()
    draft = load_draft(str(REPO / "models/draft/smollm2-eagle"), dtype=str(dtype).split(".")[1])
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    dec = SequoiaDecoding(draft)
    res: dict = {}
    for rep in range(6):
        for name, kw in (("seq64", dict(max_new_tokens=64, custom_generate=dec)),
                         ("seq32k", dict(max_new_tokens=32768, custom_generate=dec)),
                         ("plain64", dict(max_new_tokens=64)), ("plain32k", dict(max_new_tokens=32768))):
            t0 = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)
            dt = time.perf_counter() - t0
            if rep:
                res.setdefault(name, []).append(dt)
            res.setdefault(name + "_n", out.shape[1] - ids.shape[1])
    for k, v in res.items():
        print(k, f"{statistics.median(v) * 1e3:.1f} ms" if isinstance(v, list) else v)


if __name__ == "__main__":
    main()
