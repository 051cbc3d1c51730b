"""What keeping a TP target's ranks in step costs, per decoding step, on this machine's backend.

    torchrun --nproc-per-node 2 bench/tp_collectives.py [--iters 2000]

Times, on every rank, the collectives the two designs would add to a step: seeded ranks (ours:
nothing per step; a re-planning loop all-reduces one float, the step time) against rank 0
broadcasting its step decision ([B, T] tree tokens, path, bonus: int64) every step. Prints rank
0's medians in microseconds."""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    dist.barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rows = []
    step_time = torch.zeros(1, dtype=torch.float64)
    rows.append(("all-reduce of the step time (adaptive only)", timed(
        lambda: dist.all_reduce(step_time, op=dist.ReduceOp.MAX), args.iters)))
    for B, T in ((1, 8), (1, 64), (8, 64)):
        decision = torch.zeros(2 * B * T + 2 * B, dtype=torch.int64)  # tokens, path, num, bonus
        rows.append((f"broadcast of a step's decision, B={B}, T={T} ({decision.numel() * 8} bytes)",
                     timed(lambda d=decision: dist.broadcast(d, src=0), args.iters)))
    if dist.get_rank() == 0:
        print(f"gloo, {dist.get_world_size()} ranks, median of {args.iters}:")
        for name, us in rows:
            print(f"  {name}: {us:.1f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
