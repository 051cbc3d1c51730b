"""packed_linear in bf16 (csrc/cpu/packed_linear_bf16.cpp): every instruction set this CPU has
against the chain it promises (bitwise, packed_linear_bf16_chain) and against an fp64 product,
each path against the others, batch invariance bitwise (1 row against 2 .. 64), errors, and
bf16 models on it (HF Llama, the decoding loop's greedy promise)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny_models import tiny_llama

from sequoia_kernels.ops.packed_linear import (
    ISAS, bf16_isa, pack_linear_weight_bf16, packed_linear, packed_linear_bf16_chain, packed_linear_reference,
    packed_linear_supported, unpack_linear_weight_bf16, use_packed_linears,
)

HAVE = [isa for isa in ISAS if isa != "auto" and bf16_isa(isa) is not None]
# the pair chain bitwise; AMX (and its emulation, "amx_emulated": the AMX path's code on software
# tiles, on any x86-64 CPU) rounds once per tile instruction (32 products)
CHAIN = [isa for isa in HAVE if not isa.startswith("amx")]
needs_kernel = pytest.mark.skipif(bf16_isa() is None, reason="sequoia_kernels._C has no packed_linear_bf16")


def _case(M, K, N, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    return x, w


def _assert_within_one_ulp(a, b, x, w, msg=""):
    """bf16 results of two fp32 chains that differ by at most one bf16 rounding and the two chains'
    fp32 errors (2 K 2^-24 sum |x w|): AMX against the pair chain."""
    a, b = a.double(), b.double()
    scale = x.double().abs() @ w.double().abs().t()
    bound = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 2 * x.shape[1] * 2.0 ** -24 * scale + 1e-30
    assert bool(((a - b).abs() <= bound).all()), msg


def _assert_near_fp64(y, x, w, msg=""):
    """|y - x W^T| within one bf16 rounding of the result (2^-8 relative) plus the fp32 chain's
    error (K 2^-24 sum |x w|)."""
    exact = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    err = (y.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + x.shape[1] * 2.0 ** -24 * scale * 1.01 + 1e-30
    assert bool((err <= bound).all()), f"{msg}: max err {float(err.max())}"


def test_pack_layout_round_trips():
    w = torch.randn(77, 45).to(torch.bfloat16)
    wp = pack_linear_weight_bf16(w)
    assert wp.shape == (8, 32, 16, 2) and wp.is_contiguous() and wp.dtype == torch.bfloat16
    assert torch.equal(unpack_linear_weight_bf16(wp, 77, 45), w)
    full = unpack_linear_weight_bf16(wp, 128, 64)
    assert full[77:].abs().sum() == 0 and full[:, 45:].abs().sum() == 0  # zero padded past N and K
    assert torch.equal(wp[1, 3, 2], w[18, 6:8])  # [p, j, f, e] = W[16 p + f, 2 j + e]


@needs_kernel
@pytest.mark.parametrize("isa", HAVE)
@pytest.mark.parametrize("K,N", [(1, 1), (3, 5), (31, 17), (32, 64), (33, 65), (100, 130), (576, 192), (1536, 576)])
@pytest.mark.parametrize("M", [1, 3, 16, 17, 64])
def test_each_isa_is_the_chain(isa, M, K, N):
    x, w = _case(M, K, N, seed=M * 1000 + K + N)
    wp = pack_linear_weight_bf16(w)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
    got = packed_linear(x, wp, N, out=out, isa=isa)
    assert got is out and not got.isnan().any()
    chain = packed_linear_bf16_chain(x, wp, N)
    if isa.startswith("amx"):  # a tile instruction adds its 32 products with one rounding: not the pair chain
        _assert_within_one_ulp(got, chain, x, w, f"{isa} against the chain, M={M} K={K} N={N}")
    else:
        assert torch.equal(got, chain), f"{isa}: not the chain, M={M} K={K} N={N}"
    _assert_near_fp64(got, x, w, f"{isa} M={M} K={K} N={N}")


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 64), K=st.integers(1, 200), N=st.integers(1, 150), seed=st.integers(0, 2 ** 16),
       strided=st.booleans())
def test_isas_agree_bitwise_property(M, K, N, seed, strided):
    """Every path this CPU has but AMX gives the same bits, AMX the same within one bf16 rounding,
    for any M, K, N and row stride."""
    x, w = _case(M, K + 3 * strided, N, seed)
    x = x[:, :K] if strided else x  # rows with a stride wider than K
    wp = pack_linear_weight_bf16(w[:, :K])
    outs = {isa: packed_linear(x, wp, N, isa=isa) for isa in HAVE}
    first = outs[CHAIN[0]]
    for isa, y in outs.items():
        if isa.startswith("amx"):
            _assert_within_one_ulp(y, first, x, w[:, :K], isa)
        else:
            assert torch.equal(y, first), f"{isa} differs from {CHAIN[0]}"


@needs_kernel
@pytest.mark.parametrize("isa", HAVE)
def test_batch_invariant_bitwise(isa):
    """A row's result is the same bits whatever M is (1 .. 64) and wherever the row sits."""
    x, w = _case(64, 320, 200, seed=5)
    wp = pack_linear_weight_bf16(w)
    full = packed_linear(x, wp, 200, isa=isa)
    for i in range(0, 64, 3):
        assert torch.equal(packed_linear(x[i:i + 1], wp, 200, isa=isa)[0], full[i]), i
    for lo, hi in [(0, 2), (3, 19), (5, 64), (17, 50), (40, 57)]:
        assert torch.equal(packed_linear(x[lo:hi], wp, 200, isa=isa), full[lo:hi]), (lo, hi)


