"""Philox random numbers, sampling_probs (temperature / top-k / top-p) and sample_children
(without replacement), each against an independent implementation and exact probabilities."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy import stats

from conftest import HAS_CUDA, cpu_backends, skip_unless_triton_on_cpu

from sequoia_kernels.ops.sampling import sample_children, sampling_probs
from sequoia_kernels.random import (
    bits_to_uniform,
    counters_used,
    new_state,
    philox4x32,
    philox_uniforms,
)
from sequoia_kernels.reference.sampling import child_keys

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------- Philox


def philox_py(ctr, key, rounds=10):
    """Philox4x32 in plain Python integers, straight from the Random123 paper."""
    M0, M1, W0, W1, MASK = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85, 0xFFFFFFFF
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + W0) & MASK, (k1 + W1) & MASK
        p0, p1 = M0 * c0, M1 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, p0 & MASK
    return c0, c1, c2, c3


KAT = [  # Random123 kat_vectors, philox4x32 with 10 rounds
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expect", KAT)
def test_philox_known_answers(ctr, key, expect):
    out = philox4x32(tuple(torch.tensor([c]) for c in ctr), tuple(torch.tensor([k]) for k in key))
    assert tuple(int(w) for w in out) == expect
    assert philox_py(ctr, key) == expect


@pytest.mark.parametrize("seed,offset", [(0, 0), (123456789, 2**32 - 3), (-5, 7), (2**62 + 11, 2**40 + 1)])
def test_philox_stream_layout(seed, offset):
    """Element i = word i % 4 of counter (offset + i // 4) split lo/hi, key = seed lo/hi; the
    counter carry into the high word (offset near 2**32) included."""
    n = 23
    u = philox_uniforms(torch.tensor([seed]), torch.tensor([offset]), (n,))
    s = seed & (2**64 - 1)
    for i in range(n):
        ctr = (offset + i // 4) & (2**64 - 1)
        w = philox_py((ctr & 0xFFFFFFFF, ctr >> 32, 0, 0), (s & 0xFFFFFFFF, s >> 32))[i % 4]
        assert u[i].item() == ((w >> 9) * 2 + 1) * 2.0**-24


def test_philox_state_advances_and_repeats():
    seed, offset = new_state(5, offset=100)
    a = philox_uniforms(seed, offset, (3, 7), advance=True)
    assert offset.item() == 100 + counters_used(21) == 106
    b = philox_uniforms(seed, offset, (3, 7), advance=True)
    assert not torch.equal(a, b)
    assert torch.equal(a, philox_uniforms(seed, torch.tensor([100]), (3, 7)))  # same (seed, offset): same numbers
    assert not torch.equal(a, philox_uniforms(torch.tensor([6]), torch.tensor([100]), (3, 7)))
    assert philox_uniforms(seed, offset, (0, 4)).shape == (0, 4)
    with pytest.raises(ValueError, match="int64"):
        philox_uniforms(torch.tensor([1.0]), offset, (2,))


def test_philox_uniformity():
    u = philox_uniforms(torch.tensor([2024]), torch.tensor([0]), (1_000_000,)).double()
    assert u.min() > 0 and u.max() < 1
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3
    counts = torch.histc(u, bins=256, min=0, max=1)
    assert stats.chisquare(counts.numpy()).pvalue > 1e-3
    # every value is an odd multiple of 2**-24 (23 random bits, never 0 or 1)
    m = u * 2**24
    assert torch.equal(m, m.round()) and (m.long() % 2 == 1).all()
    # consecutive numbers are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 5e-3
    assert bits_to_uniform(torch.tensor([0, 2**32 - 1])).tolist() == [2.0**-24, 1 - 2.0**-24]


def test_philox_triton_bitwise_equal():
    skip_unless_triton_on_cpu()
    pytest.importorskip("triton")
    from sequoia_kernels.random import _philox_uniforms_torch
    from sequoia_kernels.triton_kernels.sampling import philox_uniforms_triton

    for seed, off, n in [(1, 0, 1), (99, 2**32 - 2, 4099), (-3, 17, 64)]:
        s, o = torch.tensor(seed), torch.tensor(off)
        assert torch.equal(_philox_uniforms_torch(s, o, n), philox_uniforms_triton(s, o, n))


# ---------------------------------------------------------------------------- sampling_probs


def hf_probs(logits, temperature, top_k, top_p):
    """Independent implementation in the style of HF's warpers (temperature, then
    TopKLogitsWarper, then TopPLogitsWarper, then softmax), with torch.sort."""
    scores = logits.float()
    V = scores.shape[-1]
    if temperature == 0:
        return torch.nn.functional.one_hot(scores.argmax(-1), V).float()
    scores = scores / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, V))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, sorted_idx, remove), -float("inf"))
    return scores.softmax(-1)


def boundary_mass(logits, temperature, top_k):
    """For each token: (mass of kept tokens strictly more likely) / total, fp64, after top-k."""
    x = logits.double() / temperature
    if top_k > 0:
        kth = torch.topk(x, min(top_k, x.shape[-1]))[0][..., -1, None]
        x = x.masked_fill(x < kth, -float("inf"))
    e = torch.softmax(x, -1)
    xs, order = x.sort(-1, descending=True)
    cum = e.gather(-1, order).cumsum(-1)
    # mass strictly above = cumulative mass before the first element of the token's tie group
    first = torch.searchsorted(-xs.contiguous(), -xs.contiguous(), right=False)
    above = torch.where(first > 0, cum.gather(-1, (first - 1).clamp(min=0)), torch.zeros_like(cum))
    return torch.empty_like(above).scatter_(-1, order, above)


def assert_probs_match(got, ref, logits, temperature, top_k, top_p, atol=2e-6):
    """Same support, except tokens whose mass-above lies within 1e-5 of top_p (fp rounding of the
    nucleus boundary); probabilities equal up to fp32 rounding on a common support."""
    sup_g, sup_r = got > 0, ref > 0
    diff = sup_g != sup_r
    if diff.any():
        assert top_p < 1, "supports differ without top-p"
        mass = boundary_mass(logits, temperature, top_k)
        assert ((mass[diff] - top_p).abs() < 1e-5).all(), "support differs away from the top-p boundary"
        return
    torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4)


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.3, 5, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.8), (1.3, 3, 0.5),
            (0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6), (0.5, 1000, 0.95)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_sampling_probs_matches_hf_style(backend, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    V = 300 if backend == "triton" else 1000
    logits = torch.randn(4, V, generator=g) * 3
    logits[0, :10] = -float("inf")
    ref = hf_probs(logits, temperature, top_k, top_p)
    got = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, backend=backend)
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert_probs_match(got, ref, logits, max(temperature, 1e-9), top_k, top_p)
    torch.testing.assert_close(got.double().sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_sampling_probs_dtypes_and_shapes(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 3, 64, generator=g) * 2).to(dtype)
    ref = hf_probs(logits.float().reshape(6, 64), 0.8, 10, 0.9).reshape(2, 3, 64)
    for backend in cpu_backends("reference", "triton", "cpu"):
        got = sampling_probs(logits, temperature=0.8, top_k=10, top_p=0.9, backend=backend)
        assert got.shape == (2, 3, 64) and got.dtype == torch.float32
        assert_probs_match(got, ref, logits.float(), 0.8, 10, 0.9)


def test_sampling_probs_triton_matches_reference_multi_chunk():
    """V = 4099 spans several 1024-wide chunks in the Triton kernel (threshold searches too)."""
    skip_unless_triton_on_cpu()
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 4099, generator=g) * 4
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.6, 50, 1.0), (1.0, 0, 0.7), (0.9, 200, 0.9), (0.0, 0, 1.0)]:
        ref = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, backend="reference")
        got = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, backend="triton")
        assert_probs_match(got, ref, logits, max(temperature, 1e-9), top_k, top_p)


def test_sampling_probs_llama3_vocab_reference():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 128256, generator=g) * 3
    for temperature, top_k, top_p in [(0.7, 0, 0.9), (1.0, 40, 1.0)]:
        ref = hf_probs(logits, temperature, top_k, top_p)
        got = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, backend="reference")
        assert_probs_match(got, ref, logits, temperature, top_k, top_p)


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_sampling_probs_ties(backend):
    """Documented tie rules: top-k keeps every token tied with the k-th largest value; top-p keeps
    or drops tied tokens together; temperature 0 picks the lowest index of the maximum."""
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0, 3.0, -1.0]])
    # top-k = 3: values 3, 3, then 2 (three tokens tie with the 3rd largest) -> 5 tokens kept
    p = sampling_probs(x, top_k=3, backend=backend)
    assert (p[0] > 0).tolist() == [True, False, True, True, True, False, True, False]
    # top-p: the mass strictly above a "2" is 2 e^3 / Z = 0.605 (Z over all 8 tokens); with
    # top_p = 0.655 all three 2s are kept, with 0.555 none (HF's choice would depend on sort order)
    e = torch.exp(x[0].double())
    above_two = float(2 * e[0] / e.sum())
    p = sampling_probs(x, top_p=above_two + 0.05, backend=backend)
    assert (p[0] > 0).tolist() == [True, False, True, True, True, False, True, False]
    p = sampling_probs(x, top_p=above_two - 0.05, backend=backend)
    assert (p[0] > 0).tolist() == [True, False, False, False, False, False, True, False]
    assert torch.allclose(p[0, [0, 6]], torch.tensor([0.5, 0.5]))
    p = sampling_probs(x, temperature=0, backend=backend)
    assert p[0].tolist() == [1.0, 0, 0, 0, 0, 0, 0, 0]


def test_sampling_probs_extreme_temperatures_no_nan():
    x = torch.tensor([[30.0, 29.0, -50.0, 0.0]])
    for backend in cpu_backends("reference", "triton", "cpu"):
        for t in (1e-6, 1e-3, 1e3):
            p = sampling_probs(x, temperature=t, backend=backend)
            assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-6
        assert sampling_probs(x, temperature=1e-6, backend=backend)[0, 0] == 1.0


def test_sampling_probs_out_and_strided():
    g = torch.Generator().manual_seed(4)
    big = torch.randn(5, 80, generator=g)
    logits = big[:, ::2]  # non-contiguous vocabulary
    out = torch.full((5, 40), float("nan"))
    ref = sampling_probs(logits.contiguous(), temperature=0.9, top_p=0.8, backend="reference")
    for backend in cpu_backends("reference", "triton", "cpu"):
        r = sampling_probs(logits, temperature=0.9, top_p=0.8, backend=backend, out=out)
        assert r is out
        assert_probs_match(out, ref, logits, 0.9, 0, 0.8)
        out_t = torch.full((40, 5), float("nan")).t()  # non-contiguous out
        sampling_probs(logits, temperature=0.9, top_p=0.8, backend=backend, out=out_t)
        assert_probs_match(out_t, ref, logits, 0.9, 0, 0.8)


@pytest.mark.parametrize(
    "kwargs,logits,match",
    [
        ({}, torch.tensor([[0.0, float("nan")]]), "NaN"),
        ({}, torch.tensor([[0.0, float("inf")]]), r"\+inf"),
        ({}, torch.tensor([[0.0, 1.0], [-float("inf"), -float("inf")]]), "no finite"),
        ({"temperature": -1.0}, torch.zeros(1, 3), "temperature"),
        ({"temperature": float("nan")}, torch.zeros(1, 3), "temperature"),
        ({"top_k": -1}, torch.zeros(1, 3), "top_k"),
        ({"top_k": 2.5}, torch.zeros(1, 3), "top_k"),
        ({"top_p": 0.0}, torch.zeros(1, 3), "top_p"),
        ({"top_p": 1.5}, torch.zeros(1, 3), "top_p"),
        ({}, torch.zeros(1, 3, dtype=torch.int64), "float"),
        ({"out": torch.zeros(1, 3, dtype=torch.float16)}, torch.zeros(1, 3), "out must be"),
        ({"backend": "tpu"}, torch.zeros(1, 3), "unknown backend"),
    ],
)
def test_sampling_probs_bad_input(kwargs, logits, match):
    out = kwargs.pop("out", None)
    guard = torch.full(logits.shape, 7.0)
    with pytest.raises((ValueError, TypeError), match=match):
        sampling_probs(logits, out=out if out is not None else guard, **kwargs)
    assert (guard == 7.0).all()


# ---------------------------------------------------------------------------- sample_children


def exact_first_and_pairs(q: torch.Tensor):
    """Exact P(x1 = a) and P(x1 = a, x2 = b) for sampling without replacement from weights q."""
    q = q.double()
    S = q.sum()
    first = q / S
    pair = first[:, None] * q[None, :] / (S - q)[:, None]
    pair.fill_diagonal_(0)
    return first, pair


def chi2_ok(counts, expected_p):
    counts = counts.double()
    e = expected_p.double().flatten()
    e = e / e.sum()
    assert counts[e == 0].sum() == 0
    m = e > 0
    N = counts.sum()
    tv = 0.5 * float((counts / N - e).abs().sum())
    return tv, float(stats.chisquare(counts[m].numpy(), (e[m] * N).numpy()).pvalue)


@pytest.mark.parametrize("backend,philox_seed", [("reference", 77), ("cpu", 78)])
def test_sample_children_exact_without_replacement(one_thread, backend, philox_seed):
    """2e5 rows with the same (unnormalised, partly zero) q and Philox uniforms: the first child
    and the ordered pair of the first two children follow the exact without-replacement
    probabilities (the reference, and the CPU kernel)."""
    q = torch.tensor([0.5, 0.0, 0.3, 0.05, 0.9, 0.0, 0.2, 0.15, 0.4, 0.01])  # sums to 2.51
    N, V = 200_000, q.numel()
    seed, offset = new_state(philox_seed)
    tok = sample_children(q.expand(N, V).contiguous(), 3, seed=seed, offset=offset, backend=backend)
    assert (tok >= 0).all() and (tok[:, 0] != tok[:, 1]).all() and (tok[:, 1] != tok[:, 2]).all()
    first, pair = exact_first_and_pairs(q)
    tv1, p1 = chi2_ok(torch.bincount(tok[:, 0], minlength=V), first)
    tv2, p2 = chi2_ok(torch.bincount(tok[:, 0] * V + tok[:, 1], minlength=V * V), pair)
    assert p1 > 1e-3 and p2 > 1e-3, (p1, p2)
    assert tv1 < 0.005 and tv2 < 0.015, (tv1, tv2)


def test_sample_children_padding_and_counts():
    q = torch.tensor([[0.2, 0.0, 0.8, 0.0], [0.0, 0.0, 0.0, 0.0], [0.25] * 4, [0.1, 0.2, 0.3, 0.4]])
    u = philox_uniforms(torch.tensor([1]), torch.tensor([0]), (4, 4))
    for backend in cpu_backends("reference", "triton", "cpu"):
        tok = sample_children(q, torch.tensor([3, 2, 1, 0]), max_children=5, uniforms=u, backend=backend)
        assert tok.shape == (4, 5)
        assert sorted(tok[0, :2].tolist()) == [0, 2] and tok[0, 2:].tolist() == [-1] * 3  # only 2 tokens have q > 0
        assert tok[1].tolist() == [-1] * 5  # no token has q > 0
        assert 0 <= tok[2, 0] < 4 and tok[2, 1:].tolist() == [-1] * 4  # asked for 1
        assert tok[3].tolist() == [-1] * 5  # asked for 0
        full = sample_children(q[2:], 4, uniforms=u[2:], backend=backend)
        assert sorted(full[0].tolist()) == [0, 1, 2, 3]  # every token once: a permutation
        tok = sample_children(q, torch.tensor([3, 2, 1, 0], dtype=torch.int32), uniforms=u, backend=backend)
        assert tok.shape == (4, 3)  # max_children defaults to num_children.max()


def test_sample_children_ties_lowest_index_first():
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25]])
    u = torch.full((1, 4), 0.5)  # all keys equal
    for backend in cpu_backends("reference", "triton", "cpu"):
        assert sample_children(q, 4, uniforms=u, backend=backend).tolist() == [[0, 1, 2, 3]]


@pytest.mark.parametrize("V", [7, 50, 3000])
def test_sample_children_triton_matches_reference(V):
    skip_unless_triton_on_cpu()
    g = torch.Generator().manual_seed(V)
    R = 9
    q = torch.softmax(torch.randn(R, V, generator=g) * 2, -1)
    q[torch.rand(R, V, generator=g) < 0.3] = 0.0
    q[0] = 0.0
    q[1, :] = 0.0
    q[1, 3] = 1.0
    counts = torch.randint(0, 6, (R,), generator=g)
    counts[2] = min(V, 8)
    u = 1 - torch.rand(R, V, generator=g)
    ref = sample_children(q, counts, max_children=8, uniforms=u, backend="reference")
    got = sample_children(q, counts, max_children=8, uniforms=u, backend="triton")
    assert torch.equal(ref >= 0, got >= 0)
    if not torch.equal(ref, got):  # allowed only where two keys agree to rounding (tl.log vs torch.log)
        keys = child_keys(q, u).double()
        for r in (ref != got).any(1).nonzero()[:, 0].tolist():
            a, b = ref[r], got[r]
            i = int((a != b).nonzero()[0])
            ka, kb = float(keys[r, a[i]]), float(keys[r, b[i]])
            assert abs(ka - kb) <= 1e-5 * max(ka, kb), (r, a.tolist(), b.tolist())
    # Philox in registers = the same numbers as philox_uniforms, and offset advances alike
    s1, o1 = new_state(11, offset=5)
    s2, o2 = new_state(11, offset=5)
    a = sample_children(q, counts, max_children=8, seed=s1, offset=o1, backend="reference")
    b = sample_children(q, counts, max_children=8, seed=s2, offset=o2, backend="triton")
    assert torch.equal(a, b) and o1.item() == o2.item() == 5 + counters_used(R * V)


def test_sample_children_random_sources():
    q = torch.softmax(torch.randn(6, 30), -1)
    torch.manual_seed(0)
    a = [sample_children(q, 3, backend="reference") for _ in range(3)]
    torch.manual_seed(0)
    b = [sample_children(q, 3, backend="reference") for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], a[1])
    seed, offset = new_state(3)
    c = sample_children(q, 3, seed=seed, offset=offset)
    d = sample_children(q, 3, seed=seed, offset=offset)
    assert not torch.equal(c, d) and offset.item() == 2 * counters_used(6 * 30)
    with pytest.raises(ValueError, match="either uniforms or"):
        sample_children(q, 3, uniforms=torch.rand(6, 30), seed=seed, offset=offset)


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((torch.tensor([[0.5, float("nan")]]), 1), {}, "NaN"),
        ((torch.tensor([[0.5, -0.1]]), 1), {}, "negative"),
        ((torch.tensor([[0.5, 0.5]]), torch.tensor([3])), {"max_children": 1}, "num_children must lie"),
        ((torch.tensor([[0.5, 0.5]]), torch.tensor([1, 2])), {}, r"\[R\]"),
        ((torch.tensor([[0.5, 0.5]]), -1), {}, ">= 0"),
        ((torch.tensor([[0.5, 0.5]]).double(), 1), {}, "float32"),
        ((torch.tensor([0.5, 0.5]), 1), {}, r"\[R, V\]"),
        ((torch.tensor([[0.5, 0.5]]), 1), {"uniforms": torch.tensor([[0.5, 1.5]])}, "uniforms must lie"),
        ((torch.tensor([[0.5, 0.5]]), 1), {"uniforms": torch.rand(2, 2)}, r"uniforms must be a float32 \[R, V\]"),
        ((torch.tensor([[0.5, 0.5]]), 1), {"out": torch.zeros(1, 2, dtype=torch.int64)}, "out must be"),
    ],
)
def test_sample_children_bad_input(args, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        sample_children(*args, **kwargs)


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_sample_children_bad_values_write_nothing(backend):
    out = torch.full((2, 2), 7)
    q = torch.tensor([[0.5, 0.5], [0.5, float("nan")]])
    with pytest.raises(ValueError, match="NaN"):
        sample_children(q, 2, out=out, backend=backend)
    assert (out == 7).all()


# ------------------------------------------------------------------------- real compilation


AOT_SCRIPT = r"""
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sequoia_kernels.triton_kernels import sampling as S
def comp(k, types, consts, warps):
    sig = dict(zip(k.arg_names, types + ["constexpr"] * len(consts)))
    c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    assert "cubin" in c.asm
