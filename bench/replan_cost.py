"""One re-plan's cost (``adaptive.Replanner._solve`` around a plan, as ``next_plan`` calls it) on a
cached, loop-calibrated profile of this machine, with the shipped head's acceptance vectors.

    python bench/replan_cost.py                      # the newest cached offloaded profile (T(1024) timed)
    python bench/replan_cost.py --profile ~/.cache/sequoia-kernels/profiles/profile-XXXX.json --trees 8:3,16:4
    ATEN_CPU_CAPABILITY=avx2 python bench/replan_cost.py   # the AVX2 path of the native DP (or "default")

Prints, per temperature and plan, the median and least milliseconds of 7 re-plans (warm: the
loop's re-plans follow a forward that evicted the caches, so they cost more; ``demo --adaptive``
reports those as ``replan_ms``) and the plan each returned.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import time

from real_pair import ROOT  # (puts the package on the path)


def main() -> int:
    from sequoia_decoding.adaptive import AdaptiveConfig, Replanner
    from sequoia_decoding.loading import acceptance_file, parse_acceptance
    from sequoia_decoding.planner import plan_tree
    from sequoia_decoding.profiles import calibration_for, cpu_name

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="a cached profile with a loop calibration (default: the newest offloaded one)")
    ap.add_argument("--draft", default=os.path.join(ROOT, "models", "draft", "smollm2-eagle"))
    ap.add_argument("--trees", default="64:5,128:5,256:5", help="n:d,... the plans re-planned around")
    ap.add_argument("--max-depth", type=int, default=20)
    args = ap.parse_args()
    pattern = os.path.expanduser("~/.cache/sequoia-kernels/profiles/profile-*.json")
    cached = {p: json.load(open(p)) for p in ([args.profile] if args.profile else glob.glob(pattern))}
    found = [p for p, prof in cached.items() if args.profile or ("1024" in prof.get("target_latency_s", {})
                                                                 and prof.get("calibration"))]
    if not found:
        raise SystemExit("no calibrated offloaded profile cached: run "
                         "`make demo DEMO_ARGS=\"--offload stream --max-new-tokens 32\"` once")
    path = max(found, key=os.path.getmtime)
    prof = cached[path]
    print(f"{cpu_name()}; {path}")
    for temp in (0.0, 0.6):
        lat, oh, used = calibration_for(prof, (temp, 0, 1.0))
        if lat is None:
            raise SystemExit(f"{path}: {used}")
        acc = parse_acceptance(str(acceptance_file(args.draft, temp)))
        rp = Replanner(acc, lat, oh, 1, AdaptiveConfig(max_depth=args.max_depth))
        for n, d in (tuple(int(x) for x in t.split(":")) for t in args.trees.split(",")):
            around, ts = plan_tree(acc, n, d), []
            for _ in range(7):
                t0 = time.perf_counter()
                plan = rp._solve(acc, around)
                ts.append(time.perf_counter() - t0)
            print(f"T = {temp:g}, around ({n}, {d}): {1e3 * statistics.median(ts):.2f} ms "
                  f"(least {1e3 * min(ts):.2f}) -> ({plan.num_nodes}, {plan.num_levels})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