needs_emulated_amx = pytest.mark.skipif("amx_emulated" not in HAVE, reason="the AMX paths are not built (x86-64 only)")


@needs_emulated_amx
@pytest.mark.parametrize("split", [False, True])
def test_emulated_amx_rounds_once_per_tile_instruction(split):
    """1 + 2^-8 and sixteen products of 2^-27 (x all ones): in one tile instruction (one k block
    of 16 pairs) they sum exactly to 1 + 2^-8 + 2^-23, which rounds to bf16 1 + 2^-7; split 8 + 8
    over two instructions, each adds a tie (2^-24) that rounds back to 1 + 2^-8, which rounds to
    bf16 1; the pair chain drops every product of 2^-27 (a quarter of the last place): 1. On an
    AMX CPU the hardware gives the same (the rounding the emulation models, measured there)."""
    w = torch.zeros(1, 64)
    w[0, 0], w[0, 1] = 1.0, 2.0 ** -8
    tiny = [2 + i for i in range(16)] if not split else [2 + i for i in range(8)] + [32 + i for i in range(8)]
    w[0, tiny] = 2.0 ** -27
    x, w = torch.ones(1, 64, dtype=torch.bfloat16), w.to(torch.bfloat16)
    wp = pack_linear_weight_bf16(w)
    want = 1.0 if split else 1.0 + 2.0 ** -7
    for isa in [i for i in HAVE if i.startswith("amx")]:
        assert float(packed_linear(x, wp, 1, isa=isa)) == want, isa
    for isa in CHAIN:
        assert float(packed_linear(x, wp, 1, isa=isa)) == 1.0, isa


@pytest.mark.skipif("amx" not in HAVE, reason="needs an AMX-BF16 CPU")
@pytest.mark.parametrize("M", [1, 5, 16, 17, 32, 45, 64, 100])
def test_emulated_amx_is_the_hardware_bitwise(M):
    """The emulated tiles give the AMX CPU's bits (the same kernels; the hardware's rounding)."""
    for K, N in [(32, 64), (33, 65), (576, 192), (1536, 70)]:
        x, w = _case(M, K, N, seed=M + K + N)
        wp = pack_linear_weight_bf16(w)
        assert torch.equal(packed_linear(x, wp, N, isa="amx"), packed_linear(x, wp, N, isa="amx_emulated")), (M, K, N)


_EMULATE_SCRIPT = """
import sys, torch
from sequoia_kernels.ops.packed_linear import bf16_isa, packed_linear
cases = torch.load(sys.argv[1])
torch.save([(bf16_isa(), packed_linear(x, wp, n)) for x, wp, n in cases], sys.argv[2])
"""


