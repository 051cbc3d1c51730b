"""compact_kv_: every backend against the reference, bit for bit, on fresh random inputs."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sequoia_kernels as sk
from sequoia_kernels.reference import compact_kv_reference

from conftest import HAS_CUDA, assert_bitwise_equal, bits, requires_cuda, skip_unless_triton_on_cpu

CPU_BACKENDS = ["cpu", "triton"]


def devices_backends():
    out = [("cpu", b) for b in CPU_BACKENDS]
    if HAS_CUDA:
        out += [("cuda", "cuda"), ("cuda", "triton")]
    return out


def make_case(B, N, H, S, D, M, *, dtype=torch.float16, device="cpu", index_dtype=torch.int64,
              gen=None, accepted=None):
    """A random valid compaction: row b has a prefix of length dst_start[b], a tree of T_b <= M
    nodes right after it, and accepts an increasing subset of the tree slots. Unused columns of
    src_pos hold garbage (the op must ignore them). Destinations that are not also sources are
    poisoned with NaN so that a missed write shows."""
    g = gen or torch.Generator().manual_seed(0)
    cache = torch.randn(N, B, H, S, D, generator=g).to(dtype)
    src = torch.full((B, M), 10**6, dtype=torch.int64)  # garbage beyond num_accepted
    dst = torch.zeros(B, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        T = int(torch.randint(1, min(M, S) + 1, (1,), generator=g))
        p = int(torch.randint(0, S - T + 1, (1,), generator=g))
        n = int(torch.randint(0, T + 1, (1,), generator=g)) if accepted is None else min(accepted[b], T)
        slots = torch.randperm(T, generator=g)[:n].sort().values + p
        src[b, :n] = slots
        dst[b], num[b] = p, n
        poison = set(range(p, p + n)) - set(slots.tolist())
        for pos in poison:
            cache[:, b, :, pos] = float("nan")
    return (cache.to(device), src.to(index_dtype).to(device), dst.to(index_dtype).to(device),
            num.to(index_dtype).to(device))


def run_and_compare(case, backend, **kw):
    cache, src, dst, num = case
    expected = cache.clone()
    compact_kv_reference(expected, src, dst, num)
    out = sk.compact_kv_(cache, src, dst, num, backend=backend, **kw)
    assert out is cache
    assert_bitwise_equal(cache, expected, f"backend={backend}")


def test_reference_semantics_small_overlap():
    # Row 0: tree slots 4..9, accept slots 5, 7, 9 -> positions 4, 5, 6 (5 is both a source and a destination).
    cache = torch.arange(2 * 2 * 1 * 12 * 1, dtype=torch.float32).reshape(2, 2, 1, 12, 1)
    old = cache.clone()
    src = torch.tensor([[5, 7, 9], [2, 3, 0]])
    dst = torch.tensor([4, 2])
    num = torch.tensor([3, 2])
    compact_kv_reference(cache, src, dst, num)
    assert cache[0, 0, 0, 4:7, 0].tolist() == old[0, 0, 0, [5, 7, 9], 0].tolist()
    assert torch.equal(cache[:, 0, :, 7:], old[:, 0, :, 7:])  # tail untouched, not zeroed
    assert torch.equal(cache[:, 1], old[:, 1])  # identity copy


@pytest.mark.parametrize("device,backend", devices_backends())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [64, 128, 80, 96])
def test_backends_match_reference(device, backend, dtype, D):
    g = torch.Generator().manual_seed(hash((backend, str(dtype), D)) % 2**31)
    for B, N, H, S, M in [(1, 2, 1, 17, 5), (3, 4, 3, 61, 16), (2, 6, 2, 40, 40)]:
        run_and_compare(make_case(B, N, H, S, D, M, dtype=dtype, device=device, gen=g), backend)


@pytest.mark.parametrize("device,backend", devices_backends())
def test_zero_and_all_accepted_rows(device, backend):
    g = torch.Generator().manual_seed(1)
    B, N, H, S, D, M = 4, 4, 2, 50, 64, 12
    # row 0: nothing accepted, row 1: all M columns accepted, rows 2, 3: random
    case = make_case(B, N, H, S, D, M, device=device, gen=g, accepted=[0, M, M, 0])
    run_and_compare(case, backend)
    # a 128-node tree, all accepted, maximal overlap with the destinations
    cache = torch.randn(2, 1, 2, 300, 64, generator=g).half().to(device)
    src = (torch.arange(128) * 2 + 7).view(1, -1).to(device)
    run_and_compare((cache, src, torch.tensor([3], device=device), torch.tensor([128], device=device)), backend)


@pytest.mark.parametrize("device,backend", devices_backends())
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_index_dtypes_and_mixed(device, backend, index_dtype):
    g = torch.Generator().manual_seed(2)
    cache, src, dst, num = make_case(3, 2, 2, 33, 64, 9, device=device, gen=g, index_dtype=index_dtype)
    run_and_compare((cache, src, dst.long(), num.int()), backend)


@pytest.mark.parametrize("device,backend", devices_backends())
def test_strided_cache_view(device, backend):
    """The cache may be a view (e.g. a slice of a longer buffer, heads not contiguous)."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(4, 2, 5, 70, 64, generator=g).half().to(device)
    guard = big.clone()
    view = big[:, :, 1:4, 5:45]  # [4, 2, 3, 40, 64], strides of the big buffer
    cache, src, dst, num = make_case(2, 4, 3, 40, 64, 10, device=device, gen=g)
    view.copy_(cache)
    expected = view.clone()
    compact_kv_reference(expected, src, dst, num)
    sk.compact_kv_(view, src, dst, num, backend=backend)
    assert_bitwise_equal(view, expected)
    # nothing outside the view changed
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[:, :, 1:4, 5:45] = False
    assert torch.equal(bits(big)[mask], bits(guard)[mask])


