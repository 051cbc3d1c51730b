"""tree_attention vs what a Hugging Face Llama does for a tree today (SDPA with a dense additive
mask over the prefix and the tree, GQA heads repeated first), on the CPU.

Shapes: one layer of Llama-2-7B (32 heads, head dim 128) and Llama-3-8B (32 query / 8 kv heads,
head dim 128), batch 1, fp32 (the CPU's native dtype), a DP-shaped tree of 64 or 128 nodes after
a prefix of 1k or 4k tokens; and the demo's target, SmolLM2-135M (9 / 3 heads, head dim 64), for
one token (a plain decoding step) and a 16-node tree after 160 tokens (the demo's context); the
cache holds 256 more positions than are used. The dense mask is
built outside the timed region (it is shared by all layers), the packed mask likewise.
Each (shape, T, prefix) is one benchmark group; bench/report.py divides by the group's
``test_sdpa_dense_mask``. Few rounds (benchmark.pedantic): a 4k-prefix call takes ~0.1-1 s here.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F

import sequoia_kernels  # noqa: F401
from sequoia_kernels.ops.tree_attention import tree_attention
from sequoia_kernels.reference.tree_attention import pack_tree_mask

from sequoia_decoding.planner import plan_tree  # noqa: E402

HAS_OP = hasattr(torch.ops.sequoia_kernels, "tree_attention")
MODELS = {"llama2-7b": (32, 32, 128), "llama3-8b": (32, 8, 128)}  # Hq, Hkv, D
SMALL = {"smollm2-135m": (9, 3, 64)}  # CPU-only cases (not in gpu_rows)
CASES = [(m, T, P) for m in MODELS for T in (64, 128) for P in (1024, 4096)] + [("smollm2-135m", T, 160)
                                                                                for T in (1, 16)]
IDS = [f"{m}-T{T}-P{P}" for m, T, P in CASES]
ROUNDS = dict(rounds=int(os.environ.get("BENCH_ROUNDS", 3)), iterations=1, warmup_rounds=1)


def tree_mask(T: int) -> torch.Tensor:
    """The ancestor-or-self mask of the planner's tree with exactly T nodes (shallowest depth)."""
    if T == 1:
        return torch.ones(1, 1, dtype=torch.bool)
    for depth in range(2, T + 1):
        plan = plan_tree((0.63, 0.11, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01), T, depth)
        if len(plan.parents) == T:
            return torch.from_numpy(plan.mask())
    raise ValueError(f"no planned tree of {T} nodes")


@functools.lru_cache(maxsize=2)
def make_case(model: str, T: int, P: int):
    Hq, Hkv, D = {**MODELS, **SMALL}[model]
    S = P + T + 256
    g = torch.Generator().manual_seed(T + P)
    q = torch.randn(1, Hq, T, D, generator=g)
    cache = torch.randn(2, 1, Hkv, S, D, generator=g)  # one layer of the [2 x layers, B, H, S, D] cache
    mask = tree_mask(T)
    prefix_len = torch.tensor([P], dtype=torch.int32)
    additive = torch.zeros(1, 1, T, P + T)
    additive[..., P:].masked_fill_(~mask, float("-inf"))
    return dict(q=q, k=cache[0], v=cache[1], prefix_len=prefix_len, mask=mask, bits=pack_tree_mask(mask),
                additive=additive, out=torch.empty_like(q), Hq=Hq, Hkv=Hkv, L=P + T)


def sdpa_dense_mask(q, k, v, additive, L, groups):
    """What transformers' sdpa path does per layer: repeat_kv for GQA, SDPA with the float mask."""
    k, v = k[:, :, :L], v[:, :, :L]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


