"""`sequoia-kernels generate` on a tiny local model pair with a tiny local tokenizer."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from sequoia_decoding.cli import main

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(46)]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    dirs = {}
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(vocab_size=len(WORDS), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          eos_token_id=1, bos_token_id=None, pad_token_id=None)
        model = LlamaForCausalLM(cfg).eval()
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    return dirs, tok


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


@pytest.mark.parametrize("extra", [["--chain", "3"], ["--kxd", "2x2"], ["--temperature", "0.7", "--seed", "1"]])
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
])
def test_generate_bad_input_is_one_line_exit_2(pair_dirs, capsys, extra, match):
    dirs, _ = pair_dirs
    rc = main(["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--prompt", "w1", *extra])
    _, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("sequoia-kernels: error:") and match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_generate_missing_model_folder(capsys, tmp_path):
    rc = main(["generate", "--target", str(tmp_path / "nope"), "--prompt", "w1"])
    _, err = capsys.readouterr()
    assert rc == 2 and "sequoia-kernels: error:" in err
