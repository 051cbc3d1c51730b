"""`sequoia-kernels demo --adaptive --hindsight` on every prompt set, then one table with the goals marked.

    python bench/adaptive_sets.py                      # four sets, one run each (~20 minutes on 2 cores)
    python bench/adaptive_sets.py --rounds 2 --sets demo,creative
    python bench/adaptive_sets.py --table-only         # the table again from the last runs' demo.json files
    python bench/adaptive_sets.py --table-only --pool run1,run2   # and the ratios pooled over those runs too

Each set runs as its own `demo` process (the demo's own setup, calibration and interleaved turns; one run
at a time: never beside a build, a test run or another benchmark), its `demo.json` kept under
`--out/<set>/`. The table has a row per set and setting: the static plan against AR, the adaptive plan
against AR, the static plan and the hindsight plan (the static plan solved from the set's own measured
vector), its plan changes and re-plan cost. The issue's goals are marked in bold where a row misses them:
adaptive >= 0.97x the static and the hindsight plan, and >= 0.97x AR where the static plan loses to AR.

`--pool` adds a table of each ratio pooled over several runs (`--out` and the folders named, each laid out as
`--out`): the geometric mean of the runs' ratios weighted by their paired calls (prompts x rounds), the goals
marked on the pooled ratios. Two equal generators read 3-6% apart in one 8-prompt x 4-round run on a 2-core
VM (docs/adaptive.md), the size of the goals' margin: a pooled ratio is the one that can resolve it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETS = {"demo": None, "repetitive": "bench/prompts/repetitive.txt", "creative": "bench/prompts/creative.txt",
        "multilingual": "bench/prompts/multilingual.txt"}
GOAL = 0.97


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default=",".join(SETS), help=f"a comma-separated subset of {', '.join(SETS)}")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default="adaptive-sets", help="a folder per set holds its demo.json and plots")
    ap.add_argument("--table-only", action="store_true", help="print the table from the existing demo.json files")
    ap.add_argument("--pool", default="", help="comma-separated folders of earlier runs (laid out as --out): "
                    "a second table pools each ratio over them and --out's")
    args = ap.parse_args(argv)
    args.sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        ap.error(f"unknown set(s) {', '.join(unknown)}; known: {', '.join(SETS)}")
    return args


def run_set(name: str, args: argparse.Namespace) -> int:
    """One `demo --adaptive --hindsight` process for the set ``name``; its return code."""
    cmd = [sys.executable, "-m", "sequoia_decoding.cli", "demo", "--adaptive", "--hindsight", "--num-prompts",
           str(args.num_prompts), "--rounds", str(args.rounds), "--out", str(Path(args.out) / name)]
    if SETS[name] is not None:
        cmd += ["--prompts", str(ROOT / SETS[name])]
    print(f"== {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    path = os.pathsep.join(p for p in (str(ROOT / "python_api"), os.environ.get("PYTHONPATH")) if p)
    return subprocess.call(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path})


def _setting(name: str, row: dict) -> str:
    return f"{name}, T={row['temperature']:g}" + (f" top-p {row['top_p']:g}" if row["top_p"] < 1 else "") + \
        (f" top-k {row['top_k']}" if row["top_k"] else "")


def _ratio(x: float, goal: bool) -> str:
    return f"{x:.2f}x" if goal else f"**{x:.2f}x**"


def _judge(met: dict[str, list[int]], vs_static: float, vs_hs: float | None, static_ar: float,
           adaptive_ar: float) -> dict[str, bool]:
    """Which goals a row meets (adaptive >= GOAL x the static plan, the hindsight plan where measured, and
    AR where the static plan loses to AR), each due one counted in ``met`` ({goal: [met, due]})."""
    ar_due = static_ar < 1.0  # where the static plan loses to AR, adaptive must not
    ok = {"static": vs_static >= GOAL, "hindsight": vs_hs is None or vs_hs >= GOAL,
          "AR": not ar_due or adaptive_ar >= GOAL}
    for goal, due in (("static", True), ("hindsight", vs_hs is not None), ("AR", ar_due)):
        met[goal][0] += due and ok[goal]
        met[goal][1] += due
    return ok


def _met_line(met: dict[str, list[int]]) -> str:
    return "; ".join(f"adaptive >= {GOAL}x {goal}: {k} of {n} rows" for goal, (k, n) in met.items())


def goals_table(results: dict[str, list[dict]]) -> str:
    """The markdown table of ``results`` ({set: demo.json rows}) with every missed goal in bold, and a
    line counting the rows that meet each goal."""
    lines = ["| set, setting | static n, d | static / AR | adaptive / AR | changes | re-plan ms | adaptive / static "
             "| hindsight n, d | adaptive / hindsight | tokens a step, adaptive / static | greedy identical |",
             "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    met = {"static": [0, 0], "hindsight": [0, 0], "AR": [0, 0]}
    for name, rows in results.items():
        for r in rows:
            setting = _setting(name, r)
            vs_static, vs_hs = r["adaptive_vs_static"], r.get("adaptive_vs_hindsight")
            ok = _judge(met, vs_static, vs_hs, r["speedup"], r["adaptive_speedup"])
            hs = "-" if vs_hs is None else f"{r['hindsight_budget']}, {r['hindsight_depth']}"
            same = "-" if r["identical"] is None else f"{r['identical']}/{r['num_prompts']}"
            lines.append(f"| {setting} | {r['budget']}, {r['depth']} | {r['speedup']:.2f}x | "
                         f"{_ratio(r['adaptive_speedup'], ok['AR'])} | {r['plan_changes']} | {r['replan_ms']:.2f} | "
                         f"{_ratio(vs_static, ok['static'])} | {hs} | "
                         f"{'-' if vs_hs is None else _ratio(vs_hs, ok['hindsight'])} | "
                         f"{r['adaptive_tokens_per_step']:.2f} / {r['tokens_per_step']:.2f} | {same} |")
    lines.append("")
    lines.append(_met_line(met))
    return "\n".join(lines)


def _key(row: dict) -> tuple:
    return row["temperature"], row["top_k"], row["top_p"]


def _weight(doc: dict, row: dict) -> int:
    """A run's paired calls behind ``row``: its prompts x its rounds (runs before demo.json held a
    ``rounds`` field: the rounds its title names, 1 if none)."""
    rounds = doc.get("rounds")
    if rounds is None:
        m = re.search(r" x (\d+) rounds", doc.get("title", ""))
        rounds = int(m.group(1)) if m else 1
    return row["num_prompts"] * rounds


def _pooled(xs: list[tuple[float, int]]) -> float:
    """The geometric mean of ratios ``[(ratio, weight)]`` weighted by their paired calls."""
    return math.exp(sum(w * math.log(x) for x, w in xs) / sum(w for _, w in xs))


def _each(rows: list[dict], key: str, depth: str | None = None) -> str:
    """Each run's ``key`` (a ratio, or with ``depth`` a tree "n, d"), "-" where a run has none."""
    return " / ".join("-" if r.get(key) is None else f"{r[key]}, {r[depth]}" if depth else f"{r[key]:.3f}"
                      for r in rows)


