"""The loop on a tensor-parallel target: tiny Llamas loaded with Hugging Face's TP plan under
``torchrun --nproc-per-node 2`` (gloo, CPU), each rank checked against an unsharded copy of the
same model in the same process (``tp_worker.py``). Bounded: every launch has a timeout and the
process group one of 20 s."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny_models
from sequoia_decoding.cli import main

pytestmark = [pytest.mark.multiprocess,
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                 reason="Hugging Face's TP plan needs accelerate (pip install accelerate)")]
WORKER = Path(__file__).with_name("tp_worker.py")
CLI = ["generate", "--prompt", "w5 w9 w11", "--budget", "6", "--max-new-tokens", "12"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    # vocab 62: HF's TP plan gathers the LM head's output and refuses a vocabulary the world does not divide
    for name, heads, kv in (("mha", 4, 4), ("gqa", 4, 2), ("kv1", 4, 1)):
        tiny_models.tiny_llama(0, vocab=62, layers=2, heads=heads, kv_heads=kv, sharpen=3.0,
                               tie_word_embeddings=False).save_pretrained(root / f"target-{name}")
    tiny_models.tiny_llama(1, vocab=62, layers=1, heads=4, kv_heads=2, sharpen=3.0).save_pretrained(root / "draft")
    tiny_models.tiny_llama(1, vocab=400, layers=1, heads=4, kv_heads=2).save_pretrained(root / "draft-v400")
    tok = word_tokenizer(62)
    for name in ("target-gqa", "draft"):
        tok.save_pretrained(root / name)
    return root


def word_tokenizer(n: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(n)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0", eos_token="w1")


def run(root: Path, mode: str, timeout: float = 150, env: dict | None = None) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(WORKER.parent), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(WORKER), str(root), mode],
                          env=env, capture_output=True, text=True, timeout=timeout)
    files = [root / f"{mode}-{r}.json" for r in range(2)]
    assert all(f.exists() for f in files), proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads(f.read_text()) for f in files]
    assert not any("error" in r for r in ranks), "\n".join(r.get("error", "") for r in ranks)
    return ranks


def test_tp_target_decodes_as_one_process(models, capsys):
    """Greedy, sampled (seeded) and unseeded, batch 1 and 3 with ragged prompts, MHA and GQA, the
    loop and SequoiaDecoding, a model draft and feature heads (EAGLE-1 with a draft vocabulary,
    EAGLE-3) bound to the sharded target: every rank emits what one process emits with the
    unsharded model (the sampled cases too: the gathered logits differ from the unsharded ones
    only by rounding, which moves a draw only when a uniform lands within ~1e-7 of a threshold),
    and unseeded calls the same tokens on both ranks (rank 0's seed); the latency profile is
    rank 0's on both."""
    ranks = run(models, "decode")
    for kind in ("mha", "gqa"):
        for case, got in ranks[0]["decode"][kind].items():
            assert got["tp"] == ranks[1]["decode"][kind][case]["tp"], (kind, case)  # the ranks agree
            if case.startswith("unseeded"):
                continue  # each process's own unsharded run draws from its own default generator
            assert got["tp"] == got["single"], (kind, case, got)
    # the latency profile: every rank timed the same forwards and holds rank 0's times
    assert ranks[0]["profile"] == ranks[1]["profile"] and all(t > 0 for t in ranks[0]["profile"]["gqa"].values())
    # the CLI under torchrun: rank 0 prints what one process prints, rank 1 nothing
    assert main(CLI + ["--target", str(models / "target-gqa"), "--draft", str(models / "draft")]) == 0
    one = capsys.readouterr().out
    assert ranks[0]["cli"] == one and "w5 w9 w11" in one and len(one.split()) > 6, (ranks[0]["cli"], one)
    assert ranks[1]["cli"] == ""


def test_demo_under_torchrun(models, tmp_path):
    """``sequoia-kernels demo`` under torchrun: every rank runs it on its shard, rank 0 prints the
    table (greedy Sequoia identical to AR) and writes the results and the profile, which is keyed
    by the world size; rank 1 prints nothing."""
    r0, r1 = run(models, "demo", env={"SEQUOIA_CACHE": str(tmp_path / "cache")})
    assert r0["rc"] == 0 and r1["rc"] == 0, (r0, r1)
    assert r1["stdout"] == "" and "TP 2 ranks x 1 threads" in r0["stdout"], (r0, r1)
    rows = [ln for ln in r0["stdout"].splitlines() if ln.startswith("| 0 |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| 2/2 |"), r0["stdout"]
    res = json.loads((models / "demo-out" / "demo.json").read_text())
    assert len(res["rows"]) == 3 and all(r["sequoia_tokens_per_s"] > 0 for r in res["rows"])
    (prof,) = (tmp_path / "cache" / "profiles").glob("profile-*.json")
    assert json.loads(prof.read_text())["machine"]["tensor_parallel"] == 2


def test_faults_are_errors_on_every_rank(models):
    """A world that does not divide the KV heads, or a draft of another vocabulary: a ValueError
    on every rank (and the kv1 model under a TP plan that keeps attention whole decodes as one
    process does). A bad request on rank 1 only: its own ValueError there, at once one naming it
    on rank 0 (not a collective's timeout), and both ranks decode the next request as before. A
    rank failing mid-call: an error on every rank within the process group's timeout."""
    r0, r1 = run(models, "faults")
    for r in (r0, r1):
        assert "must hold whole KV heads" in r.get("bad-heads", ""), r
        tp, single = r["whole-attention"]  # a plan that keeps attention whole serves that model
        assert tp == single, r
    assert "must lie in [0, 62)" in r1.get("one-rank-fails", ""), r1
    assert "rank(s) [1] refused" in r0.get("one-rank-fails", ""), r0
    assert r0["after"] == r1["after"] and len(r0["after"][0]) == 8
    for r in (r0, r1):  # a draft of another vocabulary: refused on every rank when the generator is built
        assert "vocabularies differ (400 vs 62)" in r.get("bad-vocab", ""), r
    # rank 1 raises mid-call and stays alive: its own error there; rank 0 stops within the process
    # group's timeout (10 s) with an error saying why; neither streamed a step the other did not reach
    assert r1["mid-call"] == "RuntimeError: injected fault in rank 1's verifier", r1
    assert r0["mid-call"].startswith("RuntimeError: tensor-parallel rank 0 of 2: a collective failed mid-call"), r0
    assert "another rank raised or exited" in r0["mid-call"] and r0["mid-call-s"] < 10 + 8, r0
    assert r0["streamed"] == r1["streamed"] and len(r1["streamed"]) >= 2, (r0, r1)


def test_the_plan_keeps_attention_whole_where_the_world_does_not_divide_the_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    from sequoia_decoding.tensor_parallel import tp_plan_for

    assert tp_plan_for(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), LlamaForCausalLM, 2) == "auto"
    plan = tp_plan_for(LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576), LlamaForCausalLM, 2)
    whole = ("replicate", "replicated_with_grad_allreduce")
    assert {k: v for k, v in plan.items() if v not in whole} == {
        "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "colwise_gather_output"}
    # transformers 5.19 on merges a plan into the model's: attention's rules then say "replicated"
    assert all("self_attn" in k for k, v in plan.items() if v in whole)


def test_a_mesh_with_other_parallel_dimensions_is_refused():
    """transformers 5.19 on puts a TP model on a ("pp", "fsdp", "tp") mesh: the loop runs on its "tp"
    group and refuses a target also sharded another way, naming the dimensions."""
    import types

    from sequoia_decoding.tensor_parallel import tensor_parallel_of

    mesh = types.SimpleNamespace(ndim=3, mesh_dim_names=("pp", "fsdp", "tp"), shape=(1, 2, 2))
    with pytest.raises(ValueError, match=r"\{'pp': 1, 'fsdp': 2, 'tp': 2\}: only tensor parallelism"):
        tensor_parallel_of(types.SimpleNamespace(_device_mesh=mesh))


def test_an_older_transformers_is_named(tmp_path, monkeypatch):
    """Before transformers 5.17 there is no DistributedConfig: loading a TP target says which version it needs."""
    import transformers

    from sequoia_decoding.loading import load_causal_lm

    monkeypatch.setattr(transformers, "DistributedConfig", None, raising=False)
    with pytest.raises(ImportError, match=r"transformers >= 5\.17"):
        load_causal_lm(str(tmp_path), tensor_parallel=True)


def test_the_one_rank_check_gpu_check_runs():
    """``bench/tp_check.py`` (what ``bench/gpu_check.sh`` runs over NCCL on a GPU) here over gloo:
    the loop's TP path on a one-rank mesh emits what the model emits without one."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                           str(WORKER.parents[1] / "bench" / "tp_check.py"), "--device", "cpu"],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "tp_check: ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("same tokens as without the mesh") == 5 and "TP group of 1" in proc.stdout
