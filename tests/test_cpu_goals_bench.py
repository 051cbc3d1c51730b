"""bench/cpu_goals.py: each kernel path is held to its own goals of issue 27 (AVX2, AMX), on unrounded figures,
other paths only to greedy identity; the exit status says whether every goal checked holds."""

import json

import pytest
from bench_scripts import load_bench


@pytest.fixture(scope="module")
def goals():
    return load_bench("cpu_goals")


def _fwd(bf1, bf32, fp1):
    return {"fp32": {"1": fp1, "16": 2 * fp1, "32": 3 * fp1}, "bf16-fused": {"1": bf1, "16": bf1 * 1.1, "32": bf32}}


def _row(temp, speedup, predicted, identical=None, top_p=1.0):
    return {"temperature": temp, "top_k": 0, "top_p": top_p, "speedup": speedup, "predicted_speedup": predicted,
            "identical": identical, "num_prompts": 3}


def _oks(goal_list):
    return {g["goal"]: g["ok"] for g in goal_list}


def test_forward_goals_per_path_on_unrounded_ratios(goals):
    amx = _oks(goals.forward_verdicts("amx", _fwd(bf1=30.0, bf32=39.0, fp1=50.0)))
    assert amx == {"the target's forward, medians": None, "bf16 T(1) <= 0.6x fp32 T(1)": True,
                   "bf16 T(32) <= 1.3x T(1)": True}
    # 0.6002x and 1.3003x print as 0.60x and 1.30x: both miss
    amx = _oks(goals.forward_verdicts("amx", _fwd(bf1=30.01, bf32=39.02, fp1=50.0)))
    assert amx["bf16 T(1) <= 0.6x fp32 T(1)"] is False and amx["bf16 T(32) <= 1.3x T(1)"] is False
    avx2 = _oks(goals.forward_verdicts("avx2", _fwd(bf1=37.0, bf32=100.0, fp1=50.0)))
    assert avx2["bf16 T(1) <= 0.75x fp32 T(1)"] is True
    assert avx2["bf16 T(32) / T(1) (no goal on this path)"] is None  # T(32) is an AMX goal only
    assert _oks(goals.forward_verdicts("avx2", _fwd(bf1=38.0, bf32=40.0, fp1=50.0)))["bf16 T(1) <= 0.75x fp32 T(1)"] \
        is False
    other = goals.forward_verdicts("avx512_bf16", _fwd(bf1=40.0, bf32=100.0, fp1=50.0))
    assert all(g["ok"] is None for g in other)