@pytest.mark.parametrize("model,T,P", CASES, ids=IDS)
def test_sdpa_dense_mask(benchmark, model, T, P):
    c = make_case(model, T, P)
    benchmark.group = f"tree_attention {model} T={T} prefix={P}"
    benchmark.pedantic(sdpa_dense_mask, args=(c["q"], c["k"], c["v"], c["additive"], c["L"], c["Hq"] // c["Hkv"]),
                       **ROUNDS)


@pytest.mark.skipif(not HAS_OP, reason="sequoia_kernels._C has no tree_attention op")
@pytest.mark.parametrize("model,T,P", CASES, ids=IDS)
def test_tree_attention_cpu(benchmark, model, T, P):
    c = make_case(model, T, P)
    benchmark.group = f"tree_attention {model} T={T} prefix={P}"
    benchmark.pedantic(lambda: tree_attention(c["q"], c["k"], c["v"], c["prefix_len"], c["bits"], backend="cpu",
                                              out=c["out"], validate=False), **ROUNDS)


@pytest.mark.parametrize("model,T,P", CASES, ids=IDS)
def test_tree_attention_reference(benchmark, model, T, P):
    c = make_case(model, T, P)
    benchmark.group = f"tree_attention {model} T={T} prefix={P}"
    benchmark.pedantic(lambda: tree_attention(c["q"], c["k"], c["v"], c["prefix_len"], c["bits"],
                                              backend="reference", validate=False), **ROUNDS)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=pytest.mark.skipif(not HAS_OP, reason="no op"))])
def test_tree_attention_results_agree(backend):
    c = make_case("llama3-8b", 64, 1024)
    expect = sdpa_dense_mask(c["q"], c["k"], c["v"], c["additive"], c["L"], 4)
    got = tree_attention(c["q"], c["k"], c["v"], c["prefix_len"], c["bits"], backend=backend)
    torch.testing.assert_close(got, expect, atol=2e-5, rtol=1e-4)


def gpu_rows(bench) -> list[tuple[str, str, str, float, float | None, str]]:
    """Rows for bench/gpu_bench.py (``ROWS += gpu_rows(bench)``): fp16, batch 1 and 4, trees of 64
    and 128 nodes after 1k / 4k / 16k prefixes, SDPA with a dense mask as the baseline row, then
    the CUDA and Triton kernels (preallocated out and workspace, validate=False: the captured
    path). GB/s counts the K/V bytes a row must read (the kernels' lower bound)."""
    from sequoia_kernels._backend import compiled_op_available
    from sequoia_kernels.ops.tree_attention import tree_attention_workspace

    rows = []
    for model, (Hq, Hkv, D) in MODELS.items():
        for B, T, P in [(1, 64, 1024), (1, 128, 4096), (1, 128, 16384), (4, 64, 4096)]:
            S = P + T + 256
            g = torch.Generator(device="cuda").manual_seed(T + P)
            q = torch.randn(B, Hq, T, D, device="cuda", generator=g, dtype=torch.float16)
            cache = torch.randn(2, B, Hkv, S, D, device="cuda", generator=g, dtype=torch.float16)
            k, v = cache[0], cache[1]
            mask = tree_mask(T).cuda()
            bits = pack_tree_mask(mask)
            prefix_len = torch.full((B,), P, dtype=torch.int32, device="cuda")
            additive = torch.zeros(1, 1, T, P + T, device="cuda", dtype=torch.float16)
            additive[..., P:].masked_fill_(~mask, float("-inf"))
            out = torch.empty_like(q)
            ws = tree_attention_workspace(B, Hq, T, D, 64, "cuda")
            shape = f"{model} B{B} T{T} prefix {P}"
            moved = 2 * B * Hkv * (P + T) * D * 2
            base = bench(lambda: sdpa_dense_mask(q, k, v, additive, P + T, Hq // Hkv))
            rows.append(("tree_attention", "SDPA + dense mask (HF)", shape, base, moved / base / 1e6, "1.0x"))
            for backend in ("cuda", "triton"):
                if backend == "cuda" and not compiled_op_available("cuda", "tree_attention"):
                    continue
                t = bench(lambda: tree_attention(q, k, v, prefix_len, bits, backend=backend, out=out, workspace=ws,
                                                 validate=False))
                rows.append(("tree_attention", backend, shape, t, moved / t / 1e6, f"{base / t:.1f}x"))
    return rows
