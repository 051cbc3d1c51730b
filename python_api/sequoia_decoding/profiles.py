"""This machine's latency profiles of a model pair and their calibration on the decoding loop:
measured once (``sequoia-kernels demo``, ``bench/e2e.py``), cached under
``$SEQUOIA_CACHE/profiles`` (default ``~/.cache/sequoia-kernels``), and the one planning path
every entry point uses (:func:`plan_setting`, :func:`calibrated_plan`).

A profile (``tools.profile_latency``, measured and cached by ``profiling.cached_profile``) holds
the target's forward time T(n) by tree size and the
draft's step; the demo then times the loop itself (``demo.calibrate_on_loop``) and stores that
calibration in the same file (:func:`store_calibration`): T(n) and the draft rescaled to the
loop's own forwards, and per sampling setting the loop's time outside the forwards by node
count. ``SequoiaDecoding``, ``sequoia-kernels generate`` and ``bench/e2e.py`` plan from it with
the demo's planner call, so they choose the demo's tree.

A profile is keyed by what it depends on (:func:`machine_key`: host, device, threads, dtype, the
two models, torch, and ``PROFILE_VERSION``, bumped by hand whenever a change to the loop changes
what a step costs).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .loading import acceptance_file, is_filtered, nearest_acceptance_file, parse_acceptance
from .planner import HardwarePlan, choose_plan, validate_latency
from .offload import offload_of
from .tensor_parallel import tensor_parallel_of

#: bump when the decoding loop's cost per step changes (a cached profile then no longer applies)
PROFILE_VERSION = "2026-12-05g"  # b: packed_linears only where they pay; c: bf16 on packed_linear; d: own CPU attention;
# e: AMX row pairs, lane-parallel CPU attention; f: fused bf16 RMSNorm / SiLU-and-multiply; g: + rotary
# h: a feature head's readout on packed_linear; i: sizes <= 32 timed 3 x the repeats; j: fused projections,
# RoPE tables, a head's logits over its own tokens; k: AVX-512 CPU attention, no q/k/gate/up copies in bf16;
# l: RMSNorm 4 rows at a time; m: AMX tile scores in the bf16 CPU attention; n: bf16 row ops and AMX
# output stores on 16 lanes, the AMX pair kernel's load order; o: greedy sampling_probs' vector argmax (the
# loop's step overhead, calibrated with the profile); p: top-p's nucleus search on the few tokens near the maximum;
# 2026-12-04 a: lean decoder layers (a switched layer's forward on the ops directly); b: fp32 on torch's linears too;
# c: bf16 residual adds in packed_linear_bf16's output store; d: SiLU by lookup (Intel AVX-512), AMX scores
# four key blocks in flight, no v / prefix_len copies per layer; e: the rotary in the qkv product's store;
# f: SiLU-and-multiply in the gate-up product's store; g: AVX-512F paths for bf16 (CPUs without AVX-512-BF16) and
# fp32 linears, fp32 linears packed on Intel CPUs without AMX; 2026-12-05 a: trees of LAZY_MIN_NODES+ nodes
# verified with the LM head at the rows read (``lazy_logits``; the profile times a target's head over 6 rows there);
# b: the disk stream's reads up to 7 layers ahead; c: two reads in flight (STREAM_READERS); d: the AVX2 packed
# linears prefetch their weights (2+ rows); e: the loop and the profile in inference mode; f: the profile packs
# each size's tree mask once (as the loop), attention launches replayed per packed mask; g: the loop calibrated
# at 16 nodes too (both sides of LAZY_MIN_NODES)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def profiles_dir() -> Path:
    """Where profiles are cached (read at call time: tests and users may point SEQUOIA_CACHE elsewhere)."""
    from .modeling.smollm2 import CACHE_ROOT

    return Path(CACHE_ROOT) / "profiles"


def cpu_name() -> str:
    """This machine's CPU model (as figures are labelled)."""
    from sequoia_kernels._backend import cpuinfo

    return cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_kernels() -> str:
    """The CPU kernel paths a forward takes here (torch's CPU capability, the bf16 linear's
    instruction set, whether fp32 linears run packed): ``ATEN_CPU_CAPABILITY`` changes them, and
    with them the timings a profile holds."""
    from sequoia_kernels.ops.packed_linear import bf16_isa, packed_linear_pays

    fp32 = "packed" if packed_linear_pays(torch.float32) else "torch"
    return f"{torch.backends.cpu.get_cpu_capability()}/bf16-{bf16_isa()}/fp32-{fp32}"


def _model_fingerprint(model) -> str:
    """Config and parameter count: enough to tell models apart, cheap to compute. The folder a
    model was loaded from (``_name_or_path``) is left out: the same draft loaded by another path
    (the demo's absolute one, a user's relative one) must find the same profile."""
    cfg = getattr(model, "config", None)
    if hasattr(cfg, "to_json_string"):
        d = json.loads(cfg.to_json_string(use_diff=False))
        d.pop("_name_or_path", None)
        text = json.dumps(d, sort_keys=True)
    else:
        text = repr(cfg)
    n = sum(p.numel() for p in model.parameters())
    return hashlib.sha1(f"{text}|{n}|{type(model).__name__}".encode()).hexdigest()[:16]