@needs_emulated_amx
def test_emulate_switch_makes_auto_the_amx_path(tmp_path):
    """``SEQUOIA_KERNELS_AMX=emulate`` (read once per process): "auto" is the AMX path on emulated
    tiles, the bits of ``isa="amx_emulated"``; ATEN_CPU_CAPABILITY=avx512 still rules AMX out."""
    from cpu_paths import outputs_per_path

    x, w = _case(37, 576, 192, seed=11)
    wp = pack_linear_weight_bf16(w)
    outs = outputs_per_path(_EMULATE_SCRIPT, [(x, wp, 192)], tmp_path, caps=("emulate", "avx512+emulate"))
    (isa, y), = outs["emulate"]
    assert isa == "amx" and torch.equal(y, packed_linear(x, wp, 192, isa="amx_emulated"))
    (isa, y), = outs["avx512+emulate"]  # an AVX path: the pair chain bitwise (this run may be capped below it)
    assert isa != "amx" and torch.equal(y, packed_linear_bf16_chain(x, wp, 192))


def test_reference_backend_and_chain():
    x, w = _case(5, 70, 33, seed=1)
    wp = pack_linear_weight_bf16(w)
    ref = packed_linear(x, wp, 33, backend="reference")
    assert ref.dtype == torch.bfloat16 and torch.equal(ref, packed_linear_reference(x, wp, 33))
    _assert_near_fp64(ref, x, w, "reference")
    _assert_near_fp64(packed_linear_bf16_chain(x, wp, 33), x, w, "chain")


