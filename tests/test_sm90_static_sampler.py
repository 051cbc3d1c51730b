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
Local helpers (cuobjdump discovery, -res-usage / -sass parsing, AOT Triton compile) with a small
API, to be merged with the tree-attention checks' tests/sm90.py.
Run as a script to print the figures: ``python tests/test_sm90_static_sampler.py``.
"""

from __future__ import annotations

import collections
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMEM_LIMIT = 227 * 1024  # bytes per block on sm_90 (opt-in maximum)
REGS_PER_SM = 65536

# ------------------------------------------------------------------------------------ helpers


@functools.lru_cache(maxsize=None)
def nvidia_bin() -> Path | None:
    """triton/backends/nvidia/bin (cuobjdump, nvdisasm, ptxas ship there), or None."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
    except Exception:
        return None
    if spec is None or spec.origin is None:
        return None
    d = Path(spec.origin).parent / "backends" / "nvidia" / "bin"
    return d if d.is_dir() else None


def cuobjdump() -> Path | None:
    d = nvidia_bin()
    if d is not None and (d / "cuobjdump").exists():
        return d / "cuobjdump"
    w = shutil.which("cuobjdump")
    return Path(w) if w else None


def nvcc() -> Path | None:
    for c in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        if c and (Path(c) / "bin" / "nvcc").exists():
            return Path(c) / "bin" / "nvcc"
    w = shutil.which("nvcc")
    return Path(w) if w else None


def _run(args: list) -> str:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {r.stderr[-2000:]}")
    return r.stdout


@functools.lru_cache(maxsize=None)
def res_usage(binary: Path, arch: str = "sm_90") -> dict[str, dict[str, int]]:
    """{mangled kernel name: {"REG", "STACK", "SHARED", "LOCAL", ...}} for `arch` from
    ``cuobjdump -res-usage`` of a cubin or a host binary with an embedded fatbin."""
    out = _run([cuobjdump(), "-res-usage", binary])
    cur_arch, res, fn = None, {}, None
    for line in out.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        if m:
            cur_arch = m.group(1)
            continue
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            fn = m.group(1)
            continue
        if fn and "REG:" in line:
            if cur_arch in (None, arch):
                res[fn] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}
            fn = None
    return res


@functools.lru_cache(maxsize=None)
def sass(binary: Path, arch: str = "sm_90") -> dict[str, str]:
    """{mangled kernel name: its SASS} for `arch`."""
    args = [cuobjdump(), "-sass", binary]
    if binary.suffix != ".cubin":
        args[2:2] = ["-arch", arch]
    out = _run(args)
    funcs, fn, buf = {}, None, []
    for line in out.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            if fn:
                funcs[fn] = "\n".join(buf)
            fn, buf = m.group(1), []
        elif fn:
            buf.append(line)
    if fn:
        funcs[fn] = "\n".join(buf)
    return funcs


def opcodes(sass_text: str) -> collections.Counter:
    """Instruction mix: opcode (with modifiers) -> count."""
    c = collections.Counter()
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_.]+)", sass_text):
        c[m.group(1)] += 1
    return c


def built_extension() -> Path | None:
    """sequoia_kernels/_C*.so of this tree when it embeds sm_90 code, else None."""
    for so in sorted(glob.glob(str(ROOT / "sequoia_kernels" / "_C*.so"))):
        if cuobjdump() is None:
            return None
        try:
            if res_usage(Path(so)):
                return Path(so)
        except RuntimeError:
            return None
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
def cuda_binary() -> tuple[Path | None, str]:
    """(binary with the sampler kernels for sm_90, where it came from) or (None, why not)."""
    if cuobjdump() is None:
        return None, "no cuobjdump (it ships with triton's NVIDIA backend)"
    so = built_extension()
    if so is not None:
        return so, f"built extension {so.name}"
    if nvcc() is None:
        return None, "sequoia_kernels._C has no CUDA code and nvcc is absent"
    d = Path(tempfile.mkdtemp(prefix="sm90_sampler_"))
    (d / "k.cu").write_text(_HEADERS_TU)
    _run([nvcc(), "-arch=sm_90", "-cubin", "-O3", "-std=c++20", "--expt-relaxed-constexpr",
          f"-I{ROOT / 'csrc'}", "-o", d / "k.cubin", d / "k.cu"])
    return d / "k.cubin", "nvcc -cubin of csrc/kernels/{verify_tree,sampling}.cuh"


def cuda_kernels() -> tuple[dict, dict, str]:
    binary, how = cuda_binary()
    if binary is None:
        pytest.skip(how)
    res = {k: v for k, v in res_usage(binary).items() if _ours(k)}
    code = {k: v for k, v in sass(binary).items() if _ours(k)}
    if not res:
        pytest.skip(f"no sampler kernels in {how}")
    return res, code, how


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
    res, _, how = cuda_kernels()
    for k in EXPECTED_CUDA:
        assert any(k in n for n in res), f"{k} missing from {how}"
    assert sum("sampling_probs_kernel" in n for n in res) == 4, "one sampling_probs kernel per logits dtype"


