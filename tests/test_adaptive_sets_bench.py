"""bench/adaptive_sets.py: the table of every prompt set's `demo --adaptive --hindsight` rows marks each
missed goal and counts the goals on the unrounded ratios (a 0.966 printed as "0.97x" is a miss)."""

import json
import math

import pytest
from bench_scripts import load_bench


def _load():
    return load_bench("adaptive_sets")


def _row(speedup, vs_static, vs_hindsight, adaptive, top_p=1.0, identical=None):
    return {"temperature": 0.6 if identical is None else 0.0, "top_k": 0, "top_p": top_p, "budget": 8, "depth": 3,
            "speedup": speedup, "adaptive_speedup": adaptive, "adaptive_vs_static": vs_static,
            "adaptive_vs_hindsight": vs_hindsight, "hindsight_budget": None if vs_hindsight is None else 4,
            "hindsight_depth": None if vs_hindsight is None else 2, "plan_changes": 1, "replan_ms": 0.08,
            "adaptive_tokens_per_step": 1.9, "tokens_per_step": 1.8, "identical": identical, "num_prompts": 8}


def test_the_table_marks_every_missed_goal_on_unrounded_ratios(tmp_path, capsys):
    bench = _load()
    sets = {"demo": [_row(1.40, 0.99, 1.02, 1.39, identical=8), _row(1.30, 0.966, 0.971, 1.26, top_p=0.9)],
            "multilingual": [_row(0.85, 1.14, None, 0.9699), _row(0.90, 1.10, 0.98, 0.975)]}
    for name, rows in sets.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "demo.json").write_text(json.dumps({"rows": rows}))
    assert bench.main(["--table-only", "--sets", "demo,multilingual", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines[1:]]  # after the header
    assert [c[0] for c in cells] == ["demo, T=0", "demo, T=0.6 top-p 0.9", "multilingual, T=0.6", "multilingual, T=0.6"]
    assert cells[0][3:] == ["1.39x", "1", "0.08", "0.99x", "4, 2", "1.02x", "1.90 / 1.80", "8/8"]
    assert cells[1][6] == "**0.97x**" and cells[1][8] == "0.97x"  # 0.966 misses, 0.971 meets, both print 0.97
    assert cells[2][3] == "**0.97x**" and cells[2][7:9] == ["-", "-"]  # static loses to AR: adaptive 0.9699 misses
    assert cells[3][3] == "0.97x" and cells[0][3] == "1.39x"  # >= AR due only where static loses to AR
    assert out.strip().splitlines()[-1] == ("adaptive >= 0.97x static: 3 of 4 rows; adaptive >= 0.97x hindsight: "
                                            "3 of 3 rows; adaptive >= 0.97x AR: 1 of 2 rows")


def test_a_set_without_its_results_is_an_error(tmp_path, capsys):
    bench = _load()
    assert bench.main(["--table-only", "--sets", "creative", "--out", str(tmp_path)]) == 1
    assert "creative: no" in capsys.readouterr().err


def _run(folder, rounds, rows, field=True):
    """A run's demo.json: its rounds in the ``rounds`` field (the title silent on them), or, as runs written
    before that field, only in the title."""
    (folder / "demo").mkdir(parents=True)
    title = "target / draft, cpu, 8 prompts x 64 new tokens"
    in_title = f" x {rounds} rounds" if rounds > 1 else ""
    doc = {"title": title, "rounds": rounds} if field else {"title": title + in_title}
    (folder / "demo" / "demo.json").write_text(json.dumps({**doc, "rows": rows}))


def test_pooled_ratios_weigh_each_run_by_its_paired_calls(tmp_path, capsys):
    bench = _load()
    _run(tmp_path / "a", 12, [_row(1.30, 0.966, 0.960, 1.26), _row(0.95, 1.10, None, 0.96, top_p=0.9)])
    _run(tmp_path / "b", 4, [_row(1.32, 1.020, 0.990, 1.30), _row(0.97, 1.05, 0.99, 0.99, top_p=0.9)], field=False)
    _run(tmp_path / "c", 1, [_row(1.28, 0.900, 0.900, 1.20), _row(0.99, 1.00, 1.00, 0.97, top_p=0.9)])
    assert bench.main(["--table-only", "--sets", "demo", "--out", str(tmp_path / "a"),
                       "--pool", f"{tmp_path / 'b'},{tmp_path / 'c'}"]) == 0
    out = capsys.readouterr().out
    pooled = out[out.index("| set, setting | runs, calls"):]
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in pooled.splitlines()[2:4]]
    w = (12, 4, 1)  # x 8 prompts each: the weights' common factor
    vs_static = math.exp(sum(k * math.log(x) for k, x in zip(w, (0.966, 1.020, 0.900))) / sum(w))
    vs_hs = math.exp(sum(k * math.log(x) for k, x in zip(w, (0.960, 0.990, 0.900))) / sum(w))
    assert 0.97 < vs_static < 0.975 and vs_hs < 0.965  # the first meets pooled although two of three runs miss
    assert cells[0][:6] == ["demo, T=0.6", "3, 136", "8, 3 / 8, 3 / 8, 3", "0.966 / 1.020 / 0.900",
                            f"{vs_static:.2f}x", "4, 2 / 4, 2 / 4, 2"]
    assert cells[0][7] == f"**{vs_hs:.2f}x**"
    # the hindsight ratio pools the runs that have one; static loses to AR pooled, so adaptive / AR is due
    ar = math.exp(sum(k * math.log(x) for k, x in zip(w, (0.96, 0.99, 0.97))) / sum(w))
    assert cells[1][5:8] == ["- / 4, 2 / 4, 2", "- / 0.990 / 1.000", f"{math.exp((4 * math.log(0.99)) / 5):.2f}x"]
    assert cells[1][9] == f"**{ar:.2f}x**" and ar < 0.97
    assert out.strip().splitlines()[-1] == ("pooled: adaptive >= 0.97x static: 2 of 2 rows; adaptive >= 0.97x "
                                            "hindsight: 1 of 2 rows; adaptive >= 0.97x AR: 0 of 1 rows")


def test_pooling_needs_every_set_and_setting_in_every_run(tmp_path, capsys):
    bench = _load()
    _run(tmp_path / "a", 4, [_row(1.30, 0.99, 0.99, 1.30), _row(1.3, 1.0, 1.0, 1.3, top_p=0.9)])
    _run(tmp_path / "b", 4, [_row(1.30, 0.99, 0.99, 1.30)])
    with pytest.raises(ValueError, match="in 1 of the 2 runs"):
        bench.main(["--table-only", "--sets", "demo", "--out", str(tmp_path / "a"), "--pool", str(tmp_path / "b")])
    assert bench.main(["--table-only", "--sets", "demo", "--out", str(tmp_path / "a"),
                       "--pool", str(tmp_path / "none")]) == 1
    assert "demo: no" in capsys.readouterr().err
