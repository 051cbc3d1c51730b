"""One target forward of T(n) tree tokens after a 96-token prefix, four ways in one process,
interleaved round by round so that the machine's drift hits them alike: fp32 on ``packed_linear``,
bf16 on the loop's kernels without the fused row ops (packed linears, the tree attention), bf16
with the fused row ops (``use_fused_bf16``) but each projection its own call and the RoPE computed
per forward, and bf16 as the loop runs it (``sequoia_models``: also the fused projections and the
RoPE tables). Prints each round, then medians and the ratios docs/bf16_cpu.md quotes.
``--unmirrored`` adds bf16 as the loop runs it without the project's mirrors of Llama's attention and
decoder-layer forwards (no fused-projection attention, no lean layers: what a transformers whose
forwards the project does not mirror gets; docs/build.md).

    python bench/bf16_forward.py [--target ~/.cache/sequoia-kernels/smollm2-135m-instruct] [--rounds 7] [--json F]
        [--unmirrored]

``--json F`` also writes the medians, ``{kind: {n: ms}}`` (``bench/cpu_goals.py`` reads them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

from sequoia_decoding.loading import load_causal_lm
from sequoia_decoding.patching import sequoia_models
from sequoia_kernels.hf import SequoiaCache, cache_kw
import sequoia_kernels.ops.fused_projections as fp
import sequoia_kernels.ops.lean_layers as ll
from sequoia_kernels.ops.fused_bf16 import use_fused_bf16
from sequoia_kernels.ops.packed_linear import use_packed_linears

SIZES = (1, 16, 32)
KINDS = (("fp32", "float32"), ("bf16-unfused", "bfloat16"), ("bf16-rowops", "bfloat16"), ("bf16-fused", "bfloat16"))
UNMIRRORED = ("bf16-unmirrored", "bfloat16")


@contextlib.contextmanager
def _unmirrored():
    """Within the block no transformers version's Llama attention / decoder-layer forward is mirrored."""
    saved = ll._MIRRORED, dict(fp._MIRRORED)
    ll._MIRRORED, fp._MIRRORED["attention"] = (), ()
    ll._mirrors.cache_clear(), fp._mirrors.cache_clear()
    try:
        yield
    finally:
        ll._MIRRORED = saved[0]
        fp._MIRRORED.update(saved[1])
        ll._mirrors.cache_clear(), fp._mirrors.cache_clear()


def forwards(path: str, stack: contextlib.ExitStack, kinds=KINDS) -> dict:
    """{(kind, n): a call of one forward of n chain tokens after the prefix}"""
    runs = {}
    for kind, dtype in kinds:
        m = load_causal_lm(path, dtype=dtype, device="cpu")
        if kind in ("bf16-unfused", "bf16-rowops"):
            m.set_attn_implementation("sequoia_tree")
            stack.enter_context(use_packed_linears(m, True, max(SIZES)))
            if kind == "bf16-rowops":
                stack.enter_context(use_fused_bf16(m))
        elif kind == "bf16-unmirrored":
            with _unmirrored():  # (switched on entry)
                stack.enter_context(sequoia_models(m, packed_linears=True, max_rows=max(SIZES)))
        else:
            stack.enter_context(sequoia_models(m, packed_linears=True, max_rows=max(SIZES)))
        cache = SequoiaCache(m.config, batch_size=1, max_cache_len=96 + max(SIZES) + 1,
                             dtype=next(m.parameters()).dtype, validate=False)
        g = torch.Generator().manual_seed(0)
        vocab = m.config.vocab_size
        m(torch.randint(0, vocab, (1, 96), generator=g), **cache_kw(m, cache),
          position_ids=torch.arange(96)[None], use_cache=True)
        cache.commit(96)
        for n in SIZES:
            ids, mask = torch.randint(0, vocab, (1, n), generator=g), torch.ones(n, n, dtype=torch.bool).tril()
            runs[(kind, n)] = (lambda m=m, ids=ids, cache=cache, mask=mask, n=n:
                               m(ids, **cache_kw(m, cache), use_cache=True, **cache.tree_inputs(torch.arange(n), mask)))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.expanduser("~/.cache/sequoia-kernels/smollm2-135m-instruct"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="FILE", help="write the medians here, {kind: {n: ms}}")
    ap.add_argument("--unmirrored", action="store_true",
                    help="also bf16 without the mirrored Llama attention / decoder-layer forwards")
    args = ap.parse_args()
    kinds = KINDS + ((UNMIRRORED,) if args.unmirrored else ())
    torch.set_num_threads(args.threads)
    with contextlib.ExitStack() as stack, torch.inference_mode():
        runs = forwards(args.target, stack, kinds)
        res = {k: [] for k in runs}
        for f in runs.values():
            f(), f()
        for r in range(args.rounds):
            for k, f in runs.items():
                ts = []
                for _ in range(5):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                res[k].append(statistics.median(ts) * 1e3)
            print(f"round {r}:", " ".join(f"{k[0]} T({k[1]})={v[-1]:.1f}" for k, v in res.items()), flush=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    for kind, _ in kinds:
        print(f"{kind}: " + ", ".join(f"T({n}) = {med[(kind, n)]:.1f} ms" for n in SIZES)
              + f"; T(32) / T(1) = {med[(kind, 32)] / med[(kind, 1)]:.2f}")
    print(f"bf16 T(1) / fp32 T(1): fused {med[('bf16-fused', 1)] / med[('fp32', 1)]:.2f}, unfused "
          f"{med[('bf16-unfused', 1)] / med[('fp32', 1)]:.2f}; fused / unfused: T(1) "
          f"{med[('bf16-fused', 1)] / med[('bf16-unfused', 1)]:.2f}, T(32) "
          f"{med[('bf16-fused', 32)] / med[('bf16-unfused', 32)]:.2f}; fused / row ops only (the projections, "
          f"the RoPE tables): T(1) {med[('bf16-fused', 1)] / med[('bf16-rowops', 1)]:.2f}, T(32) "
          f"{med[('bf16-fused', 32)] / med[('bf16-rowops', 32)]:.2f}")
    if args.unmirrored:
        print("unmirrored / fused: " + ", ".join(f"T({n}) {med[('bf16-unmirrored', n)] / med[('bf16-fused', n)]:.2f}"
                                                  for n in SIZES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({kind: {str(n): med[(kind, n)] for n in SIZES} for kind, _ in kinds}, f, indent=2)


if __name__ == "__main__":
    main()
