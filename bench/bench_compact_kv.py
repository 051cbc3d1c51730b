"""compact_kv_ vs the original Sequoia way (a per-layer gather + copy loop), on the CPU.

Shape: 32 layers (N = 64 K/V tensors), 32 KV heads, head dim 128, 2048 positions, fp16,
10 accepted nodes of a 128-node tree. Run with `make bench`; the ratio table is printed by
bench/report.py from the same run.
"""

import pytest
import torch

import sequoia_kernels as sk

LAYERS, HEADS, S, D, TREE, ACCEPTED, PREFIX = 32, 32, 2048, 128, 128, 10, 1500


@pytest.fixture(scope="module")
def case():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2 * LAYERS, 1, HEADS, S, D, generator=g).half()
    slots = torch.randperm(TREE, generator=g)[:ACCEPTED].sort().values
    slots[0] = 0  # the root is always accepted
    src = (PREFIX + slots).view(1, -1)
    dst = torch.tensor([PREFIX])
    num = torch.tensor([ACCEPTED])
    return cache, src, dst, num


def per_layer_loop(cache, src, dst, num):
    """What the original Sequoia code does after verification: one gather/copy per layer, K and V."""
    n = int(num[0])
    d = int(dst[0])
    idx = src[0, :n]
    for layer in range(cache.shape[0] // 2):
        for kv in (cache[2 * layer], cache[2 * layer + 1]):  # [B, H, S, D]
            kv[:, :, d : d + n] = kv.index_select(2, idx)


def test_per_layer_loop(benchmark, case):
    benchmark.group = "compact_kv"
    benchmark(per_layer_loop, *case)


def test_compact_kv_cpu(benchmark, case):
    benchmark.group = "compact_kv"
    benchmark(sk.compact_kv_, *case, backend="cpu")


def test_compact_kv_cpu_unvalidated(benchmark, case):
    benchmark.group = "compact_kv"
    benchmark(sk.compact_kv_, *case, backend="cpu", validate=False)


def test_compact_kv_results_agree(case):
    cache, src, dst, num = case
    a, b = cache.clone(), cache.clone()
    per_layer_loop(a, src, dst, num)
    sk.compact_kv_(b, src, dst, num, backend="cpu")
    assert torch.equal(a, b)
