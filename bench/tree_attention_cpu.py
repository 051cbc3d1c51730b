"""The CPU tree_attention op alone, at SmolLM2-135M's shapes (9 / 3 heads of 64, a 96-key
prefix, chain-masked trees of T nodes): microseconds per layer, the best of 7 rounds of 200 calls.

    python bench/tree_attention_cpu.py [--threads 2]

Calls the compiled op directly (as the model's layers do, ``sequoia_kernels.hf``), without the
Python wrapper's checks and mask packing that ``bench/bench_tree_attention.py`` includes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sequoia_kernels  # noqa: E402,F401  (registers the ops)
from sequoia_kernels.tree_mask import pack_tree_mask  # noqa: E402


def per_layer_us(T: int, dtype: torch.dtype, prefix: int = 96, rounds: int = 7, calls: int = 200) -> float:
    g = torch.Generator().manual_seed(T)
    S = prefix + 64
    q = torch.randn(1, 9, T, 64, generator=g).to(dtype)
    k, v = (torch.randn(1, 3, S, 64, generator=g).to(dtype) for _ in range(2))
    bits = pack_tree_mask(torch.ones(T, T, dtype=torch.bool).tril())
    bits = bits[None] if bits.dim() == 2 else bits
    p, out = torch.tensor([prefix]), torch.empty_like(q)
    po, pl = torch.empty(1, 9, T, 1, 64), torch.empty(1, 9, T, 1)
    op = torch.ops.sequoia_kernels.tree_attention
    for _ in range(20):
        op(q, k, v, p, bits, T, 0.125, out, po, pl)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            op(q, k, v, p, bits, T, 0.125, out, po, pl)
        best = min(best, (time.perf_counter() - t0) / calls)
    return 1e6 * best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--sizes", default="1,16,32,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(n) for n in args.sizes.split(",")]
    print(f"# {args.threads} threads, torch {torch.__version__}; us per layer (SmolLM2-135M, prefix 96)")
    for dtype in (torch.bfloat16, torch.float32):
        print(f"{str(dtype).replace('torch.', ''):9s}", "  ".join(f"T={T}: {per_layer_us(T, dtype):.0f}" for T in sizes))


if __name__ == "__main__":
    main()
