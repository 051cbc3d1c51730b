"""packed_linear (csrc/cpu/packed_linear.cpp) against its fp64 reference, its batch invariance,
its errors, and use_packed_linears on models (HF Llama, the decoding loop)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_paths import outputs_per_path, skip_without_avx512f
from sequoia_kernels.ops.packed_linear import (
    MAX_ROWS, PANEL, pack_linear_weight, packed_linear, packed_linear_reference, packed_linear_supported,
    use_packed_linears,
)


def _case(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K ** 0.5


def _assert_close_fp32_dot(y, x, w, msg=""):
    """|y - x W^T| within the fp32 rounding bound of a K-term dot product: K * 2^-24 * sum |x w|
    (+ a few ulp)."""
    exact = x.double() @ w.double().t()
    bound = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t()) + 1e-30
    err = (y.double() - exact).abs()
    assert bool((err <= bound * 1.01 + exact.abs() * 2.0 ** -23).all()), f"{msg}: max err {float(err.max())}"


@pytest.mark.parametrize("K,N", [(1, 1), (7, 5), (33, 17), (576, 1536), (1536, 576), (64, 16), (100, 49152 // 16 + 3)])
@pytest.mark.parametrize("M", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_matches_reference(backend, M, K, N):
    x, w = _case(M, K, N, seed=M * 1000 + K + N)
    wp = pack_linear_weight(w)
    assert wp.shape == (-(-N // PANEL), K, PANEL) and wp.is_contiguous()
    out = torch.full((M, N), float("nan"))
    got = packed_linear(x, wp, N, out=out, backend=backend)
    assert got is out and not got.isnan().any()
    _assert_close_fp32_dot(got, x, w, f"M={M} K={K} N={N}")
    if backend == "reference":
        assert torch.equal(got, packed_linear_reference(x, wp, N))


def test_batch_invariant_bitwise():
    """A row's result is the same bits whatever M is and wherever the row sits (tiles of 6)."""
    x, w = _case(23, 300, 77, seed=5)
    wp = pack_linear_weight(w)
    full = packed_linear(x, wp, 77)
    for i in range(23):
        assert torch.equal(packed_linear(x[i:i + 1], wp, 77)[0], full[i]), i
    for lo, hi in [(0, 6), (3, 11), (5, 23), (17, 19)]:
        assert torch.equal(packed_linear(x[lo:hi], wp, 77), full[lo:hi]), (lo, hi)


_PATHS_SCRIPT = """
import sys, torch
from sequoia_kernels.ops.packed_linear import pack_linear_weight
cases = torch.load(sys.argv[1])
outs = []
for x, w in cases:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    torch.ops.sequoia_kernels.packed_linear(x, pack_linear_weight(w), w.shape[0], out)
    outs.append(out)
torch.save(outs, sys.argv[2])
"""


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_avx512_and_avx2_paths_give_the_same_bits(tmp_path_factory, seed):
    """The AVX-512F tile (2 panels x 6 rows of zmm chains) runs the AVX2 tile's k-order FMA chains:
    the same bits for every output, with odd panel counts (a task's last panel alone), partial
    last panels, every row tail, denormal and infinite inputs. Each path in its own process."""
    skip_without_avx512f()
    g = torch.Generator().manual_seed(seed)
    cases = []
    for M, K, N in [(1, 576, 1536), (7, 33, 17), (13, 100, 49), (64, 300, 80), (5, 1, 1), (6, 7, 5), (32, 64, 3075)]:
        x = torch.randn(M, K, generator=g) * float(torch.rand(1, generator=g) * 10)
        w = torch.randn(N, K, generator=g) / K ** 0.5
        x[0, 0], w[0, -1] = 1e-40, float(torch.randn(1, generator=g)) * 1e-39  # denormals in and out of the chain
        cases.append((x, w))
    x, w = torch.randn(3, 40, generator=g), torch.randn(20, 40, generator=g)
    x[1, 5] = float("inf")
    cases.append((x, w))
    outs = outputs_per_path(_PATHS_SCRIPT, cases, tmp_path_factory.mktemp("paths"))
    for i, (a, b) in enumerate(zip(outs["avx2"], outs["avx512"])):
        assert not a.isnan().all(), i
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), f"case {i}: the avx2 and avx512 paths differ"


