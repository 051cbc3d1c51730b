"""Static sm_90 (H100 / H200) checks of GPU machine code, without a GPU.

Shared helpers for tests that read what the compilers made of a kernel:

* CUDA kernels of the built extension (``sequoia_kernels/_C*.so``):
  :func:`cuda_kernels` returns one :class:`CudaKernel` per ``__global__`` function in its sm_90
  machine code, keyed by the demangled name, with ``cuobjdump -res-usage`` figures (registers,
  stack, local and static shared memory) and the SASS text (:meth:`CudaKernel.count`,
  :meth:`CudaKernel.opcodes`).
* Triton kernels (in a process without TRITON_INTERPRET: :func:`call_without_interpreter` runs
  a function in a child process with it off and returns its JSON result; the test suite sets it
  on when there is no GPU): :func:`compile_triton` compiles one ``@triton.jit`` function ahead of time for
  ``GPUTarget("cuda", 90, 32)`` from the arguments a launcher would pass (tensors, possibly on
  the ``meta`` device, ints, floats) and returns a :class:`TritonKernel` (registers, spills,
  shared memory, PTX, SASS); :func:`compile_triton_signature` does the same from an explicit
  Triton signature (types, constexprs, which arguments are 16-byte aligned).

The disassemblers come from Triton's wheel (``triton/backends/nvidia/bin``: cuobjdump, nvdisasm,
ptxas) or ``$CUDA_HOME/bin``. Callers skip, with a reason, when :func:`tool` returns None or
:func:`extension_path` finds no CUDA build (``pytest.skip(why)``); nothing here needs a GPU.

Typical use::

    kernels = sm90.cuda_kernels()                       # {demangled name: CudaKernel}
    k = sm90.find(kernels, "tree_attention_mma_kernel<__half, 128, 8>")
    assert k.count("HMMA") > 0 and k.spill_free
    tk = sm90.compile_triton(my_kernel, args, constexprs, num_warps=4, num_stages=2)
    assert tk.spills == 0 and tk.shared <= sm90.SMEM_PER_BLOCK
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile

ARCH = 90
SMEM_PER_BLOCK = 227 * 1024  # sm_90: the most shared memory one block can opt in to
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255

__all__ = [
    "ARCH", "SMEM_PER_BLOCK", "REGS_PER_SM", "MAX_REGS_PER_THREAD",
    "tool", "extension_path", "cuda_kernels", "find", "CudaKernel",
    "compile_triton", "compile_triton_signature", "TritonKernel", "opcode_counts", "call_without_interpreter",
]


# ------------------------------------------------------------------------------------ tools


@functools.lru_cache(maxsize=None)
def tool(name: str) -> str | None:
    """Path of an NVIDIA binary tool ("cuobjdump", "nvdisasm", "ptxas"): Triton's bundled copy
    first, then $CUDA_HOME/bin, then PATH; None when there is none."""
    spec = importlib.util.find_spec("triton")
    cands = []
    if spec is not None and spec.origin:
        cands.append(os.path.join(os.path.dirname(spec.origin), "backends", "nvidia", "bin", name))
    cands.append(os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", name))
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return shutil.which(name)


def extension_path() -> str | None:
    """The built ``sequoia_kernels/_C*.so`` (found without importing it), or None."""
    spec = importlib.util.find_spec("sequoia_kernels")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(d, "_C*.so")))
        if hits:
            return hits[0]
    return None


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


@functools.lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    filt = shutil.which("c++filt")
    if filt is None or not name.startswith("_Z"):
        return name
    return _run([filt, name]).strip()


# ------------------------------------------------------------------------------ CUDA kernels


_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def opcode_counts(sass: str) -> collections.Counter:
    """Counter of full opcodes (with modifiers, e.g. ``LDGSTS.E.BYPASS.128``) in SASS text."""
    return collections.Counter(_OPCODE.findall(sass))


@dataclasses.dataclass
class CudaKernel:
    """One __global__ function of a cubin / fatbinary, for one architecture."""

    name: str  # demangled
    mangled: str
    regs: int
    stack: int  # bytes of stack frame a thread
    local: int  # bytes of local memory a thread (spills and local arrays)
    shared: int  # static shared memory a block (bytes; sm_90 reports its 1 KB reserve too)
    sass: str

    def opcodes(self) -> collections.Counter:
        return opcode_counts(self.sass)

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"HMMA"``, ``"LDGSTS.E.BYPASS.128"``)."""
        return sum(n for op, n in self.opcodes().items() if op.startswith(prefix))

    @property
    def spill_free(self) -> bool:
        """No local memory, no stack frame, no STL/LDL in the machine code."""
        return self.local == 0 and self.stack == 0 and self.count("STL") == 0 and self.count("LDL") == 0

    def max_regs_for(self, threads: int, blocks_per_sm: int) -> int:
        """The register budget a thread has when ``blocks_per_sm`` blocks of ``threads`` share an SM."""
        return min(MAX_REGS_PER_THREAD, REGS_PER_SM // (threads * blocks_per_sm) // 8 * 8)


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _split_sass(text: str) -> dict[str, str]:
    out, name, buf = {}, None, []
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name is not None:
                out[name] = "\n".join(buf)
            name, buf = m.group(1), []
        elif name is not None:
            buf.append(line)
    if name is not None:
        out[name] = "\n".join(buf)
    return out


@functools.lru_cache(maxsize=8)
def _cuda_kernels_cached(path: str, mtime: float, arch: int) -> dict[str, CudaKernel]:
    return _read_kernels(path, arch)


def _read_kernels(path: str, arch: int) -> dict[str, CudaKernel]:
    cuobjdump = tool("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found (install triton, or set CUDA_HOME)")
    r = subprocess.run([cuobjdump, "-res-usage", "-arch", f"sm_{arch}", path], capture_output=True, text=True)
    if r.returncode != 0:
        if "does not contain device code" in r.stdout + r.stderr:
            return {}  # e.g. a CPU-only build of the extension
        raise RuntimeError(f"cuobjdump failed on {path}: {r.stderr or r.stdout}")
    res = r.stdout
    sass = _split_sass(_run([cuobjdump, "-sass", "-arch", f"sm_{arch}", path]))
    out = {}
    for mangled, reg, stack, shared, local in _RES.findall(res):
        name = demangle(mangled)
        out[name] = CudaKernel(name, mangled, int(reg), int(stack), int(local), int(shared), sass.get(mangled, ""))
    return out


def cuda_kernels(path: str | None = None, arch: int = ARCH) -> dict[str, CudaKernel]:
    """Every __global__ function with sm_``arch`` machine code in ``path`` (default: the built
    extension), keyed by demangled name. Empty when the file has no code for that arch."""
    path = path or extension_path()
    if path is None:
        raise FileNotFoundError("sequoia_kernels/_C*.so is not built")
    return _cuda_kernels_cached(path, os.path.getmtime(path), arch)


def find(kernels: dict[str, CudaKernel], pattern: str) -> list[CudaKernel]:
    """Kernels whose demangled name contains ``pattern`` (spaces ignored)."""
    pat = pattern.replace(" ", "")
    return [k for n, k in sorted(kernels.items()) if pat in n.replace(" ", "")]


# ---------------------------------------------------------------------------- Triton kernels


@dataclasses.dataclass
class TritonKernel:
    """A Triton kernel compiled ahead of time for one target."""

    name: str
    num_warps: int
    num_stages: int
    regs: int  # from the cubin (cuobjdump -res-usage)
    spills: int  # bytes of local memory a thread (0: no spills)
    shared: int  # bytes of shared memory a block (Triton's dynamic allocation)
    ptx: str
    sass: str
    static_shared: int = 0  # static shared memory a block in the cubin (cuobjdump -res-usage SHARED)
    ttgir: str = ""  # Triton's GPU IR before lowering (its gpu.barrier / ttg.barrier ops are the kernel's own tl.debug_barrier)

    def opcodes(self) -> collections.Counter:
        return opcode_counts(self.sass)

    def count(self, prefix: str) -> int:
        return sum(n for op, n in self.opcodes().items() if op.startswith(prefix))

    @property
    def tensor_core_ops(self) -> int:
        """wgmma (HGMMA) plus mma.sync (HMMA) instructions in the SASS."""
        return self.count("HGMMA") + self.count("HMMA")


_TORCH_TO_TRITON = {
    "torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float64": "fp64",
    "torch.int8": "i8", "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64",
    "torch.uint8": "u8", "torch.bool": "i1",
}


def _jit_function(fn):
    """The JITFunction behind ``fn`` (under TRITON_INTERPRET=1 ``@triton.jit`` returns an
    interpreter wrapper that keeps the Python function in ``.fn``)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    return JITFunction(fn.fn)


def compile_triton(fn, args, constexprs: dict | None = None, *, num_warps: int = 4, num_stages: int = 3,
                   arch: int = ARCH) -> TritonKernel:
    """Compile ``fn`` for ``GPUTarget("cuda", arch, 32)`` with the launcher's arguments.

    ``args``: the non-constexpr arguments in order, as the launcher passes them (tensors on any
    device, ``meta`` included: only their dtype is used; Python ints and floats). Specialised as
    Triton's JIT does on a GPU: pointers and ints divisible by 16 get ``tt.divisibility = 16``,
    ints equal to 1 become constants. ``constexprs``: the ``tl.constexpr`` arguments by name.
    """
    import torch

    _no_interpreter()
    jf = _jit_function(fn)
    constexprs = dict(constexprs or {})
    names = [p.name for p in jf.params if not p.is_constexpr]
    if len(names) != len(args):
        raise ValueError(f"{jf.__name__}: {len(args)} arguments for {len(names)} parameters {names}")
    signature, attrs, consts = {}, {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        idx = jf.arg_names.index(name)
        if isinstance(a, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[str(a.dtype)]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            signature[name] = "i1"
        elif isinstance(a, int):
            if a == 1:
                signature[name] = "constexpr"
                consts[name] = 1
                continue
            signature[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if a % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        elif isinstance(a, float):
            signature[name] = "fp32"
        elif a is None:
            signature[name] = "constexpr"
            consts[name] = None
        else:
            raise TypeError(f"{jf.__name__}: cannot specialise argument {name} = {a!r}")
    for p in jf.params:
        if p.is_constexpr:
            if p.name not in constexprs:
                raise ValueError(f"{jf.__name__}: constexpr {p.name} not given")
            signature[p.name] = "constexpr"
    consts.update(constexprs)
    return _compile(jf, signature, consts, attrs, num_warps, num_stages, arch)


def compile_triton_signature(fn, types, constexprs: dict, *, aligned=(), num_warps: int = 4,
                             num_stages: int = 3, arch: int = ARCH, num_ctas: int = 1) -> TritonKernel:
    """Compile ``fn`` for ``GPUTarget("cuda", arch, 32)`` from an explicit signature.

    ``types``: Triton types (``"*fp32"``, ``"i32"``, ...) by position in ``fn``'s argument list;
    the positions of the arguments named in ``constexprs`` (their values, by name) are not read.
    ``aligned``: names of the arguments marked ``tt.divisibility = 16``; no other argument is.
    For a specialisation the launcher's arguments cannot express (:func:`compile_triton`).
    """
    _no_interpreter()
    jf = _jit_function(fn)
    signature = {n: ("constexpr" if n in constexprs else types[i]) for i, n in enumerate(jf.arg_names)}
    attrs = {(jf.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return _compile(jf, signature, dict(constexprs), attrs, num_warps, num_stages, arch, num_ctas)


def _no_interpreter() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_triton needs a process without TRITON_INTERPRET (the interpreter replaces "
                           "@triton.jit functions): use call_without_interpreter")


def _compile(jf, signature, consts, attrs, num_warps, num_stages, arch, num_ctas: int = 1) -> TritonKernel:
    """One compilation per distinct specialisation (cached in _COMPILED)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    key = (jf.cache_key, arch, num_warps, num_stages, num_ctas, tuple(sorted(signature.items())),
           tuple(sorted((k, repr(v)) for k, v in consts.items())), tuple(sorted((k, repr(v)) for k, v in attrs.items())))
    if key not in _COMPILED:
        src = ASTSource(fn=jf, signature=signature, constexprs=consts, attrs=attrs)
        ck = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "num_ctas": num_ctas})
        _COMPILED[key] = _summarise(jf.__name__, ck, num_warps, num_stages, arch)
    return _COMPILED[key]


_COMPILED: dict = {}  # one compilation per distinct specialisation


def _summarise(name, ck, num_warps, num_stages, arch) -> TritonKernel:
    cubin = ck.asm["cubin"]
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        kern = _read_kernels(path, arch)
    (k,) = kern.values()
    shared = int(ck.metadata.shared)
    return TritonKernel(name, num_warps, num_stages, k.regs, k.local + k.stack, max(shared, 0), ck.asm["ptx"],
                        k.sass, k.shared, ck.asm.get("ttgir", ""))


def call_without_interpreter(target: str, timeout: float = 900) -> object:
    """Run ``module:function`` (importable from tests/ or the repository root) in a child Python
    with TRITON_INTERPRET=0 and return what it returns (JSON-serialisable)."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    module, func = target.split(":")
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.path.dirname(here), env.get("PYTHONPATH", "")) if p)
    code = f"import json, {module} as m; print('@@' + json.dumps(m.{func}()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{target} failed in a child process without TRITON_INTERPRET:\n{r.stderr[-4000:]}")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("@@")][-1]
    return json.loads(line[2:])
