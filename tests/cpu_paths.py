"""Running one script under each of the CPU kernels' vector paths (AVX2, AVX-512, the AMX paths on
emulated tiles), each in its own process: ``ATEN_CPU_CAPABILITY`` caps our kernels as it caps
torch's and ``SEQUOIA_KERNELS_AMX=emulate`` emulates the AMX tiles, both read once per process
(``csrc/cpu/simd.h``, ``csrc/cpu/amx.h``). Shared by the tests that check two paths give the same bits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from sequoia_kernels._backend import cpuinfo


def _cpu_has(flag: str) -> bool:
    return flag in cpuinfo("flags").split()


def skip_without_avx512f() -> None:
    if not _cpu_has("avx512f"):
        pytest.skip("this CPU has no AVX-512F: only the AVX2 path runs here")


def cap_env(cap: str) -> dict[str, str]:
    """This process's environment for a child under ``cap``: an ``ATEN_CPU_CAPABILITY`` value, "all"
    (the variable unset, every path the CPU has, whatever cap this process runs under), "emulate"
    (every path, AMX's on emulated tiles) or a cap and "+emulate", e.g. "avx512+emulate"."""
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "SEQUOIA_KERNELS_AMX")}
    for part in cap.split("+"):
        if part == "emulate":
            env["SEQUOIA_KERNELS_AMX"] = "emulate"
        elif part != "all":
            env["ATEN_CPU_CAPABILITY"] = part
    return env


def outputs_per_path(script: str, cases, tmp_path, caps=("avx2", "avx512")) -> dict[str, list]:
    """``script`` (run as ``python -c script cases.pt out.pt``: it loads the cases, saves a list of
    outputs) under each ``ATEN_CPU_CAPABILITY`` in ``caps`` (default avx2 and avx512; "all": the
    variable unset, every path the CPU has; "emulate": every path, AMX's on emulated tiles; a cap
    and "+emulate", e.g. "avx512+emulate": both); the lists by capability."""
    torch.save(cases, tmp_path / "cases.pt")
    outs = {}
    for cap in caps:
        res = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.pt"), str(tmp_path / f"{cap}.pt")],
                             env=cap_env(cap), capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        outs[cap] = torch.load(tmp_path / f"{cap}.pt")
    return outs


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX-BF16 tiles (``/proc/cpuinfo``; whether Linux lets a process use them
    is the kernels' own check)."""
    return _cpu_has("amx_bf16")
