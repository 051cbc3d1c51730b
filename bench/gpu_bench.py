"""GPU benchmark table (triton.testing.do_bench), run by bench/gpu_check.sh on a machine with a GPU.

Each later kernel adds its rows here. Prints one markdown table: op, backend, shape, time, achieved
bandwidth, and the speedup over the baseline row of the same shape; and for tree_attention a
second table against its analytic roofline (attention_rows).
"""

from __future__ import annotations

import sys

import torch
import triton.testing

import sequoia_kernels as sk

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_compact_kv import ACCEPTED, D, HEADS, LAYERS, PREFIX, S, TREE, per_layer_loop  # noqa: E402
from bench_tree_attention import tree_mask  # noqa: E402

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


# ----------------------------------------------------------------------- tree attention roofline

H200_HBM = 4.8e12  # bytes/s (datasheet)
H200_BF16 = 790e12  # FLOP/s, dense bf16 on mma/wgmma (the planning figure)
ATTN_MODELS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # Hq, Hkv, D


def attention_floor(B: int, Hq: int, Hkv: int, T: int, P: int, D: int, elem: int = 2) -> tuple[float, float, float]:
    """(bytes, FLOPs, floor seconds) of one tree-attention call: every K/V byte of the prefix and
    the tree read once per kv head, Q read and O written once; Q K^T and P V over all P + T
    keys (2 FLOPs a multiply-add). The floor is the slower of HBM and the bf16 tensor cores."""
    nbytes = 2 * B * Hkv * (P + T) * D * elem + 2 * B * Hq * T * D * elem
    flops = 4 * B * Hq * T * (P + T) * D
    return nbytes, flops, max(nbytes / H200_HBM, flops / H200_BF16)


def attention_rows(bench, backends=("triton", "cuda")) -> list[tuple]:
    """Llama-2-7B and Llama-3-8B heads; prefix 1k/4k/16k; trees of 16/64/128 nodes (planned
    shapes); batch 1 and 8; bf16. Each kernel runs the captured path (preallocated out and
    workspace, packed mask, validate=False). Baseline: torch SDPA with a dense boolean mask on
    the efficient-attention backend, K/V already expanded to Hq heads (not timed: a lower bound
    for what transformers' sdpa path costs). Each row also checks the kernel against SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sequoia_kernels._backend import compiled_op_available
    from sequoia_kernels.ops.tree_attention import pack_tree_mask, tree_attention, tree_attention_workspace

    rows = []
    for model, (Hq, Hkv, D) in ATTN_MODELS.items():
        for P in (1024, 4096, 16384):
            for T in (16, 64, 128):
                for B in (1, 8):
                    S = P + T
                    g = torch.Generator(device="cuda").manual_seed(T + P + B)
                    q = torch.randn(B, Hq, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
                    k = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
                    v = torch.randn(B, Hkv, S, D, device="cuda", generator=g, dtype=torch.bfloat16)
                    mask = tree_mask(T).cuda()
                    bits = pack_tree_mask(mask)
                    prefix_len = torch.full((B,), P, dtype=torch.int32, device="cuda")
                    dense = torch.ones(B, 1, T, S, dtype=torch.bool, device="cuda")
                    dense[..., P:] = mask
                    ke, ve = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
                    nbytes, flops, floor = attention_floor(B, Hq, Hkv, T, P, D)
                    shape = f"{model} B{B} T{T} P{P // 1024}k"

                    def sdpa():
                        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                            return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, attn_mask=dense)

                    ref = sdpa().float()
                    base = bench(sdpa) * 1e-3
                    rows.append((shape, "SDPA dense bool mask (efficient)", base, nbytes, floor, base, 0.0))
                    out = torch.empty_like(q)
                    ws = tree_attention_workspace(B, Hq, T, D, 64, "cuda")
                    for backend in backends:
                        if backend == "cuda" and not compiled_op_available("cuda", "tree_attention"):
                            continue

                        def run():
                            return tree_attention(q, k, v, prefix_len, bits, backend=backend, out=out, workspace=ws,
                                                  validate=False)

                        run()
                        err = (out.float() - ref).abs().max().item()
                        t = bench(run) * 1e-3
                        rows.append((shape, backend, t, nbytes, floor, base, err))
                    del k, v, ke, ve, dense
    return rows


def print_attention(rows) -> None:
    print(f"\n## tree_attention against the H200 floor (HBM {H200_HBM / 1e12:.1f} TB/s, bf16 {H200_BF16 / 1e12:.0f} "
          "TFLOP/s; floor = max(bytes / HBM, FLOPs / bf16))\n")
    print("| shape | backend | time (us) | floor (us) | % of floor | GB/s | vs SDPA | max err vs SDPA |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for shape, backend, t, nbytes, floor, base, err in rows:
        print(f"| {shape} | {backend} | {t * 1e6:.1f} | {floor * 1e6:.1f} | {100 * floor / t:.0f}% | "
              f"{nbytes / t / 1e9:.0f} | {base / t:.2f}x | {err:.3g} |")


def main() -> None:
    assert torch.cuda.is_available(), "gpu_bench.py needs a GPU"
    compact_kv_rows()
    from gpu_bench_sampler import gpu_rows as sampler_rows  # verify_tree, sampling_probs, sample_children

    ROWS.extend(sampler_rows(bench))
    print(f"\n## GPU benchmarks ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| op | backend | shape | time (us) | GB/s | speedup |")
    print("|---|---|---|---:|---:|---:|")
    for op, backend, shape, ms, gbs, speedup in ROWS:
        print(f"| {op} | {backend} | {shape} | {ms * 1e3:.1f} | {gbs:.0f} | {speedup} |")
    print_attention(attention_rows(bench))


if __name__ == "__main__":
    main()
