"""Print a ratio table from one pytest-benchmark JSON file: every benchmark of a group against
the group's baseline (the first name in BASELINES found in the group)."""

import json
import sys

BASELINES = ("test_per_layer_loop", "test_sequoia_python_loop", "test_sdpa_dense_mask", "test_reference_op")


def main(path: str) -> None:
    data = json.load(open(path))
    groups: dict[str, list] = {}
    for b in data["benchmarks"]:
        groups.setdefault(b["group"] or "", []).append(b)
    for group, items in groups.items():
        base = next((b for name in BASELINES for b in items if b["name"].split("[")[0] == name), None)
        print(f"\n{group}")
        print(f"{'benchmark':<48} {'median ms':>10} {'speedup vs ' + (base['name'] if base else '-'):>40}")
        for b in items:
            med = b["stats"]["median"] * 1e3
            ratio = f"{base['stats']['median'] / b['stats']['median']:.1f}x" if base else "-"
            print(f"{b['name']:<48} {med:>10.3f} {ratio:>40}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "build/bench.json")
