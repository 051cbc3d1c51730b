"""The tensor-parallel code path on one rank, over the backend's real collectives.

    torchrun --standalone --nproc-per-node 1 bench/tp_check.py                  # NCCL, cuda:0
    torchrun --standalone --nproc-per-node 1 bench/tp_check.py --device cpu     # gloo

``bench/gpu_check.sh`` runs the first on a GPU (Hugging Face's own TP loading needs
``accelerate``, which the device image lacks; the tests run two ranks under gloo with it). A tiny
random Llama gets a one-rank device mesh, what Hugging Face's TP loading attaches to a model, so
the loop takes its TP path: the seed broadcast, the request all-gather, the streamed-step barrier,
the re-planner's step-time all-reduce and the emitted tokens' digest, all through NCCL (CUDA
tensors) or gloo. Each case's tokens must equal the same model's without a mesh: greedy, seeded
sampling, unseeded (two ranks' agreement is the tests'; here the broadcast seed must just work),
adaptive re-planning and ``SequoiaDecoding``. Prints one line per case and the time per call
with and without the mesh; exit status 1 on any mismatch."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))

from sequoia_decoding.adaptive import AdaptiveConfig  # noqa: E402
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator  # noqa: E402
from sequoia_decoding.hf_generate import SequoiaDecoding  # noqa: E402
from sequoia_decoding.planner import plan_tree  # noqa: E402
from sequoia_decoding.tensor_parallel import tensor_parallel_of  # noqa: E402

PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [13, 4], [21, 33, 1, 6, 40]]
LATENCY = {"draft_step_s": 0.001, "target_latency_s": {"1": 0.01, "4": 0.011, "8": 0.012, "16": 0.014}}


def tiny_llama(seed: int, layers: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # peaked distributions: trees get accepted
    return model


def cases(target, draft, device: str) -> dict:
    """Each case's tokens (and seconds per call) for ``target`` as it is."""
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    out = {}
    for name, sampling, kw in (("greedy", SamplingParams(), {}),
                               ("sampled", SamplingParams(temperature=0.8, top_p=0.9, seed=3), {}),
                               ("unseeded", SamplingParams(temperature=0.8, top_k=20), {}),
                               ("adaptive", SamplingParams(), {"adaptive": AdaptiveConfig(every=2, latency=LATENCY,
                                                                                          overhead_s={1: 0.0})})):
        gen = SequoiaGenerator(target, draft, plan, sampling, max_length=96, **kw)
        gen.generate(PROMPTS, max_new_tokens=4, eos_token_id=[])  # warm
        t0 = time.perf_counter()
        streamed = []
        res = gen.generate(PROMPTS, max_new_tokens=24, eos_token_id=[], callback=lambda b, new: streamed.extend(new))
        out[name] = (res.tokens, time.perf_counter() - t0)
    ids = torch.tensor([[0, 0] + PROMPTS[2], PROMPTS[0]], device=device)
    mask = (ids != 0).long()
    mask[1] = 1
    t0 = time.perf_counter()
    got = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=0,
                          custom_generate=SequoiaDecoding(draft, budget=8, max_depth=4))
    out["SequoiaDecoding"] = (got.tolist(), time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (NCCL) or cpu (gloo)")
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh

    cuda = args.device.startswith("cuda")
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=60))
    target, draft = tiny_llama(0, 2, device), tiny_llama(1, 1, device)
    plain = cases(target, draft, device)
    target._device_mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    tp = tensor_parallel_of(target)
    print(f"backend {dist.get_backend()}, {device}, TP group of {tp.size} (the loop's TP path)")
    meshed = cases(target, draft, device)
    bad = 0
    for name, (tokens, seconds) in meshed.items():
        same = tokens == plain[name][0] or name == "unseeded"
        bad += not same
        print(f"{name:16s} {'same tokens' if same else 'DIFFERENT TOKENS'} as without the mesh"
              f"{' (unseeded: a new seed per call)' if name == 'unseeded' else ''}; "
              f"{1e3 * seconds:.1f} ms per call against {1e3 * plain[name][1]:.1f}")
    dist.destroy_process_group()
    print("tp_check:", "ok" if not bad else f"{bad} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
