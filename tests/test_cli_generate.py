"""`sequoia-kernels generate` on a tiny local model pair with a tiny local tokenizer."""

import pytest

from sequoia_decoding.cli import main


def test_generate_streams_and_reports(pair_dirs, capsys):
    dirs, tok = pair_dirs
    rc = main(["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w3 w4 w5",
               "--max-new-tokens", "10", "--budget", "8"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("w3 w4 w5")
    assert "tokens/step" in err and "tokens/s" in err
    # greedy: the same text as the target alone (autoregressive baseline through the same CLI)
    rc = main(["generate", "--target", dirs["target"], "--prompt", "w3 w4 w5", "--max-new-tokens", "10"])
    out_ar, err_ar = capsys.readouterr()
    assert rc == 0, err_ar
    assert out_ar == out
    assert "autoregressive" in err_ar


def test_generate_without_a_tree_plans_as_the_hf_entry_point(pair_dirs, capsys, tmp_path, monkeypatch, caplog):
    """No --budget / --tree / --chain / --kxd: the tree SequoiaDecoding would use. On a machine
    without a calibrated profile that is plain decoding (the draft not run), said in the log."""
    import logging

    from sequoia_decoding import logs
    from sequoia_decoding.modeling import smollm2

    monkeypatch.setattr(smollm2, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(logs, "SAID", set())
    dirs, _ = pair_dirs
    with caplog.at_level(logging.WARNING, logger="sequoia_decoding"):
        rc = main(["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w3 w4 w5",
                   "--max-new-tokens", "10"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "autoregressive" in err and any("no latency profile" in r.getMessage() for r in caplog.records)
    rc = main(["generate", "--target", dirs["target"], "--prompt", "w3 w4 w5", "--max-new-tokens", "10"])
    assert rc == 0 and capsys.readouterr()[0] == out


@pytest.mark.parametrize("extra", [["--chain", "3"], ["--kxd", "2x2"], ["--temperature", "0.7", "--seed", "1"],
                                   # filters narrower than the tree (a node with more children than tokens)
                                   ["--temperature", "0.7", "--top-p", "0.3", "--kxd", "6x2"],
                                   ["--temperature", "0.5", "--top-k", "2", "--budget", "16"]])
def test_generate_baselines_and_sampling(pair_dirs, capsys, extra):
    dirs, _ = pair_dirs
    rc = main(["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w1 w2",
               "--max-new-tokens", "6", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err


@pytest.mark.parametrize("extra,match", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--kxd", "3by2"], "--kxd"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--max-depth", "0"], "--max-depth must be an int >= 1"),  # was: decoded without speculation
])
def test_generate_bad_input_is_one_line_exit_2(pair_dirs, capsys, extra, match):
    dirs, _ = pair_dirs
    rc = main(["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w1", *extra])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("sequoia-kernels: error:") and match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("verb,extra,match", [
    ("measure-acceptance", ["--runs", "0"], "--runs must be an int >= 1"),  # was: ZeroDivisionError after the runs
    ("measure-acceptance", ["--num-prompts", "0"], "--num-prompts must be an int >= 1"),
    ("measure-acceptance", ["--max-new-tokens", "0"], "--max-new-tokens must be an int >= 1"),
    ("measure-acceptance", ["--width", "0"], "--width must be an int >= 1"),
    ("profile", ["--prefix", "-1"], "--prefix must be an int >= 0"),  # was: profiled
    ("profile", ["--repeats", "0"], "--repeats must be an int >= 1"),  # was: "no median for empty data"
    ("profile", ["--sizes", "1,0,4"], "--sizes must be tree sizes >= 1"),
])
def test_tools_bad_counts_are_one_line_exit_2_before_loading(pair_dirs, capsys, tmp_path, monkeypatch, verb, extra,
                                                             match):
    from sequoia_decoding import cli

    monkeypatch.setattr(cli, "_load_pair", lambda args: pytest.fail("loaded the models before checking the input"))
    dirs, _ = pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\n")
    pair = ["--target", dirs["target"]] + (["--draft", dirs["draft"], "--prompts", str(prompts)]
                                           if verb == "measure-acceptance" else [])
    rc = main([verb, *pair, *extra])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("sequoia-kernels: error:") and match in err, err
    assert len(err.strip().splitlines()) == 1


def test_generate_missing_model_folder(capsys, tmp_path):
    rc = main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "w1"])
    _, err = capsys.readouterr()
    assert rc == 2 and "sequoia-kernels: error:" in err


def test_measure_acceptance_json(pair_dirs, capsys, tmp_path):
    import json

    dirs, _ = pair_dirs
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw7 w8\n")
    out = tmp_path / "acc.json"
    for temp in ("0", "0.8"):
        rc = main(["measure-acceptance", "--target", dirs["target"], "--draft", dirs["draft"], "--prompts",
                   str(prompts), "--temperature", temp, "--width", "3", "--max-new-tokens", "6", "--out", str(out)])
        _, err = capsys.readouterr()
        assert rc == 0, err
        res = json.loads(out.read_text())
        assert len(res["acceptance"]) == 3 and abs(sum(res["acceptance"]) + res["rejected"] - 1) < 1e-9
    # the planner reads it
    assert main(["plan", "--acceptance", str(out), "--budget", "8", "--json"]) == 0
    capsys.readouterr()
    # a draft equal to the target: its first child is always accepted
    rc = main(["measure-acceptance", "--target", dirs["target"], "--draft", dirs["target"], "--prompts",
               str(prompts), "--temperature", "0.8", "--width", "2", "--max-new-tokens", "5", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["acceptance"][0] == pytest.approx(1.0) and res["rejected"] == 0.0


def test_measure_acceptance_with_sampling_filters(pair_dirs, capsys, tmp_path):
    """--top-k / --top-p measure the vector the filtered setting decodes with: with top-k 1 both
    distributions are one-hot (the continuation is greedy), so the first child is accepted
    exactly when the draft's argmax is the target's, i.e. p_1 equals the greedy (T = 0) p_1 on
    the same prompts; unfiltered sampling at that temperature gives another value. At T = 0 the
    filters are ignored, as greedy decoding ignores them."""
    import json

    import torch
    from transformers import LlamaForCausalLM

    from sequoia_decoding.demo import plan_name
    from sequoia_decoding.loading import acceptance_file, is_filtered

    dirs, tok = pair_dirs
    # a draft that agrees with the target part of the time: the target with a perturbed head
    torch.manual_seed(3)
    draft = LlamaForCausalLM.from_pretrained(dirs["target"]).eval()
    with torch.no_grad():
        draft.lm_head.weight.add_(torch.randn_like(draft.lm_head.weight) * draft.lm_head.weight.std())
    draft_dir = tmp_path / "draft"
    draft.save_pretrained(draft_dir)
    tok.save_pretrained(draft_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3\nw7 w8\nw4 w9 w2 w5\n")

    def measure(*extra):
        out = tmp_path / "acc.json"
        rc = main(["measure-acceptance", "--target", dirs["target"], "--draft", str(draft_dir), "--prompts",
                   str(prompts), "--width", "3", "--max-new-tokens", "8", "--out", str(out), *extra])
        _, err = capsys.readouterr()
        assert rc == 0, err
        return json.loads(out.read_text())

    greedy = measure("--temperature", "0")
    top1 = measure("--temperature", "0.8", "--top-k", "1")
    plain = measure("--temperature", "0.8")
    assert (top1["top_k"], top1["top_p"], plain["top_k"], plain["top_p"]) == (1, 1.0, 0, 1.0)
    assert 0 < greedy["acceptance"][0] < 1
    assert top1["acceptance"][0] == pytest.approx(greedy["acceptance"][0], abs=1e-12)
    assert plain["acceptance"][0] != pytest.approx(greedy["acceptance"][0], abs=1e-12)
    assert abs(sum(top1["acceptance"]) + top1["rejected"] - 1) < 1e-9
    assert measure("--temperature", "0", "--top-p", "0.5")["acceptance"] == greedy["acceptance"]
    rc = main(["measure-acceptance", "--target", dirs["target"], "--draft", str(draft_dir), "--prompts",
               str(prompts), "--temperature", "0.8", "--top-p", "0"])
    assert rc == 2 and "top_p" in capsys.readouterr().err
    # where a draft folder keeps each setting's vector
    names = [acceptance_file("d", *a).name for a in [(0.6,), (0.6, 0, 0.9), (0.6, 50, 0.9), (0.6, 50), (0.0, 50, 0.9)]]
    assert names == ["acceptance-T0.6.json", "acceptance-T0.6-topp0.9.json", "acceptance-T0.6-topk50-topp0.9.json",
                     "acceptance-T0.6-topk50.json", "acceptance-T0.json"]
    settings = [(0.6,), (0.6, 0, 0.9), (0.6, 50), (0.0, 50, 0.9), (0.6, 0, 1.0)]
    assert [is_filtered(*a) for a in settings] == [False, True, True, False, False]
    assert [plan_name(a if len(a) == 3 else a[0]) for a in settings[:1] + settings[3:]] == ["T0.6", "T0", "T0.6"]


def test_profile_json_feeds_the_planner(pair_dirs, capsys, tmp_path):
    import json

    dirs, _ = pair_dirs
    lat, png = tmp_path / "lat.json", tmp_path / "curve.png"
    rc = main(["profile", "--target", dirs["target"], "--draft", dirs["draft"], "--sizes", "1,4,16",
               "--prefix", "32", "--repeats", "2", "--out", str(lat), "--plot", str(png)])
    _, err = capsys.readouterr()
    assert rc == 0, err
    res = json.loads(lat.read_text())
    assert set(res["target_latency_s"]) == {"1", "4", "16"} and res["draft_step_s"] > 0
    assert res["knee"] in (1, 4, 16)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--latency", str(lat), "--budget", "16", "--max-depth", "4", "--json"]) == 0
    assert "hardware" in json.loads(capsys.readouterr().out)


def test_every_verb_takes_a_feature_head(pair_dirs, capsys, tmp_path):
    """`--draft` naming an EAGLE-style head: generate (greedy = the target alone), measure-acceptance
    and profile run; a head built for another target is refused in one line."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from sequoia_decoding.modeling.feature_head import FeatureHead

    dirs, _ = pair_dirs
    c = AutoModelForCausalLM.from_pretrained(dirs["target"]).config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=c.vocab_size, max_position_embeddings=512)
    torch.manual_seed(0)
    head = str(FeatureHead(cfg).save(tmp_path / "head"))
    rc = main(["generate", "--target", dirs["target"], "--draft", head, "--prompt", "w3 w4 w5", "--max-new-tokens",
               "10", "--budget", "6", "--max-depth", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert main(["generate", "--target", dirs["target"], "--prompt", "w3 w4 w5", "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr()[0] == out
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5\nw7 w8\n")
    rc = main(["measure-acceptance", "--target", dirs["target"], "--draft", head, "--prompts", str(prompts),
               "--temperature", "0", "--width", "4", "--max-new-tokens", "6", "--head-level", "2",
               "--out", str(tmp_path / "acc.json")])
    err = capsys.readouterr()[1]
    assert rc == 0, err
    acc = json.loads((tmp_path / "acc.json").read_text())
    assert acc["head_level"] == 2 and len(acc["acceptance"]) == 4
    rc = main(["profile", "--target", dirs["target"], "--draft", head, "--sizes", "1,4", "--repeats", "2",
               "--out", str(tmp_path / "lat.json")])
    err = capsys.readouterr()[1]
    assert rc == 0, err
    assert json.loads((tmp_path / "lat.json").read_text())["draft_step_s"] > 0
    bad = str(FeatureHead(dict(cfg, hidden_size=2 * c.hidden_size)).save(tmp_path / "bad"))
    rc = main(["generate", "--target", dirs["target"], "--draft", bad, "--prompt", "w3", "--max-new-tokens", "2",
               "--budget", "4"])
    err = capsys.readouterr()[1]
    assert rc == 2 and "width" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("offload", ["stream", "disk"])
def test_generate_with_an_offloaded_target(pair_dirs, capsys, tmp_path, offload):
    """``--offload``: the same greedy text as the resident target, through our stream or accelerate's hooks."""
    pytest.importorskip("accelerate")
    dirs, _ = pair_dirs
    common = ["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w3 w4 w5",
              "--max-new-tokens", "10", "--budget", "8"]
    assert main(common) == 0
    want = capsys.readouterr().out
    rc = main([*common, "--offload", offload, "--offload-folder", str(tmp_path / "w")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == want


def test_tools_refuse_bad_counts_from_python_too():
    from tiny_models import tiny_llama

    from sequoia_decoding.tools import measure_acceptance, profile_latency

    target, draft = tiny_llama(0, layers=1), tiny_llama(1, layers=1)
    for kw in (dict(runs=0), dict(max_new_tokens=0), dict(width=0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            measure_acceptance(target, draft, [[3, 4]], temperature=0.7, **{"width": 3, **kw})
    for kw in (dict(prefix=-1), dict(repeats=0)):
        with pytest.raises(ValueError, match="prefix must be >= 0 and repeats >= 1"):
            profile_latency(target, draft, sizes=[1, 2], **kw)


def test_the_stream_holds_back_a_character_whose_bytes_are_still_arriving():
    """``generate``'s streamed text is the tokens' text, whole: a token holding part of a multi-byte
    character (byte-level tokenizers split CJK and emoji) decodes to a trailing U+FFFD, which is
    held back until the rest arrives (it was written, and the character it became never was:
    "你好�����"); bytes that never make a character are written at the end."""
    import io

    from sequoia_decoding.cli import _TextStream

    class Bytes:  # a byte-level tokenizer: token id = one byte
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    text = "Hi 你好, 😀 ok"
    data = list(text.encode()) + [0xF0, 0x9F]  # the run ends inside a character
    for chunk in (1, 2, 3, 5):
        out = io.StringIO()
        stream = _TextStream(Bytes(), out)
        for i in range(0, len(data), chunk):
            stream(0, data[i:i + chunk])
            assert "\ufffd" not in out.getvalue()
        stream.finish()
        assert out.getvalue() == text + "\ufffd" == Bytes.decode(data)


def test_dtype_auto_is_the_demos_choice_for_the_target(pair_dirs, capsys, tmp_path, monkeypatch):
    """Without ``--dtype``: the dtype the demo picked for this target here (its cached choice,
    said on stderr), else float32 (the default was float32 always: after a demo that picked bf16,
    ``generate`` found no profile in fp32 and decoded without speculation)."""
    import torch

    from sequoia_decoding import profiling
    from sequoia_decoding.modeling import smollm2
    from sequoia_kernels.ops.packed_linear import packed_linear_supported

    if not packed_linear_supported(torch.bfloat16):
        pytest.skip("this CPU has no bf16 vector path: the demo picks float32 without measuring")
    monkeypatch.setattr(smollm2, "CACHE_ROOT", tmp_path / "cache")
    dirs, _ = pair_dirs
    run = ["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w3 w4 w5",
           "--max-new-tokens", "12", "--budget", "6"]

    def outputs(*extra):
        assert main([*run, *extra]) == 0
        return capsys.readouterr()

    fp32, bf16 = outputs("--dtype", "float32")[0], outputs("--dtype", "bfloat16")[0]
    out, err = outputs()  # nothing measured for this target yet: float32, as before
    assert out == fp32 and "[dtype" not in err
    monkeypatch.setattr(profiling, "profile_latency", lambda model, draft, sizes, **kw: {"target_latency_s": {
        str(n): 0.01 * n * (1 if next(model.parameters()).dtype == torch.bfloat16 else 2) for n in sizes}})
    assert profiling.pick_dtype(dirs["target"], torch.device("cpu"), log=lambda s: None)[0] == "bfloat16"
    out, err = outputs()
    assert out == bf16 and "[dtype bfloat16: T(1) = 10.0 ms" in err and "(cached)" in err
    out, err = outputs("--dtype", "float32")
    assert out == fp32 and "[dtype" not in err


def test_generate_chat_sends_the_prompt_through_the_chat_template(pair_dirs, capsys, tmp_path):
    """``--chat``: the prompt as one user message through the tokenizer's chat template (an
    instruct model answered a raw question with EOS at once); a tokenizer without a template is a
    one-line error, as is a prompt without tokens."""
    import shutil

    from transformers import AutoTokenizer

    dirs, _ = pair_dirs
    target = tmp_path / "target"
    shutil.copytree(dirs["target"], target)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = ("{% for m in messages %}w40 {{ m['content'] }} w41{% endfor %}"
                         "{% if add_generation_prompt %} w42{% endif %}")
    tok.save_pretrained(target)
    common = ["--draft", dirs["draft"], "--max-new-tokens", "10", "--budget", "6"]
    assert main(["generate", "--target", str(target), "--prompt", "w7 w8", "--chat", *common]) == 0
    chat = capsys.readouterr()[0]
    assert main(["generate", "--target", str(target), "--prompt", "w40 w7 w8 w41 w42", *common]) == 0
    raw = capsys.readouterr()[0]
    answer = raw[len("w40 w7 w8 w41 w42"):].strip()
    assert answer and chat.startswith("w7 w8\n") and chat[len("w7 w8\n"):].strip() == answer
    for bad, match in (([dirs["target"], "--prompt", "w7", "--chat"], "needs a tokenizer with a chat template"),
                       ([str(target), "--prompt", "  "], "has no tokens")):
        assert main(["generate", "--target", *bad, *common]) == 2
        err = capsys.readouterr()[1]
        assert err.startswith("sequoia-kernels: error:") and match in err and len(err.strip().splitlines()) == 1
