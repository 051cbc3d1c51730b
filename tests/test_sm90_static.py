"""Static sm_90 checks of the GPU kernels' machine code: no GPU needed (tests/sm90.py).

CUDA: every __global__ function of the built extension, read with cuobjdump: zero local memory
(no spills), registers within the launcher's occupancy assumption, tensor-core instructions in
the tree-attention kernel, 128-bit global loads where a kernel claims vector loads.

Triton: every kernel of sequoia_kernels.triton_kernels.tree_attention, compiled ahead of time
for GPUTarget("cuda", 90, 32) at the launches its launcher makes (plan_tree_attention) for
bf16/fp16/fp32, D 64/128, T 1/16/64/128, GQA group 1 and 4: zero spills, shared memory within
the 227 KB a block can have, tl.dot on tensor cores (HGMMA/HMMA) for fp16/bf16 (fp32 runs the
exact "ieee" dot on FMAs by design: no TF32 rounding).

SEQUOIA_SM90_BINARY=path (a .so or .cubin) checks another binary instead of the built
extension, e.g. an older kernel compiled with nvcc -cubin -arch=sm_90.
"""

from __future__ import annotations

import os
import re

import pytest

import sm90

pytestmark = pytest.mark.aot  # GPU machine code compiled ahead of time: one pass runs it

HERE = os.path.dirname(os.path.abspath(__file__))

# ---------------------------------------------------------------------------------- CUDA

# Kernels that claim 128-bit global memory accesses, and the SASS opcode that proves it.
VECTOR_LOADS = {
    "tree_attention_mma_kernel<": "LDGSTS.E.BYPASS.128",  # cp.async 16-byte K/V/Q copies
    "compact_kv_kernel<uint4,": "LDG.E.128",
}
# Occupancy assumptions: kernel name pattern -> (threads a block, blocks an SM) from the launcher
# (__launch_bounds__ / TreeAttnConfig in csrc/kernels/tree_attention.cuh).
TREE_ATTN_WARPS = re.compile(r"tree_attention_mma_kernel<(__half|__nv_bfloat16),(\d+),(\d+)>")
TREE_ATTN_SMEM = {  # dynamic shared memory a block: (BM + 2 stages x 2 x BN) x (D + 8) x 2 bytes
    (d, w): (16 * w + 2 * 2 * 64) * (d + 8) * 2 for d in (64, 128) for w in (4, 8)
}


