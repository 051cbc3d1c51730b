"""sampling_probs and sample_children on the CPU: the compiled kernels vs the PyTorch reference.

Shape: 64 rows (e.g. 8 sequences x 8 nodes of a tree level) of a 49152-token vocabulary, fp32.
Name the CPU next to every figure: on an AVX2-only CPU (AMD EPYC, Zen 3) and on an AVX-512 one
the ratios differ.
sampling_probs: temperature 0 (greedy: the one-hot argmax), temperature only (the decoding
default), top-p 0.9, and top-k 50 + top-p 0.9, on flat random logits and on peaked ones (a few
tokens 8-14 above the rest, as a language model's rows: top-p's nucleus path);
sample_children: 8 children per row. Both backends get the same inputs and run unvalidated with
preallocated outputs (as the decoding loop calls them), one ``benchmark.group`` per setting; the
baseline is ``test_reference_op`` (bench/report.py prints every row's speedup over it).

Run with ``make bench`` (or ``pytest bench/bench_sampling.py``).
"""

from __future__ import annotations

import pytest
import torch

from sequoia_kernels.ops.sampling import sample_children, sampling_probs

R, V = 64, 49152
SETTINGS = [(0.0, 0, 1.0, "flat"), (0.7, 0, 1.0, "flat"), (1.0, 0, 0.9, "flat"), (0.7, 50, 0.9, "flat"),
            (0.7, 0, 0.9, "peaked")]
IDS = [f"t{t}-k{k}-p{p}" + ("" if kind == "flat" else f"-{kind}") for t, k, p, kind in SETTINGS]


def _logits(kind: str = "flat") -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(R, V, generator=g) * 3.0
    if kind == "peaked":  # 5 tokens a row 8-14 above the rest's spread
        top = torch.randint(0, V, (R, 5), generator=g)
        x.scatter_(1, top, x.max(-1, keepdim=True).values + 8.0 + 6.0 * torch.rand(R, 5, generator=g))
    return x


def _children_case():
    g = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(R, V, generator=g) * 3.0, -1)
    u = 1.0 - torch.rand(R, V, generator=g)
    return q, u


CASES = [("sampling_probs", s) for s in SETTINGS] + [("sample_children", 8)]
CASE_IDS = [f"sampling_probs-{i}" for i in IDS] + ["sample_children-K8"]


def _run(benchmark, case, backend):
    op, arg = case
    if op == "sampling_probs":
        t, k, p, kind = arg
        x = _logits(kind)
        out = torch.empty(R, V)
        fn, args = sampling_probs, (x,)
        kw = dict(temperature=t, top_k=k, top_p=p, validate=False, out=out)
    else:
        q, u = _children_case()
        out = torch.empty(R, arg, dtype=torch.int64)
        fn, args = sample_children, (q, arg)
        kw = dict(uniforms=u, validate=False, out=out)
    benchmark.group = f"{op} R{R} V{V} {CASE_IDS[CASES.index(case)].split('-', 1)[1]}"
    if backend == "reference":  # 0.05-1 s per call: a few rounds
        rounds = 10 if op == "sampling_probs" and arg[1:3] == (0, 1.0) else 3
        benchmark.pedantic(fn, args=args, kwargs={**kw, "backend": backend}, rounds=rounds, iterations=1, warmup_rounds=1)
    else:
        benchmark(fn, *args, **kw, backend=backend)
    # same inputs, same outputs: sample_children equals the reference bit for bit, sampling_probs
    # has its support and its values to 4 ulp (the CPU kernel's exp is not torch's)
    expect = fn(*args, **{**kw, "out": None, "backend": "reference"})
    if op == "sample_children":
        assert torch.equal(out, expect), f"{op} {backend} differs from the reference"
    else:
        assert torch.equal(out > 0, expect > 0), f"{op} {backend}: another support than the reference's"
        ulps = (out.view(torch.int32).long() - expect.view(torch.int32).long()).abs().max().item()
        assert ulps <= 4, f"{op} {backend}: {ulps} ulp from the reference"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_op(benchmark, case):
    _run(benchmark, case, "reference")


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_cpu_op(benchmark, case):
    """The compiled CPU kernel (the default backend on CPU tensors)."""
    _run(benchmark, case, "cpu")
