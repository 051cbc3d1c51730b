"""GPU-side sampling kernels against their spec (sequoia_kernels/reference/sampling.py): the Triton
one-pass sample_children (under the CPU interpreter here, compiled on a GPU), and the CUDA
sampling_probs / sample_children kernels (skipped without a CUDA device and a CUDA build).
Random ops are checked statistically as well as against the reference given the same uniforms."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from conftest import HAS_CUDA

from sequoia_kernels._backend import compiled_op_available, triton_interpreted
from sequoia_kernels.ops.sampling import sample_children, sampling_probs
from sequoia_kernels.random import counters_used, new_state, philox_uniforms
from sequoia_kernels.reference.sampling import child_keys, sample_children_reference, sampling_probs_reference

CUDA_OPS = HAS_CUDA and compiled_op_available("cuda", "sampling_probs") and compiled_op_available(
    "cuda", "sample_children")
requires_cuda_ops = pytest.mark.skipif(not CUDA_OPS, reason="needs a CUDA device and the CUDA build of "
                                                            "sequoia_kernels._C (sampling ops)")
TRITON_DEV = "cuda" if HAS_CUDA else "cpu"


def triton_ok():
    if not HAS_CUDA and not triton_interpreted():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")


def random_q(R, V, seed, zero_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(R, V, generator=g) * 2, -1)
    q[torch.rand(R, V, generator=g) < zero_frac] = 0.0
    q[0] = 0.0  # no eligible token
    q[1 % R, :] = 0.0
    q[1 % R, V // 2] = 1.0  # one eligible token
    return q, 1 - torch.rand(R, V, generator=g), g


def assert_children_match(ref, got, q, u):
    """Equal, except where two keys agree to fp32 rounding (device log vs torch.log)."""
    got = got.cpu()
    assert torch.equal(ref >= 0, got >= 0)
    if torch.equal(ref, got):
        return
    keys = child_keys(q.cpu(), u.cpu()).double()
    for r in (ref != got).any(1).nonzero()[:, 0].tolist():
        i = int((ref[r] != got[r]).nonzero()[0])
        ka, kb = float(keys[r, ref[r, i]]), float(keys[r, got[r, i]])
        assert abs(ka - kb) <= 1e-5 * max(ka, kb), (r, ref[r].tolist(), got[r].tolist())


# ----------------------------------------------------------------- Triton one-pass sample_children


def assert_first_two_without_replacement(tok: torch.Tensor, q: torch.Tensor) -> None:
    """``tok [N, >= 2]``: the first two children of N rows drawn from ``q`` without replacement.
    Nothing outside q's support, and chi-square tests (p > 1e-4) of the first child against
    q / S and of the (first, second) pairs against q_i / S * q_j / (S - q_i)."""
    N, V = tok.shape[0], q.numel()
    S = q.double().sum()
    first = q.double() / S
    pair = first[:, None] * q.double()[None, :] / (S - q.double())[:, None]
    pair.fill_diagonal_(0)
    for obs, exp in ((torch.bincount(tok[:, 0], minlength=V), first),
                     (torch.bincount(tok[:, 0] * V + tok[:, 1], minlength=V * V), pair.flatten())):
        m = exp > 0
        assert obs[~m].sum() == 0
        pval = stats.chisquare(obs[m].double().numpy(), (exp[m] / exp[m].sum() * N).numpy()).pvalue
        assert pval > 1e-4, pval


@pytest.mark.parametrize("V,block_v,K", [(7, 16, 5), (50, 16, 8), (301, 32, 3), (301, 64, 64), (257, 16, 1)])
def test_triton_onepass_children_match_reference(V, block_v, K):
    """Several chunks per row (block_v << V), rows whose flat start is not a multiple of 4 (the
    Philox chunks are shifted), K up to the one-pass limit."""
    triton_ok()
    from sequoia_kernels.triton_kernels.sampling import sample_children_triton

    R = 6
    q, u, g = random_q(R, V, seed=V + K)
    counts = torch.randint(0, K + 1, (R,), generator=g)
    counts[2] = K
    ref = sample_children_reference(q, counts, K, u)
    out = torch.full((R, K), -7, dtype=torch.int64)
    sample_children_triton(q.to(TRITON_DEV), counts.to(TRITON_DEV), out := out.to(TRITON_DEV),
                           uniforms=u.to(TRITON_DEV), block_v=block_v)
    assert_children_match(ref, out, q, u)
    # Philox in registers, four words per call: the numbers of philox_uniforms(seed, offset, (R, V))
    seed, offset = new_state(5, offset=3)
    uu = philox_uniforms(seed, offset, (R, V))
    ref = sample_children_reference(q, counts, K, uu)
    out = torch.full((R, K), -7, dtype=torch.int64, device=TRITON_DEV)
    sample_children_triton(q.to(TRITON_DEV), counts.to(TRITON_DEV), out, seed=seed.reshape(()).to(TRITON_DEV),
                           offset=offset.reshape(()).to(TRITON_DEV), block_v=block_v)
    assert torch.equal(out.cpu(), ref), "Philox uniforms differ from philox_uniforms"


def test_triton_children_k_above_onepass_limit():
    """K > 64 takes the K-pass kernel; same results."""
    triton_ok()
    R, V, K = 3, 90, 70
    q, u, g = random_q(R, V, seed=1, zero_frac=0.1)
    counts = torch.tensor([K, 65, 3])
    ref = sample_children(q, counts, max_children=K, uniforms=u, backend="reference")
    got = sample_children(q.to(TRITON_DEV), counts.to(TRITON_DEV), max_children=K, uniforms=u.to(TRITON_DEV),
                          backend="triton")
    assert_children_match(ref, got, q, u)


def test_triton_onepass_exact_without_replacement():
    """The first two children follow the exact without-replacement law (chi-square), with the
    in-register Philox numbers (seed, offset) and rows not aligned to the counter grid (V = 10)."""
    triton_ok()
    q = torch.tensor([0.5, 0.0, 0.3, 0.05, 0.9, 0.0, 0.2, 0.15, 0.4, 0.01])
    N, V = 300 if not HAS_CUDA else 200_000, q.numel()  # the interpreter runs a program per row
    seed, offset = new_state(77)
    tok = sample_children(q.expand(N, V).contiguous().to(TRITON_DEV), 2, seed=seed.to(TRITON_DEV),
                          offset=offset.to(TRITON_DEV), backend="triton").cpu()
    assert offset.item() == counters_used(N * V) or TRITON_DEV == "cuda"
    assert_first_two_without_replacement(tok, q)


# ---------------------------------------------------------------------------------- CUDA kernels


def probs_close(got, ref, logits, temperature, top_k, top_p):
    """Same support except tokens on the top-p boundary (mass above within 1e-5 of top_p);
    values equal up to fp32 exp / rounding."""
    got, ref = got.cpu(), ref.cpu()
    diff = (got > 0) != (ref > 0)
    if diff.any():
        assert top_p < 1, "supports differ without top-p"
        y = (logits.float() - logits.float().amax(-1, keepdim=True)) / temperature
        if 0 < top_k < y.shape[-1]:
            y = y.masked_fill(y < y.topk(top_k, -1).values[..., -1:], -float("inf"))
        e = torch.softmax(y.double(), -1)
        for r, v in diff.nonzero().tolist():  # mass strictly above each differing token
            above = float(e[r][y[r] > y[r, v]].sum())
            assert abs(above - top_p) < 1e-5, f"support differs away from the top-p boundary at {(r, v)}"
        return
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)


SETTINGS = [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.3, 5, 1.0), (1.0, 0, 0.9), (0.7, 20, 0.8), (1.3, 3, 0.5),
            (0.0, 0, 1.0), (1.0, 1, 1.0), (1.0, 0, 1e-6), (0.5, 1000, 0.95)]


@requires_cuda_ops
@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
@pytest.mark.parametrize("V", [7, 1000, 32000])
def test_cuda_sampling_probs_matches_reference(V, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(V + top_k)
    logits = torch.randn(5, V, generator=g) * 3
    logits[0, : V // 3] = -float("inf")
    logits[1, : V // 2] = 1.5  # many ties (top-k and top-p boundaries inside a tie group)
    ref = sampling_probs_reference(logits, temperature, top_k, top_p)
    out = torch.full((5, V), float("nan"), device="cuda")
    got = sampling_probs(logits.cuda(), temperature=temperature, top_k=top_k, top_p=top_p, backend="cuda", out=out)
    probs_close(got, ref, logits, max(temperature, 1e-9), top_k, top_p)


@requires_cuda_ops
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_cuda_sampling_probs_dtypes(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 128256, generator=g) * 2).to(dtype)
    ref = sampling_probs_reference(logits, 0.8, 40, 0.9)
    got = sampling_probs(logits.cuda(), temperature=0.8, top_k=40, top_p=0.9, backend="cuda")
    probs_close(got, ref, logits.float(), 0.8, 40, 0.9)


@requires_cuda_ops
@pytest.mark.parametrize("V,K", [(7, 5), (50, 8), (3000, 8), (32000, 16), (128256, 4), (100, 100)])
def test_cuda_sample_children_matches_reference(V, K):
    R = 9
    q, u, g = random_q(R, V, seed=V)
    counts = torch.randint(0, K + 1, (R,), generator=g)
    counts[2] = K
    ref = sample_children_reference(q, counts, K, u)
    out = torch.full((R, K), -7, dtype=torch.int64, device="cuda")
    for c in (counts, counts.to(torch.int32)):
        got = sample_children(q.cuda(), c.cuda(), max_children=K, uniforms=u.cuda(), backend="cuda", out=out)
        assert_children_match(ref, got, q, u)


@requires_cuda_ops
def test_cuda_sample_children_exact_without_replacement():
    q = torch.tensor([0.5, 0.0, 0.3, 0.05, 0.9, 0.0, 0.2, 0.15, 0.4, 0.01])
    N, V = 200_000, q.numel()
    seed, offset = new_state(78, device="cuda")
    tok = sample_children(q.expand(N, V).contiguous().cuda(), 2, seed=seed, offset=offset, backend="cuda").cpu()
    assert_first_two_without_replacement(tok, q)


@requires_cuda_ops
def test_cuda_sampling_ops_opcheck_and_graph():
    logits = torch.randn(4, 500, device="cuda")
    out = torch.empty(4, 500, device="cuda")
    torch.library.opcheck(torch.ops.sequoia_kernels.sampling_probs.default, (logits, 0.7, 20, 0.9, out),
                          test_utils=("test_schema", "test_faketensor"))
    q = torch.softmax(logits, -1)
    u = 1 - torch.rand(4, 500, device="cuda")
    n = torch.tensor([3, 0, 5, 1], device="cuda")
    o = torch.empty(4, 5, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.sequoia_kernels.sample_children.default, (q, n, u, o),
                          test_utils=("test_schema", "test_faketensor"))
    # CUDA graph: captured once, replays compute the same as eager calls
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.ops.sequoia_kernels.sampling_probs(logits, 0.7, 20, 0.9, out)
        torch.ops.sequoia_kernels.sample_children(q, n, u, o)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        torch.ops.sequoia_kernels.sampling_probs(logits, 0.7, 20, 0.9, out)
        torch.ops.sequoia_kernels.sample_children(q, n, u, o)
    logits.copy_(torch.randn(4, 500, device="cuda"))
    u.copy_(1 - torch.rand(4, 500, device="cuda"))
    gr.replay()
    torch.cuda.synchronize()
    probs_close(out, sampling_probs_reference(logits.cpu(), 0.7, 20, 0.9), logits.cpu(), 0.7, 20, 0.9)
    assert_children_match(sample_children_reference(q.cpu(), n.cpu(), 5, u.cpu()), o, q, u)


# ------------------------------------------------------------- Triton sampling_probs (radix top-k)


@pytest.mark.parametrize("top_k", [1, 2, 7, 64, 500, 2999])
def test_triton_radix_topk_ties_and_infinities(top_k):
    """The 4-pass radix select keeps exactly the keys >= the top_k-th largest (ties kept): rows
    with a large tie group across the boundary, -inf logits, values differing in the last bit
    (they differ only in the low digit), several chunks (V = 3000)."""
    triton_ok()
    V = 3000
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(4, V, generator=g) * 3
    logits[0, : V // 2] = -float("inf")
    logits[1, 100:700] = 2.0  # a 600-wide tie group
    base = torch.tensor(1.25)
    logits[2, :64] = torch.nextafter(base.expand(64), torch.tensor(10.0)) * torch.linspace(1, 1 + 1e-6, 64)
    logits[3] = logits[3].round()  # few distinct values: big ties everywhere
    ref = sampling_probs_reference(logits, 0.8, top_k, 1.0)
    got = sampling_probs(logits.to(TRITON_DEV), temperature=0.8, top_k=top_k, backend="triton").cpu()
    assert torch.equal(got > 0, ref > 0), "different top-k support"
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-4)


# ------------------------------------------------- model of the CUDA radix thresholds (runs here)


def _okey_u32(y: torch.Tensor) -> torch.Tensor:
    """The CUDA kernel's okey: order-preserving uint32 image of fp32 y (-0.0 as +0.0), in int64."""
    y = torch.where(y == 0, torch.zeros_like(y), y)
    b = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 0x80000000, (~b) & 0xFFFFFFFF, b | 0x80000000)