def test_demo_goals_on_amx_and_elsewhere(goals):
    rows = [_row(0.0, 1.65, 1.50, identical=3), _row(0.6, 1.31, 1.25), _row(0.6, 1.20, 1.30, top_p=0.9)]
    amx = _oks(goals.demo_verdicts("amx", rows))
    assert amx == {"greedy identical to AR (T = 0)": True, "speedup >= 1.5x (T = 0)": True,
                   "speedup >= 1.3x (T = 0.6)": True, "within 10% of its prediction (T = 0)": True,
                   "within 10% of its prediction (T = 0.6)": True,
                   "within 10% of its prediction (T = 0.6, top-p 0.9)": True}
    rows = [_row(0.0, 1.49, 1.35, identical=2), _row(0.6, 1.29, 1.10), _row(0.6, 1.20, 1.30, top_p=0.9)]
    amx = _oks(goals.demo_verdicts("amx", rows))
    assert amx["greedy identical to AR (T = 0)"] is False and amx["speedup >= 1.5x (T = 0)"] is False
    assert amx["speedup >= 1.3x (T = 0.6)"] is False
    assert amx["within 10% of its prediction (T = 0)"] is False  # +10.4%
    assert amx["within 10% of its prediction (T = 0.6)"] is False and amx[
        "within 10% of its prediction (T = 0.6, top-p 0.9)"] is True
    avx2 = goals.demo_verdicts("avx2", rows)
    assert [g["ok"] for g in avx2 if g["ok"] is not None] == [False]  # greedy identity only
    assert goals.demo_verdicts("avx2", [_row(0.0, 1.1, 1.3, identical=3)])[0]["ok"] is True


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_packed_linear_bf16" name="test_emulated_amx_is_the_hardware_bitwise[1]" time="0.1">
{first}</testcase>
<testcase classname="tests.test_packed_linear_bf16" name="test_emulated_amx_is_the_hardware_bitwise[5]" time="0.1">
{second}</testcase>
<testcase classname="tests.test_tree_attention" name="test_cpu_amx_scores_on_emulated_tiles" time="2.0" />
</testsuite></testsuites>"""


def test_the_hardware_tests_must_run_on_amx(goals, tmp_path):
    skip = '<skipped type="pytest.skip" message="needs an AMX-BF16 CPU">needs</skipped>'
    (tmp_path / "skipped.xml").write_text(JUNIT.format(first=skip, second=skip))
    outcomes = goals.junit_outcomes(tmp_path / "skipped.xml")
    assert outcomes == {"tests/test_packed_linear_bf16.py::test_emulated_amx_is_the_hardware_bitwise[1]": "skipped",
                        "tests/test_packed_linear_bf16.py::test_emulated_amx_is_the_hardware_bitwise[5]": "skipped",
                        "tests/test_tree_attention.py::test_cpu_amx_scores_on_emulated_tiles": "passed"}
    assert [g["ok"] for g in goals.tests_verdicts("amx", outcomes)] == [False]  # skipped on an AMX CPU: not done
    assert [g["ok"] for g in goals.tests_verdicts("avx512_bf16", outcomes)] == [None]
    (tmp_path / "failed.xml").write_text(JUNIT.format(first="", second='<failure message="x">x</failure>'))
    outcomes = goals.junit_outcomes(tmp_path / "failed.xml")
    assert outcomes["tests/test_packed_linear_bf16.py::test_emulated_amx_is_the_hardware_bitwise[5]"] == "failed"
    assert [g["ok"] for g in goals.tests_verdicts("amx", outcomes)] == [False]
    assert [g["ok"] for g in goals.tests_verdicts("avx512_bf16", outcomes)] == [False]  # a failure fails anywhere
    (tmp_path / "passed.xml").write_text(JUNIT.format(first="", second=""))
    assert [g["ok"] for g in goals.tests_verdicts("amx", goals.junit_outcomes(tmp_path / "passed.xml"))] == [True]


@pytest.mark.parametrize("identical, errors, rc", [(3, [], 0), (2, [], 1), (3, ["demo: rc 1, no result"], 2)])
def test_table_only_exit_status(goals, tmp_path, capsys, identical, errors, rc):
    res = {"isa": "avx2", "cap": "avx2", "cpu": "AMD EPYC (family 25 model 17)", "errors": errors, "tests": None,
           "forward": _fwd(bf1=30.0, bf32=90.0, fp1=50.0), "demo": [_row(0.0, 1.2, 1.1, identical=identical)]}
    (tmp_path / "goals.json").write_text(json.dumps({"result": res}))
    assert goals.main(["--table-only", "--out", str(tmp_path)]) == rc
    out = capsys.readouterr().out
    assert "AMD EPYC (family 25 model 17), capped to avx2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)" in out
    assert "| bf16 T(1) <= 0.75x fp32 T(1) | 0.60x | yes |" in out
    assert f"| greedy identical to AR (T = 0) | {identical}/3 | {'yes' if identical == 3 else '**no**'} |" in out


def test_emulated_tiles_are_refused(goals, tmp_path, monkeypatch, capsys):
    """Timing goals on software tiles would judge the emulation's speed: refused before any step runs."""
    monkeypatch.setenv("SEQUOIA_KERNELS_AMX", "emulate")
    assert goals.main(["--out", str(tmp_path)]) == 2
    assert "SEQUOIA_KERNELS_AMX=emulate" in capsys.readouterr().out and not (tmp_path / "goals.json").exists()
