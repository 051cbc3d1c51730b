"""GPU benchmark rows of the sampler kernels (issue 12, point 6): verify_tree, sampling_probs and
sample_children at V = 32000 / 49152 / 128256, B = 1 and 8, T = 16 / 64 / 128, timed with
triton.testing.do_bench, each with its roofline floor.

Floors (bytes that must move, over the device's measured copy bandwidth):
* verify_tree: the p and q rows of every node the walk visits (the root and each accepted node:
  8 * V bytes each; a walk cannot decide without reading them once), from the run's own
  num_accepted. The typical-acceptance input: the draft is a noisy copy of the target (mean
  accepted length reported in the shape column), children drafted without replacement from q.
* sampling_probs: read the fp32 logits and write the fp32 probabilities (8 bytes per element).
* sample_children: read q and the uniforms (8 bytes per element; the Triton kernel makes its
  uniforms in registers, so only q is read: its floor is half).
Rows: (op, backend, shape, time ms, GB/s of the floor's bytes, "x.x% of floor (floor us)").

Called by bench/gpu_bench.py's main (``gpu_rows(bench)``); runnable alone:
``python bench/gpu_bench_sampler.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python_api"))

VOCABS = (32000, 49152, 128256)
BATCHES = (1, 8)
TREES = (16, 64, 128)


def copy_bandwidth() -> float:
    """Achievable device bandwidth in bytes/s: a 1 GiB device-to-device copy (read + write)."""
    import triton.testing

    a = torch.empty(1 << 28, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50)
    return 2 * a.numel() * 4 / (ms * 1e-3)


def tree(T: int) -> list[int]:
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree

    return list(plan_tree(DEFAULT_ACCEPTANCE, T, 8).parents)


def verify_inputs(B: int, T: int, V: int, seed: int = 0):
    """Target p and draft q per node (q a noisy copy of p: typical acceptance), tokens drafted
    without replacement from each parent's q, fresh uniforms."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    parents = tree(T)
    T = len(parents)
    lp = torch.randn(B, T, V, device="cuda", generator=g) * 3
    lq = lp + torch.randn(B, T, V, device="cuda", generator=g) * 0.7
    p, q = torch.softmax(lp, -1), torch.softmax(lq, -1)
    tokens = torch.full((B, T), -1, dtype=torch.int64, device="cuda")
    tokens[:, 0] = 0
    kids: dict[int, list[int]] = {}
    for c in range(1, T):
        kids.setdefault(parents[c], []).append(c)
    for u, ch in kids.items():
        tokens[:, ch] = torch.multinomial(q[:, u], len(ch), replacement=False, generator=g)
    uni = torch.rand(B, T, device="cuda", generator=g)
    return p, q, tokens, torch.tensor(parents, device="cuda"), uni


def verify_rows(bench, bw: float) -> list[tuple]:
    import sequoia_kernels as sk
    from sequoia_kernels._backend import compiled_op_available
    from sequoia_kernels.triton_kernels import verify_tree as vt

    rows = []
    backends = (["cuda"] if compiled_op_available("cuda", "verify_tree") else []) + ["triton"]
    for V in VOCABS:
        for B in BATCHES:
            for T in TREES:
                p, q, tokens, par, u = verify_inputs(B, T, V)
                ws = torch.empty(B, 2, V, device="cuda")
                out = (torch.empty(B, len(par), dtype=torch.int64, device="cuda"),
                       torch.empty(B, dtype=torch.int64, device="cuda"), torch.empty(B, dtype=torch.int64, device="cuda"))
                ref = sk.verify_tree(p, q, tokens, par, uniforms=u, backend="reference")
                n = ref[1].double()
                floor_bytes = float(n.sum()) * 8 * V
                floor_ms = floor_bytes / bw * 1e3
                shape = f"V {V} B {B} T {len(par)} (mean accepted {float(n.mean()) - 1:.1f})"
                for backend in backends:
                    got = sk.verify_tree(p, q, tokens, par, uniforms=u, backend=backend, out=out, workspace=ws,
                                         validate=False)
                    same = all(torch.equal(a, b) for a, b in zip(ref, got))
                    ms = bench(lambda: sk.verify_tree(p, q, tokens, par, uniforms=u, backend=backend, out=out,
                                                      workspace=ws, validate=False))
                    name = backend + (f" ({vt.cluster_ctas(B, p.device)} CTA/seq)" if backend == "triton" else "")
                    rows.append(("verify_tree", name + ("" if same else " (differs from ref!)"), shape, ms,
                                 floor_bytes / ms / 1e6, f"{100 * floor_ms / ms:.0f}% of floor ({floor_ms * 1e3:.1f} us)"))
                # the Triton kernel with the other cluster size than its default (1 vs 8 CTAs)
                other = 1 if vt.cluster_ctas(B, p.device) > 1 else 8
                if B * other <= torch.cuda.get_device_properties(p.device).multi_processor_count:
                    def run(c=other):
                        vt.verify_tree_triton(p, q, tokens, par, u, False, *out, workspace=ws, num_ctas=c)
                    try:
                        run()
                        same = all(torch.equal(a, b) for a, b in zip(ref, out))
                        ms = bench(run)
                        rows.append(("verify_tree", f"triton ({other} CTA/seq)" + ("" if same else " (differs from ref!)"),
                                     shape, ms, floor_bytes / ms / 1e6,
                                     f"{100 * floor_ms / ms:.0f}% of floor ({floor_ms * 1e3:.1f} us)"))
                    except Exception as e:  # noqa: BLE001 - reported, not fatal
                        rows.append(("verify_tree", f"triton ({other} CTA/seq) FAILED: {type(e).__name__}", shape,
                                     float("nan"), float("nan"), str(e).splitlines()[0][:80] if str(e) else ""))
                if V == VOCABS[0] and B == 1 and T == TREES[0]:
                    ms = bench(lambda: sk.verify_tree(p, q, tokens, par, uniforms=u, backend="reference",
                                                      validate=False))
                    rows.append(("verify_tree", "reference (torch)", shape, ms, floor_bytes / ms / 1e6,
                                 f"{100 * floor_ms / ms:.0f}% of floor"))
    return rows