def test_cuda_no_spills_and_register_budget():
    res, code, how = cuda_kernels()
    for name, r in res.items():
        threads, _ = cuda_launch(name)
        assert r["LOCAL"] == 0 and r["STACK"] == 0, f"{name}: local memory / stack (spills) in {how}: {r}"
        ops = opcodes(code[name])
        assert not any(o.startswith(("LDL", "STL")) for o in ops), f"{name}: LDL/STL in its SASS"
        assert r["REG"] * threads <= REGS_PER_SM, f"{name}: {r['REG']} registers x {threads} threads"


def test_cuda_static_shared_in_budget():
    res, _, _ = cuda_kernels()
    for name, r in res.items():
        assert r["SHARED"] <= 48 * 1024, f"{name}: {r['SHARED']} B of static shared memory"


def test_verify_cluster_smem_budget():
    """The cluster kernel's static shared memory plus its dynamic part at V = 128256 with
    clusters of 8 (3 * ceil4(V / 8) floats = 192384 B) fit in 227 KB, so Llama-3 vocabularies run
    with portable clusters; V = 152064 (Qwen2) fits with clusters of 16."""
    res, _, _ = cuda_kernels()
    (name,) = [n for n in res if "verify_tree_cluster_kernel" in n]

    def dyn(V, c):
        return 3 * (((V + c - 1) // c + 3) // 4 * 4) * 4

    assert res[name]["SHARED"] + dyn(128256, 8) <= SMEM_LIMIT
    assert res[name]["SHARED"] + dyn(152064, 16) <= SMEM_LIMIT


def test_verify_cluster_kernel_instruction_mix():
    """128-bit global loads (the rows entering shared memory), 128-bit shared loads (the
    rejection pass), the cluster barrier, and remote (distributed shared memory) loads."""
    _, code, how = cuda_kernels()
    (name,) = [n for n in code if "verify_tree_cluster_kernel" in n]
    ops = opcodes(code[name])
    assert any(o.startswith("LDG") and ".128" in o for o in ops), f"no 128-bit global loads ({how})"
    assert ops.get("LDS.128", 0) > 0, "no 128-bit shared loads"
    assert ops.get("UCGABAR_ARV", 0) > 0 and ops.get("UCGABAR_WAIT", 0) > 0, "no cluster barrier"
    assert any(o.startswith("LD.E") for o in ops), "no generic loads (distributed shared memory reads)"


# ---------------------------------------------------------------------------- Triton checks
# (the parsers above are cached: treat their dicts as read-only)

_AOT = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sequoia_kernels.triton_kernels import verify_tree as vt, sampling as sp

out = sys.argv[1]
target = GPUTarget("cuda", 90, 32)
res = {}

def build(label, k, types, constexprs, num_warps, aligned=()):
    sig = {n: ("constexpr" if n in constexprs else types[i]) for i, n in enumerate(k.arg_names)}
    attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    c = triton.compile(ASTSource(fn=k, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                       options={"num_warps": num_warps})
    path = f"{out}/{label}.cubin"
    open(path, "wb").write(c.asm["cubin"])
    res[label] = {"cubin": path, "shared": c.metadata.shared, "name": c.metadata.name,
                  "ld128": c.asm["ptx"].count("ld.global.v4") + c.asm["ptx"].count("ld.global.nc.v4")}

# verify_tree: BLOCK_V = 2048 (V >= 2048), BLOCK_T = 128 (T = 128), NCHUNK = 64 (V <= 131072), 8 warps
vt_types = ["*fp32", "*fp32", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64", "*fp32"] + ["i32"] * 16
vt_al = ["tp_ptr", "dp_ptr", "ws_ptr", "V", "s_tp_b", "s_tp_t", "s_dp_b", "s_dp_t", "s_ws_b", "s_ws_r"]
for g in (False, True):
    build(f"verify_tree_greedy{int(g)}", vt._verify_tree_kernel, vt_types,
          {"GREEDY": g, "BLOCK_V": 2048, "BLOCK_T": 128, "NCHUNK": 64}, 8, vt_al)
# sampling_probs: BLOCK_V = 1024, 8 warps, fp32 and bf16 logits
for dt, g, tk, tp in (("fp32", True, False, False), ("fp32", False, False, False), ("fp32", False, True, True),
                      ("bf16", False, True, True)):
    if True:
        build(f"sampling_probs_{dt}_g{int(g)}k{int(tk)}p{int(tp)}", sp._sampling_probs_kernel,
              [f"*{dt}", "*fp32", "*fp64", "i32", "i32", "i32", "fp32", "i32"],
              {"GREEDY": g, "DO_TOPK": tk, "DO_TOPP": tp, "BLOCK_V": 1024, "NS": 16}, 8,
              ["x_ptr", "out_ptr", "V", "s_x", "s_o"])
# sample_children one pass: BLOCK_V = 1024, KP = 64 (the largest), 8 warps; the K-pass fallback
sc_types = ["*fp32", "*fp32", "*i64", "*i64", "*i64", "*i64"] + ["i32"] * 7
for ph in (True, False):
    for kp in (64,):
        build(f"sample_children_onepass_philox{int(ph)}_kp{kp}", sp._sample_children_onepass_kernel, sc_types,
              {"PHILOX": ph, "BLOCK_V": 1024, "KP": kp}, 8, ["q_ptr", "u_ptr", "V", "s_q", "s_u"])
build("sample_children_kpass_philox1", sp._sample_children_kernel, sc_types[:6] + ["i32"] * 6,
      {"PHILOX": True, "BLOCK_V": 2048}, 8, ["q_ptr", "V", "s_q"])
build("philox_uniforms", sp._philox_uniform_kernel, ["*i64", "*i64", "*fp32", "i32"], {"BLOCK": 1024}, 4,
      ["out_ptr"])
json.dump(res, open(f"{out}/index.json", "w"))
print("compiled")
"""


@functools.lru_cache(maxsize=None)
def triton_aot() -> tuple[dict | None, str]:
    if cuobjdump() is None:
        return None, "no cuobjdump (it ships with triton's NVIDIA backend)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return None, "triton is not installed"
    d = tempfile.mkdtemp(prefix="sm90_sampler_triton_")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", _AOT, d], env=env, capture_output=True, text=True, timeout=900,
                       cwd=str(ROOT))
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        return None, "triton has no ptxas here"
    if r.returncode != 0 or "compiled" not in r.stdout:
        raise AssertionError(f"AOT compile failed:\n{r.stderr[-4000:]}")
    return json.loads(Path(d, "index.json").read_text()), "triton AOT, GPUTarget('cuda', 90, 32)"


def triton_kernels() -> dict:
    idx, why = triton_aot()
    if idx is None:
        pytest.skip(why)
    return idx


def test_triton_no_spills_and_shared_in_budget():
    for label, k in triton_kernels().items():
        (r,) = res_usage(Path(k["cubin"])).values()
        assert r["LOCAL"] == 0 and r["STACK"] == 0, f"{label}: spills / local memory {r}"
        (code,) = sass(Path(k["cubin"])).values()
        assert not any(o.startswith(("LDL", "STL")) for o in opcodes(code)), f"{label}: LDL/STL in SASS"
        assert k["shared"] + r["SHARED"] <= SMEM_LIMIT, f"{label}: {k['shared']} B dynamic shared memory"


def test_triton_vectorised_row_loads():
    """With 16-byte aligned rows (as the launchers' torch tensors are) the verify_tree and
    sample_children (uniforms given) kernels read rows with 128-bit loads."""
    idx = triton_kernels()
    for label in ("verify_tree_greedy0", "verify_tree_greedy1", "sample_children_onepass_philox0_kp64"):
        assert idx[label]["ld128"] > 0, f"{label}: no ld.global.v4 in its PTX"


# ------------------------------------------------------------------------------------ report


def report() -> None:
    binary, how = cuda_binary()
    print(f"CUDA ({how})")
    if binary is not None:
        res = res_usage(binary)
        code = sass(binary)
        for name in sorted(n for n in res if _ours(n)):
            r, ops = res[name], opcodes(code[name])
            mix = {k: v for k, v in sorted(ops.items()) if k.startswith(("LDG", "LDS", "STS", "STG", "LD.", "BAR",
                                                                          "UCGABAR", "MUFU", "DADD", "ATOMS",
                                                                          "LDL", "STL"))}
            print(f"  {name}: REG {r['REG']} STACK {r['STACK']} LOCAL {r['LOCAL']} SHARED {r['SHARED']} "
                  f"instructions {sum(ops.values())}\n    {mix}")
    idx, why = triton_aot()
    print(f"Triton ({why})")
    for label, k in (idx or {}).items():
        (r,) = res_usage(Path(k["cubin"])).values()
        (code,) = sass(Path(k["cubin"])).values()
        ops = opcodes(code)
        print(f"  {label}: REG {r['REG']} LOCAL {r['LOCAL']} shared {k['shared']} B, ld.global.v4 in PTX "
              f"{k['ld128']}, LDG.128 {sum(v for o, v in ops.items() if o.startswith('LDG') and '.128' in o)}, "
              f"instructions {sum(ops.values())}")


if __name__ == "__main__":
    report()