def test_strided_rows_and_empty():
    x, w = _case(9, 40, 20, seed=2)
    wide = torch.randn(9, 50)
    wide[:, :40] = x
    wp = pack_linear_weight(w)
    assert torch.equal(packed_linear(wide[:, :40], wp, 20), packed_linear(x, wp, 20))
    assert packed_linear(x[:0], wp, 20).shape == (0, 20)


def test_bad_input_raises():
    x, w = _case(3, 8, 20, seed=1)
    wp = pack_linear_weight(w)
    with pytest.raises(ValueError, match="float32"):
        packed_linear(x.double(), wp, 20)
    with pytest.raises(ValueError, match="w_packed"):
        packed_linear(x, wp[:, :4], 20)
    with pytest.raises(ValueError, match="out_features"):
        packed_linear(x, wp, 33)
    with pytest.raises(ValueError, match="out_features"):
        packed_linear(x, wp, 16)  # 2 panels hold 17 .. 32 features
    with pytest.raises(ValueError, match="backend"):
        packed_linear(x, wp, 20, backend="triton")
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        pack_linear_weight(torch.randn(3))


def test_opcheck():
    x, w = _case(5, 24, 40, seed=3)
    torch.library.opcheck(torch.ops.sequoia_kernels.packed_linear.default,
                          (x, pack_linear_weight(w), 40, torch.empty(5, 40)),
                          test_utils=("test_schema", "test_faketensor"))


def _tiny_llama():
    import tiny_models

    return tiny_models.tiny_llama(0, vocab=101, hidden=48, special_tokens=True, attn=None)


@pytest.mark.skipif(not packed_linear_supported(), reason="needs an AVX2+FMA CPU")
def test_use_packed_linears_on_a_model():
    """Inside the block the model's logits match HF's plain forward (fp32 rounding), every Linear
    is switched and restored after; prefill-sized calls keep torch's GEMM; an in-place weight
    change is picked up (repacked); autograd keeps torch's path."""
    model = _tiny_llama()
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        with use_packed_linears(model) as n:
            assert n == 2 * 7 + 1
            got = model(ids).logits
            assert all("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
            with use_packed_linears(model) as inner:
                assert inner == 0  # already switched: nothing to do, nothing undone on exit
            assert all("forward" in m.__dict__ for m in model.modules() if type(m) is torch.nn.Linear)
            lin = model.model.layers[0].mlp.down_proj
            x = torch.randn(3, lin.in_features)
            before = lin(x)
            lin.weight.mul_(2.0)  # in place: the packed copy must follow
            torch.testing.assert_close(lin(x), 2 * before, rtol=1e-6, atol=1e-6)
            lin.weight.div_(2.0)
            big = torch.randn(MAX_ROWS + 1, lin.in_features)
            assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight))
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert not any("forward" in m.__dict__ or hasattr(m, "_sequoia_packed") for m in model.modules())
    with use_packed_linears(model):
        lin = model.lm_head
        x = torch.randn(2, lin.in_features, requires_grad=True)
        y = lin(x)
        assert y.grad_fn is not None  # torch's linear: differentiable
    with use_packed_linears(model, enabled=False) as n:
        assert n == 0


@pytest.mark.skipif(not packed_linear_supported(), reason="needs an AVX2+FMA CPU")
def test_packed_weights_are_kept_between_blocks_until_a_weight_changes_or_release():
    """A second block reuses the first block's packed copies (no repacking per generate call);
    a weight modified in place, replaced, or given new storage is repacked; release frees them."""
    from sequoia_kernels.ops.packed_linear import release_packed_linears

    model = _tiny_llama()
    lin = model.model.layers[0].mlp.down_proj
    x = torch.randn(3, lin.in_features)
    with torch.no_grad():
        with use_packed_linears(model):
            y0 = lin(x)
            first = lin._sequoia_packed[2]
        assert lin._sequoia_packed_kept[2] is first and "forward" not in lin.__dict__
        with use_packed_linears(model):
            assert torch.equal(lin(x), y0) and lin._sequoia_packed[2] is first  # reused, not repacked
        lin.weight.mul_(2.0)  # in place, outside any block
        with use_packed_linears(model):
            torch.testing.assert_close(lin(x), 2 * y0, rtol=1e-6, atol=1e-6)
            second = lin._sequoia_packed[2]
            assert second is not first
        lin.weight.data = lin.weight.data.clone().mul_(0.5)  # new storage, same Parameter and version
        with use_packed_linears(model):
            torch.testing.assert_close(lin(x), y0, rtol=1e-6, atol=1e-6)
            assert lin._sequoia_packed[2] is not second
        lin.weight = torch.nn.Parameter(lin.weight.detach() * 3.0)  # replaced
        with use_packed_linears(model):
            torch.testing.assert_close(lin(x), 3 * y0, rtol=1e-5, atol=1e-6)
    # only the modules that ran a small call were packed: down_proj of layer 0 here
    assert release_packed_linears(model) == 1 and release_packed_linears(model) == 0
    assert not any(hasattr(m, "_sequoia_packed_kept") for m in model.modules())


