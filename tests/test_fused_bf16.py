"""The fused bf16 row ops (csrc/cpu/fused_bf16.cpp): RMSNorm bitwise against the order it
promises (rms_norm_bf16_chain) and within a bf16 rounding of Hugging Face's module and of fp64,
SiLU-and-multiply against Hugging Face's ops (bitwise but for exp's last ulp), rotary bitwise
Hugging Face's, special values,
batch invariance bitwise, outputs poisoned with NaN, errors, and models switched to them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cpu_paths import outputs_per_path, skip_without_avx512f
from tiny_models import tiny_llama

from sequoia_kernels.ops.fused_bf16 import (
    fused_bf16_supported, rms_norm_bf16, rms_norm_bf16_chain, rms_norm_reference, rotary_bf16, rotary_reference,
    silu_mul_bf16, silu_mul_reference, use_fused_bf16,
)

pytestmark = pytest.mark.skipif(not fused_bf16_supported(), reason="sequoia_kernels._C has no fused bf16 ops")
BF16_ULP = 2.0 ** -7  # relative spacing of bf16 values (8 significant bits)


def _norm_case(R, H, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, H, generator=g) * scale).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(H, generator=g)).to(torch.bfloat16)
    return x, w


def _into_poisoned(op, *args):
    """The op's result written into an output filled with NaN first: every element overwritten."""
    out = torch.full(args[0].shape, float("nan"), dtype=torch.bfloat16)
    getattr(torch.ops.sequoia_kernels, op)(*args, out)
    return out