def cuda_radix_thresholds(y: torch.Tensor, top_k: int, top_p: float) -> int:
    """Line-by-line model of sampling_probs_kernel's two radix searches for one row (fp32 y):
    returns the key threshold tau (keep = key >= tau)."""
    V = y.numel()
    k = _okey_u32(y)
    tau = 0
    if 0 < top_k < V:
        prefix, need = 0, top_k
        for shift in (24, 16, 8, 0):
            hmask = 0 if shift == 24 else (0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF
            m = (k & hmask) == prefix
            cnt = torch.bincount(((k[m] >> shift) & 255), minlength=256).tolist()
            above, d = 0, 255
            while d > 0:
                if above + cnt[d] >= need:
                    break
                above += cnt[d]
                d -= 1
            prefix |= d << shift
            need -= above
        tau = prefix
    if top_p < 1:
        e = torch.exp(y).double()
        prefix, above, PZ = 0, 0.0, 0.0
        for shift in (24, 16, 8, 0):
            hmask = 0 if shift == 24 else (0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF
            m = (k >= tau) & ((k & hmask) == prefix)
            if shift == 24:
                PZ = top_p * float(e[m].sum())
            h = torch.zeros(256, dtype=torch.float64).index_add_(0, (k[m] >> shift) & 255, e[m]).tolist()
            acc, f_at, pick = above, above, 255
            for d in range(255, -1, -1):
                if not acc < PZ:
                    break
                pick, f_at = d, acc
                acc += h[d]
            prefix |= pick << shift
            above = f_at
        tau = max(tau, prefix)
    return tau


@pytest.mark.parametrize("top_k,top_p", [(0, 0.9), (0, 0.5), (0, 1e-6), (50, 1.0), (1, 1.0), (20, 0.8), (3, 0.5),
                                         (1000, 0.95), (0, 0.999)])
def test_cuda_radix_threshold_model_matches_reference(top_k, top_p):
    """The digit-by-digit top-k / top-p threshold searches of the CUDA sampling_probs kernel,
    modelled in torch, keep exactly the reference's set (up to the top-p boundary's rounding):
    random rows, -inf logits, wide tie groups, few distinct values."""
    g = torch.Generator().manual_seed(top_k + int(top_p * 1000))
    V = 700
    logits = torch.randn(5, V, generator=g) * 3
    logits[0, :300] = -float("inf")
    logits[1, 100:400] = 1.0
    logits[2] = logits[2].round()
    logits[3] = (logits[3] * 1e-5).round() * 1e-5  # tiny differences
    temp = 0.7
    ref = sampling_probs_reference(logits, temp, top_k, top_p)
    for r in range(5):
        x = logits[r].float()
        y = (x - x.max()) / torch.tensor(temp, dtype=torch.float32)
        keep = _okey_u32(y) >= cuda_radix_thresholds(y, top_k, top_p)
        diff = keep != (ref[r] > 0)
        if diff.any():
            assert top_p < 1, f"row {r}: top-k set differs"
            e = torch.softmax(torch.where(_okey_u32(y) >= cuda_radix_thresholds(y, top_k, 1.0), y,
                                          torch.tensor(-float("inf"))).double(), -1)
            for v in diff.nonzero()[:, 0].tolist():
                assert abs(float(e[y > y[v]].sum()) - top_p) < 1e-5, f"row {r} token {v} away from the boundary"


def cuda_children_model(q: torch.Tensor, u: torch.Tensor, nch: int, K: int, threads: int = 8) -> list[int]:
    """Line-by-line model of sample_children_kernel for one row: thread t owns tokens t,
    t + threads, ...; its head is its smallest eligible (key, index); each round takes the
    minimum head, and the owner's next head is its smallest pair strictly above the one given up."""
    V = q.numel()
    keys = child_keys(q[None], u[None])[0].tolist()

    def head(t, above=(-float("inf"), -1)):
        best = (float("inf"), V)
        for v in range(t, V, threads):
            k = keys[v]
            if k != float("inf") and (k, v) > above:
                best = min(best, (k, v))
        return best

    heads = [head(t) for t in range(threads)]
    out, done = [], False
    for i in range(K):
        tok = -1
        if i < nch and not done:
            win = min(heads)
            if win[1] < V:
                tok = win[1]
                heads[win[1] % threads] = head(win[1] % threads, win)
            else:
                done = True
        out.append(tok)
    return out


@pytest.mark.parametrize("V,K,threads", [(7, 5, 8), (50, 8, 8), (301, 12, 16), (64, 64, 8)])
def test_cuda_children_model_matches_reference(V, K, threads):
    R = 6
    q, u, g = random_q(R, V, seed=V + K, zero_frac=0.3)
    u[3, : V // 2] = 0.5  # equal uniforms and q: key ties, lower index first
    q[3, : V // 2] = 0.01
    counts = torch.randint(0, K + 1, (R,), generator=g)
    counts[2] = K
    ref = sample_children_reference(q, counts, K, u)
    got = torch.tensor([cuda_children_model(q[r], u[r], int(counts[r]), K, threads) for r in range(R)])
    assert torch.equal(got, ref)