@pytest.mark.parametrize("device,backend", devices_backends())
def test_unchecked_out_of_range_never_escapes(device, backend):
    """validate=False (the captured loop): bad indices are skipped, nothing outside the cache is touched."""
    g = torch.Generator().manual_seed(4)
    big = torch.randn(2, 2, 2, 30, 64, generator=g).to(device)
    before = big.clone()
    view = big[:, :, :, 10:20]  # S = 10, guard positions on both sides
    src = torch.tensor([[-1, 3, 15], [8, 9, 10**6]], device=device)
    dst = torch.tensor([9, 8], device=device)
    num = torch.tensor([5, 3], device=device)  # > M on row 0: clamped to M
    sk.compact_kv_(view, src, dst, num, backend=backend, validate=False)
    assert torch.equal(big[..., :10, :], before[..., :10, :])
    assert torch.equal(big[..., 20:, :], before[..., 20:, :])


BAD_CASES = {
    "src out of range": (lambda s, d, n: (s.fill_(0).copy_(torch.tensor([[3, 4, 99]])), d, n), "src_pos entries"),
    "src negative": (lambda s, d, n: (s.copy_(torch.tensor([[-1, 4, 5]])), d, n), "src_pos entries"),
    "not increasing": (lambda s, d, n: (s.copy_(torch.tensor([[4, 4, 5]])), d, n), "strictly increasing"),
    "src before dst": (lambda s, d, n: (s.copy_(torch.tensor([[3, 5, 6]])), d.fill_(4), n), r"dst_start\[b\] \+ i"),
    "num > M": (lambda s, d, n: (s, d, n.fill_(4)), "num_accepted"),
    "num negative": (lambda s, d, n: (s, d, n.fill_(-1)), "num_accepted"),
    "dst past end": (lambda s, d, n: (s.copy_(torch.tensor([[17, 18, 19]])), d.fill_(18), n), "dst_start"),
}


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_values_raise_and_leave_cache_unchanged(backend, case):
    cache = torch.randn(2, 1, 2, 20, 64)
    before = cache.clone()
    src, dst, num = torch.tensor([[3, 4, 5]]), torch.tensor([2]), torch.tensor([3])
    fn, match = BAD_CASES[case]
    src, dst, num = fn(src, dst, num)
    with pytest.raises(ValueError, match=match):
        sk.compact_kv_(cache, src, dst, num, backend=backend)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c, s, d, n: (c[0], s, d, n), r"\[N, B, H, S, D\]"),
        (lambda c, s, d, n: (c, s[0], d, n), r"src_pos must be \[B, M\]"),
        (lambda c, s, d, n: (c, s, d[:0], n), r"dst_start must be \[B\]"),
        (lambda c, s, d, n: (c, s, d, n.float()), "int32 or int64"),
        (lambda c, s, d, n: (c.int(), s, d, n), "cache dtype"),
        (lambda c, s, d, n: (c, s.to("meta"), d, n), "is on meta"),
        (lambda c, s, d, n: (c.transpose(3, 4), s, d, n), "contiguous"),
        (lambda c, s, d, n: (c, s, d, n.tolist()), "must be a torch.Tensor"),
    ],
)
def test_bad_layout_raises(mutate, match):
    cache = torch.randn(2, 1, 2, 20, 64)
    before = cache.clone()
    args = mutate(cache, torch.tensor([[3, 4, 5]]), torch.tensor([2]), torch.tensor([3]))
    with pytest.raises((ValueError, TypeError), match=match):
        sk.compact_kv_(*args)
    assert torch.equal(cache, before)


