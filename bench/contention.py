"""Decoding speed on a CPU shared with a busy process: AR and a small tree, tokens/s.

    .venv/bin/python bench/contention.py --target ~/.cache/sequoia-kernels/smollm2-135m-instruct \
        --draft models/draft/smollm2-draft [--threads 2] [--busy] [--no-adapt]

``--busy`` starts one spinning Python process for the duration (the load that collapsed the loop:
every OpenMP region of a step waits for the thread whose core is taken); ``--no-adapt`` turns
``SequoiaGenerator(adapt_threads=...)`` off to show the collapse. Set ``OMP_WAIT_POLICY`` in the
environment to compare wait policies. Prints one line: the setting, then AR and tree tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_api"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="run one spinning process meanwhile")
    ap.add_argument("--no-adapt", action="store_true", help="SequoiaGenerator(adapt_threads=False)")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args(argv)

    import torch

    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.loading import acceptance_file, load_causal_lm, parse_acceptance
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree
    from sequoia_decoding.tools import time_decoding

    torch.set_num_threads(args.threads)
    target, draft = load_causal_lm(args.target), load_causal_lm(args.draft)
    acc_path = acceptance_file(Path(args.draft), 0.0)
    acc = parse_acceptance(str(acc_path)) if acc_path.is_file() else DEFAULT_ACCEPTANCE
    vocab = int(target.config.vocab_size)
    prompts = [torch.randint(0, vocab, (60,), generator=torch.Generator().manual_seed(0)).tolist()]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        res = []
        for name, d, plan in (("AR", None, plan_tree(acc, 1, 1)), ("4-node tree", draft, plan_tree(acc, 4, 2))):
            gen = SequoiaGenerator(target, d, plan, SamplingParams(temperature=0.0), max_length=256,
                                   adapt_threads=not args.no_adapt)
            r = time_decoding(gen, prompts, args.tokens, eos_token_id=[])
            res.append(f"{name} {r['tokens_per_s']:.1f} tok/s")
    finally:
        if busy is not None:
            busy.kill()
    setting = {"threads": args.threads, "busy": args.busy, "adapt_threads": not args.no_adapt,
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "")}
    print(json.dumps(setting), "|", " | ".join(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