@needs_kernel
def test_errors_leave_out_untouched():
    x, w = _case(3, 40, 20, seed=2)
    wp = pack_linear_weight_bf16(w)
    out = torch.full((3, 20), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        packed_linear(x, wp.float(), 20, out=out)
    with pytest.raises(ValueError, match=r"\(4, 32, 16, 2\)"):
        packed_linear(x, wp[:, :16], 20, out=out)
    with pytest.raises(ValueError, match="bf16 w_packed for N = 70"):
        packed_linear(x, wp, 70, out=out)
    with pytest.raises(ValueError, match="unknown isa"):
        packed_linear(x, wp, 20, out=out, isa="sse9")
    missing = [isa for isa in ISAS if isa != "auto" and bf16_isa(isa) is None]
    if missing:
        with pytest.raises(ValueError, match="not available on this CPU"):
            packed_linear(x, wp, 20, out=out, isa=missing[0])
    with pytest.raises(RuntimeError, match="w_packed must be a contiguous"):
        torch.ops.sequoia_kernels.packed_linear_bf16(x, wp[:2], 20, out, 0)
    assert out.isnan().all()


@needs_kernel
def test_opcheck():
    x, w = _case(4, 64, 40, seed=3)
    wp = pack_linear_weight_bf16(w)
    out = torch.empty(4, 40, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.sequoia_kernels.packed_linear_bf16.default, (x, wp, 40, out, 0),
                          test_utils=("test_schema", "test_faketensor"))


@functools.lru_cache(maxsize=None)
def _paths_under(cap: str) -> tuple[str, list[str]]:
    """The bf16 linear's "auto" path and every path it offers in a fresh process (the cap is read
    once per process) under ``cpu_paths.cap_env(cap)``; "all": no cap, whatever cap this test run
    itself is under."""
    from cpu_paths import cap_env

    code = ("from sequoia_kernels.ops.packed_linear import bf16_isa, ISAS; "
            "print(bf16_isa(), [i for i in ISAS if i != 'auto' and bf16_isa(i)])")
    out = subprocess.run([sys.executable, "-c", code], env=cap_env(cap), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    best, have = out.stdout.split(" ", 1)
    return best, ast.literal_eval(have)


@needs_kernel
@pytest.mark.parametrize("cap", ["default", "avx2", "avx512"])
def test_aten_cpu_capability_caps_the_paths(cap):
    """ATEN_CPU_CAPABILITY caps our kernels as it caps torch's (csrc/cpu/simd.h: isa_cap): the
    bf16 linear's best path, the fused row ops' 16 lanes, the fp32 kernels' AVX2. Run in fresh
    processes, since the cap is read once; the CPU's own paths from one with no cap (so the test
    holds under any cap the run itself is under, e.g. ``ATEN_CPU_CAPABILITY=avx2 pytest``)."""
    order = ["scalar", "avx2", "avx512", "avx512_bf16", "amx"]
    allowed = {"default": "scalar", "avx2": "avx2", "avx512": "avx512_bf16"}[cap]
    uncapped_best, uncapped = _paths_under("all")
    assert uncapped_best in order and uncapped_best in uncapped, uncapped
    want = max((isa for isa in order if isa in uncapped and order.index(isa) <= order.index(allowed)),
               key=order.index)
    best, have = _paths_under(cap)
    assert best == want, (cap, best, have)
    assert ("amx_emulated" in have) == ("amx_emulated" in uncapped)  # software tiles: under any cap, never "auto"
    assert all(order.index(i) <= order.index(allowed) for i in have if i != "amx_emulated"), (cap, have)


def _first_loop(body, first):
    """The machine code from the line of `first`'s first occurrence to the loop's back edge (the
    first jump to an earlier address)."""
    import re

    start = body.index(first)
    lines = body[body.rfind("\n", 0, start) + 1:].splitlines()
    back = next(i for i, ln in enumerate(lines)
                if (m := re.search(r"^\s*([0-9a-f]+):\s+j\w+\s+([0-9a-f]+) ", ln)) and int(m[2], 16) < int(m[1], 16))
    return "\n".join(lines[:back])


def test_machine_code_uses_amx_and_vdpbf16ps():
    """Static (objdump) check of the compiled paths: the AMX block issues tile loads and
    tdpbf16ps, the AVX-512 tile vdpbf16ps on zmm registers, with no stack traffic in its loop."""
    import re

    from machine_code import function_body as body

    amx = body("block_bf16_amx<sequoia_kernels::cpu::HwTiles>(")
    assert amx.count("tdpbf16ps") == 4 and "tileloadd" in amx
    pair = body("pair_bf16_amx<sequoia_kernels::cpu::HwTiles>(")
    # (B, A, C) as AT&T writes them: both row blocks (A tiles 0, 1) times both panels (B tiles 2, 3)
    assert set(re.findall(r"tdpbf16ps %tmm(\d),%tmm(\d),%tmm(\d)", pair)) == {
        ("2", "0", "4"), ("3", "0", "5"), ("2", "1", "6"), ("3", "1", "7")}
    # the emulated path (the same kernels on software tiles) runs on any x86-64 CPU: no tile, no
    # AVX-512 and no AVX instruction in its code
    for name in ("block_bf16_amx<sequoia_kernels::cpu::EmuTiles>(", "pair_bf16_amx<sequoia_kernels::cpu::EmuTiles>(",
                 "groups_bf16_amx<sequoia_kernels::cpu::EmuTiles>("):
        assert not re.search(r"%[tzy]mm|^\s*[0-9a-f]+:\s+(tile|tdp|ldtilecfg|sttilecfg)", body(name), re.M), name
    loop = _first_loop(body("tile_bf16_avx512<4>("), "vdpbf16ps")
    assert loop.count("vdpbf16ps") >= 16 and "zmm" in loop
    assert not re.search(r"mov\w*\s+%zmm\d+,\S*\(%rsp\)", loop), "an accumulator spilled to the stack"
    # AVX-512F: the 4-row tile's pair loop is 32 zmm FMAs (4 rows x 4 panels x odd, even) with no
    # register stored to the stack inside it
    loop = _first_loop(body("tile_bf16_avx512f<4>("), "vfmadd")
    assert len(re.findall(r"vfmadd\w+\s+%zmm", loop)) == 32, loop
    assert not re.search(r"mov\w*\s+%zmm\d+,\S*\(%rsp\)", loop), "a register spilled to the stack"
    # AVX2: the 6-row tile's pair loop is 24 ymm FMAs (6 rows x 2 halves x odd, even) with no
    # register stored to the stack inside it
    loop = _first_loop(body("tile_bf16_avx2<6>("), "vfmadd")
    assert len(re.findall(r"vfmadd\w+\s+%ymm", loop)) == 24, loop
    assert not re.search(r"mov\w*\s+%ymm\d+,\S*\(%rsp\)", loop), "a register spilled to the stack"
    # and prefetches its weights ahead of the stream (the first tile of a call of 2+ rows:
    # cpu::kPrefetchBytes in csrc/cpu/simd.h)
    assert "prefetcht0" in body("tile_bf16_avx2<6>(")


def _tiny_llama_bf16():
    return tiny_llama(vocab=101, inter=96, dtype=torch.bfloat16)


@pytest.mark.skipif(not packed_linear_supported(torch.bfloat16), reason="needs an AVX2+FMA CPU")
def test_bf16_model_rows_are_batch_invariant():
    """A bf16 Llama on packed linears: the last token's logits are the same bits whether it is
    run alone (an AR step) or as the last of 9 tokens (a tree's rows), which torch's bf16 GEMM
    does not promise."""
    model = _tiny_llama_bf16()
    ids = torch.randint(0, 101, (1, 9))
    with torch.no_grad(), use_packed_linears(model) as n:
        assert n == 2 * 7 + 1
        lin = model.model.layers[0].mlp.down_proj
        h = torch.randn(5, 96).to(torch.bfloat16)
        assert torch.equal(lin(h), packed_linear_bf16_chain(h, pack_linear_weight_bf16(lin.weight), 64))
        x = model.model.embed_tokens(ids)  # [1, 9, 64]
        for layer_lin in (model.model.layers[1].self_attn.q_proj, model.lm_head):
            rows = layer_lin(x)
            for i in range(9):
                assert torch.equal(layer_lin(x[:, i:i + 1])[0, 0], rows[0, i])
    assert not any("forward" in m.__dict__ for m in model.modules())
    # a tree larger than MAX_ROWS (the loop raises the limit to its batch times its largest tree),
    # SmolLM2's MLP shape, where torch's bf16 GEMM gives 200 rows other bits than one row alone
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False)).to(torch.bfloat16)
    x = torch.randn(1, 200, 576).to(torch.bfloat16)
    with torch.no_grad(), use_packed_linears(wide, max_rows=256):
        rows = wide(x)
        assert all(torch.equal(wide(x[:, i:i + 1])[0, 0], rows[0, i]) for i in range(0, 200, 7))


