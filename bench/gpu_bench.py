"""GPU benchmark table (triton.testing.do_bench), run by bench/gpu_check.sh on a machine with a GPU.

Each later kernel adds its rows here. Prints one markdown table: op, backend, shape, time, achieved
bandwidth, and the speedup over the baseline row of the same shape.
"""

from __future__ import annotations

import sys

import torch
import triton.testing

import sequoia_kernels as sk

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_compact_kv import ACCEPTED, D, HEADS, LAYERS, PREFIX, S, TREE, per_layer_loop  # noqa: E402
from bench_tree_attention import gpu_rows as tree_attention_rows  # noqa: E402

ROWS: list[tuple[str, str, str, float, float | None, str]] = []


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def compact_kv_rows() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(2 * LAYERS, 1, HEADS, S, D, device="cuda", generator=g, dtype=torch.float16)
    slots = torch.randperm(TREE, device="cuda", generator=g)[:ACCEPTED].sort().values
    slots[0] = 0
    src, dst, num = (PREFIX + slots).view(1, -1), torch.tensor([PREFIX], device="cuda"), torch.tensor([ACCEPTED], device="cuda")
    shape = f"L{LAYERS} H{HEADS} D{D} S{S} acc {ACCEPTED}/{TREE}"
    moved = 2 * (2 * LAYERS) * HEADS * ACCEPTED * D * 2  # bytes read + written
    base = bench(lambda: per_layer_loop(cache, src, dst, num))
    ROWS.append(("compact_kv_", "per-layer loop (original)", shape, base, moved / base / 1e6, "1.0x"))
    for backend in ("cuda", "triton"):
        t = bench(lambda: sk.compact_kv_(cache, src, dst, num, backend=backend, validate=False))
        ROWS.append(("compact_kv_", backend, shape, t, moved / t / 1e6, f"{base / t:.1f}x"))
    t = bench(lambda: sk.compact_kv_(cache, src, dst, num, backend="cuda"))
    ROWS.append(("compact_kv_", "cuda, validated (1 sync)", shape, t, moved / t / 1e6, f"{base / t:.1f}x"))


def main() -> None:
    assert torch.cuda.is_available(), "gpu_bench.py needs a GPU"
    compact_kv_rows()
    ROWS.extend(tree_attention_rows(bench))
    from gpu_bench_sampler import gpu_rows as sampler_rows  # verify_tree, sampling_probs, sample_children

    ROWS.extend(sampler_rows(bench))
    print(f"\n## GPU benchmarks ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| op | backend | shape | time (us) | GB/s | speedup |")
    print("|---|---|---|---:|---:|---:|")
    for op, backend, shape, ms, gbs, speedup in ROWS:
        print(f"| {op} | {backend} | {shape} | {ms * 1e3:.1f} | {gbs:.0f} | {speedup} |")


if __name__ == "__main__":
    main()
