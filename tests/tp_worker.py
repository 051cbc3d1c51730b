"""One rank of ``test_tensor_parallel.py`` (run by ``torchrun --nproc-per-node 2``).

``python tp_worker.py DIR MODE``: DIR holds the tiny models (written by the test); MODE:
``decode`` (the loop and ``SequoiaDecoding`` on the TP target against an unsharded copy in the
same process), ``demo`` (``sequoia-kernels demo`` on the TP target), ``faults`` (a world that does not divide the KV heads; a bad request on rank 1
only; a draft of another vocabulary; a rank failing mid-call). Each rank writes DIR/MODE-RANK.json with what it saw."""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, DistributedConfig, LlamaForCausalLM

from sequoia_decoding import cli
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.hf_generate import SequoiaDecoding
from sequoia_decoding.modeling.feature_head import FeatureHead
from sequoia_decoding.planner import plan_tree
from sequoia_decoding.tensor_parallel import tp_plan_for
from sequoia_decoding.tools import profile_latency

CLI = ["generate", "--prompt", "w5 w9 w11", "--budget", "6", "--max-new-tokens", "12"]  # the test's
PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [13, 4], [21, 33, 1, 6, 40]]  # ragged
TIMEOUT_S = 10  # the process group's: every collective's bound


def load(path: Path, sharded: bool):
    kw = {"distributed_config": DistributedConfig(tp_plan="auto")} if sharded else {}
    return AutoModelForCausalLM.from_pretrained(path, **kw).eval()


def decode(root: Path, kind: str) -> dict:
    target, single = load(root / f"target-{kind}", True), load(root / f"target-{kind}", False)
    draft = load(root / "draft", False)
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    seen = {}
    for name, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=0.8, top_p=0.9, seed=3)),
                           ("unseeded", SamplingParams(temperature=0.8, top_k=20))):
        for rows in (PROMPTS[:1], PROMPTS):
            got = SequoiaGenerator(target, draft, plan, sampling, max_length=96).generate(
                rows, max_new_tokens=24, eos_token_id=[]).tokens
            one = SequoiaGenerator(single, draft, plan, sampling, max_length=96).generate(
                rows, max_new_tokens=24, eos_token_id=[]).tokens
            seen[f"{name}-B{len(rows)}"] = {"tp": got, "single": one}
    ids = torch.tensor([[0, 0] + PROMPTS[2], PROMPTS[0]])  # left padded
    mask = (ids != 0).long()
    mask[1] = 1
    got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                          custom_generate=SequoiaDecoding(draft, budget=8, max_depth=4))
    one = single.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0)
    seen["SequoiaDecoding-greedy"] = {"tp": got.tolist(), "single": one.tolist()}
    for kind_, vd in (("eagle1", 30), ("eagle3", None)):  # a feature head replicated on every rank
        head = feature_head(single, kind_, vd)
        got, one = (SequoiaGenerator(m, head, plan, SamplingParams(), max_length=96).generate(
            PROMPTS, max_new_tokens=16, eos_token_id=[]).tokens for m in (target, single))
        seen[f"head-{kind_}"] = {"tp": got, "single": one}
    prof = profile_latency(target, draft, sizes=[1, 4], prefix=8, repeats=2, progress=False)
    return seen, prof["target_latency_s"]


def feature_head(target, kind: str, draft_vocab: int | None) -> FeatureHead:
    """A random feature head for ``target`` (the same on every rank: seeded), reading its LM head
    and embedding, which a TP target holds as sharded DTensors."""
    c = target.config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, head_dim=c.head_dim,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               vocab_size=c.vocab_size, max_position_embeddings=256, rms_norm_eps=c.rms_norm_eps, rope_theta=1e4,
               **({"draft_vocab_size": draft_vocab} if draft_vocab else {}))
    torch.manual_seed(7)
    head = FeatureHead(cfg, kind, feature_layers=(-1, 0, 1) if kind == "eagle3" else None)  # 2 target layers
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        if draft_vocab:  # every second target id
            head.d2t.copy_(torch.arange(draft_vocab))
    return head.eval()


