"""What the real-pair benchmark scripts share (``bench/lazy_logits.py``, ``stream_buffers.py``,
``chain_depth_acceptance.py``): the package on the path and the pair's common arguments."""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_api"))


def pair_arguments(description: str, *, prompts: str = "demo_prompts.txt", num_prompts: int = 3,
                   max_new_tokens: int = 32) -> argparse.ArgumentParser:
    """A parser with ``--draft`` (default: the shipped feature head), ``--prompts`` (a file of
    ``models/draft``), ``--num-prompts``, ``--max-new-tokens`` and ``--dtype`` (bfloat16)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--draft", default=os.path.join(ROOT, "models", "draft", "smollm2-eagle"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "models", "draft", prompts))
    ap.add_argument("--num-prompts", type=int, default=num_prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--dtype", default="bfloat16")
    return ap
