"""Static sm_90 checks of the sampler kernels (issue 12, point 7), no GPU needed:

* CUDA (csrc/kernels/verify_tree.cuh, csrc/kernels/sampling.cuh): from the built extension
  sequoia_kernels/_C*.so when it contains CUDA code, else from a cubin compiled here with nvcc from
  the framework-free headers: zero spills (no local memory, no stack, no LDL/STL), registers within
  the launch's budget, static + the largest dynamic shared memory <= 227 KB, and in the verify
  cluster kernel 128-bit global and shared loads and the cluster barrier.
* Triton (verify_tree, sampling_probs, sample_children, the Philox generator): compiled ahead of
  time for GPUTarget("cuda", 90, 32) at the launchers' block sizes: zero spills, shared memory
  <= 227 KB.

Skipped with a reason where cuobjdump (shipped with triton), nvcc or the CUDA build is absent.
Helpers (cuobjdump discovery, -res-usage / -sass parsing, AOT Triton compile) are tests/sm90.py's.
Run as a script to print the figures: ``python tests/test_sm90_static_sampler.py``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

import sm90

pytestmark = pytest.mark.aot  # GPU machine code compiled ahead of time: one pass runs it

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = sm90.SMEM_PER_BLOCK  # bytes per block on sm_90 (opt-in maximum)
REGS_PER_SM = sm90.REGS_PER_SM

# ------------------------------------------------------------------------------------ helpers


def built_extension() -> str | None:
    """sequoia_kernels/_C*.so when it embeds sm_90 code, else None."""
    so = sm90.extension_path()
    if so is None or sm90.tool("cuobjdump") is None:
        return None
    try:
        return so if sm90.cuda_kernels(so) else None
    except RuntimeError:
        return None


_HEADERS_TU = """
#include "kernels/verify_tree.cuh"
#include "kernels/sampling.cuh"
using namespace sequoia_kernels;
template __global__ void sequoia_kernels::verify_tree_block_kernel<kVerifyThreads>(VerifyTreeParams);
template __global__ void sequoia_kernels::sampling_probs_kernel<__half>(SamplingProbsParams);
template __global__ void sequoia_kernels::sampling_probs_kernel<__nv_bfloat16>(SamplingProbsParams);
template __global__ void sequoia_kernels::sampling_probs_kernel<float>(SamplingProbsParams);
template __global__ void sequoia_kernels::sampling_probs_kernel<double>(SamplingProbsParams);
"""


@functools.lru_cache(maxsize=None)
def cuda_binary(arch: int = sm90.ARCH) -> tuple[str | None, str]:
    """(binary with the sampler kernels for sm_``arch``, where it came from) or (None, why not):
    the built extension when it holds code for that arch (the default build: 8.0;9.0), else a
    cubin nvcc compiles here from the framework-free headers."""
    if sm90.tool("cuobjdump") is None:
        return None, "no cuobjdump (it ships with triton's NVIDIA backend)"
    so = built_extension()
    if so is not None and sm90.cuda_kernels(so, arch=arch):
        return so, f"built extension {os.path.basename(so)} (sm_{arch})"
    nvcc = sm90.tool("nvcc")
    if nvcc is None:
        return None, f"sequoia_kernels._C has no sm_{arch} code and nvcc is absent"
    d = Path(tempfile.mkdtemp(prefix=f"sm{arch}_sampler_"))
    (d / "k.cu").write_text(_HEADERS_TU)
    r = subprocess.run([nvcc, f"-arch=sm_{arch}", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
                        f"-I{ROOT / 'csrc'}", "-o", str(d / "k.cubin"), str(d / "k.cu")],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"nvcc failed: {r.stderr[-2000:]}")
    return str(d / "k.cubin"), f"nvcc -cubin -arch=sm_{arch} of csrc/kernels/{{verify_tree,sampling}}.cuh"


def cuda_kernels(arch: int = sm90.ARCH) -> tuple[dict[str, sm90.CudaKernel], str]:
    """The sampler kernels ({demangled name: sm90.CudaKernel}) for sm_``arch`` and where they
    came from."""
    binary, how = cuda_binary(arch)
    if binary is None:
        pytest.skip(how)
    ks = {n: k for n, k in sm90.cuda_kernels(binary, arch=arch).items() if _ours(n)}
    if not ks:
        pytest.skip(f"no sampler kernels in {how}")
    return ks, how


def _ours(name: str) -> bool:
    return any(s in name for s in ("verify_tree_", "sampling_probs_kernel", "sample_children_kernel"))


# CUDA kernels: launch threads and the largest dynamic shared memory the launchers request
# (csrc/cuda/verify_tree.cu: 3 * ceil4(V / 8) floats, used only while <= the opt-in limit).
def cuda_launch(name: str) -> tuple[int, int]:
    if "verify_tree_cluster_kernel" in name:
        return 512, 0  # dynamic part checked in test_verify_cluster_smem_budget
    if "verify_tree_block_kernel" in name:
        return 512, 0
    if "sampling_probs_kernel" in name:
        return 512, 0
    return 256, 0


EXPECTED_CUDA = ["verify_tree_cluster_kernel", "verify_tree_block_kernel", "sampling_probs_kernel",
                 "sample_children_kernel"]


# ------------------------------------------------------------------------------ CUDA checks


def test_cuda_kernels_present():
    ks, how = cuda_kernels()
    for k in EXPECTED_CUDA:
        assert any(k in n for n in ks), f"{k} missing from {how}"
    assert sum("sampling_probs_kernel" in n for n in ks) == 4, "one sampling_probs kernel per logits dtype"


@pytest.mark.parametrize("arch", [80, 90])
def test_cuda_no_spills_and_register_budget(arch):
    ks, how = cuda_kernels(arch)
    for name, k in ks.items():
        threads, _ = cuda_launch(name)
        assert k.local == 0 and k.stack == 0, \
            f"{name}: local memory / stack (spills) in {how}: LOCAL {k.local} STACK {k.stack}"
        assert k.count("LDL") == 0 and k.count("STL") == 0, f"{name}: LDL/STL in its SASS"
        assert k.regs * threads <= REGS_PER_SM, f"{name}: {k.regs} registers x {threads} threads"


def test_cuda_static_shared_in_budget():
    ks, _ = cuda_kernels()
    for name, k in ks.items():
        assert k.shared <= 48 * 1024, f"{name}: {k.shared} B of static shared memory"


def test_verify_cluster_smem_budget():
    """The cluster kernel's static shared memory plus its dynamic part at V = 128256 with
    clusters of 8 (3 * ceil4(V / 8) floats = 192384 B) fit in 227 KB, so Llama-3 vocabularies run
    with portable clusters; V = 152064 (Qwen2) fits with clusters of 16."""
    ks, _ = cuda_kernels()
    (k,) = sm90.find(ks, "verify_tree_cluster_kernel")

    def dyn(V, c):
        return 3 * (((V + c - 1) // c + 3) // 4 * 4) * 4

    assert k.shared + dyn(128256, 8) <= SMEM_LIMIT
    assert k.shared + dyn(152064, 16) <= SMEM_LIMIT


def test_verify_cluster_kernel_instruction_mix():
    """128-bit global loads (the rows entering shared memory), 128-bit shared loads (the
    rejection pass), the cluster barrier, and remote (distributed shared memory) loads."""
    ks, how = cuda_kernels()
    (k,) = sm90.find(ks, "verify_tree_cluster_kernel")
    ops = k.opcodes()
    assert any(o.startswith("LDG") and ".128" in o for o in ops), f"no 128-bit global loads ({how})"
    assert ops.get("LDS.128", 0) > 0, "no 128-bit shared loads"
    assert ops.get("UCGABAR_ARV", 0) > 0 and ops.get("UCGABAR_WAIT", 0) > 0, "no cluster barrier"
    assert k.count("LD.E") > 0, "no generic loads (distributed shared memory reads)"


@pytest.mark.parametrize("arch", [80, 90])
def test_verify_kernels_read_the_vocabulary_with_128_bit_loads(arch):
    """Every verify_tree kernel that runs on sm_``arch`` reads its rows with 128-bit global loads
    (LDG.128) where they are 16-byte aligned: the one-block kernel (the A100 path, and V too large
    for a cluster's shared memory on H100/H200) on both, the cluster kernel on sm_90. Its sm_80
    build is a trap that the launcher never picks (test_cluster_kernel_not_chosen_without_sm90_code)."""
    ks, how = cuda_kernels(arch)
    names = ["verify_tree_block_kernel"] + (["verify_tree_cluster_kernel"] if arch >= 90 else [])
    for name in names:
        (k,) = sm90.find(ks, name)
        ldg128 = sum(v for o, v in k.opcodes().items() if o.startswith("LDG") and ".128" in o)
        assert ldg128 > 0, f"{name} (sm_{arch}, {how}): no LDG.128 ({k.count('LDG')} LDG in all)"
    if arch < 90:
        (k,) = sm90.find(ks, "verify_tree_cluster_kernel")
        assert k.count("BPT.TRAP") > 0 and k.count("LDG") == 0, "the sm_80 cluster kernel is the trap"


_CLUSTER_CHOICE_TU = r"""
#include <cstdio>
#include "kernels/verify_tree.h"
using sequoia_kernels::verify_cluster_kernel_usable;
int main() {
  struct { int major, ptx, bin; bool want; const char* what; } cases[] = {
      {9, 90, 90, true, "sm_90 code on an H100/H200"},
      {10, 90, 100, true, "compute_90 PTX JIT-compiled on a newer GPU: still the real kernel"},
      {9, 80, 90, false, "8.0+PTX JIT-compiled on an H100/H200: the trap"},
      {9, 80, 80, false, "sm_80 code only"},
      {8, 80, 80, false, "an A100"},
      {8, 90, 90, false, "an sm_8x device"},
  };
  int bad = 0;
  for (const auto& c : cases) {
    const bool got = verify_cluster_kernel_usable(c.major, c.ptx, c.bin);
    std::printf("%s: %s\n", c.what, got ? "cluster kernel" : "one-block kernel");
    bad += got != c.want;
  }
  return bad;
}
"""


def test_cluster_kernel_not_chosen_without_sm90_code(tmp_path):
    """The launcher (csrc/cuda/verify_tree.cu, plan_cluster) chooses the cluster kernel only
    through verify_cluster_kernel_usable(device major, ptxVersion, binaryVersion of the loaded
    kernel): a binary without sm_90 code for it (its sm_80 body is a __trap(), e.g. an 8.0+PTX
    build JIT-compiled on an H200) gets the one-block kernel. The predicate is compiled and run
    here on the cases that matter, and the launcher is checked to gate every cluster plan on it."""
    import shutil

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "t.cpp").write_text(_CLUSTER_CHOICE_TU)
    subprocess.run([cxx, "-std=c++20", f"-I{ROOT / 'csrc'}", "-o", str(tmp_path / "t"), str(tmp_path / "t.cpp")],
                   check=True, capture_output=True, timeout=120)
    r = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout
    launcher = (ROOT / "csrc" / "cuda" / "verify_tree.cu").read_text()
    gate = "if (verify_cluster_kernel_usable(prop.major, fa.ptxVersion, fa.binaryVersion)"
    assert launcher.count(gate) == 1, "plan_cluster must gate the cluster plan on verify_cluster_kernel_usable"
    assert launcher.index("cudaFuncGetAttributes(&fa, verify_tree_cluster_kernel)") < launcher.index(gate)
    assert launcher.count("plan.cluster = ") == 2 and launcher.index(gate) < launcher.index("plan.cluster = "), \
        "every cluster plan is set inside the gated branch"


def test_verify_kernels_do_not_divide_in_the_pass():
    """The rejection passes multiply by the reciprocals of Sp, Sq (the spec's rcp): the only
    reciprocals left are the scalar ones per decision (MUFU.RCP: 9 in the cluster kernel, 12 in
    the block kernel with this nvcc; the division form had 30 and 31, four per float4 token
    group, in the unrolled passes)."""
    ks, how = cuda_kernels()
    for name in ("verify_tree_cluster_kernel", "verify_tree_block_kernel"):
        (k,) = sm90.find(ks, name)
        rcp = k.count("MUFU.RCP")
        assert 0 < rcp <= 14, f"{name}: {rcp} MUFU.RCP ({how}): divisions back in the rejection pass?"


# ---------------------------------------------------------------------------- Triton checks


def _builds():
    """(label, kernel, types, constexprs, num_warps, 16-byte aligned arguments[, num_ctas]) of every
    launch checked."""
    from sequoia_kernels.triton_kernels import sampling as sp
    from sequoia_kernels.triton_kernels import verify_tree as vt

    # verify_tree: BLOCK_V = 2048 (V >= 2048), BLOCK_T = 128 (T = 128), NCHUNK = 64 (V <= 131072), 8 warps
    vt_types = ["*fp32", "*fp32", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64", "*fp32"] + ["i32"] * 16
    vt_al = ["tp_ptr", "dp_ptr", "ws_ptr", "V", "s_tp_b", "s_tp_t", "s_dp_b", "s_dp_t", "s_ws_b", "s_ws_r"]
    for g in (False, True):
        yield (f"verify_tree_greedy{int(g)}", vt._verify_tree_kernel, vt_types,
               {"GREEDY": g, "BLOCK_V": 2048, "BLOCK_T": 128, "NCHUNK": 64, "GROUPS": 64, "GROUP_W": 32}, 8, vt_al)
    # the 8-CTA cluster launch of batch <= 16 (BLOCK_V = 8 x 2048, NCHUNK = 8 for V <= 131072),
    # where this Triton compiles it (>= 3.8; verify_tree.cluster_build_supported)
    for g in ((False, True) if vt.cluster_build_supported() else ()):
        yield (f"verify_tree_cluster8_greedy{int(g)}", vt._verify_tree_kernel, vt_types,
               {"GREEDY": g, "BLOCK_V": 16384, "BLOCK_T": 128, "NCHUNK": 8, "GROUPS": 128, "GROUP_W": 128}, 8,
               vt_al, 8)
    # sampling_probs: BLOCK_V = 1024, 8 warps, fp32 and bf16 logits
    for dt, g, tk, tp in (("fp32", True, False, False), ("fp32", False, False, False), ("fp32", False, True, True),
                          ("bf16", False, True, True)):
        yield (f"sampling_probs_{dt}_g{int(g)}k{int(tk)}p{int(tp)}", sp._sampling_probs_kernel,
               [f"*{dt}", "*fp32", "*fp64", "i32", "i32", "i32", "fp32", "i32"],
               {"GREEDY": g, "DO_TOPK": tk, "DO_TOPP": tp, "BLOCK_V": 1024, "NS": 16}, 8,
               ["x_ptr", "out_ptr", "V", "s_x", "s_o"])
    # sample_children one pass: BLOCK_V = 1024, KP = 64 (the largest), 8 warps; the K-pass fallback
    sc_types = ["*fp32", "*fp32", "*i64", "*i64", "*i64", "*i64"] + ["i32"] * 7
    for ph in (True, False):
        for kp in (64,):
            yield (f"sample_children_onepass_philox{int(ph)}_kp{kp}", sp._sample_children_onepass_kernel, sc_types,
                   {"PHILOX": ph, "BLOCK_V": 1024, "KP": kp}, 8, ["q_ptr", "u_ptr", "V", "s_q", "s_u"])
    yield ("sample_children_kpass_philox1", sp._sample_children_kernel, sc_types[:6] + ["i32"] * 6,
           {"PHILOX": True, "BLOCK_V": 2048}, 8, ["q_ptr", "V", "s_q"])
    yield ("philox_uniforms", sp._philox_uniform_kernel, ["*i64", "*i64", "*fp32", "i32"], {"BLOCK": 1024}, 4,
           ["out_ptr"])


def triton_sampler_report() -> dict:
    """{label: figures} of every launch in _builds (run in a child process without TRITON_INTERPRET)."""
    out = {}
    for label, fn, types, constexprs, num_warps, aligned, *ctas in _builds():
        k = sm90.compile_triton_signature(fn, types, constexprs, aligned=aligned, num_warps=num_warps,
                                          num_ctas=ctas[0] if ctas else 1)
        ops = k.opcodes()
        out[label] = {"name": k.name, "regs": k.regs, "spills": k.spills, "shared": k.shared,
                      "static_shared": k.static_shared, "ldl_stl": k.count("LDL") + k.count("STL"),
                      "ld128": k.ptx.count("ld.global.v4") + k.ptx.count("ld.global.nc.v4"),
                      "ldg128": sum(v for o, v in ops.items() if o.startswith("LDG") and ".128" in o),
                      "instructions": sum(ops.values()), "cluster_barriers": k.ptx.count("barrier.cluster"),
                      "dsmem": k.ptx.count("shared::cluster"), "debug_barriers": k.ttgir.count("gpu.barrier") + k.ttgir.count("ttg.barrier")}
    return out


@functools.lru_cache(maxsize=None)
def triton_aot() -> tuple[dict | None, str]:
    if sm90.tool("cuobjdump") is None:
        return None, "no cuobjdump (it ships with triton's NVIDIA backend)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return None, "triton is not installed"
    try:
        idx = sm90.call_without_interpreter("test_sm90_static_sampler:triton_sampler_report")
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            return None, "triton has no ptxas here"
        raise AssertionError(f"AOT compile failed:\n{e}") from None
    return idx, "triton AOT, GPUTarget('cuda', 90, 32)"


def triton_kernels() -> dict:
    idx, why = triton_aot()
    if idx is None:
        pytest.skip(why)
    return idx


def test_triton_no_spills_and_shared_in_budget():
    for label, k in triton_kernels().items():
        assert k["spills"] == 0, f"{label}: spills / local memory {k}"
        assert k["ldl_stl"] == 0, f"{label}: LDL/STL in SASS"
        assert k["shared"] + k["static_shared"] <= SMEM_LIMIT, f"{label}: {k['shared']} B dynamic shared memory"


def test_triton_vectorised_row_loads():
    """With 16-byte aligned rows (as the launchers' torch tensors are) the verify_tree and
    sample_children (uniforms given) kernels read rows with 128-bit loads."""
    idx = triton_kernels()
    for label in ("verify_tree_greedy0", "verify_tree_greedy1", "sample_children_onepass_philox0_kp64",
                  "verify_tree_cluster8_greedy0", "verify_tree_cluster8_greedy1"):
        if label in idx or "cluster" not in label:
            assert idx[label]["ld128"] > 0, f"{label}: no ld.global.v4 in its PTX"


def test_triton_verify_fences_the_workspace_rewrite():
    """The sampling build of the Triton verifier fences its workspace-rewriting pass with two CTA
    barriers (tl.debug_barrier, before and after: triton_kernels/verify_tree.py, "Workspace
    ordering"); the greedy build never writes the workspace and has none."""
    idx = triton_kernels()
    assert idx["verify_tree_greedy0"]["debug_barriers"] == 2, idx["verify_tree_greedy0"]
    assert idx["verify_tree_greedy1"]["debug_barriers"] == 0, idx["verify_tree_greedy1"]


def test_triton_verify_cluster_launch_splits_the_vocabulary():
    """The 8-CTA build really is a cluster kernel (batch 1 on 8 SMs): its reductions synchronise
    the cluster (barrier.cluster) and read the other CTAs' shared memory (shared::cluster); the
    one-CTA build has neither."""
    from sequoia_kernels.triton_kernels import verify_tree as vt

    idx = triton_kernels()
    if not vt.cluster_build_supported():
        pytest.skip("this Triton cannot compile the cluster build (needs >= 3.8)")
    for g in (0, 1):
        k1, k8 = idx[f"verify_tree_greedy{g}"], idx[f"verify_tree_cluster8_greedy{g}"]
        assert k8["cluster_barriers"] > 0 and k8["dsmem"] > 0, k8
        assert k1["cluster_barriers"] == 0 and k1["dsmem"] == 0, k1


# ------------------------------------------------------------------------------------ report


def report() -> None:
    binary, how = cuda_binary()
    print(f"CUDA ({how})")
    if binary is not None:
        for name, k in sorted((n, k) for n, k in sm90.cuda_kernels(binary).items() if _ours(n)):
            ops = k.opcodes()
            mix = {o: v for o, v in sorted(ops.items()) if o.startswith(("LDG", "LDS", "STS", "STG", "LD.", "BAR",
                                                                        "UCGABAR", "MUFU", "DADD", "ATOMS",
                                                                        "LDL", "STL"))}
            print(f"  {name}: REG {k.regs} STACK {k.stack} LOCAL {k.local} SHARED {k.shared} "
                  f"instructions {sum(ops.values())}\n    {mix}")
    idx, why = triton_aot()
    print(f"Triton ({why})")
    for label, k in (idx or {}).items():
        print(f"  {label}: REG {k['regs']} LOCAL {k['spills']} shared {k['shared']} B, ld.global.v4 in PTX "
              f"{k['ld128']}, LDG.128 {k['ldg128']}, instructions {k['instructions']}")


if __name__ == "__main__":
    report()