def test_unknown_or_unavailable_backend():
    cache, src, dst, num = make_case(1, 2, 1, 10, 64, 4)
    with pytest.raises(ValueError, match="unknown backend"):
        sk.compact_kv_(cache, src, dst, num, backend="tpu")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="not available"):
            sk.compact_kv_(cache, src, dst, num, backend="cuda")


def test_compiled_op_checks_shapes_itself():
    """Direct callers of torch.ops.sequoia_kernels.compact_kv_ get the C++ checks."""
    cache = torch.randn(2, 2, 1, 10, 8)
    with pytest.raises(RuntimeError, match="src_pos must be"):
        torch.ops.sequoia_kernels.compact_kv_(cache, torch.zeros(3, 2, dtype=torch.long),
                                              torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_default_backend_is_compiled_cpu():
    assert sk.available_backends("cpu")[0] == "cpu"


def test_cuda_kernel_registered():
    """The CUDA implementation is compiled in whenever torch is a CUDA build and nvcc was found
    (unless the build was asked for the CPU kernels only: ``SEQUOIA_KERNELS_NO_CUDA=1``)."""
    import os
    import shutil

    if torch.version.cuda is None or not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("CPU-only torch or no nvcc: CUDA kernels are not built")
    if os.environ.get("SEQUOIA_KERNELS_NO_CUDA", "0") not in ("", "0"):
        pytest.skip("SEQUOIA_KERNELS_NO_CUDA: the CPU kernels only")
    assert sk.cuda_compiled()
    assert "CUDA: registered" in torch._C._dispatch_dump("sequoia_kernels::compact_kv_")


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_opcheck(device):
    cache, src, dst, num = make_case(2, 4, 2, 24, 64, 6, device=device)
    torch.library.opcheck(torch.ops.sequoia_kernels.compact_kv_.default, (cache, src, dst, num))


def test_traces_under_torch_compile():
    cache, src, dst, num = make_case(2, 4, 2, 24, 64, 6)
    expected = cache.clone()
    compact_kv_reference(expected, src, dst, num)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(cache, src, dst, num):
        torch.ops.sequoia_kernels.compact_kv_(cache, src, dst, num)
        return cache.sum()

    step(cache, src, dst, num)
    assert_bitwise_equal(cache, expected)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    B=st.integers(1, 4), N=st.integers(1, 4), H=st.integers(1, 5), S=st.integers(1, 64),
    D=st.sampled_from([1, 3, 8, 64, 80]), M=st.integers(1, 20), seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
)
def test_property_cpu_matches_reference(B, N, H, S, D, M, seed, dtype):
    run_and_compare(make_case(B, N, H, S, D, M, dtype=dtype, gen=torch.Generator().manual_seed(seed)), "cpu")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), H=st.integers(1, 3), S=st.integers(1, 40), M=st.integers(1, 12),
       seed=st.integers(0, 2**31 - 1))
def test_property_triton_matches_reference(B, H, S, M, seed):
    skip_unless_triton_on_cpu()
    run_and_compare(make_case(B, 2, H, S, 64, M, gen=torch.Generator().manual_seed(seed)), "triton")


@requires_cuda
def test_cuda_graph_capture_replay():
    """No host sync or allocation inside: capture once, replay with new device-resident counts."""
    g = torch.Generator().manual_seed(5)
    cache, src, dst, num = make_case(2, 4, 2, 64, 128, 16, device="cuda", gen=g, accepted=[5, 9])
    work = cache.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sk.compact_kv_(work, src, dst, num, validate=False)  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sk.compact_kv_(work, src, dst, num, validate=False)
    for n0, n1 in [(0, 3), (5, 1), (2, 2)]:
        work.copy_(cache)
        num.copy_(torch.tensor([n0, n1]))
        graph.replay()
        expected = cache.clone()
        compact_kv_reference(expected, src, dst, num)
        torch.cuda.synchronize()
        assert_bitwise_equal(work, expected)