comp(S._philox_uniform_kernel, ["*i64", "*i64", "*fp32", "i64"], {"BLOCK": 1024}, 4)
for g, tk, tp in [(True, False, False), (False, False, False), (False, True, True), (False, True, False), (False, False, True)]:
    comp(S._sampling_probs_kernel, ["*bf16", "*fp32", "*fp64", "i32", "i64", "i64", "fp32", "i32"],
         {"GREEDY": g, "DO_TOPK": tk, "DO_TOPP": tp, "BLOCK_V": 1024, "NS": 16}, 8)
for ph in (True, False):
    comp(S._sample_children_kernel, ["*fp32", "*fp32", "*i64", "*i64", "*i64", "*i64", "i32", "i32", "i64", "i64", "i64", "i64"],
         {"PHILOX": ph, "BLOCK_V": 2048}, 8)
print("compiled")
"""


@pytest.mark.aot
def test_triton_kernels_compile_for_sm90():
    """The interpreter accepts code the real compiler rejects: compile every kernel for Hopper in
    a subprocess without the interpreter (no GPU needed)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                       cwd=str(REPO))
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("triton has no ptxas here")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


# Triton's tl.exp compiles to ex2.approx.f32 on a GPU (PTX of _sampling_probs_kernel; the CPU
# interpreter computes an exact exp): exp(y) = ex2(f32(y * log2 e)), relative error at most
# 2^-22 (ex2.approx) plus |y| * 2^-24 (the rounded product moves the exponent by half an ulp of
# y * log2 e, times ln 2). tl.log in sample_children compiles to libdevice's logf (no lg2.approx).
EX2_APPROX_REL = 2.0 ** -22