def fault_mid_call(gen: SequoiaGenerator, rank: int) -> dict:
    """Rank 1's verifier raises at the third step of a streamed call, and rank 1 then stays alive
    without joining any collective (its process does not exit: the worst case for the others).
    Rank 0 must raise on its own within the process group's timeout, and neither rank may have
    streamed a step the other did not reach."""
    streamed, calls, seen = [], [0], {}
    if rank == 1:
        verify = gen._verify

        def failing(*a):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected fault in rank 1's verifier")
            return verify(*a)
        gen._verify = failing
    t0 = time.perf_counter()
    try:
        gen.generate(PROMPTS[:1], max_new_tokens=24, eos_token_id=[], callback=lambda b, new: streamed.extend(new))
        seen["mid-call"] = "no error"
    except Exception as e:  # noqa: BLE001 - what each rank saw is the test's to judge
        seen["mid-call"] = f"{type(e).__name__}: {e}"
    seen["mid-call-s"], seen["streamed"] = time.perf_counter() - t0, streamed
    if rank == 1:
        time.sleep(TIMEOUT_S + 2)  # alive and silent past rank 0's timeout
    return seen


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    out = {"rank": rank}
    try:
        if mode == "decode":
            out["decode"], out["profile"] = {}, {}
            for kind in ("mha", "gqa"):
                out["decode"][kind], out["profile"][kind] = decode(root, kind)
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                cli.main(CLI + ["--target", str(root / "target-gqa"), "--draft", str(root / "draft")])
            out["cli"] = text.getvalue()
        elif mode == "demo":  # the demo under torchrun (SEQUOIA_CACHE: the test's folder)
            (root / "prompts.txt").write_text("w3 w4 w5\nw7 w8\nw9 w10 w11 w12\n")
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                out["rc"] = cli.main(["demo", "--target", str(root / "target-gqa"), "--draft", str(root / "draft"),
                                      "--prompts", str(root / "prompts.txt"), "--acceptance-prompts",
                                      str(root / "prompts.txt"), "--num-prompts", "2", "--max-new-tokens", "12",
                                      "--temperatures", "0,0.7", "--max-depth", "4", "--dtype", "float32",
                                      "--out", str(root / "demo-out")])
            out["stdout"] = text.getvalue()
        elif mode == "faults":
            try:  # a world that does not divide the KV heads
                SequoiaGenerator(load(root / "target-kv1", True), load(root / "draft", False), plan_tree([0.6], 4, 2))
            except ValueError as e:
                out["bad-heads"] = str(e)
            # the same model with a plan that keeps attention whole (MLP and LM head sharded): decodes
            whole_attn = tp_plan_for(AutoConfig.from_pretrained(root / "target-kv1"), LlamaForCausalLM, 2)
            kv1 = AutoModelForCausalLM.from_pretrained(root / "target-kv1",
                                                       distributed_config=DistributedConfig(tp_plan=whole_attn))
            plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
            out["whole-attention"] = [SequoiaGenerator(m, load(root / "draft", False), plan, max_length=96).generate(
                PROMPTS, max_new_tokens=16, eos_token_id=[]).tokens for m in (kv1, load(root / "target-kv1", False))]
            target, draft = load(root / "target-gqa", True), load(root / "draft", False)
            gen = SequoiaGenerator(target, draft, plan_tree([0.6, 0.2], 6, 3), max_length=96)
            bad = [[5, 10_000]] if rank == 1 else PROMPTS[:1]  # a token outside the vocabulary on rank 1 only
            try:
                gen.generate(bad, max_new_tokens=24, eos_token_id=[])
            except Exception as e:  # noqa: BLE001 - what each rank saw is the test's to judge
                out["one-rank-fails"] = f"{type(e).__name__}: {e}"
            out["after"] = gen.generate(PROMPTS[:1], max_new_tokens=8, eos_token_id=[]).tokens  # still usable
            try:  # a draft whose vocabulary cannot be the sharded target's (padded further than 256 ids)
                SequoiaGenerator(target, load(root / "draft-v400", False), plan_tree([0.6], 4, 2))
            except ValueError as e:
                out["bad-vocab"] = str(e)
            out.update(fault_mid_call(gen, rank))  # last: the ranks' process group is out of step after it
    except Exception:
        out["error"] = traceback.format_exc()  # for the test's message
        raise
    finally:
        (root / f"{mode}-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