@pytest.mark.parametrize("H", [1, 7, 8, 9, 64, 576, 1000, 1537])
@pytest.mark.parametrize("R", [1, 3, 70])
def test_rms_norm_is_its_chain_bitwise_and_near_hf_and_fp64(R, H):
    x, w = _norm_case(R, H, seed=R * 10007 + H)
    y = _into_poisoned("rms_norm_bf16", x, w, 1e-5)
    assert not y.isnan().any()
    assert torch.equal(y, rms_norm_bf16_chain(x, w, 1e-5))
    assert torch.equal(rms_norm_bf16(x.view(1, R, H), w, 1e-5).view(R, H), y)  # the Python wrapper, any leading dims
    assert torch.equal(rms_norm_bf16(x.t().contiguous().t(), w, 1e-5), y)  # non-contiguous input
    # Hugging Face's module sums in another order: the inner rounding to bf16 may flip, one ulp
    # of the result each time (two roundings: <= 2 ulp of the output)
    hf = rms_norm_reference(x, w, 1e-5)
    rel = (y.double() - hf.double()).abs() / hf.double().abs().clamp_min(1e-30)
    assert float(rel.max()) <= 2 * BF16_ULP and float((y == hf).double().mean()) > 0.98
    xd = x.double()
    exact = w.double() * xd / torch.sqrt(xd.square().mean(-1, keepdim=True) + 1e-5)
    assert float(((y.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max()) <= 2 * BF16_ULP


def test_rms_norm_rows_are_batch_invariant():
    x, w = _norm_case(64, 576, seed=3)
    together = rms_norm_bf16(x, w, 1e-6)
    for r in (0, 17, 63):
        assert torch.equal(rms_norm_bf16(x[r:r + 1], w, 1e-6), together[r:r + 1])
    assert torch.equal(rms_norm_bf16(x[5:9], w, 1e-6), together[5:9])


@settings(max_examples=30, deadline=None)
@given(R=st.integers(1, 40), H=st.integers(1, 300), seed=st.integers(0, 2 ** 16),
       scale=st.sampled_from([1e-20, 1e-3, 1.0, 300.0, 1e18]), eps=st.sampled_from([1e-6, 1e-5, 0.0]))
@example(R=20, H=173, seed=3865, scale=1e-3, eps=1e-5)  # torch's fp32 sqrt 1 ulp off: the chain's was
def test_property_rms_norm_matches_its_chain(R, H, seed, scale, eps):
    """Any row count, width, magnitude (tiny rows where eps dominates, rows whose squares near
    fp32's range) and eps (0 too: a zero row gives NaN, as the module)."""
    x, w = _norm_case(R, H, seed, scale)
    if seed % 5 == 0:
        x[0] = 0
    y, chain = rms_norm_bf16(x, w, eps), rms_norm_bf16_chain(x, w, eps)
    assert bool(((y.view(torch.int16) == chain.view(torch.int16)) | (y.isnan() & chain.isnan())).all())
    if seed % 5 == 0 and eps == 0:
        assert y[0].isnan().all()


@pytest.mark.parametrize("n", [1, 5, 8, 13, 1536])
def test_silu_mul_matches_hf_but_for_exps_last_ulp(n):
    g = torch.Generator().manual_seed(n)
    gate = (torch.randn(33, n, generator=g) * 4).to(torch.bfloat16)
    up = torch.randn(33, n, generator=g).to(torch.bfloat16)
    y = _into_poisoned("silu_mul_bf16", gate, up)
    ref = silu_mul_reference(gate, up)
    assert not y.isnan().any() and float((y == ref).double().mean()) > 0.99
    rel = (y.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-30)
    assert float(rel.max()) <= 2 * BF16_ULP
    assert torch.equal(silu_mul_bf16(gate[7:8], up[7:8]), y[7:8])  # batch invariance
    exact = gate.double() / (1 + torch.exp(-gate.double())) * up.double()
    assert float(((y.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max()) <= 2 * BF16_ULP


def test_silu_mul_special_values_as_torch():
    """Gates past exp's range (-inf, -1e4, -100: e^-g overflows to inf, silu = -0), large positive
    ones, zeros of both signs, NaN: the same bits as torch's bf16 ops."""
    vals = [float("-inf"), -1e4, -100.0, -88.0, -20.0, -0.0, 0.0, 1e-38, 20.0, 100.0, 1e4, float("inf"), float("nan")]
    gate = torch.tensor(vals * 3).to(torch.bfloat16).view(3, -1)
    up = torch.tensor([1.0, -2.0, 0.5] * len(vals)).to(torch.bfloat16).view(3, -1)
    y, ref = silu_mul_bf16(gate, up), silu_mul_reference(gate, up)
    same = (y.view(torch.int16) == ref.view(torch.int16)) | (y.isnan() & ref.isnan())
    assert bool(same.all()), (y, ref)


@pytest.mark.parametrize("D", [2, 6, 16, 64, 128])
@pytest.mark.parametrize("cos_batch", [1, 3])
def test_rotary_is_hfs_bitwise(D, cos_batch):
    """x as the attention hands it over (a [B, T, H, D] projection viewed as [B, H, T, D]), cos and
    sin per row or broadcast: the same bits as Hugging Face's bf16 ops, into a NaN-poisoned output;
    D = 2, 6 (not a multiple of 16) take the scalar rows."""
    g = torch.Generator().manual_seed(D + cos_batch)
    x = (torch.randn(3, 5, 4, D, generator=g) * 3).to(torch.bfloat16).transpose(1, 2)  # [B, H=4, T=5, D]
    ang = torch.randn(cos_batch, 5, D, generator=g) * 10
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    out = torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
    torch.ops.sequoia_kernels.rotary_bf16(x, cos, sin, out)
    ref = rotary_reference(x, cos, sin)
    assert out.is_contiguous() and torch.equal(out.view(torch.int16), ref.contiguous().view(torch.int16))
    b = min(1, cos_batch - 1)  # row 1's cos and sin
    assert torch.equal(rotary_bf16(x[1:2], cos[b:b + 1], sin[b:b + 1]), out[1:2])  # batch invariance


def test_bad_input_is_an_error():
    x, w = _norm_case(2, 8, seed=0)
    out = torch.empty_like(x)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.sequoia_kernels.rms_norm_bf16(x.float(), w, 1e-6, out)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.sequoia_kernels.rms_norm_bf16(x, w[:5], 1e-6, out)
    with pytest.raises(RuntimeError, match=r"one shape \[\.\.\., H\]"):
        torch.ops.sequoia_kernels.silu_mul_bf16(x, x, out[:1])
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.sequoia_kernels.rms_norm_bf16(x.t(), w[:2], 1e-6, out.t())
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_bf16(x, x[:1])
    q = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[B or 1, T, D\]"):
        rotary_bf16(q, torch.zeros(1, 4, 8, dtype=torch.bfloat16), torch.zeros(1, 4, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bfloat16 CPU"):
        rotary_bf16(q.float(), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))


def test_models_switch_to_the_fused_ops_and_back():
    """A bf16 tiny Llama: every RMSNorm (2 per layer + the final one) and MLP switched and Llama's
    rotary replaced, the output close to the module's own (the sum order of the norm), everything
    restored on exit; an fp32 model and a model whose norm is not Llama's are left alone."""
    from transformers.models.llama import modeling_llama as ml

    model = tiny_llama(0, vocab=61, layers=3).to(torch.bfloat16).eval()
    ids = torch.tensor([[5, 9, 11, 3, 7]])
    hf_rotary = ml.apply_rotary_pos_emb
    with torch.no_grad():
        before = model(ids).logits
        with use_fused_bf16(model) as n:
            assert n == 3 * 2 + 1 + 3 and ml.apply_rotary_pos_emb is not hf_rotary
            fused = model(ids).logits
            with use_fused_bf16(model) as inner:  # an enclosing block already switched them
                assert inner == 0
            assert ml.apply_rotary_pos_emb is not hf_rotary  # the inner block left the outer's rotary
        assert all("forward" not in m.__dict__ for m in model.modules()) and ml.apply_rotary_pos_emb is hf_rotary
        assert torch.equal(model(ids).logits, before)
    assert (fused.float() - before.float()).abs().max() <= 0.05 * before.float().abs().max()
    with use_fused_bf16(tiny_llama(0, vocab=61, layers=2).eval()) as n:
        assert n == 0  # fp32

    class GemmaLikeNorm(torch.nn.Module):  # not Llama's forward: not switched
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16)), 1e-6

        def forward(self, x):
            return x * (1 + self.weight)

    with use_fused_bf16(torch.nn.Sequential(GemmaLikeNorm())) as n:
        assert n == 0


@pytest.mark.parametrize("shape", [(2, 5), (1, 1), (3, 1), (1, 7), (4,)])
def test_silu_mul_reads_the_halves_of_a_fused_output_in_place(shape):
    """The MLP's fused gate-up output split in two: the op reads each half's evenly spaced rows in
    place, bitwise its result on contiguous copies; other layouts are copied by the wrapper and
    refused by the op itself with a clear error."""
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[0])
    I = 40
    gu = (torch.randn(*shape, 2 * I, generator=g) * 3).to(torch.bfloat16)
    gate, up = gu.split(I, -1)
    ref = silu_mul_bf16(gate.contiguous(), up.contiguous())
    out = torch.full(gate.shape, float("nan"), dtype=torch.bfloat16)
    torch.ops.sequoia_kernels.silu_mul_bf16(gate, up, out)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(silu_mul_bf16(gate, up).view(torch.int16), ref.view(torch.int16))
    if len(shape) == 2 and shape[0] > 1 and shape[1] > 1:  # leading dims swapped: rows not evenly spaced
        gt, ut = gate.transpose(0, 1), up.transpose(0, 1)
        with pytest.raises(RuntimeError, match="rows contiguous at one stride"):
            torch.ops.sequoia_kernels.silu_mul_bf16(gt, ut, torch.empty(gt.shape, dtype=torch.bfloat16))
        assert torch.equal(silu_mul_bf16(gt, ut), ref.transpose(0, 1))


_PATHS_SCRIPT = """
import sys, torch
import sequoia_kernels  # registers the ops
ops = torch.ops.sequoia_kernels
cases = torch.load(sys.argv[1])
outs = []
for kind, args in cases:
    out = torch.full(args[0].shape, float("nan"), dtype=torch.bfloat16)
    getattr(ops, kind)(*args, out)
    outs.append(out)
torch.save(outs, sys.argv[2])
"""


def test_silu_mul_gives_the_same_bits_on_every_path_for_every_gate(tmp_path):
    """bf16(silu(g)) depends on the bf16 gate alone: every one of the 65,536 bf16 gate values
    (NaN payloads, infinities, subnormals, both zeros), times random and special up values, on
    the 8-lane path, the 16-lane path and every path the CPU has (on Intel CPUs with AVX-512F the
    lookup of silu16's own results): the same bits on all of them, the 8-lane path checked
    against torch elsewhere in this module."""
    skip_without_avx512f()
    g = torch.Generator().manual_seed(29)
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(256, 256)
    cases = []
    for up in ((torch.randn(256, 256, generator=g) * 8).to(torch.bfloat16), torch.ones(256, 256, dtype=torch.bfloat16),
               torch.tensor([float("inf"), -0.0, 1e-39, float("nan")]).repeat(256, 64).to(torch.bfloat16)):
        gu = torch.cat([gate, up], 1)  # [256, 512]: a fused gate-up output read in place
        cases.append(("silu_mul_bf16", (gu[:, :256], gu[:, 256:])))
        cases.append(("silu_mul_bf16", (gate[:, :250].contiguous(), up[:, :250].contiguous())))  # 8-lane tails
    outs = outputs_per_path(_PATHS_SCRIPT, cases, tmp_path, caps=("avx2", "avx512", "all"))
    for i in range(len(cases)):
        a = outs["avx2"][i].view(torch.int16)
        for cap in ("avx512", "all"):
            diff = int((a != outs[cap][i].view(torch.int16)).sum())
            assert diff == 0, f"case {i}: {diff} values differ between the avx2 and {cap} paths"


def test_cpu_vector_paths_give_the_same_bits(tmp_path):
    """The 16-lane (AVX-512F) RMSNorm scale, SiLU-and-multiply and rotary run the 8-lane (AVX2)
    path's operations value for value: the same bits on either path (row lengths with 8- and
    16-lane tails, half rows of 24 / 32 / 64 for the rotary, NaN and infinities, values near
    exp's range ends). Each path in its own process, chosen by ATEN_CPU_CAPABILITY."""
    skip_without_avx512f()
    g = torch.Generator().manual_seed(23)
    cases = []
    for R, H in [(1, 576), (5, 100), (33, 1536), (2, 24)]:
        x, w = _norm_case(R, H, seed=R * H, scale=3.0)
        x[0, :3] = torch.tensor([float("nan"), float("inf"), 1e-39])
        cases.append(("rms_norm_bf16", (x, w, 1e-5)))
        gu = (torch.randn(R, 2 * H, generator=g) * 30).to(torch.bfloat16)
        gu[0, :4] = torch.tensor([float("nan"), float("-inf"), 95.0, -95.0])
        cases.append(("silu_mul_bf16", (gu[:, :H], gu[:, H:])))
    for B, Hh, T, D in [(1, 9, 32, 64), (2, 3, 5, 48), (1, 2, 7, 128)]:
        x = (torch.randn(B, Hh, T, D, generator=g) * 4).to(torch.bfloat16)
        cos, sin = (torch.randn(B, T, D, generator=g).to(torch.bfloat16) for _ in range(2))
        cases.append(("rotary_bf16", (x, cos, sin)))
    outs = outputs_per_path(_PATHS_SCRIPT, cases, tmp_path)
    for i, (a, b) in enumerate(zip(outs["avx2"], outs["avx512"])):
        kind = cases[i][0]
        assert a.view(torch.int16).eq(b.view(torch.int16)).all(), f"case {i} ({kind}): the paths' bits differ"
        if kind != "rms_norm_bf16":  # (row 0 holds a NaN: its whole row is NaN)
            assert not torch.isnan(b[1:]).any(), f"case {i} ({kind}): NaN left in out"