@pytest.mark.skipif(not packed_linear_supported(), reason="needs an AVX2+FMA CPU")
def test_decoding_loop_uses_and_restores_packed_linears():
    """SequoiaGenerator switches the models' Linears for the call only; greedy tokens are the same
    with and without them (batch invariance keeps AR and the tree's verification consistent)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.tree import chain_tree

    target = _tiny_llama()
    ids = torch.randint(0, 101, (2, 7))
    outs = []
    for packed in (True, False):
        gen = SequoiaGenerator(target, target, chain_tree(3), SamplingParams(temperature=0.0), max_length=64,
                               packed_linears=packed)
        outs.append(gen.generate(ids, max_new_tokens=12).tokens)
        assert not any("forward" in m.__dict__ for m in target.modules())
    assert outs[0] == outs[1]


def _assert_tile_in_registers(name: str, reg: str) -> None:
    """The compiled tile `name` has >= 12 FMAs on `reg` registers and no stack traffic between its
    first and last FMA."""
    from machine_code import function_body

    body = [ln.split("\t")[-1].strip() for ln in function_body(f"::{name}(").splitlines() if "\t" in ln]
    fma = [i for i in body if i.startswith("vfmadd") and reg in i]
    assert len(fma) >= 12, f"{name}: {len(fma)} {reg} FMAs"
    first, last = body.index(fma[0]), body.index(fma[-1])
    assert not any("rsp" in i for i in body[first:last + 1]), f"{name}: stack traffic between the tile's FMAs"


def test_tile_keeps_accumulators_in_registers():
    """Static (objdump) check of the compiled tiles: the AVX2 6 x 16 tile's 12 ymm FMAs per k step
    and the AVX-512F 6-row x 2-panel tile's 12 zmm FMAs, with no stack traffic in their loops (a
    spilled accumulator turns the FMA chain into a store chain: that build ran 2.4x slower)."""
    _assert_tile_in_registers("tile_avx2<6>", "ymm")
    _assert_tile_in_registers("tile_avx512<6, 2>", "zmm")
    # the AVX2 tile prefetches its weights ahead of the stream (the first tile of a call of 2+
    # rows: cpu::kPrefetchBytes in csrc/cpu/simd.h)
    from machine_code import function_body

    assert "prefetcht0" in function_body("::tile_avx2<6>(")


@pytest.mark.parametrize("cap,vendor,amx,pays", [("AVX2", "GenuineIntel", False, True), ("AVX2", "GenuineIntel", True, True),
                                                 ("AVX2", "AuthenticAMD", False, True),
                                                 ("AVX512", "AuthenticAMD", False, True),
                                                 ("AVX512", "GenuineIntel", False, True),
                                                 ("AVX512", "GenuineIntel", True, False),
                                                 ("DEFAULT", "AuthenticAMD", False, False)])
def test_fp32_pays_where_measured(monkeypatch, cap, vendor, amx, pays):
    """fp32 packed linears by default where they were measured faster than torch's GEMM: AVX2
    CPUs, AMD CPUs with AVX-512 and Intel CPUs with AVX-512 but no AMX (torch's GEMM there is
    1.5-2.5x slower at few rows), not Intel CPUs with AMX; bf16 wherever the kernel has a vector
    path."""
    import sequoia_kernels.ops.packed_linear as pl

    if not pl.compiled_op_available("cpu", "packed_linear"):
        pytest.skip("sequoia_kernels._C has no packed_linear")
    flags = "fpu avx2 avx512f" + (" amx_bf16 amx_tile" if amx else "")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setattr(pl, "cpuinfo", lambda field: {"vendor_id": vendor, "flags": flags}.get(field, ""))
    assert pl.packed_linear_pays(torch.float32) is pays
    assert pl.packed_linear_pays(torch.bfloat16) is pl.packed_linear_supported(torch.bfloat16)