def _binary() -> str:
    path = os.environ.get("SEQUOIA_SM90_BINARY") or sm90.extension_path()
    if path is None:
        pytest.skip("sequoia_kernels/_C*.so is not built (python setup.py build_ext --inplace)")
    if sm90.tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (it ships with triton's wheel, or set CUDA_HOME)")
    return path


@pytest.fixture(scope="module")
def kernels():
    ks = sm90.cuda_kernels(_binary())
    if not ks:
        pytest.skip("the extension has no sm_90 CUDA code (a CPU-only build, or TORCH_CUDA_ARCH_LIST without 9.0)")
    return ks


def _short(name: str) -> str:
    return name.replace(" ", "").replace("sequoia_kernels::", "").split("(")[0].removeprefix("void")


def test_every_cuda_kernel_is_spill_free(kernels):
    bad = {_short(n): (k.regs, k.stack, k.local, k.count("STL")) for n, k in kernels.items() if not k.spill_free}
    assert not bad, f"kernels with local memory (regs, stack, local bytes, STL count): {bad}"


def test_tree_attention_kernels_present(kernels):
    names = {_short(n) for n in kernels}
    want = {f"tree_attention_mma_kernel<{t},{d},{w}>" for t in ("__half", "__nv_bfloat16") for d in (64, 128)
            for w in (4, 8)}
    missing = want - names
    assert not missing, f"tensor-core tree-attention kernels missing from the build: {sorted(missing)}; " \
                        f"tree-attention kernels found: {sorted(n for n in names if 'tree_attention' in n)}"


def test_tree_attention_on_tensor_cores(kernels):
    attn = {_short(n): k for n, k in kernels.items() if "tree_attention" in n and "merge" not in n}
    assert attn, "no tree-attention kernel in the build"
    no_tc = {n: dict(k.opcodes().most_common(6)) for n, k in attn.items()
             if k.count("HMMA") + k.count("HGMMA") == 0}
    assert not no_tc, f"tree-attention kernels without tensor-core instructions (top opcodes): {no_tc}"
    for n, k in attn.items():  # Q K^T and P V: D/16 * BN/8 + BN/16 * D/8 mma a tile, fully unrolled
        m = TREE_ATTN_WARPS.search(n)
        if m:
            d = int(m.group(2))
            assert k.count("HMMA") >= 2 * (d // 16) * 8, f"{n}: {k.count('HMMA')} HMMA"


@pytest.mark.parametrize("pattern,opcode", list(VECTOR_LOADS.items()))
def test_vector_loads_where_claimed(kernels, pattern, opcode):
    hit = {n: k for n, k in kernels.items() if pattern in _short(n)}
    assert hit, f"no kernel matches {pattern!r}"
    scalar = {_short(n): dict((op, c) for op, c in k.opcodes().items() if op.startswith(("LDG", "LDGSTS")))
              for n, k in hit.items() if k.count(opcode) == 0}
    assert not scalar, f"kernels claiming {opcode} without it (their global loads): {scalar}"


def test_tree_attention_registers_and_shared_memory(kernels):
    seen = 0
    for n, k in kernels.items():
        m = TREE_ATTN_WARPS.search(_short(n))
        if not m:
            continue
        seen += 1
        d, w = int(m.group(2)), int(m.group(3))
        threads, blocks = 32 * w, (1 if w >= 8 else 2)  # TreeAttnConfig::kMinBlocks
        budget = k.max_regs_for(threads, blocks)
        assert k.regs <= budget, f"{_short(n)}: {k.regs} registers > {budget} ({blocks} blocks of {threads})"
        assert k.shared <= 1024, f"{_short(n)}: {k.shared} B static shared memory (expected only sm_90's 1 KB reserve)"
        dyn = TREE_ATTN_SMEM[(d, w)]
        assert blocks * (dyn + 1024) <= 228 * 1024, f"{_short(n)}: {blocks} x {dyn} B dynamic shared memory per SM"
    if seen == 0:
        pytest.fail("no tree_attention_mma_kernel in the build")


# -------------------------------------------------------------------------------- Triton

DTYPES = ("bf16", "fp16", "fp32")
SHAPES = [(d, t, g) for d in (64, 128) for t in (1, 16, 64, 128) for g in (1, 4)]
H200_SMS = 132


def triton_tree_attention_report() -> list[dict]:
    """Compile every launch of the Triton tree attention at the static-check shapes (run in a
    child process without TRITON_INTERPRET; a worker process per core, one task per dtype and head
    dimension: six similar tasks balance over two cores where three dtypes did not)."""
    import concurrent.futures
    import multiprocessing

    tasks = [(dn, d) for dn in DTYPES for d in sorted({s[0] for s in SHAPES})]
    workers = max(1, min(len(tasks), os.cpu_count() or 1))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        parts = list(pool.map(_report_for, *zip(*tasks)))
    return [r for part in parts for r in part]


def _report_for(dn: str, head_dim: int) -> list[dict]:
    """The launches of one dtype and head dimension; each distinct specialisation is compiled once
    (sm90.compile_triton)."""
    import torch

    from sequoia_kernels.triton_kernels import tree_attention as ta

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dn]
    out = []
    for D, T, G in (s for s in SHAPES if s[0] == head_dim):
        B, Hkv, S = 1, 8, 4096 + 128  # one cache capacity for every tree size, as in decoding
        Hq = G * Hkv
        # the launcher's split at batch 1 on an H200, and one split (larger batches: direct write)
        for ns in sorted({1, ta.default_num_splits(B, Hq, Hkv, T, D, S, dt, H200_SMS)}):
            meta = dict(device="meta")
            q = torch.empty(B, Hq, T, D, dtype=dt, **meta)
            k = torch.empty(B, Hkv, S, D, dtype=dt, **meta)
            p = torch.empty(B, dtype=torch.int32, **meta)
            mb = torch.empty(1, T, (T + 31) // 32, dtype=torch.int32, **meta)
            po = torch.empty(B, Hq, T, ns, D, dtype=torch.float32, **meta)
            pl = torch.empty(B, Hq, T, ns, dtype=torch.float32, **meta)
            for ln in ta.plan_tree_attention(q, k, k, p, mb, T, 0.1, q, po, pl, interpret=False):
                kk = sm90.compile_triton(ln.fn, ln.args, ln.constexprs, num_warps=ln.num_warps,
                                         num_stages=ln.num_stages)
                out.append(dict(kernel=kk.name, dtype=dn, D=D, T=T, G=G, splits=ns, num_warps=ln.num_warps,
                                num_stages=ln.num_stages, block_m=ln.constexprs.get("BLOCK_M"),
                                block_n=ln.constexprs.get("BLOCK_N"), regs=kk.regs, spills=kk.spills,
                                shared=kk.shared, hgmma=kk.count("HGMMA"), hmma=kk.count("HMMA"),
                                wgmma_ptx=kk.ptx.count("wgmma.mma_async"),
                                mma_ptx=len(re.findall(r"\bmma\.sync", kk.ptx))))
    return out


@pytest.fixture(scope="module")
def triton_report():
    if sm90.tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found (it ships with triton's wheel)")
    pytest.importorskip("triton")
    return sm90.call_without_interpreter("test_sm90_static:triton_tree_attention_report")


PINNED_TRITON = (3, 8)  # requirements.txt's torch 2.14.1 ships Triton 3.8


def test_triton_tree_attention_static(triton_report):
    rows = triton_report
    assert {(r["dtype"], r["D"], r["T"], r["G"]) for r in rows} == {(dn, *s) for dn in DTYPES for s in SHAPES}
    spills = [r for r in rows if r["spills"]]
    big = [r for r in rows if r["shared"] > sm90.SMEM_PER_BLOCK]
    assert not big, f"Triton launches over 227 KB of shared memory: {big}"
    no_tc = [r for r in rows if r["kernel"] == "_tree_attn_fwd_kernel" and r["dtype"] != "fp32"
             and r["hgmma"] + r["hmma"] == 0]
    assert not no_tc, f"fp16/bf16 launches whose tl.dot is not on tensor cores: {no_tc}"
    regs = [r for r in rows if r["regs"] > sm90.MAX_REGS_PER_THREAD]
    assert not regs, regs
    if spills:
        import triton

        msg = f"Triton launches that spill on sm_90 with Triton {triton.__version__}: {spills}"
        if tuple(int(v) for v in triton.__version__.split(".")[:2]) < PINNED_TRITON:
            # the launch configurations are tuned on the pinned Triton; an older one (the GPU device
            # image's 3.6 spills 8 bytes in the fp16/bf16 D = 128, T = 1 build) is reported, not failed
            pytest.xfail(msg)
        raise AssertionError(msg)