def machine_key(target, draft, device: torch.device, dtype: torch.dtype) -> dict:
    """What a latency profile depends on."""
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    tp = tensor_parallel_of(target)
    return {"host": platform.node(), "device": dev, "device_type": device.type, "threads": torch.get_num_threads(),
            "loop": PROFILE_VERSION,
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
            "target": _model_fingerprint(target), "draft": _model_fingerprint(draft),
            **({"cpu_kernels": cpu_kernels()} if device.type == "cpu" else {}),
            **({"tensor_parallel": tp.size} if tp is not None else {}),  # a TP target: its world size too
            **({"offload": off} if (off := offload_of(target)) else {})}  # an offloaded one: where its layers are


def profile_path(cache_dir: Path, key: dict, sizes: Sequence[int] = PROFILE_SIZES, prefix: int = 256) -> Path:
    """Where the profile of ``key`` (``machine_key``) is cached."""
    digest = hashlib.sha1(json.dumps({**key, "sizes": list(sizes), "prefix": prefix}, sort_keys=True)
                          .encode()).hexdigest()[:16]
    return Path(cache_dir) / f"profile-{digest}.json"


def find_cached_profile(target, draft, device: torch.device, dtype: torch.dtype, prefix: int | None = None
                        ) -> dict | None:
    """This machine's cached profile of the pair (what ``sequoia-kernels demo`` measured), or
    None; never measures. The demo profiles at its prompts' typical context, so any cached
    profile of this machine key qualifies: the one at ``prefix`` if there is one, else the one
    whose prefix is nearest to it (to 256 when None)."""
    key = machine_key(target, draft, torch.device(device), dtype)
    folder = profiles_dir()
    exact = profile_path(folder, key, prefix=prefix if prefix is not None else 256)
    if exact.is_file():
        return json.loads(exact.read_text())
    found = []
    for path in folder.glob("profile-*.json") if folder.is_dir() else ():
        try:
            prof = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if prof.get("machine") == key:
            found.append((abs(int(prof.get("prefix", 256)) - (prefix if prefix is not None else 256)), path.name, prof))
    return min(found, key=lambda f: f[:2])[2] if found else None


