"""bench/e2e.py: every row reports the planner's prediction beside the measurement (a tiny
random pair; timings are not checked, only that the table holds what it promises)."""

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", os.path.join(REPO, "bench", "e2e.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_e2e"] = mod  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def test_e2e_table_has_a_prediction_for_every_row(capsys):
    e2e = _load_e2e()
    e2e.main(["--tiny", "--max-new-tokens", "6", "--num-prompts", "1", "--budgets", "8", "--temperatures", "0,0.8",
              "--no-hf", "--max-depth", "4", "--top-p", "0.9"])
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert head == ["method", "T", "tokens/step", "planner's E", "ms/step: draft + target + rest", "predicted ms/step",
                    "tokens/s", "speedup vs AR", "predicted", "measured / predicted"]
    rows = [dict(zip(head, (c.strip() for c in ln.split("|")[1:-1]))) for ln in lines[1:]]
    names = [r["method"] for r in rows]
    for temp in ("0", "0.8"):
        mine = [r["method"] for r in rows if r["T"] == temp]
        assert mine[0] == "autoregressive" and any(m.startswith("chain n=8") for m in mine)
        assert any(m.startswith("SpecInfer") for m in mine) and any(m.startswith("Sequoia n=8") for m in mine)
    assert len(names) >= 8
    for r in rows:
        measured, predicted = float(r["speedup vs AR"].rstrip("x")), float(r["predicted"].rstrip("x"))
        assert measured > 0 and predicted > 0
        # the ratio is of the unrounded speedups; the cells are rounded to 0.01
        ratio = float(r["measured / predicted"])
        assert abs(ratio - measured / predicted) <= ratio * (0.005 / measured + 0.005 / predicted) + 1e-3
        # "d + t + r = total" on both sides; the prediction's phases add up
        d, t, rest = (float(x) for x in r["predicted ms/step"].split("=")[0].split("+"))
        assert float(r["predicted ms/step"].split("=")[1]) == pytest.approx(d + t + rest, abs=0.16)  # each rounded to 0.1
        assert float(r["ms/step: draft + target + rest"].split("=")[1]) > 0
        if r["method"] == "autoregressive":
            assert r["predicted"] == "1.00x" and d == 0.0 and float(r["tokens/step"]) == 1.0
        elif float(r["planner's E"]) > 1.0:  # a tree (a plan of 1 node, E = 1, runs no draft)
            assert d > 0
    assert "calibrated on the loop" in err and "the planner's choice" in err
    assert "top-p 0.9" in out  # the filter is named in the title