def sampling_rows(bench, bw: float) -> list[tuple]:
    from sequoia_kernels._backend import compiled_op_available
    from sequoia_kernels.ops.sampling import sample_children, sampling_probs
    from sequoia_kernels.random import new_state

    rows = []
    cuda = compiled_op_available("cuda", "sampling_probs") and compiled_op_available("cuda", "sample_children")
    for V in VOCABS:
        for B in BATCHES:
            for T in TREES:
                R = B * T
                g = torch.Generator(device="cuda").manual_seed(R + V)
                logits = torch.randn(R, V, device="cuda", generator=g) * 3
                out = torch.empty(R, V, device="cuda")
                floor_ms = 8 * R * V / bw * 1e3
                for temp, k, tp in ((1.0, 0, 1.0), (0.7, 50, 0.9)):
                    shape = f"V {V} rows {R} (B {B} x T {T}) T={temp} k={k} p={tp}"
                    smallest = V == VOCABS[0] and B == BATCHES[0] and T == TREES[0]
                    for backend in (["cuda"] if cuda else []) + ["triton"] + (["reference"] if smallest else []):
                        ms = bench(lambda: sampling_probs(logits, temperature=temp, top_k=k, top_p=tp,
                                                          backend=backend, out=out, validate=False))
                        rows.append(("sampling_probs", backend, shape, ms, 8 * R * V / ms / 1e6,
                                     f"{100 * floor_ms / ms:.0f}% of floor ({floor_ms * 1e3:.1f} us)"))
                q = torch.softmax(logits, -1)
                u = 1 - torch.rand(R, V, device="cuda", generator=g)
                seed, offset = new_state(1, device="cuda")
                o = torch.empty(R, 4, dtype=torch.int64, device="cuda")
                shape = f"V {V} rows {R} (B {B} x T {T}) K=4"
                cases = [("triton", dict(uniforms=u), 8), ("triton", dict(seed=seed, offset=offset), 4)]
                if V == VOCABS[0] and B == BATCHES[0] and T == TREES[0]:  # the reference once (slow)
                    cases.append(("reference", dict(uniforms=u), 8))
                if cuda:
                    cases.insert(0, ("cuda", dict(uniforms=u), 8))
                for backend, kw, nbytes in cases:
                    fl = nbytes * R * V / bw * 1e3
                    ms = bench(lambda: sample_children(q, 4, backend=backend, out=o, validate=False, **kw))
                    name = backend + (" (Philox in registers)" if "seed" in kw else "")
                    rows.append(("sample_children", name, shape, ms, nbytes * R * V / ms / 1e6,
                                 f"{100 * fl / ms:.0f}% of floor ({fl * 1e3:.1f} us)"))
    return rows


def gpu_rows(bench) -> list[tuple]:
    """All sampler rows, in bench/gpu_bench.py's row format."""
    bw = copy_bandwidth()
    rows = [("(copy bandwidth)", "torch copy_ 1 GiB", "", 0.0, bw / 1e9, "the floors' bandwidth")]
    rows += verify_rows(bench, bw)
    rows += sampling_rows(bench, bw)
    return rows


def main() -> None:
    import triton.testing

    assert torch.cuda.is_available(), "gpu_bench_sampler.py needs a GPU"
    rows = gpu_rows(lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100))
    print(f"\n## Sampler GPU benchmarks ({torch.cuda.get_device_name()}, torch {torch.__version__})\n")
    print("| op | backend | shape | time (us) | GB/s | floor |")
    print("|---|---|---|---:|---:|---:|")
    for op, backend, shape, ms, gbs, note in rows:
        print(f"| {op} | {backend} | {shape} | {ms * 1e3:.1f} | {gbs:.0f} | {note} |")


if __name__ == "__main__":
    main()
