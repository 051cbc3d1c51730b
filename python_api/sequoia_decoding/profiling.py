"""Measuring this machine once and caching what was measured (``profiles`` reads the cache and
plans from it, without measuring anything): the pair's latency profile (:func:`cached_profile`)
and the CPU dtype (:func:`pick_dtype`: fp32 or bf16, by measured forwards)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Callable, Sequence

import torch

from .cpu_threads import busy_cores
from .profiles import PROFILE_SIZES, PROFILE_VERSION, _write_json, cpu_kernels, cpu_name, profile_path, profiles_dir
from .tensor_parallel import TensorParallel, is_rank0, rank0s, torchrun_group
from .tools import profile_latency

__all__ = ["cached_profile", "pick_dtype", "choose_cpu_dtype", "default_dtype", "DTYPE_SIZES"]


def default_dtype(device: torch.device) -> str:
    """The dtype to try first without a measurement: bf16 on GPUs and where bf16 packed_linear
    has a vector path (AVX2 or better: half the weight bytes of fp32), else fp32.
    :func:`choose_cpu_dtype` decides on CPUs by measurement."""
    from sequoia_kernels.ops.packed_linear import packed_linear_supported

    if device.type != "cpu":
        return "bfloat16"
    return "bfloat16" if packed_linear_supported(torch.bfloat16) else "float32"


def pick_dtype(target_dir: str | Path, device: torch.device, *, refresh: bool = False,
               log: Callable[[str], None] = print, measure: bool = True) -> tuple[str, str] | None:
    """The demo's dtype for the target in ``target_dir`` on ``device``: bf16 on GPUs, measured on
    CPUs (:func:`choose_cpu_dtype`). Returns ``(dtype, why)``; with ``measure=False`` None where
    this CPU's choice for the target is not cached (nothing is timed)."""
    from .loading import load_causal_lm

    if device.type != "cpu":
        return "bfloat16", "bfloat16: a GPU"
    files = sorted(Path(target_dir).glob("*.json")) + sorted(Path(target_dir).glob("*.safetensors"))
    fingerprint = hashlib.sha1("|".join(f"{f.name}:{f.stat().st_size}" for f in files).encode()).hexdigest()[:16]
    tp = torchrun_group()  # under torchrun: the target timed sharded, as it will run
    return choose_cpu_dtype(lambda d: load_causal_lm(str(target_dir), dtype=d, device="cpu",
                                                     tensor_parallel=tp is not None),
                            cache_dir=profiles_dir(), fingerprint=fingerprint, refresh=refresh, log=log, tp=tp,
                            measure=measure)


DTYPE_SIZES = (1, 16)  # the tree sizes choose_cpu_dtype times: one token (AR) and a typical tree


def choose_cpu_dtype(load: Callable[[str], object], *, cache_dir: Path, fingerprint: str, refresh: bool = False,
                     log: Callable[[str], None] = print, tp: TensorParallel | None = None,
                     measure: bool = True) -> tuple[str, str] | None:
    """bf16 or fp32 for the target on this CPU, by its measured forward T(1) and T(16) in each
    (as the loop runs it: tree attention, the linears the loop picks), the lower T(1) + T(16)
    winning; ``load(dtype)`` returns the target in that dtype. Cached per machine and target
    (``fingerprint``) in ``cache_dir``. ``tp``: the ranks of a TP target (``load`` loads it
    sharded): rank 0's cache and times decide on every rank. Returns ``(dtype, why)``, ``why``
    one line of figures; ``measure=False``: None where nothing is cached."""
    from sequoia_kernels.ops.packed_linear import packed_linear_supported

    if not packed_linear_supported(torch.bfloat16):
        return "float32", "float32: this CPU has no bf16 vector path (AVX2 or better)"
    key = {"host": platform.node(), "device": cpu_name(), "threads": torch.get_num_threads(), "loop": PROFILE_VERSION,
           "torch": torch.__version__, "target": fingerprint, "cpu_kernels": cpu_kernels(),
           **({"tensor_parallel": tp.size} if tp else {})}
    path = Path(cache_dir) / f"dtype-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    got = rank0s(json.loads(path.read_text()) if path.is_file() and not refresh else None, tp)
    if got is not None:
        return got["dtype"], got["why"] + " (cached)"
    if not measure:
        return None
    log("timing the target in float32 and bfloat16 once to pick the dtype ...")
    t = {}
    for dtype in ("float32", "bfloat16"):
        model = load(dtype)
        prof = profile_latency(model, None, sizes=DTYPE_SIZES, prefix=96, repeats=5, progress=False)
        t[dtype] = [prof["target_latency_s"][str(n)] for n in DTYPE_SIZES]
        del model
    best = min(t, key=lambda d: sum(t[d]))
    other = "float32" if best == "bfloat16" else "bfloat16"
    why = (f"{best}: T(1) = {1e3 * t[best][0]:.1f} ms, T(16) = {1e3 * t[best][1]:.1f} ms against {other}'s "
           f"{1e3 * t[other][0]:.1f} / {1e3 * t[other][1]:.1f} ms ({cpu_name()})")
    if is_rank0(tp):
        _write_json(path, {"machine": key, "dtype": best, "why": why, "latency_s": t})
    return best, why


def cached_profile(target, draft, *, cache_dir: Path, key: dict, refresh: bool = False,
                   sizes: Sequence[int] = PROFILE_SIZES, prefix: int = 256, repeats: int = 5,
                   log: Callable[[str], None] = print) -> tuple[dict, Path, bool]:
    """The latency profile for this machine: read from the cache, or measured and cached.
    A TP target (``key`` has its world size): rank 0's cache decides, every rank times the same
    forwards, rank 0 writes. Returns ``(profile, path, was_cached)``."""
    path = profile_path(cache_dir, key, sizes, prefix)
    tp = torchrun_group() if key.get("tensor_parallel") else None
    found = rank0s(json.loads(path.read_text()) if path.is_file() and not refresh else None, tp)
    if found is not None:
        return found, path, True
    log(f"profiling this machine once (cached in {path}) ...")
    # other processes' runnable tasks now (not the load average, which counts this process's own
    # model loading of the last minute and warned on a quiet machine); not under TP, whose other
    # ranks are this run's own processes
    cpu = key.get("device_type") == "cpu" and tp is None
    busy = busy_cores(samples=20, interval_s=0.005) if cpu else None
    if busy:
        log(f"warning: other processes keep {busy} of {os.cpu_count()} cores busy: the latency curve (and the plan) "
            "may be off; rerun with --reprofile on a quiet machine")
    prof = profile_latency(target, draft, sizes=sizes, prefix=prefix, repeats=repeats)
    prof["machine"] = key
    if prof["noisy"]:
        worst = max(prof["spread"], key=prof["spread"].get)
        spread = f"repeats at n = {worst} spread by {100 * prof['spread'][worst]:.0f}% of their median"
        after = busy_cores(samples=20, interval_s=0.005) if cpu else None
        if busy or after or key.get("device_type") != "cpu":
            log(f"warning: the latency curve is noisy ({spread}): another process shares the machine; this "
                "profile is used for this run only and not cached (rerun on a quiet machine)")
            return prof, path, False
        # no other process before or after: the spread is the VM's own jitter (seen on a quiet
        # 2-core VM at 50-67%), which medians of interleaved repeats absorb; the loop calibration
        # that follows re-measures the sizes the planner uses
        log(f"note: the latency curve's repeats spread widely ({spread}) with no other process running: "
            "this VM's own jitter; cached with their medians")
    if is_rank0(tp):
        _write_json(path, prof)
    return prof, path, False