def ex2_approx_probs(logits, temperature, top_k, top_p, sign_seed=0):
    """The reference's probabilities with every kept exp(y) moved by the worst ex2.approx error,
    in a random direction per token (the support kept as the reference's)."""
    ref = sampling_probs_reference(logits, temperature, top_k, top_p)
    y = (logits.double() - logits.double().amax(-1, keepdim=True)) / max(temperature, 1e-9)
    g = torch.Generator().manual_seed(sign_seed)
    sign = torch.randint(0, 2, y.shape, generator=g).double() * 2 - 1
    rel = EX2_APPROX_REL + y.abs() * 2.0 ** -24
    e = torch.where(ref > 0, torch.exp(y) * (1 + sign * rel), torch.zeros_like(y))
    return (e / e.sum(-1, keepdim=True)).float(), ref, float(rel[ref > 0].max())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 0.9), (1.0, 0, 0.8), (0.3, 5, 1.0)])
def test_gpu_tolerances_hold_for_the_approximate_exp(temperature, top_k, top_p):
    """The GPU tests of the Triton sampling_probs (test_cuda_sampling_matches_reference, the
    radix top-k test: atol 1e-6 / 2e-6, rtol 1e-4, top-p support within 1e-5 of the boundary)
    were run here in the interpreter with an exact exp: on their own inputs, probabilities moved by
    the worst ex2.approx error still pass them, and the largest relative move of a kept exp stays
    well inside the top-p boundary window (so the support may only differ where they allow)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 128256, generator=g) * 3
    got, ref, worst = ex2_approx_probs(logits, temperature, top_k, top_p)
    assert worst < 1e-5 / 2, f"ex2.approx moves a kept exp by {worst:.2e}: the 1e-5 top-p window is too tight"
    assert_probs_match(got, ref, logits, max(temperature, 1e-9), top_k, top_p, atol=1e-6)
    logits = torch.randn(4, 3000, generator=g) * 3
    got, ref, _ = ex2_approx_probs(logits, 0.8, top_k or 64, 1.0)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)
    # the check can fail: an exp off by 1e-3 (a fast-math exp much worse than ex2.approx) does
    bad = ref * (1 + 1e-3 * (torch.arange(ref.shape[-1]) % 2 * 2 - 1))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(bad / bad.sum(-1, keepdim=True), ref, atol=2e-6, rtol=1e-4)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_sampling_matches_reference():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 128256, generator=g) * 3).cuda()
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 50, 0.9), (0.0, 0, 1.0), (1.0, 0, 0.8)]:
        ref = sampling_probs(logits.cpu(), temperature=temperature, top_k=top_k, top_p=top_p, backend="reference")
        got = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p, backend="triton").cpu()
        assert_probs_match(got, ref, logits.cpu(), max(temperature, 1e-9), top_k, top_p, atol=1e-6)
    q = torch.softmax(torch.randn(64, 32000, generator=g), -1).cuda()
    s1, o1 = new_state(1, "cuda")
    s2, o2 = new_state(1, "cuda")
    a = sample_children(q, 8, seed=s1, offset=o1, backend="triton").cpu()
    b = sample_children(q.cpu(), 8, seed=s2.cpu(), offset=o2.cpu(), backend="reference")
    assert (a == b).float().mean() > 0.99


# ------------------------------------------------------------------ compiled CPU kernels


from conftest import assert_bitwise_equal, assert_ulp_close  # noqa: E402

# The CPU kernel's exp (csrc/cpu/vec_math.h, <= 1 ulp) is not torch's (SLEEF, <= 1 ulp), its fp64
# sums run in another order, the rest is the spec's IEEE arithmetic: probabilities within 4 ulp.
CPU_PROBS_ULP = 4

from sequoia_kernels._backend import compiled_op_available, resolve_op_backend  # noqa: E402
from sequoia_kernels.reference.sampling import (  # noqa: E402
    sample_children_reference,
    sampling_probs_reference,
)

CPU_PROBS = compiled_op_available("cpu", "sampling_probs")
CPU_CHILDREN = compiled_op_available("cpu", "sample_children")
assert CPU_PROBS and CPU_CHILDREN, "sequoia_kernels._C must register the CPU sampling kernels (rebuild the extension)"

# (temperature, top_k, top_p): off / top-k / top-p / both, with k at 1, inside, and >= V.
CPU_SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.3, 5, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.8), (1.3, 3, 0.5),
                (0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6), (0.5, 1000, 0.95), (2.0, 4000, 0.3), (0.9, 10**6, 0.99)]


def awkward_logits(R: int, V: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Random logits with the cases that decide thresholds: -inf entries, a row with one finite
    entry, rows of heavy ties (values on a 0.5 grid, so top-k and top-p boundaries fall inside
    tie groups), a row of all-equal logits, very large magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g, dtype=torch.float64) * 3
    x[0, torch.rand(V, generator=g) < 0.4] = -float("inf")
    x[0, int(torch.randint(0, V, (1,), generator=g))] = 1.0
    if R > 1:
        x[1] = (x[1] * 2).round() / 2
    if R > 2:
        x[2] = 0.25
    if R > 3:  # large magnitudes (finite in the dtype)
        x[3] = x[3] * (1e4 if dtype in (torch.float32, torch.float64) else 1e3)
    if R > 4:
        x[4] = -float("inf")
        x[4, V // 2] = -7.0
    return x.to(dtype)


@pytest.mark.parametrize("V", [1, 5, 300, 32000])
@pytest.mark.parametrize("temperature,top_k,top_p", CPU_SETTINGS)
def test_cpu_sampling_probs_matches_reference(V, temperature, top_k, top_p):
    """The reference's support exactly (top-k/top-p thresholds exact with ties) and its values to
    CPU_PROBS_ULP (sums fp64, every step but exp the spec's IEEE fp32 operation), into a
    NaN-poisoned out."""
    R = 6 if V < 32000 else 3
    x = awkward_logits(R, V, seed=V + top_k + int(100 * top_p), dtype=torch.float32)
    out = torch.full((R, V), float("nan"))
    got = sampling_probs(x, temperature=temperature, top_k=top_k, top_p=top_p, backend="cpu", out=out)
    assert got is out
    assert_ulp_close(out, sampling_probs_reference(x, temperature, top_k, top_p), CPU_PROBS_ULP, f"V={V}")
    if 0 < top_k < V and temperature > 0 and top_p == 1 and V >= 300:  # tie row: at least k kept
        assert int((out[1] > 0).sum()) >= top_k


@pytest.mark.parametrize("setting", [(0.7, 40, 0.9), (1.0, 0, 0.95), (0.6, 0, 1.0), (1.0, 2000, 1.0)])
def test_cpu_sampling_probs_llama3_vocab_one_row(setting):
    t, k, p = setting
    x = awkward_logits(1, 128256, seed=7, dtype=torch.float32)
    x[0, :1000] = (x[0, :1000] * 2).round() / 2
    got = sampling_probs(x, temperature=t, top_k=k, top_p=p, backend="cpu")
    assert_ulp_close(got, sampling_probs_reference(x, t, k, p), CPU_PROBS_ULP, f"{setting}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_cpu_sampling_probs_dtypes_strides_batch_dims(dtype):
    """Half/bfloat16/double logits (rounded to fp32 first, as the reference), rows with a stride
    larger than V, leading batch dimensions, a non-contiguous out."""
    wide = awkward_logits(6, 500, seed=11, dtype=dtype)
    x = wide[:, :431]  # row stride 500
    ref = sampling_probs_reference(x, 0.8, 17, 0.9)
    flat = sampling_probs(x, temperature=0.8, top_k=17, top_p=0.9, backend="cpu")
    assert_ulp_close(flat, ref, CPU_PROBS_ULP, str(dtype))
    x3 = x.reshape(2, 3, 431)
    got = sampling_probs(x3, temperature=0.8, top_k=17, top_p=0.9, backend="cpu")
    assert_bitwise_equal(got, flat.reshape(2, 3, 431), "batch dims")
    out_t = torch.full((431, 6), float("nan")).t()
    sampling_probs(x, temperature=0.8, top_k=17, top_p=0.9, backend="cpu", out=out_t)
    assert_bitwise_equal(out_t.contiguous(), flat, "strided out")


def test_cpu_sampling_probs_many_rows_parallel():
    """More rows than threads x grain: every row equals its own reference (no scratch shared)."""
    x = awkward_logits(97, 777, seed=5)
    for t, k, p in [(0.9, 30, 0.8), (1.0, 0, 0.7)]:
        assert_ulp_close(sampling_probs(x, temperature=t, top_k=k, top_p=p, backend="cpu"),
                         sampling_probs_reference(x, t, k, p), CPU_PROBS_ULP, f"{t, k, p}")


def test_cpu_is_the_default_backend_on_cpu_tensors():
    assert resolve_op_backend("sampling_probs", None, "cpu") == "cpu"
    assert resolve_op_backend("sample_children", None, "cpu") == "cpu"


@pytest.mark.parametrize("V", [1, 5, 300, 32000])
def test_cpu_sample_children_equals_reference(V):
    """The same children as the reference (log is torch's, the keys are the spec's fp32 ops, ties
    by lower index, NaN/-0 keys ordered as torch.sort), into a poisoned out; K > V, zero rows,
    repeated keys, int32 and int64 counts."""
    R = 9
    g = torch.Generator().manual_seed(V)
    q = torch.softmax(torch.randn(R, V, generator=g) * 2, -1)
    q[torch.rand(R, V, generator=g) < 0.3] = 0.0
    q[0] = 0.0  # no eligible token
    q[1] = 1.0  # all keys tied when u is constant
    u = 1 - torch.rand(R, V, generator=g)
    u[1] = 0.5
    u[2, : V // 2] = 1.0  # keys -0.0 (tie with +0.0 order)
    u[3, :2] = 0.0  # key +inf -> FLT_MAX
    for K in sorted({1, 3, 8, V + 2}):
        for dtype in (torch.int64, torch.int32):
            counts = torch.randint(0, K + 1, (R,), generator=g).to(dtype)
            counts[1] = K
            out = torch.full((R, K), -7, dtype=torch.int64)
            sample_children(q, counts, max_children=K, uniforms=u, backend="cpu", out=out)
            assert torch.equal(out, sample_children_reference(q, counts.long(), K, u)), (V, K, dtype)
    out_t = torch.full((8, R), -7, dtype=torch.int64).t()  # non-contiguous out
    sample_children(q, 8, uniforms=u, backend="cpu", out=out_t)
    assert torch.equal(out_t, sample_children_reference(q, torch.full((R,), 8), 8, u))


def test_cpu_sample_children_unvalidated_garbage_matches_reference():
    """validate=False with NaN / negative q and uniforms outside (0, 1]: still the reference's
    answer (NaN keys sort last), nothing out of range."""
    g = torch.Generator().manual_seed(3)
    q = torch.rand(4, 50, generator=g)
    q[0, :5] = float("nan")
    q[1, :5] = -1.0
    u = torch.rand(4, 50, generator=g)
    u[2, :5] = -0.5  # log -> NaN keys
    u[3, :5] = 2.0  # negative keys
    got = sample_children(q, 6, uniforms=u, backend="cpu", validate=False)
    assert torch.equal(got, sample_children_reference(q, torch.full((4,), 6), 6, u))


def test_cpu_sample_children_large_vocab_frequencies():
    """V = 32000: over 4000 rows the first child's frequency of the 10 most likely tokens matches
    q (a sampler bug that ignores q or the index tie rule would be far off)."""
    g = torch.Generator().manual_seed(9)
    q = torch.softmax(torch.randn(32000, generator=g) * 3.5, -1)
    N = 1500
    tok = sample_children(q.expand(N, -1).contiguous(), 2, uniforms=1 - torch.rand(N, 32000, generator=g),
                          backend="cpu")
    top = q.topk(10).indices
    freq = (tok[:, :1] == top[None]).double().mean(0)
    se = (q[top].double() * (1 - q[top].double()) / N).sqrt()
    assert ((freq - q[top].double()).abs() < 5 * se + 1e-3).all(), (freq.tolist(), q[top].tolist())


def test_cpu_ops_bad_input_raise_before_writing():
    """The compiled ops check their arguments (a clear RuntimeError) before writing anything."""
    ops = torch.ops.sequoia_kernels
    out = torch.full((2, 4), 7.0)
    x = torch.randn(2, 4)
    bad_probs = [
        ((torch.randn(8), 1.0, 0, 1.0, out), "logits must be \\[R, V\\]"),
        ((x.long(), 1.0, 0, 1.0, out), "logits must be float"),
        ((x, 1.0, 0, 1.0, torch.full((2, 4), 7.0).double()), "out must be float32"),
        ((x, 1.0, 0, 1.0, torch.full((2, 5), 7.0)), "out must be float32"),
        ((x, 1.0, 0, 1.5, out), "top_p"),
        ((x, -1.0, 0, 1.0, out), "temperature"),
        ((x, 1.0, -2, 1.0, out), "top_k"),
        ((torch.randn(4, 2).t(), 1.0, 0, 1.0, out), "contiguous"),
    ]
    for args, match in bad_probs:
        with pytest.raises(RuntimeError, match=match):
            ops.sampling_probs(*args)
        assert (out == 7.0).all()
    q = torch.softmax(torch.randn(2, 4), -1)
    u = torch.rand(2, 4)
    n = torch.tensor([1, 2])
    o = torch.full((2, 3), -7, dtype=torch.int64)
    bad_children = [
        ((q.double(), n, u, o), "draft_probs must be float32"),
        ((q, n, u[:, :3], o), "uniforms must be float32 \\[R, V\\]"),
        ((q, n.float(), u, o), "num_children must be int32/int64"),
        ((q, n[:1], u, o), "num_children must be int32/int64"),
        ((q, n, u, o.int()), "out must be int64"),
        ((q, n, u, o[:1]), "out must be int64"),
    ]
    for args, match in bad_children:
        with pytest.raises(RuntimeError, match=match):
            ops.sample_children(*args)
        assert (o == -7).all()


def test_opcheck_cpu_sampling_ops():
    x = awkward_logits(3, 40, seed=1)
    torch.library.opcheck(torch.ops.sequoia_kernels.sampling_probs.default,
                          (x, 0.8, 5, 0.9, torch.empty(3, 40)), test_utils=("test_schema", "test_faketensor"))
    q = torch.softmax(torch.randn(3, 40), -1)
    torch.library.opcheck(torch.ops.sequoia_kernels.sample_children.default,
                          (q, torch.tensor([1, 2, 3]), 1 - torch.rand(3, 40), torch.empty(3, 3, dtype=torch.int64)),
                          test_utils=("test_schema", "test_faketensor"))


def test_cpu_kernels_static_avx2_clones_without_fma():
    """Static check of the compiled CPU kernels (no run): every hot loop of sampling.cpp and
    verify_tree.cpp has an AVX2 clone that really is 8-wide (ymm packed instructions; the fp64 sums
    as vcvtps2pd + vaddpd), and no fused multiply-add appears in any sequoia_kernels function
    (the spec's IEEE fp32 operations one by one: FMA contraction would change bits) but the
    AVX2+FMA row functions of csrc/cpu/vec_math.h (namespace sequoia_kernels::cpu: the exp
    polynomial and the division by remainder correction, whose bits tests/cpp/vec_math_check.cpp
    checks), which exist, use FMA and stream the probabilities out (vmovntps)."""
    import platform
    import re
    import shutil

    import sequoia_kernels._C as ext

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("objdump") is None:
        pytest.skip("needs x86-64 and binutils' objdump")
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", ext.__file__], capture_output=True,
                         text=True, timeout=300).stdout
    funcs: dict[str, list[str]] = {}
    cur = None
    for line in dis.splitlines():
        m = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if m:
            cur = m.group(1) if "sequoia_kernels" in m.group(1) and not m.group(1).endswith("@plt") else None
            if cur:
                funcs[cur] = []
        elif cur and "\t" in line:
            funcs[cur].append(line.split("\t")[1].strip())
    def has_fma(ins):
        return any(i.startswith(("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")) for i in ins)

    # (packed_linear's tiles and the CPU attention's scores and outputs are FMA chains by their own spec:
    # csrc/cpu/packed_linear.cpp, packed_linear_bf16.cpp, tree_attention.cpp; the fused SiLU's rows and its
    # lookup table's builder inline vec_math.h's exp polynomial: csrc/cpu/fused_bf16.cpp, whose RMSNorm rows
    # must have none)
    by_spec = ("tile_avx2<", "panel_avx2(", "tile_avx512<", "panels_avx512<", "tile_bf16_avx2<", "group_bf16_avx2(",
               "tile_bf16_avx512f<", "chunk_bf16_avx512f(", "group_bf16_avx512f(", "attend8_avx2(", "values_avx2<",
               "attend16_avx512(", "softmax_values16(", "values_avx512<", "values_rows_avx512<", "silu_mul_row_avx2(",
               "silu_mul_row_avx512(", "fill_silu_table(")
    fma = [n for n, ins in funcs.items()
           if has_fma(ins) and "sequoia_kernels::cpu::" not in n and not any(f in n for f in by_spec)]
    assert not fma, f"FMA instructions in {fma[:3]}"
    for short in ("scale_exp_sum_avx2", "divide_stream_avx2"):
        (ins,) = [ins for n, ins in funcs.items() if f"sequoia_kernels::cpu::{short}(" in n]
        assert has_fma(ins) and any(i.startswith("vmulps") and "ymm" in i for i in ins), short
    (ins,) = [ins for n, ins in funcs.items() if "sequoia_kernels::cpu::divide_stream_avx2(" in n]
    assert any(i.startswith("vmovntps") for i in ins), "divide_stream_avx2: no streaming stores"
    need = {"reject_segment": ("vmulps", "vcvtps2pd", "vaddpd"), "block_sums": ("vcvtps2pd", "vaddpd"),
            "row_max": ("vmaxps",), "scale_row": ("vsubps", "vdivps"), "mask_and_sum": ("vcvtps2pd", "vaddpd"),
            "race_keys": ("vdivps",)}
    for short, ops in need.items():
        clones = [ins for n, ins in funcs.items() if f"::{short}(" in n and "[clone .avx2]" in n]
        assert len(clones) == 1, f"{short}: no AVX2 clone"
        for op in ops:
            assert any(i.startswith(op) and "ymm" in i for i in clones[0]), f"{short}.avx2: no 8-wide {op}"


def test_cpu_vec_math():
    """csrc/cpu/vec_math.h against the correctly rounded results (tests/cpp/vec_math_check.cpp):
    exp within 1 ulp over every 97th float of [-104, 0], the remainder-corrected division bit for
    bit vdivps over every 97th fp32 bit pattern and fresh random pairs. (Run with stride 1 once:
    1.1e9 exps, 5.2e10 quotients, the same verdict; the closing note of the sampler issue.)"""
    import platform
    import random
    import shutil
    import tempfile

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("g++") is None:
        pytest.skip("needs x86-64 and g++")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "vec_math_check")
        subprocess.run(["g++", "-O2", "-std=c++20", "-I", os.path.join(root, "csrc"),
                        os.path.join(root, "tests", "cpp", "vec_math_check.cpp"), "-o", exe],
                       check=True, capture_output=True, text=True, timeout=300)
        seed = random.randrange(2**31)
        r = subprocess.run([exe, "97", str(seed)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"seed {seed}:\n{r.stdout}{r.stderr}"
    assert "SKIP" in r.stdout or ("largest error" in r.stdout and "0 differ" in r.stdout), r.stdout


@settings(max_examples=60, deadline=None)
@given(V=st.integers(1, 700), seed=st.integers(0, 2**31 - 1), ties=st.integers(0, 3),
       special=st.sampled_from(["none", "nan", "neg_inf_row", "signed_zeros"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sampling_probs_greedy_is_torch_argmax(V, seed, ties, special, dtype):
    """temperature 0 on the CPU kernel: one-hot at torch.argmax's index (the first index of the
    maximum, the first NaN's when the row has one) over rows of several 64-value blocks, the
    maximum tied at random places, rows of -inf, +0 / -0 maxima; rows in a NaN-poisoned out."""
    if "cpu" not in cpu_backends("cpu"):
        pytest.skip("no compiled CPU sampling op")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, V, generator=g)
    top = x.max()
    for _ in range(ties):  # the maximum again at random places
        x[torch.randint(0, 3, (1,), generator=g), torch.randint(0, V, (1,), generator=g)] = top
    if special == "nan":
        x[1, torch.randint(0, V, (1,), generator=g)] = float("nan")
    elif special == "neg_inf_row":
        x[2] = float("-inf")
    elif special == "signed_zeros":
        x[0] = -x[0].abs() - 1
        x[0, torch.randint(0, V, (2,), generator=g)] = torch.tensor([-0.0, 0.0])
    x = x.to(dtype)
    out = torch.full((3, V), float("nan"))
    p = sampling_probs(x, temperature=0, backend="cpu", out=out, validate=False)
    want = torch.nn.functional.one_hot(x.float().argmax(-1), V).float()
    assert torch.equal(p, want), (x.float().argmax(-1), p.argmax(-1))


@settings(max_examples=60, deadline=None)
@example(head=50, tail=5000, tail_y=-8.4, ties=3, top_p=0.9, temperature=1.0, seed=1, dtype=torch.float32)
@example(head=50, tail=5000, tail_y=-8.4, ties=3, top_p=0.5, temperature=0.7, seed=2, dtype=torch.float32)
@example(head=20, tail=3000, tail_y=-9.6, ties=5, top_p=0.99, temperature=1.0, seed=3, dtype=torch.bfloat16)
@example(head=50, tail=5000, tail_y=-8.4, ties=0, top_p=1e-6, temperature=1.0, seed=4, dtype=torch.float32)
@example(head=50, tail=5000, tail_y=-8.4, ties=0, top_p=1e-6, temperature=1.0, seed=5, dtype=torch.float32)
@given(head=st.integers(1, 300), tail=st.integers(0, 6000), tail_y=st.floats(-12.0, -8.0),
       ties=st.integers(0, 20), top_p=st.sampled_from([1e-6, 0.5, 0.9, 0.99, 0.9999]),
       temperature=st.sampled_from([1.0, 0.7]), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_sampling_probs_top_p_nucleus_and_its_fallbacks(head, tail, tail_y, ties, top_p, temperature, seed, dtype):
    """Top-p without top-k on the CPU kernel, against the reference: a head of tokens within the
    nucleus cut of the maximum (y > -9 after the temperature; the maximum and other values tied
    at random), and a tail of up to 6000 tokens around the cut, whose mass decides whether the
    head alone holds top_p (the nucleus path) or not, and whose count whether the candidates
    exceed the nucleus path's limit (both fallbacks to the general search). NaN-poisoned out."""
    if "cpu" not in cpu_backends("cpu"):
        pytest.skip("no compiled CPU sampling op")
    g = torch.Generator().manual_seed(seed)
    y_head = -torch.rand(head, generator=g) * 8.5  # [head]: y in (-8.5, 0]
    y_head[0] = 0.0
    for _ in range(ties):
        i, j = torch.randint(0, head, (2,), generator=g).tolist()
        y_head[i] = y_head[j]
    y_tail = tail_y + 0.3 * torch.randn(tail, generator=g)  # around the cut, on both sides
    x = torch.cat([y_head, y_tail])[torch.randperm(head + tail, generator=g)] * temperature + 3.0
    x = x.to(dtype)[None].repeat(2, 1)
    out = torch.full(x.shape, float("nan"))
    got = sampling_probs(x, temperature=temperature, top_p=top_p, backend="cpu", out=out)
    ref = sampling_probs(x, temperature=temperature, top_p=top_p, backend="reference")
    assert not torch.isnan(got).any()
    assert_probs_match(got, ref, x, temperature, 0, top_p)


# ----------------------------------------------------------------------------- overlap_rows


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.sampled_from([1, 2, 7, 8, 9, 33, 1000, 49152]), st.integers(0, 12),
       st.sampled_from(["softmax", "filtered", "equal", "disjoint"]), st.booleans(), st.integers(0, 2**31 - 1))
def test_overlap_rows_matches_the_fp64_reference(R, V, N, kind, strided, seed):
    """overlap_rows (the compiled CPU kernel where built, else the reference) against the fp64
    reference: random rows (repeats included) of softmaxes, top-k filtered rows with zeros,
    equal rows (overlap 1) and disjoint supports (overlap 0), every vector tail of V, rows with a
    stride, ``out`` poisoned with NaN."""
    from sequoia_kernels.ops.sampling import overlap_rows
    from sequoia_kernels.reference.sampling import overlap_rows_reference

    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(R, V, generator=g), -1)
    q = torch.softmax(3 * torch.randn(R, V, generator=g), -1)
    if kind == "filtered":
        keep = torch.rand(R, V, generator=g) < 0.3
        p, q = p * keep, q * keep.roll(1, -1)
    elif kind == "equal":
        q = p.clone()
    elif kind == "disjoint":
        half = torch.arange(V) % 2 == 0
        p, q = p * half, q * ~half
    if strided:  # row stride > V (views into wider rows)
        p, q = torch.cat([p, p], -1)[:, :V], torch.cat([q, q], -1)[:, :V]
    rows = torch.randint(0, R, (N,), generator=g)
    out = torch.full((N,), float("nan"))
    got = overlap_rows(p, q, rows, out=out)
    want = overlap_rows_reference(p.double(), q.double(), rows)
    assert got is out and not bool(out.isnan().any())
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-7), (out, want)
    if kind == "equal":
        assert torch.allclose(out.double(), p.double().sum(-1)[rows], rtol=1e-6)
    if kind == "disjoint":
        assert bool((out == 0).all())
    assert torch.allclose(overlap_rows(p, q, rows, backend="reference").double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_overlap_rows_bad_input(backend):
    """Clear errors, ``out`` untouched: rows outside [0, R), wrong dtypes and shapes."""
    from sequoia_kernels.ops.sampling import overlap_rows

    p = q = torch.full((4, 16), 1 / 16)
    out = torch.full((2,), float("nan"))
    for rows in (torch.tensor([0, 4]), torch.tensor([-1, 0])):
        with pytest.raises(ValueError, match=r"rows.*\[0, 4\)"):
            overlap_rows(p, q, rows, out=out, backend=backend)
        assert bool(out.isnan().all())
    with pytest.raises(ValueError, match="float32"):
        overlap_rows(p.double(), q, torch.tensor([0]), backend=backend)
    with pytest.raises(ValueError, match="one shape"):
        overlap_rows(p, q[:3], torch.tensor([0]), backend=backend)
    with pytest.raises(ValueError, match="int64"):
        overlap_rows(p, q, torch.tensor([0], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="out must be"):
        overlap_rows(p, q, torch.tensor([0]), out=out, backend=backend)
    assert overlap_rows(p, q, torch.zeros(0, dtype=torch.int64), backend=backend).shape == (0,)


def test_overlap_rows_opcheck():
    if not hasattr(torch.ops.sequoia_kernels, "overlap_rows"):
        pytest.skip("sequoia_kernels._C has no overlap_rows")
    g = torch.Generator().manual_seed(3)
    p, q = torch.rand(5, 130, generator=g), torch.rand(5, 130, generator=g)
    torch.library.opcheck(torch.ops.sequoia_kernels.overlap_rows.default,
                          (p, q, torch.tensor([4, 0, 4]), torch.empty(3)))
