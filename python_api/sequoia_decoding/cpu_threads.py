"""How many intra-op threads a decoding call on the CPU can use: the cores other processes
leave free (Linux ``/proc``), re-read every ``THREADS_CHECK_STEPS`` steps.

A step makes ~2,000-4,000 framework calls, each an OpenMP region whose threads wait for each
other: with one thread sharing its core with another process every region waits for the
scheduler (measured on 2 cores beside one busy process: 6.0 tok/s with 2 threads, 18.9 with 1,
21-23 with 2 on a quiet machine).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import torch

__all__ = ["THREADS_CHECK_STEPS", "busy_cores", "adapted_threads", "ThreadAdapter"]

THREADS_CHECK_STEPS = 32  # how often a call re-reads the machine's load


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable) now, from /proc/self/task: its
    OpenMP workers keep spinning for a while after each parallel region."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        state = st.rindex(")") + 2  # the field after "(comm)", which may itself hold ")"
        n += st[state:state + 1] == "R"
    return n


def busy_cores(samples: int = 5, interval_s: float = 0.001) -> int | None:
    """How many cores *other* processes keep busy right now (Linux): the fewest runnable tasks seen
    in ``samples`` reads of /proc/stat's ``procs_running`` ``interval_s`` apart, minus this
    process's own runnable threads at each read (the reading thread, and OpenMP workers still
    spinning after a parallel region: counting those made a decoding call drop to one thread on a
    quiet machine, 25% slower, at its first re-check mid-generation). A read of none busy ends the
    reads (the fewest can go no lower): on a quiet machine one read, no sleep (the five cost ~4 ms
    of every ``generate`` call). None elsewhere."""
    seen = []
    try:
        for i in range(samples):
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("procs_running"):
                        seen.append(int(line.split()[1]) - _own_running_threads())
                        break
            if (seen and seen[-1] <= 0) or i + 1 == samples:
                break
            time.sleep(interval_s)
    except (OSError, ValueError):
        return None
    return max(0, min(seen)) if seen else None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class ThreadAdapter:
    """The intra-op thread count of one call: at most the cores other processes leave free,
    never more than torch's setting when the call began (``threads0``)."""

    def __init__(self, threads0: int):
        self.threads0 = threads0

    def adapt(self) -> None:
        busy = busy_cores()
        if busy is None:
            return
        want = max(1, min(self.threads0, _usable_cores() - busy))
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    def step(self, k: int) -> None:
        """Before step ``k``: re-read the machine's load every ``THREADS_CHECK_STEPS`` steps."""
        if k % THREADS_CHECK_STEPS == THREADS_CHECK_STEPS - 1:
            self.adapt()


@contextlib.contextmanager
def adapted_threads(enabled: bool) -> Iterator[ThreadAdapter | None]:
    """Within the block, torch runs on the cores other processes leave free (checked now, and by
    the caller's ``ThreadAdapter.step`` later); torch's thread count is restored on exit. Yields
    None when not ``enabled``."""
    if not enabled:
        yield None
        return
    adapter = ThreadAdapter(torch.get_num_threads())
    try:
        adapter.adapt()
        yield adapter
    finally:
        if torch.get_num_threads() != adapter.threads0:
            torch.set_num_threads(adapter.threads0)
