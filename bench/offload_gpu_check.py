"""Sequoia's offloading setting on a GPU: a target whose decoder layers live in pinned host memory
and are copied to the GPU a layer ahead of the compute (``load_offloaded(where="stream")`` on a
CUDA device; ``docs/offloading.md``, "The GPU path").

    python bench/offload_gpu_check.py              # 4 layers of Llama-2-7B's shapes, random weights
    python bench/offload_gpu_check.py --layers 8 --sizes 1,64,512
    python bench/offload_gpu_check.py --device cpu --layers 3 --hidden 256 --inter 512 --heads 4 --sizes 1,16
                                                   # the same code path on a CPU, tiny (a smoke test)

A random-weight target with Llama-2-7B's layer shapes (``--layers`` of them: each layer streams a
7B layer's 405 MB of bf16 over PCIe; few layers keep the run short) is written as safetensors,
loaded resident and streamed. Prints T(n) of both for each tree size n, the bytes a streamed
forward copies and the bandwidth that makes, then decodes greedy and seeded-sampled through the
loop (eager and in CUDA graphs) with a small random draft: the streamed target's tokens must equal
the resident one's. No network and no model hub needed. Exit status 1 on a mismatch."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: equal tokens are a fair test

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator  # noqa: E402
from sequoia_decoding.planner import plan_tree  # noqa: E402
from sequoia_decoding.streaming import load_streamed, stream_of  # noqa: E402
from sequoia_decoding.tools import profile_latency  # noqa: E402


def llama(layers: int, hidden: int, inter: int, heads: int, seed: int, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def decode(target, draft, plan, sampling, graphs: bool, prompts) -> list:
    gen = SequoiaGenerator(target, draft, plan, sampling, max_length=256, cuda_graphs=graphs)
    return gen.generate(prompts, max_new_tokens=16, eos_token_id=[]).tokens


def main() -> int:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="1,16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the checkpoint and the stream file go (default: a temp dir)")
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("offload_gpu_check: no CUDA device")
        return 1
    work = Path(args.dir or tempfile.mkdtemp(prefix="sk-offload-"))
    t0 = time.time()
    llama(args.layers, args.hidden, args.inter, args.heads, seed=0, device=dev).save_pretrained(work / "target")
    if dev == "cuda":
        torch.cuda.empty_cache()
    resident = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.bfloat16).to(dev).eval()
    target = load_streamed(str(work / "target"), dtype=torch.bfloat16, folder=work / "w", device=dev, source="host")
    stream = stream_of(target)
    print(f"{args.layers} layers of hidden {args.hidden}, MLP {args.inter}, bf16 on {dev}: "
          f"{stream._host.numel() / 1e9:.2f} GB in host memory (pinned: {stream._host.is_pinned()}); "
          f"written and loaded in {time.time() - t0:.0f} s")
    sizes = [int(x) for x in args.sizes.split(",")]
    kw = dict(sizes=sizes, prefix=128, repeats=args.repeats, progress=False)
    res = profile_latency(resident, None, **kw)["target_latency_s"]
    before, forwards = stream.bytes_read, time.perf_counter()
    streamed = profile_latency(target, None, **kw)["target_latency_s"]
    t1 = streamed["1"]
    per_forward = sum(x["length"] for x in stream.index["layers"])  # bytes a forward copies
    print("n      resident ms  streamed ms  streamed / its T(1)")
    for n in sizes:
        print(f"{n:<6} {res[str(n)] * 1e3:11.2f}  {streamed[str(n)] * 1e3:11.2f}  {streamed[str(n)] / t1:8.2f}")
    print(f"a streamed forward copies {per_forward / 1e9:.2f} GB ({per_forward / args.layers / 1e6:.0f} MB a layer): "
          f"{per_forward / t1 / 1e9:.1f} GB/s at n = 1; {(stream.bytes_read - before) / 1e9:.1f} GB "
          f"copied in {time.perf_counter() - forwards:.1f} s of profiling")
    draft = llama(2, 512, 1376, 8, seed=1, device=dev)
    plan = plan_tree([0.5, 0.2, 0.1, 0.05], 32, 5)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (37, 12)]
    if dev == "cpu":  # a resident target reads a ragged batch in runs there, a streamed one padded
        # (``sequoia_decoding.prefill``: other GEMM shapes, other bits), and its prefill's linears of more
        # rows than the loop's calls run torch's GEMM where packed_prefill_pays says no, a streamed
        # one's the packed op; the check compares the weights each forward computes with, so both read
        # the padded batch on the packed op, as on a GPU both run cuBLAS
        from sequoia_decoding import prefill
        from sequoia_kernels.ops import packed_linear

        prefill.runs = lambda lens: [(0, len(lens))]
        packed_linear.packed_prefill_pays = lambda dtype=torch.bfloat16: dtype == torch.bfloat16
    ok = True
    for graphs in (False, True):
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3)):
            a, b = (decode(m, draft, plan, sampling, graphs, prompts) for m in (target, resident))
            same = a == b
            ok &= same
            print(f"decode cuda_graphs={graphs} T={sampling.temperature}: streamed == resident: {same}")
    print("offload_gpu_check:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