@pytest.mark.skipif(not packed_linear_supported(torch.bfloat16), reason="needs an AVX2+FMA CPU")
def test_bf16_decoding_loop_greedy_is_ar():
    """Greedy Sequoia decoding of a bf16 model (draft = target, a chain of 3) emits the tokens of
    its own AR decoding (budget 1) through the same packed linears."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))
    from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
    from sequoia_decoding.tree import chain_tree

    from sequoia_decoding.planner import plan_tree

    target = _tiny_llama_bf16()
    ids = torch.randint(0, 101, (2, 7))
    outs = []
    # a chain, and a tree of 100 nodes: with batch 2, 200 rows per step, above MAX_ROWS
    for tree in (chain_tree(1), chain_tree(3), plan_tree([0.3, 0.2, 0.1, 0.08, 0.06, 0.05, 0.04], 100, 5)):
        gen = SequoiaGenerator(target, target, tree, SamplingParams(temperature=0.0), max_length=160)
        assert gen.packed_linears
        outs.append(gen.generate(ids, max_new_tokens=16).tokens)
    assert outs[0] == outs[1] == outs[2]


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(isa=st.sampled_from(HAVE), M=st.integers(1, 70), K=st.integers(1, 130), N=st.integers(1, 150),
       seed=st.integers(0, 2 ** 16), strided=st.booleans(), in_place=st.booleans())
def test_residual_is_torchs_bf16_add_of_the_product(isa, M, K, N, seed, strided, in_place):
    """A residual added in the output store is bitwise torch's bf16 add of the product and the
    residual (two roundings), on every path, for panel tails (N % 16), AMX's row blocks and pairs
    (M <= 16, 17 .. 32, > 32), residual rows with a stride wider than N, and out = residual."""
    x, w = _case(M, K, N, seed)
    wp = pack_linear_weight_bf16(w)
    g = torch.Generator().manual_seed(seed + 1)
    res = (torch.randn(M, N + 5 * strided, generator=g) * 4).to(torch.bfloat16)[:, :N]
    res[0, 0] = float("inf") if seed % 3 == 0 else -0.0
    want = packed_linear(x, wp, N, isa=isa) + res  # torch's bf16 add
    if in_place:
        out = res.contiguous()
        got = packed_linear(x, wp, N, out=out, isa=isa, residual=out)
        assert got is out
    else:
        got = packed_linear(x, wp, N, isa=isa, residual=res)
    _assert_same_bits(got, want)


def _assert_same_bits(a, b):
    """Bitwise equal but for NaN payloads (torch's vectorized bf16 rounding writes NaN as 0xFFFF,
    its scalar one and ours as 0x7FC0)."""
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@needs_kernel
def test_residual_nan_errors_and_schema():
    x, w = _case(3, 40, 20, seed=4)
    wp = pack_linear_weight_bf16(w)
    res = torch.zeros(3, 20, dtype=torch.bfloat16)
    res[1, 7] = float("nan")
    for isa in HAVE:
        got = packed_linear(x, wp, 20, isa=isa, residual=res)
        assert got[1, 7].isnan() and int(got.isnan().sum()) == 1
        _assert_same_bits(got, packed_linear(x, wp, 20, isa=isa) + res)
    out = torch.full((3, 20), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        packed_linear(x, wp, 20, out=out, residual=res[:2])
    with pytest.raises(ValueError, match="residual"):
        packed_linear(x, wp, 20, out=out, residual=res.float())
    with pytest.raises(RuntimeError, match="residual must be"):
        torch.ops.sequoia_kernels.packed_linear_bf16(x, wp, 20, out, 0, res[:, :19])
    assert out.isnan().all()
    torch.library.opcheck(torch.ops.sequoia_kernels.packed_linear_bf16.default, (x, wp, 20, out, 0, res),
                          test_utils=("test_schema", "test_faketensor"))


def _rope_case(M_per_batch, B, K, heads, D, seed, batched_table):
    g = torch.Generator().manual_seed(seed)
    N = heads * D + 64 * (seed % 2)  # (odd seeds: 64 columns past the rotated ones, left alone)
    x, w = _case(B * M_per_batch, K, N, seed)
    Bc = B if batched_table else 1
    cos, sin = ((torch.randn(Bc, M_per_batch, D, generator=g) * 2).to(torch.bfloat16) for _ in range(2))
    return x, w, cos, sin, heads * D


def _rotary_of(y, cos, sin, B, T, cols, D):
    """The rotary_bf16 op on the product's first ``cols`` columns as heads of D (the lean layer's
    unfused path), the rest as they are."""
    from sequoia_kernels.ops.fused_bf16 import rotary_bf16

    q = y[:, :cols].reshape(B, T, cols // D, D).transpose(1, 2)  # [B, H, T, D]
    out = y.clone()
    out[:, :cols] = rotary_bf16(q, cos, sin).transpose(1, 2).reshape(B * T, cols)
    return out


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(isa=st.sampled_from(HAVE), T=st.integers(1, 40), B=st.integers(1, 3), K=st.integers(1, 100),
       heads=st.sampled_from([1, 3, 4]), D=st.sampled_from([64, 32, 16, 8, 2]), seed=st.integers(0, 2 ** 16),
       batched_table=st.booleans())
def test_rotary_epilogue_is_the_rotary_op_on_the_product(isa, T, B, K, heads, D, seed, batched_table):
    """rope_cos / rope_sin / rope_cols: the first rope_cols columns rotated in place as the
    rotary_bf16 op rotates the product's heads, bitwise, on every path (AMX's single row blocks,
    pairs and M > 32 passes; head sizes 64, 32, 16 (the 16- and 8-lane rows), 8 and 2 (scalar);
    one table for every batch row or one per row), the columns past them untouched."""
    heads = heads * (64 // D) if D < 64 else heads  # rope_cols a multiple of 64
    x, w, cos, sin, cols = _rope_case(T, B, K, heads, D, seed, batched_table)
    N = w.shape[0]
    wp = pack_linear_weight_bf16(w)
    out = torch.full((B * T, N), float("nan"), dtype=torch.bfloat16)
    torch.ops.sequoia_kernels.packed_linear_bf16(x, wp, N, out, ISAS[isa], None, cos, sin, cols)
    want = _rotary_of(packed_linear(x, wp, N, isa=isa), cos, sin, B, T, cols, D)
    _assert_same_bits(out, want)


@needs_kernel
def test_rotary_epilogue_errors_and_schema():
    x, w, cos, sin, cols = _rope_case(4, 2, 40, 2, 64, seed=0, batched_table=True)
    wp = pack_linear_weight_bf16(w)
    out = torch.full((8, 128), float("nan"), dtype=torch.bfloat16)
    op = torch.ops.sequoia_kernels.packed_linear_bf16
    res = torch.zeros(8, 128, dtype=torch.bfloat16)
    bad = [((res, cos, sin, cols), "cannot be combined"), ((None, None, sin, cols), "needs rope_cos"),
           ((None, cos, sin, 0), "needs rope_cos"), ((None, cos.float(), sin.float(), cols), "bfloat16"),
           ((None, cos[:, :3], sin[:, :3], cols), "does not fit"), ((None, cos, sin, 96), "multiple of 64"),
           ((None, cos, sin, 192), "multiple of 64"), ((None, cos[..., :48], sin[..., :48], cols), "dividing 64"),
           ((None, cos, sin.transpose(0, 1).contiguous().transpose(0, 1), cols), "one shape and strides")]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            op(x, wp, 128, out, 0, *args)
    assert out.isnan().all()
    torch.library.opcheck(op.default, (x, wp, 128, out, 0, None, cos, sin, cols),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(isa=st.sampled_from(HAVE), M=st.integers(1, 70), K=st.integers(1, 100), I=st.sampled_from([32, 64, 96, 160]),
       seed=st.integers(0, 2 ** 16), strided=st.booleans())
def test_silu_epilogue_is_silu_mul_on_the_product(isa, M, K, I, seed, strided):
    """silu_out: w is [gate; up] and silu_out = silu_mul_bf16 of the product's two halves, bitwise,
    on every path (AMX's single row blocks, pairs and M > 32 passes, whose groups read gate and up
    panels I / 16 apart), with silu_out's rows at a stride wider than I; out still the product."""
    from sequoia_kernels.ops.fused_bf16 import silu_mul_bf16

    x, w = _case(M, K, 2 * I, seed)
    w[:I] *= 8  # gates across SiLU's range
    wp = pack_linear_weight_bf16(w)
    out = torch.full((M, 2 * I), float("nan"), dtype=torch.bfloat16)
    silu_out = torch.full((M, I + 7 * strided), float("nan"), dtype=torch.bfloat16)[:, :I]
    torch.ops.sequoia_kernels.packed_linear_bf16(x, wp, 2 * I, out, ISAS[isa], None, None, None, 0, silu_out)
    product = packed_linear(x, wp, 2 * I, isa=isa)
    _assert_same_bits(out, product)
    _assert_same_bits(silu_out, silu_mul_bf16(product[:, :I], product[:, I:]))