def _write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def typical_context(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> int:
    """The context length the demo's steps see on average (median prompt + half the new tokens),
    rounded up to a multiple of 32 in [32, 1024]: the prefix the latency profile and the step
    overhead are measured at, so that T(n) is the forward the loop will actually run (a 256-token
    profile overstated this machine's T(1) by 7% for 40-token prompts and 64 new tokens)."""
    lens = sorted(len(p) for p in prompts) or [0]
    ctx = lens[len(lens) // 2] + max_new_tokens // 2
    return int(min(max(-(-ctx // 32) * 32, 32), 1024))


# ----------------------------------------------------------------------------- acceptance


def acceptance_dirs(draft) -> list[Path]:
    """Where a draft's acceptance vectors are looked up, in order: the draft's own folder
    (shipped ``acceptance-T<t>.json`` files), then the vectors the demo measured for it
    (``$SEQUOIA_CACHE/acceptance/<draft fingerprint>``)."""
    from .modeling.smollm2 import CACHE_ROOT

    folder = getattr(getattr(draft, "config", None), "_name_or_path", None) or ""
    dirs = [Path(folder)] if folder and Path(folder).is_dir() else []
    measured = Path(CACHE_ROOT) / "acceptance" / _model_fingerprint(draft)
    return dirs + ([measured] if measured.is_dir() else [])


def find_acceptance(draft, temperature: float, top_k: int = 0, top_p: float = 1.0, *, nearest: bool = True
                    ) -> tuple[tuple[float, ...] | None, bool, Path | None]:
    """THE acceptance-vector lookup (``SequoiaDecoding``, the demo, ``bench/e2e.py``):
    (vector, whether it was measured with these filters, its file) from :func:`acceptance_dirs`,
    in their order: the file measured with exactly these filters when the setting is filtered,
    else the unfiltered file of this temperature (``nearest``: of the nearest temperature a
    folder has). (None, False, None) when there is none (a filtered setting with ``nearest=False``
    and no file of its own: the caller chooses the fallback)."""
    dirs = acceptance_dirs(draft)
    if is_filtered(temperature, top_k, top_p):
        for d in dirs:
            f = acceptance_file(d, temperature, top_k, top_p)
            if f.is_file():
                return parse_acceptance(str(f)), True, f
        if not nearest:
            return None, False, None
    for d in dirs:
        f = nearest_acceptance_file(d, temperature) if nearest else acceptance_file(d, temperature)
        if f is not None and f.is_file():
            return parse_acceptance(str(f)), False, f
    return None, False, None


# ------------------------------------------------------------------------ calibration, planning

Setting = tuple  # (temperature, top_k, top_p)


def _kind(setting: Setting) -> str:
    return "greedy" if setting[0] == 0 else ("filtered" if is_filtered(*setting) else "sampled")


def with_level_cost(latency: dict, level_s: float | None) -> dict:
    """``latency`` (a profile's ``draft_step_s``, ``target_latency_s``, optional ``draft_latency_s``)
    with ``level_s`` added to every draft forward: what one setting's planner charges a draft
    level, its forward and the drafter's own time around it (sampling the level's children and
    their q: ``tools.measure_step_overhead``'s ``level_s``), so that the planner, the re-planner
    and the compiled search charge a deeper tree its levels' sampling with no change of theirs.
    The live costs correct whole steps against this sum: they do not learn it back out."""
    if not level_s:
        return latency
    out = {**latency, "draft_step_s": float(latency["draft_step_s"]) + level_s}
    if latency.get("draft_latency_s"):
        out["draft_latency_s"] = {k: float(v) + level_s for k, v in latency["draft_latency_s"].items()}
    return out


def store_calibration(path: Path, profile: dict, calibrated: dict,
                      overhead: Mapping[Setting, Mapping[int, float]],
                      level_s: Mapping[Setting, float] | None = None) -> dict:
    """Write the loop calibration (``demo.calibrate_on_loop``: the rescaled forward times and,
    per setting, the time outside the forwards by node count, less the draft levels' own time,
    and that time per draft level, ``level_s``) into the cached profile at ``path``; settings
    calibrated earlier and not now are kept. Returns the profile as written."""
    cal = dict(profile.get("calibration") or {})
    cal["latency"] = {k: calibrated[k] for k in ("target_latency_s", "draft_step_s", "draft_latency_s")
                      if calibrated.get(k) is not None}
    rows = {(r["temperature"], r["top_k"], r["top_p"]): r for r in cal.get("overhead", [])}
    for (t, k, p), oh in overhead.items():
        rows[(float(t), int(k), float(p))] = {"temperature": float(t), "top_k": int(k), "top_p": float(p),
                                             "overhead_s": {str(n): float(s) for n, s in oh.items()},
                                             "level_s": float((level_s or {}).get((t, k, p), 0.0))}
    cal["overhead"] = [rows[key] for key in sorted(rows)]
    out = {**profile, "calibration": cal}
    _write_json(Path(path), out)
    return out


def calibration_for(profile: dict | None, setting: Setting) -> tuple[dict | None, dict[int, float] | None, str]:
    """(calibrated latency, overhead by node count, what was used) for ``setting`` from a
    profile's stored calibration: the overhead of the calibrated setting of the same kind
    (greedy / sampled / sampled with top-k or top-p) nearest to it, its time per draft level
    charged with the draft's forwards (:func:`with_level_cost`; a calibration stored before it
    was measured has none: its overhead holds it). (None, None, why) when there is none."""
    if profile is None:
        return None, None, "no latency profile of this pair is cached on this machine"
    cal = profile.get("calibration")
    if not cal or not cal.get("overhead"):
        return None, None, "the cached profile has no loop calibration"
    same = [r for r in cal["overhead"] if _kind((r["temperature"], r["top_k"], r["top_p"])) == _kind(setting)]
    if not same:
        return None, None, f"the cached profile's calibration has no {_kind(setting)} setting"
    t, k, p = setting
    r = min(same, key=lambda r: (abs(r["temperature"] - t), abs(r["top_p"] - p), abs(r["top_k"] - k)))
    used = f"T={r['temperature']:g} top-k {r['top_k']} top-p {r['top_p']:g}"
    return (with_level_cost(cal["latency"], r.get("level_s")), {int(n): float(s) for n, s in r["overhead_s"].items()},
            used)


def plan_setting(acceptance: Sequence[float], latency: dict, overhead_s: Mapping[int, float] | None, *,
                 max_depth: int = 16) -> HardwarePlan:
    """THE planner call of every entry point: ``choose_plan`` on ``latency`` (a profile's fields
    ``draft_step_s``, ``target_latency_s``, optional ``draft_latency_s``, calibrated on the loop)
    with the loop's time outside the forwards ``overhead_s`` by node count."""
    step, table = validate_latency(latency["draft_step_s"], latency["target_latency_s"])
    return choose_plan(acceptance, step, table, max_depth=max_depth, step_overhead_s=overhead_s,
                       draft_latency_s=latency.get("draft_latency_s"))


def calibrated_plan(acceptance: Sequence[float], profile: dict | None, setting: Setting, *,
                    max_depth: int = 16) -> tuple[HardwarePlan | None, str]:
    """The plan the demo would choose for ``setting`` from a cached, calibrated profile, and a
    note saying which calibration it used; (None, why) when the profile has none for this kind
    of setting (the caller then decodes plainly and says so)."""
    latency, overhead, note = calibration_for(profile, setting)
    if latency is None:
        return None, note
    return plan_setting(acceptance, latency, overhead, max_depth=max_depth), note