def pooled_table(runs: list[dict[str, dict]]) -> str:
    """The markdown table of each set and setting's ratios pooled over ``runs`` ([{set: demo.json}], every
    run holding every set and setting), each run's own ratio listed, every missed goal on a pooled ratio in
    bold, and a line counting the rows that meet each goal."""
    lines = ["| set, setting | runs, calls | static n, d | adaptive / static | pooled | hindsight n, d "
             "| adaptive / hindsight | pooled | static / AR, pooled | adaptive / AR, pooled |",
             "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    met = {"static": [0, 0], "hindsight": [0, 0], "AR": [0, 0]}
    for name in runs[0]:
        for first in runs[0][name]["rows"]:
            rows = [(r, _weight(run[name], r)) for run in runs for r in run[name]["rows"] if _key(r) == _key(first)]
            if len(rows) != len(runs):
                raise ValueError(f"{_setting(name, first)}: in {len(rows)} of the {len(runs)} runs")
            vs_static = _pooled([(r["adaptive_vs_static"], w) for r, w in rows])
            hs = [(r["adaptive_vs_hindsight"], w) for r, w in rows if r.get("adaptive_vs_hindsight") is not None]
            vs_hs = _pooled(hs) if hs else None
            static_ar, adaptive_ar = (_pooled([(r[k], w) for r, w in rows]) for k in ("speedup", "adaptive_speedup"))
            ok = _judge(met, vs_static, vs_hs, static_ar, adaptive_ar)
            runs_rows = [r for r, _ in rows]
            lines.append(f"| {_setting(name, first)} | {len(rows)}, {sum(w for _, w in rows)} | "
                         f"{_each(runs_rows, 'budget', 'depth')} | {_each(runs_rows, 'adaptive_vs_static')} | "
                         f"{_ratio(vs_static, ok['static'])} | "
                         f"{_each(runs_rows, 'hindsight_budget', 'hindsight_depth')} | "
                         f"{_each(runs_rows, 'adaptive_vs_hindsight')} | "
                         f"{'-' if vs_hs is None else _ratio(vs_hs, ok['hindsight'])} | {static_ar:.2f}x | "
                         f"{_ratio(adaptive_ar, ok['AR'])} |")
    lines.append("")
    lines.append("pooled: " + _met_line(met))
    return "\n".join(lines)


def _load(folder: str, sets: list[str]) -> tuple[dict[str, dict], bool]:
    """{set: demo.json} of the runs under ``folder``, and whether every set was there."""
    docs, ok = {}, True
    for name in sets:
        path = Path(folder) / name / "demo.json"
        if path.exists():
            docs[name] = json.loads(path.read_text())
        else:
            print(f"{name}: no {path}", file=sys.stderr)
            ok = False
    return docs, ok


def main(argv=None) -> int:
    args = parse(argv)
    rc = 0
    if not args.table_only:
        for name in args.sets:
            rc = run_set(name, args) or rc
    docs, ok = _load(args.out, args.sets)
    print(goals_table({name: doc["rows"] for name, doc in docs.items()}))
    rc = rc or (0 if ok else 1)
    if args.pool:
        runs = [_load(folder, args.sets) for folder in args.pool.split(",") if folder.strip()]
        if not ok or not all(found for _, found in runs):
            return rc or 1
        print()
        print(pooled_table([docs] + [d for d, _ in runs]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
