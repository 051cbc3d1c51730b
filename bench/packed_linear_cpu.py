"""Few-row linears of SmolLM2-135M on this CPU: torch's GEMM against packed_linear, fp32 and bf16.

    python bench/packed_linear_cpu.py                  # M = 1, 4, 8, 16, 32, 64; every bf16 path
    python bench/packed_linear_cpu.py --rows 1,16 --repeats 7
    python bench/packed_linear_cpu.py --shapes separate    # q, k, v, o, gate, up, down one by one

Each "forward" is the 30 decoder layers' linears as the decoding loop runs them (``--shapes
fused``, the default: the q, k and v projections in one product and gate and up in one, as
``sequoia_kernels/ops/lean_layers.py`` calls them, then o and down; ``separate``: the 7 of a
Hugging Face layer), 30 distinct weights each, so the weights stream from memory as in the
model, plus the tied LM head (49152 x 576), on M rows. The packed kernels are called as the
model calls them (the compiled op on a new output, no Python checks: ``packed_linear``'s
checks cost ~9 us a call, ~2-3 ms a forward at M = 1, which figures from this script before
2026-12-07 include). Methods run interleaved, round by round; each cell is the median over
``--repeats`` rounds in ms, and the ratio column is to torch fp32 at the same M, measured in the
same round (this VM drifts 10-30% between calls; paired ratios cancel most of it). The roofline
line gives the weight bytes per forward and the time they take at the read bandwidth measured
here (a sum over a 512 MB tensor).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

SHAPES = {"fused": [(960, 576), (576, 576), (3072, 576), (576, 1536)],  # [N, K]: qkv, o, gate-up, down
          "separate": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]}
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def make_method(name: str, dtype: torch.dtype, weights):
    from sequoia_kernels.ops.packed_linear import ISAS, pack_linear_weight, pack_linear_weight_bf16

    ws = [w.to(dtype) for w in weights]
    if name == "torch":
        return lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws]
    if dtype == torch.bfloat16:  # as the model's packed linears call the op (python_api: _packed_forward)
        code = ISAS[name.split(":")[1] if ":" in name else "auto"]
        op = torch.ops.sequoia_kernels.packed_linear_bf16
        pk = [(pack_linear_weight_bf16(w), w.shape[0], w.shape[1]) for w in ws]
        return lambda xs: [op(xs[k], p, n, xs[k].new_empty(xs[k].shape[0], n), code) for p, n, k in pk]
    op = torch.ops.sequoia_kernels.packed_linear
    pk = [(pack_linear_weight(w), w.shape[0], w.shape[1]) for w in ws]
    return lambda xs: [op(xs[k], p, n, xs[k].new_empty(xs[k].shape[0], n)) for p, n, k in pk]


def main() -> int:
    from sequoia_kernels.ops.packed_linear import bf16_isa

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="fused",
                    help="the layers' linears as the loop runs them (fused q/k/v and gate/up) or one by one")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) / k ** 0.5 for _ in range(LAYERS) for n, k in SHAPES[args.shapes]]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5)
    n_params = sum(w.numel() for w in weights)
    big = torch.ones(128 * 1024 * 1024)
    big.sum()
    t0 = time.perf_counter()
    big.sum()
    bw = big.numel() * 4 / (time.perf_counter() - t0)
    del big
    isas = [i for i in ("amx", "avx512_bf16", "avx512", "avx2") if bf16_isa(i) is not None]
    methods = {"torch fp32": make_method("torch", torch.float32, weights),
               "packed fp32": make_method("packed", torch.float32, weights),
               "torch bf16": make_method("torch", torch.bfloat16, weights)}
    for isa in isas:
        methods[f"packed bf16 {isa}"] = make_method(f"packed:{isa}", torch.bfloat16, weights)
    del weights
    from sequoia_decoding.profiles import cpu_name

    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}, {args.shapes} linears; "
          f"{n_params / 1e6:.1f}M weights per "
          f"forward; read bandwidth {bw / 1e9:.1f} GB/s -> roofline fp32 {4 * n_params / bw * 1e3:.1f} ms, "
          f"bf16 {2 * n_params / bw * 1e3:.1f} ms")
    print(f"{'method':<24}" + "".join(f"{f'M={m}':>18}" for m in rows))
    table = {name: {} for name in methods}
    for m in rows:
        xs = {dt: {k: torch.randn(m, k, generator=g).to(dt) for k in (576, 1536)} for dt in (torch.float32, torch.bfloat16)}
        times = {name: [] for name in methods}
        for name, f in methods.items():  # warm-up
            f(xs[torch.bfloat16 if "bf16" in name else torch.float32])
        for _ in range(args.repeats):
            for name, f in methods.items():
                x = xs[torch.bfloat16 if "bf16" in name else torch.float32]
                t0 = time.perf_counter()
                f(x)
                times[name].append(time.perf_counter() - t0)
        base = times["torch fp32"]
        for name, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, base))
            table[name][m] = (statistics.median(ts) * 1e3, ratio)
    for name, cells in table.items():
        print(f"{name:<24}" + "".join(f"{f'{ms:.1f} ({r:.2f}x)':>18}" for ms, r in cells.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