@needs_kernel
def test_silu_epilogue_errors_and_schema():
    x, w = _case(5, 40, 128, seed=1)
    wp = pack_linear_weight_bf16(w)
    out = torch.full((5, 128), float("nan"), dtype=torch.bfloat16)
    so = torch.full((5, 64), float("nan"), dtype=torch.bfloat16)
    op = torch.ops.sequoia_kernels.packed_linear_bf16
    cos = sin = torch.ones(1, 5, 64, dtype=torch.bfloat16)
    x3, w3 = _case(5, 40, 96, seed=1)
    bad = [((x, wp, 128, out, 0, torch.zeros(5, 128, dtype=torch.bfloat16), None, None, 0, so), "cannot be combined"),
           ((x, wp, 128, out, 0, None, cos, sin, 64, so), "cannot be combined"),
           ((x3, pack_linear_weight_bf16(w3), 96, out[:, :96], 0, None, None, None, 0, so[:, :48]), "multiple of 32"),
           ((x, wp, 128, out, 0, None, None, None, 0, so[:4]), "silu_out must be"),
           ((x, wp, 128, out, 0, None, None, None, 0, so.float()), "silu_out must be"),
           ((x, wp, 128, out, 0, None, None, None, 0, so.t().contiguous().t()), "silu_out must be"),
           ((x, wp, 128, out, 0, None, None, None, 0, out[:, 32:96]), "must not overlap")]
    for args, msg in bad:
        with pytest.raises(RuntimeError, match=msg):
            op(*args)
    assert out.isnan().all() and so.isnan().all()
    torch.library.opcheck(op.default, (x, wp, 128, out, 0, None, None, None, 0, so),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
@pytest.mark.parametrize("isa", HAVE)
@pytest.mark.parametrize("M", [65, 257, 1000])
def test_prefill_sized_calls_are_the_chain_and_batch_invariant(isa, M):
    """A prompt's prefill in one call (``packed_prefill_pays``): hundreds of rows, each the
    chain's bits (AMX within one rounding), near fp64, and the same bits as the row alone."""
    x, w = _case(M, 576, 192, seed=M)
    wp = pack_linear_weight_bf16(w)
    out = torch.full((M, 192), float("nan"), dtype=torch.bfloat16)
    got = packed_linear(x, wp, 192, out=out, isa=isa)
    assert got is out and not got.isnan().any()
    chain = packed_linear_bf16_chain(x, wp, 192)
    if isa.startswith("amx"):
        _assert_within_one_ulp(got, chain, x, w, f"{isa} against the chain, M={M}")
    else:
        assert torch.equal(got, chain), f"{isa}: not the chain, M={M}"
    _assert_near_fp64(got, x, w, f"{isa} M={M}")
    for i in (0, M // 2, M - 1):
        assert torch.equal(packed_linear(x[i:i + 1], wp, 192, isa=isa)[0], got[i]), i


_AMX, _BF16 = "avx512f amx_tile amx_bf16", "avx2 avx512f avx512_bf16"


@pytest.mark.parametrize("flags,env,want", [
    ("avx2 fma avx512f avx512bw", {}, True), ("avx2 fma", {}, True), (_BF16, {}, False), (_AMX, {}, False),
    # oneDNN capped below its bf16 dot products (the AVX2 proxy of docs/bf16_cpu.md): converts as without them
    (_BF16, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, True), (_AMX, {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, True),
    (_AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False), (_AMX, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, False),
    (_BF16, {"DNNL_MAX_CPU_ISA": "AVX2"}, True),  # the older variable's name
])
def test_packed_prefill_pays_where_torchs_bf16_gemm_has_no_bf16_instructions(flags, env, want, monkeypatch):
    from sequoia_kernels.ops import packed_linear as pl

    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(pl, "cpuinfo", lambda key: flags if key == "flags" else "")
    monkeypatch.setattr(pl, "packed_linear_supported", lambda dtype: True)
    assert pl.packed_prefill_pays(torch.bfloat16) is want
    assert pl.packed_prefill_pays(torch.float32) is False


@needs_kernel
@torch.no_grad()
def test_a_long_call_runs_packed_where_the_prefill_pays(monkeypatch):
    """Inside ``use_packed_linears`` a call of more rows than ``max_rows`` runs packed_linear (its
    bits) where ``packed_prefill_pays``, torch's linear (its bits) otherwise. Which one ran is
    recorded: on an AMX CPU torch's oneDNN GEMM can give the packed kernel's bits."""
    from sequoia_kernels.ops import packed_linear as pl

    lin = torch.nn.Linear(576, 192, bias=False).to(torch.bfloat16)
    x = _case(300, 576, 192, seed=9)[0]
    packed = packed_linear(x, pack_linear_weight_bf16(lin.weight), 192)
    ran, real = [], pl.linear_packed
    monkeypatch.setattr(pl, "linear_packed", lambda *args: ran.append(args[3]) or real(*args))
    for pays in (True, False):
        monkeypatch.setattr(pl, "packed_prefill_pays", lambda dtype, pays=pays: pays)
        ran.clear()
        with pl.use_packed_linears(lin, True, max_rows=64):
            got = lin(x)
        assert ran == ([300] if pays else []), (pays, ran)
        want = packed if pays else torch.nn.functional.linear(x, lin.weight)
        assert torch.equal(got, want), pays


@needs_kernel
@pytest.mark.parametrize("pays", [True, False])
@torch.no_grad()
def test_measure_acceptance_reads_bf16_on_the_packed_linears_where_the_prefill_pays(pays, monkeypatch):
    """``measure_acceptance``'s teacher-forced bf16 forward (prompt + continuation: 94 rows) runs
    packed where ``packed_prefill_pays``, torch's GEMM otherwise."""
    from sequoia_kernels.ops import packed_linear as pl

    from sequoia_decoding.tools import measure_acceptance

    target, draft = tiny_llama(0, dtype=torch.bfloat16), tiny_llama(1, dtype=torch.bfloat16)
    monkeypatch.setattr(pl, "packed_prefill_pays", lambda dtype: pays)
    packed_rows, real = [], pl._packed_forward

    def recording(module, x):
        rows = x.numel() // x.shape[-1]
        if rows <= module._sequoia_max_rows:  # the packed kernel runs (else torch's linear inside)
            packed_rows.append(rows)
        return real(module, x)

    monkeypatch.setattr(pl, "_packed_forward", recording)
    measure_acceptance(target, draft, [[1, 2, 3] * 30], temperature=0.0, width=2, max_new_tokens=4,
                       progress=False, eos_token_id=[])
    assert (94 in packed_rows) is pays
