"""Tests of the ``sequoia-kernels`` command line (sequoia_decoding.cli)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sequoia_decoding.cli import main
from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, choose_plan, plan_tree

REPO = Path(__file__).resolve().parents[1]
PY_API = REPO / "python_api"

LATENCY = {
    "draft_step_s": 0.004,
    "target_latency_s": {"1": 0.09, "2": 0.09, "4": 0.091, "8": 0.092, "16": 0.094, "32": 0.1, "64": 0.11},
    "device": "synthetic",  # extra fields are ignored
}


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json(capsys):
    code, out, err = _run(capsys, "plan", "--acceptance", "0.63,0.11,0.06", "--budget", "128", "--max-depth", "10", "--json")
    assert code == 0 and err == ""
    assert len(out.strip().splitlines()) == 1
    d = json.loads(out)
    for key in ("expected_tokens", "parents", "depth", "rank", "levels", "num_nodes"):
        assert key in d
    ref = plan_tree([0.63, 0.11, 0.06], 128, 10)
    assert d["expected_tokens"] == ref.expected_tokens
    assert d["parents"] == list(ref.parents) and d["depth"] == list(ref.depth)
    assert "hardware" not in d


def test_plan_default_acceptance_summary(capsys):
    code, out, err = _run(capsys, "plan", "--budget", "20", "--max-depth", "5")
    assert code == 0 and err == ""
    ref = plan_tree(DEFAULT_ACCEPTANCE, 20, 5)
    assert f"expected tokens per step: {ref.expected_tokens:.4f}" in out
    assert "#0 root" in out and "depth 0:" in out


def test_plan_acceptance_from_json_file(tmp_path, capsys):
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"acceptance": [0.5, 0.2, 0.1], "note": "x"}))
    code, out, _ = _run(capsys, "plan", "--acceptance", str(f), "--budget", "12", "--json")
    assert code == 0
    assert json.loads(out)["expected_tokens"] == plan_tree([0.5, 0.2, 0.1], 12, 8).expected_tokens
    # a saved plan works as an acceptance file too
    saved = tmp_path / "plan.json"
    plan_tree([0.5, 0.2, 0.1], 6, 3).to_json(saved)
    assert _run(capsys, "plan", "--acceptance", str(saved), "--json")[0] == 0


def test_plan_latency(tmp_path, capsys):
    lat = tmp_path / "lat.json"
    lat.write_text(json.dumps(LATENCY))
    code, out, err = _run(capsys, "plan", "--budget", "16", "--max-depth", "8", "--latency", str(lat), "--json")
    assert code == 0 and err == ""
    d = json.loads(out)
    hw = d["hardware"]
    ref = choose_plan(DEFAULT_ACCEPTANCE, LATENCY["draft_step_s"], LATENCY["target_latency_s"], max_depth=8)
    assert (hw["budget"], hw["max_depth"]) == (ref.budget, ref.max_depth)
    assert hw["speedup"] == pytest.approx(ref.speedup) and hw["speedup"] > 1
    assert hw["plan"]["parents"] == list(ref.plan.parents)
    assert len(hw["candidates"]) == 7 * 8
    # human-readable form
    code, out, _ = _run(capsys, "plan", "--latency", str(lat))
    assert code == 0
    assert f"budget n = {ref.budget}, depth d = {ref.max_depth}" in out and "predicted speedup" in out


def test_plan_plot(tmp_path, capsys):
    png = tmp_path / "tree.png"
    code, out, err = _run(capsys, "plan", "--budget", "24", "--plot", str(png))
    assert code == 0 and err == ""
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _lat_file(tmp_path, text):
    f = tmp_path / "lat.json"
    f.write_text(text)
    return str(f)


@pytest.mark.parametrize(
    "args",
    [
        ["--acceptance", "-0.1,0.5"],
        ["--acceptance=-0.1,0.5"],
        ["--acceptance", "0.6,0.5"],
        ["--acceptance", "0.6,abc"],
        ["--acceptance", "0.6,,0.1"],
        ["--acceptance", "nan"],
        ["--budget", "0"],
        ["--max-depth", "0"],
        ["--latency", "MISSING"],
        ["--latency", "MALFORMED"],
        ["--latency", "NO_T1"],
        ["--latency", "WRONG_TYPES"],
        ["--acceptance", "MISSING"],
        ["--acceptance", "MALFORMED"],
    ],
)
def test_plan_bad_input(tmp_path, capsys, args):
    files = {
        "MISSING": str(tmp_path / "does-not-exist.json"),
        "MALFORMED": _lat_file(tmp_path, '{"draft_step_s": 0.004, "target_latency_s": {"1": 0.09,'),
        "NO_T1": _lat_file(tmp_path, '{"draft_step_s": 0.004, "target_latency_s": {"2": 0.09}}'),
        "WRONG_TYPES": _lat_file(tmp_path, '{"draft_step_s": "fast", "target_latency_s": {"1": 0.09}}'),
    }
    args = [files.get(a, a) for a in args]
    code, out, err = _run(capsys, "plan", *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("sequoia-kernels: error:")
    assert "Traceback" not in err


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["plan", "--budget", "abc"], ["nonsense"], ["plan", "--bogus"]):
        code, _, err = _run(capsys, *argv)
        assert code == 2 and "usage:" in err and "Traceback" not in err
    code, out, _ = _run(capsys, "plan", "--help")
    assert code == 0 and "--acceptance" in out


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PY_API) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def test_python_m_program():
    r = subprocess.run(
        [sys.executable, "-m", "sequoia_decoding", "plan", "--acceptance", "0.63,0.11,0.06",
         "--budget", "32", "--max-depth", "6", "--json"],
        capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["expected_tokens"] == plan_tree([0.63, 0.11, 0.06], 32, 6).expected_tokens
    r = subprocess.run([sys.executable, "-m", "sequoia_decoding", "plan", "--acceptance", "0.9,0.2"],
                       capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("sequoia-kernels: error:") and "Traceback" not in r.stderr


def test_import_is_light():
    code = (
        "import sys, sequoia_decoding, sequoia_decoding.cli, sequoia_decoding.planner\n"
        "heavy = [m for m in ('torch', 'sequoia_kernels', 'transformers', 'matplotlib') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ""


@pytest.mark.parametrize("device,says", [("foo", "not a device: 'foo'"), ("mps", "the loop runs on cpu or cuda"),
                                         ("cuda:99", "CUDA device(s)")])
def test_a_device_this_machine_lacks_is_a_usage_error(capsys, device, says):
    """``--device`` is checked as the arguments are read: a usage error naming it (was torch's
    RuntimeError traceback, after the models had loaded)."""
    for argv in (["generate", "--target", "nowhere", "--prompt", "hi"], ["demo"]):
        code, _, err = _run(capsys, *argv, "--device", device)
        assert code == 2 and "argument --device" in err and says in err, err
