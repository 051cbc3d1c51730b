"""tree_attention: every backend against the reference on fresh random inputs and random trees.

Caches are NaN-poisoned at positions >= prefix_len + T (must never be read) and `out` buffers
are NaN-poisoned (must be fully written). fp32 is compared tightly (1e-5); fp16/bf16 follow
flash-attention's rule: err(kernel vs fp32 reference) <= 2 x err(naive PyTorch run in that
dtype vs fp32 reference) + eps.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sequoia_kernels  # noqa: F401  (loads the compiled ops)
from sequoia_kernels.ops.tree_attention import (
    TreeAttentionWorkspace,
    tree_attention,
    tree_attention_workspace,
)
from sequoia_kernels.reference.tree_attention import (
    dense_visibility,
    mask_words,
    pack_tree_mask,
    tree_attention_reference,
    unpack_tree_mask,
)

from conftest import HAS_CUDA, requires_cuda, skip_unless_triton_on_cpu
from cpu_paths import cpu_has_amx, outputs_per_path, skip_without_avx512f


try:
    from sequoia_decoding.planner import plan_tree
except ImportError:  # the package is not installed: use the repository's copy
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python_api"))
    try:
        from sequoia_decoding.planner import plan_tree
    except ImportError:
        plan_tree = None

ACCEPTANCE = (0.63, 0.11, 0.06, 0.04, 0.03, 0.02, 0.015, 0.01)


# ---------------------------------------------------------------------------------- trees


def chain_parents(T: int) -> list[int]:
    return [-1] + list(range(T - 1))


def star_parents(T: int) -> list[int]:
    return [-1] + [0] * (T - 1)


def random_parents(T: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def planned_parents(T: int) -> list[int]:
    """A DP-shaped (Sequoia-optimal) tree of exactly T nodes, or a random one without the planner."""
    if plan_tree is None or T == 1:
        return random_parents(T, torch.Generator().manual_seed(T))
    depth = 2
    while True:  # the smallest depth whose plan uses the whole budget
        plan = plan_tree(ACCEPTANCE, T, depth)
        if len(plan.parents) == T:
            return list(plan.parents)
        depth += 1


def parents_to_mask(parents: list[int]) -> torch.Tensor:
    """bool [T, T] ancestor-or-self mask."""
    T = len(parents)
    m = torch.zeros(T, T, dtype=torch.bool)
    for i, q in enumerate(parents):
        if q >= 0:
            m[i] = m[q]
        m[i, i] = True
    return m


def depths(parents: list[int]) -> list[int]:
    d = [0] * len(parents)
    for i, q in enumerate(parents):
        if q >= 0:
            d[i] = d[q] + 1
    return d


def tree_mask(kind: str, T: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        return parents_to_mask(chain_parents(T))
    if kind == "star":
        return parents_to_mask(star_parents(T))
    if kind == "random":
        return parents_to_mask(random_parents(T, gen))
    if kind == "planned":
        return parents_to_mask(planned_parents(T))
    if kind == "self":  # each node sees only itself (and the prefix)
        return torch.eye(T, dtype=torch.bool)
    if kind == "bernoulli":  # not a tree: any pattern, rows may be empty
        return torch.rand(T, T, generator=gen) < 0.4
    raise ValueError(kind)


# --------------------------------------------------------------------------------- inputs


def make_case(B, Hq, Hkv, T, D, S, *, dtype=torch.float32, device="cpu", gen=None, prefix=None,
              mask_kind="random", per_row_mask=False):
    """Random q and a [2, B, Hkv, S, D] cache whose K/V are the (strided) views cache[0], cache[1];
    positions >= prefix_len[b] + T are NaN."""
    g = gen or torch.Generator().manual_seed(0)
    if prefix is None:
        prefix = [int(torch.randint(0, S - T + 1, (1,), generator=g)) for _ in range(B)]
    if torch.device(device).type == "cpu":
        q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
        cache = torch.randn(2, B, Hkv, S, D, generator=g).to(dtype)
    else:  # big GPU cases: generate on the device
        gd = torch.Generator(device).manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
        q = torch.randn(B, Hq, T, D, generator=gd, device=device).to(dtype)
        cache = torch.randn(2, B, Hkv, S, D, generator=gd, device=device).to(dtype)
    for b, p in enumerate(prefix):
        cache[:, b, :, p + T:] = float("nan")
    if per_row_mask:
        mask = torch.stack([tree_mask(mask_kind, T, g) for _ in range(B)])
    else:
        mask = tree_mask(mask_kind, T, g)
    prefix_len = torch.tensor(prefix, dtype=torch.int32)
    return (q.to(device), cache[0].to(device), cache[1].to(device), prefix_len.to(device), mask.to(device))


def naive_lowp(q, k, v, prefix_len, mask, scale=None):
    """Dense-mask attention entirely in q's dtype: the "PyTorch run" of flash-attention's error rule."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = scale or 1 / math.sqrt(D)
    vis = dense_visibility(prefix_len, mask if mask.dim() == 3 else mask[None], S)  # [B, T, S]
    readable = (vis.any(1))[:, None, :, None]
    k = torch.where(readable, k, 0).repeat_interleave(Hq // Hkv, 1)
    v = torch.where(readable, v, 0).repeat_interleave(Hq // Hkv, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~vis[:, None], float("-inf"))
    return torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v  # rows that see nothing: 0


def check_close(out, q, k, v, prefix_len, mask, scale=None, what=""):
    ref = tree_attention_reference(q, k, v, prefix_len, mask, scale).float()
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    err = (out.float() - ref).abs().max().item()
    if q.dtype in (torch.float32, torch.float64):
        assert err <= 1e-5, f"{what}: max abs err {err:.3g} vs the fp32 reference"
    else:
        base = (naive_lowp(q, k, v, prefix_len, mask, scale).float() - ref).abs().max().item()
        eps = 1e-3 if q.dtype == torch.float16 else 8e-3
        assert err <= 2 * base + eps, f"{what}: err {err:.3g} > 2 x {base:.3g} + {eps} (PyTorch {q.dtype} run)"


def backends():
    out = [("cpu", "cpu"), ("cpu", "triton")]
    if HAS_CUDA:
        out += [("cuda", "cuda"), ("cuda", "triton")]
    return out


def run(backend, q, k, v, prefix_len, mask, **kw):
    out = torch.full_like(q, float("nan"))
    res = tree_attention(q, k, v, prefix_len, mask, backend=backend, out=out, **kw)
    assert res is out
    return out


# ---------------------------------------------------------------------------- packed mask


@pytest.mark.parametrize("T", [1, 5, 31, 32, 33, 64, 100, 256])
def test_pack_unpack_round_trip(T):
    g = torch.Generator().manual_seed(T)
    for mask in (torch.rand(T, T, generator=g) < 0.5, torch.rand(3, T, T, generator=g) < 0.5):
        bits = pack_tree_mask(mask)
        assert bits.dtype == torch.int32 and bits.shape == (mask.shape[0] if mask.dim() == 3 else 1, T, mask_words(T))
        back = unpack_tree_mask(bits, T)
        assert torch.equal(back, mask if mask.dim() == 3 else mask[None])


def test_pack_bit_layout():
    mask = torch.zeros(2, 40, 40, dtype=torch.bool)
    mask[0, 0, 0] = True  # word 0 bit 0
    mask[0, 1, 31] = True  # word 0 bit 31: negative word
    mask[0, 2, 32] = True  # word 1 bit 0
    mask[1, 3, 5] = mask[1, 3, 39] = True
    bits = pack_tree_mask(mask)
    assert bits.shape == (2, 40, 2)
    assert bits[0, 0].tolist() == [1, 0]
    assert bits[0, 1].tolist() == [-(2**31), 0]
    assert bits[0, 2].tolist() == [0, 1]
    assert bits[1, 3].tolist() == [1 << 5, 1 << 7]
    assert pack_tree_mask(torch.ones(1, 32, 32, dtype=torch.bool))[0, 0, 0].item() == -1


def test_packed_and_bool_masks_agree():
    g = torch.Generator().manual_seed(7)
    q, k, v, p, m = make_case(2, 2, 1, 9, 64, 30, gen=g, per_row_mask=True)
    a = tree_attention(q, k, v, p, m, backend="reference")
    b = tree_attention(q, k, v, p, pack_tree_mask(m), backend="reference")
    assert torch.equal(a, b)
    # a shared [T, T] mask, as bool, packed [1, T, W] and packed [T, W]
    m1 = m[0]
    ref = tree_attention(q, k, v, p, m1, backend="reference")
    for form in (pack_tree_mask(m1), pack_tree_mask(m1)[0], m1[None].expand(2, 9, 9)):
        assert torch.equal(tree_attention(q, k, v, p, form, backend="reference"), ref)


# ------------------------------------------------------------------------------ reference


def test_reference_matches_sdpa_with_dense_mask():
    """The reference against SDPA with an independently built additive mask, in fp64."""
    g = torch.Generator().manual_seed(11)
    B, Hq, Hkv, T, D, S = 3, 4, 2, 6, 16, 20
    q, k, v, p, m = make_case(B, Hq, Hkv, T, D, S, dtype=torch.float64, gen=g, per_row_mask=True)
    add = torch.full((B, 1, T, S), float("-inf"), dtype=torch.float64)
    for b in range(B):
        pb = int(p[b])
        add[b, 0, :, :pb] = 0
        for i in range(T):
            for j in range(T):
                if m[b, i, j]:
                    add[b, 0, i, pb + j] = 0
    kk, vv = torch.nan_to_num(k), torch.nan_to_num(v)
    expect = F.scaled_dot_product_attention(q, kk.repeat_interleave(2, 1), vv.repeat_interleave(2, 1), attn_mask=add)
    got = tree_attention_reference(q, k, v, p, m)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expect, atol=1e-12, rtol=1e-12)


def test_reference_empty_rows_are_zero():
    g = torch.Generator().manual_seed(12)
    q, k, v, _, _ = make_case(2, 2, 2, 4, 64, 10, gen=g, prefix=[0, 3])
    m = torch.eye(4, dtype=torch.bool)
    m[1, 1] = False  # node 1 sees nothing in row 0 (prefix 0), only the prefix in row 1
    out = tree_attention_reference(q, k, v, torch.tensor([0, 3], dtype=torch.int32), m)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert out[1, :, 1].abs().sum() > 0
    assert not torch.isnan(out).any()


def test_default_backend():
    q, k, v, p, m = make_case(1, 2, 2, 3, 64, 10)
    out = tree_attention(q, k, v, p, m)
    torch.testing.assert_close(out, tree_attention_reference(q, k, v, p, m), atol=1e-5, rtol=0)
    from sequoia_kernels._backend import TRITON_FIRST_ON_CUDA, available_backends, resolve_op_backend

    assert resolve_op_backend("tree_attention", None, "cpu") == "cpu"
    # on CUDA tensors: Triton until a GPU run proves the CUDA kernel (no device needed to ask)
    assert "tree_attention" in TRITON_FIRST_ON_CUDA
    if "triton" in available_backends("cuda"):
        assert resolve_op_backend("tree_attention", None, "cuda") == "triton"
    if "cuda" in available_backends("cuda"):
        assert resolve_op_backend("tree_attention", "cuda", "cuda") == "cuda"  # still selectable


def test_cuda_fallback_reasons():
    """backend='cuda' runs Triton, with a warning, for what the tensor-core kernel does not take."""
    from sequoia_kernels.ops.tree_attention import _cuda_fallback_reason

    def t(*shape, dtype=torch.float16):
        return torch.empty(*shape, dtype=dtype)

    q, kv = t(2, 8, 5, 128), t(2, 2, 64, 128)
    assert _cuda_fallback_reason(q, kv, kv, q) is None
    assert _cuda_fallback_reason(t(2, 8, 5, 64, dtype=torch.bfloat16), t(2, 2, 64, 64, dtype=torch.bfloat16),
                                 t(2, 2, 64, 64, dtype=torch.bfloat16), t(2, 8, 5, 64)) is None
    assert "dtype" in _cuda_fallback_reason(q.float(), kv.float(), kv.float(), q.float())
    assert "head dim 80" in _cuda_fallback_reason(t(2, 8, 5, 80), t(2, 2, 64, 80), t(2, 2, 64, 80), t(2, 8, 5, 80))
    odd = t(2, 2, 64, 129)[..., 1:]  # head dim contiguous, rows misaligned
    assert "aligned" in _cuda_fallback_reason(q, odd, kv, q)


def test_split_heuristics(monkeypatch):
    """CUDA: one split (no merge kernel) once the blocks fill the SMs; more only for small grids.
    Triton: its own rule from its own tiles."""
    from sequoia_kernels.ops import tree_attention as ops
    from sequoia_kernels.triton_kernels.tree_attention import default_num_splits as triton_splits

    monkeypatch.setattr(ops, "_sm_count", lambda index: 132)
    dev = torch.device("cuda", 0)
    # Llama-2-7B heads, T = 128, batch 8: 8 x 32 blocks >= 132 SMs -> the output is written directly
    assert ops.default_num_splits(8, 32, 32, 128, 128, 4224, dev, "cuda") == 1
    # Llama-3-8B heads, T = 128, batch 1: 8 kv heads x 4 blocks of 128 rows = 32 blocks -> 5 splits
    assert ops.default_num_splits(1, 32, 8, 128, 128, 4224, dev, "cuda") == 5
    # a short cache: at most one split per 512 positions
    assert ops.default_num_splits(1, 32, 8, 128, 128, 700, dev, "cuda") == 2
    assert ops.default_num_splits(8, 32, 32, 128, 128, 4224, dev, "triton") == \
        triton_splits(8, 32, 32, 128, 128, 4224, torch.float16, 132) == 1
    assert triton_splits(1, 32, 32, 1, 128, 4224, torch.bfloat16, 132) == 9  # decoding: 32 programs


# ------------------------------------------------------------------------ kernels vs spec


@pytest.mark.parametrize("device,backend", backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_backends_match_reference(device, backend, dtype, D):
    g = torch.Generator().manual_seed(hash((backend, str(dtype), D)) % 2**31)
    cases = [  # B, Hq, Hkv, T, S, mask kind, per-row masks
        (1, 2, 2, 1, 40, "chain", False),  # plain decoding, MHA
        (3, 4, 2, 7, 60, "random", True),  # GQA, rows with different trees and prefixes
        (3, 2, 2, 7, 33, "planned", False),
        (1, 4, 1, 5, 21, "star", False),  # MQA
    ]
    for B, Hq, Hkv, T, S, kind, per_row in cases:
        q, k, v, p, m = make_case(B, Hq, Hkv, T, D, S, dtype=dtype, device=device, gen=g, mask_kind=kind,
                                  per_row_mask=per_row)
        out = run(backend, q, k, v, p, m)
        check_close(out, q, k, v, p, m, what=f"{backend} {dtype} D={D} B={B} Hq={Hq} Hkv={Hkv} T={T} {kind}")


@pytest.mark.parametrize("device,backend", backends())
@pytest.mark.parametrize("kind", ["self", "chain", "star", "planned", "bernoulli"])
def test_mask_kinds_and_empty_rows(device, backend, kind):
    """Masks where nodes see only themselves, any pattern, and rows of prefix 0 that see nothing (zeros)."""
    g = torch.Generator().manual_seed(len(kind))
    q, k, v, p, m = make_case(3, 4, 2, 9, 64, 40, device=device, gen=g, prefix=[0, 5, 31], mask_kind=kind,
                              per_row_mask=True)
    out = run(backend, q, k, v, p, m)
    check_close(out, q, k, v, p, m, what=f"{backend} {kind}")
    empty = ~m[0].any(-1)  # row 0 has no prefix: empty mask rows see nothing at all
    assert torch.equal(out[0][:, empty], torch.zeros_like(out[0][:, empty]))


@pytest.mark.parametrize("device,backend", backends())
def test_big_trees(device, backend):
    """T = 64 and 128 (DP-shaped trees); under the Triton interpreter one case of each."""
    g = torch.Generator().manual_seed(3)
    slow = backend == "triton" and device == "cpu"
    cases = [(3, 4, 2, 64, 100, torch.float32), (1, 2, 1, 128, 150, torch.float32)]
    if not slow:
        cases += [(2, 8, 2, 128, 300, torch.float16), (1, 4, 4, 64, 200, torch.bfloat16)]
    for B, Hq, Hkv, T, S, dtype in cases:
        q, k, v, p, m = make_case(B, Hq, Hkv, T, 64, S, dtype=dtype, device=device, gen=g, mask_kind="planned")
        out = run(backend, q, k, v, p, pack_tree_mask(m))
        check_close(out, q, k, v, p, m, what=f"{backend} T={T} B={B} {dtype}")


@pytest.mark.parametrize("device,backend", backends())
def test_splits_and_workspace(device, backend):
    """KV splits (including more splits than the row has blocks) and preallocated NaN-poisoned workspaces."""
    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, T, D, S = 2, 4, 2, 6, 64, 90
    q, k, v, p, m = make_case(B, Hq, Hkv, T, D, S, device=device, gen=g, prefix=[3, 80], per_row_mask=True)
    bits = pack_tree_mask(m)
    ws = tree_attention_workspace(B, Hq, T, D, 8, device)
    assert isinstance(ws, TreeAttentionWorkspace)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    for ns in (1, 2, 3, 8):
        out = run(backend, q, k, v, p, bits, workspace=ws, num_splits=ns, validate=False)
        check_close(out, q, k, v, p, m, what=f"{backend} num_splits={ns}")
    exact = (torch.full((B, Hq, T, 5, D), float("nan"), device=device), torch.full((B, Hq, T, 5), float("nan"), device=device))
    out = run(backend, q, k, v, p, bits, workspace=exact)
    check_close(out, q, k, v, p, m, what=f"{backend} exact workspace")
    with pytest.raises(ValueError, match="max_splits"):
        tree_attention(q, k, v, p, bits, backend=backend, workspace=ws, num_splits=9)
    small = tree_attention_workspace(1, Hq, T, D, 1, device)
    with pytest.raises(ValueError, match="workspace too small"):
        tree_attention(q, k, v, p, bits, backend=backend, workspace=small)


@pytest.mark.parametrize("device,backend", backends())
def test_strided_views_and_scale(device, backend):
    """K/V as layer views of a [2 x layers, B, H, S, D] cache sliced in S, q a transposed view, a custom scale."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(6, 2, 3, 70, 64, generator=g).to(device)
    k, v = big[2, :, :, 5:55], big[3, :, :, 5:55]  # S = 50
    q = torch.randn(2, 7, 6, 64, generator=g).to(device).transpose(1, 2)  # [B, Hq=6, T=7, D], strided
    p = torch.tensor([43, 10], dtype=torch.int32, device=device)
    m = tree_mask("random", 7, g).to(device)
    out_buf = torch.full((2, 7, 6, 64), float("nan"), device=device)
    out = out_buf.transpose(1, 2)  # a strided out: [B, T, Hq, D] memory, as HF wants it
    res = tree_attention(q, k, v, p, m, scale=0.3, backend=backend, out=out)
    assert res is out
    check_close(out, q, k, v, p, m, scale=0.3, what=f"{backend} strided")


@pytest.mark.parametrize("device,backend", backends())
def test_unvalidated_bad_prefix_never_reads_outside(device, backend):
    """validate=False with prefix_len out of range: no error, and nothing outside the cache view is read."""
    g = torch.Generator().manual_seed(6)
    big = torch.full((2, 2, 2, 60, 64), float("nan"), device=device)
    big[:, :, :, 10:40] = torch.randn(2, 2, 2, 30, 64, generator=g).to(device)
    k, v = big[0, :, :, 10:40], big[1, :, :, 10:40]  # S = 30, NaN on both sides
    q = torch.randn(2, 4, 5, 64, generator=g).to(device)
    m = tree_mask("random", 5, g).to(device)
    for bad in ([-7, 26], [1000, 2**31 - 1], [-(2**31), 30]):
        p = torch.tensor(bad, dtype=torch.int32, device=device)
        if backend == "cpu":  # the C++ CPU kernel checks each row on the host (free on the CPU) and raises
            with pytest.raises(RuntimeError, match="out of range"):
                run(backend, q, k, v, p, m, validate=False)
            continue
        out = run(backend, q, k, v, p, m, validate=False)  # GPU kernels clamp: no error, no stray read
        assert not torch.isnan(out).any(), f"{backend} read outside the cache for prefix_len {bad}"


@pytest.mark.parametrize("device,backend", backends())
def test_int64_prefix_len(device, backend):
    g = torch.Generator().manual_seed(13)
    q, k, v, p, m = make_case(2, 4, 2, 6, 64, 30, device=device, gen=g, per_row_mask=True)
    out = run(backend, q, k, v, p.long(), m)
    check_close(out, q, k, v, p, m, what=f"{backend} int64 prefix_len")


# ------------------------------------------------------------------------------ bad input


def _good():
    q, k, v, p, m = make_case(2, 4, 2, 5, 64, 20, prefix=[3, 15])
    return dict(q=q, k_cache=k, v_cache=v, prefix_len=p, tree_mask=m)


BAD = {
    "mask shape": (lambda a: a.update(tree_mask=a["tree_mask"][:4, :4]), ValueError, r"bool tree_mask must be \[T, tree_len\]"),
    "mask batch": (lambda a: a.update(tree_mask=a["tree_mask"][None].expand(3, 5, 5)), ValueError, "batch size must be 1 or B"),
    "packed words": (lambda a: a.update(tree_mask=torch.zeros(1, 5, 2, dtype=torch.int32)), ValueError, r"W = ceil\(tree_len / 32\) = 1"),
    "mask dtype": (lambda a: a.update(tree_mask=a["tree_mask"].to(torch.uint8)), ValueError, "tree_mask must be bool"),
    "prefix too long": (lambda a: a.update(prefix_len=torch.tensor([3, 16], dtype=torch.int32)), ValueError, r"prefix_len\[b\] \+ T must be <= S = 20"),
    "prefix negative": (lambda a: a.update(prefix_len=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, ">= 0"),
    "prefix shape": (lambda a: a.update(prefix_len=a["prefix_len"][:1]), ValueError, r"prefix_len must be \[B\]"),
    "prefix dtype": (lambda a: a.update(prefix_len=a["prefix_len"].float()), ValueError, "prefix_len must be int32"),
    "head counts": (lambda a: a.update(q=a["q"][:, :3]), ValueError, "multiple of the number of kv heads"),
    "dtype mix": (lambda a: a.update(k_cache=a["k_cache"].half()), ValueError, "k_cache dtype"),
    "device mix": (lambda a: a.update(v_cache=a["v_cache"].to("meta")), ValueError, "v_cache is on meta"),
    "q rank": (lambda a: a.update(q=a["q"][0]), ValueError, r"q must be \[B, Hq, T, D\]"),
    "kv shapes": (lambda a: a.update(v_cache=a["v_cache"][:, :1]), ValueError, "shapes differ"),
    "batch mismatch": (lambda a: a.update(q=a["q"][:1]), ValueError, "do not match"),
    "kv layout": (lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "contiguous"),
    "tree longer than cache": (lambda a: a.update(q=torch.randn(2, 4, 21, 64), tree_mask=torch.ones(21, 21, dtype=torch.bool)), ValueError, "must fit in the cache"),
    "not a tensor": (lambda a: a.update(prefix_len=[3, 15]), TypeError, "must be a torch.Tensor"),
}


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_and_leaves_out_untouched(backend, case):
    args = _good()
    fn, exc, match = BAD[case]
    fn(args)
    out = torch.full((2, 4, 5, 64), 7.0)
    if args["q"].shape == out.shape and args["q"].dtype == out.dtype:
        kw = dict(out=out)
    else:
        kw = {}
    with pytest.raises(exc, match=match):
        tree_attention(**args, backend=backend, **kw)
    assert torch.equal(out, torch.full_like(out, 7.0))


@pytest.mark.parametrize("mutate,match", [
    (lambda out: out.half(), "out must be"),
    (lambda out: out[:, :2], "out must be"),
    (lambda out: out.transpose(2, 3).contiguous().transpose(2, 3), "last dimension of out"),
])
def test_bad_out_raises(mutate, match):
    skip_unless_triton_on_cpu()
    args = _good()
    out = mutate(torch.full((2, 4, 5, 64), 7.0))
    before = out.clone()
    with pytest.raises(ValueError, match=match):
        tree_attention(**args, backend="triton", out=out)
    assert torch.equal(out, before)


def test_bad_backend_and_options():
    skip_unless_triton_on_cpu()
    args = _good()
    with pytest.raises(ValueError, match="unknown backend"):
        tree_attention(**args, backend="tpu")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="not available"):
            tree_attention(**args, backend="cuda")
    with pytest.raises(ValueError, match="head dim 8 is not supported by backend 'triton'"):
        q, k, v, p, m = make_case(1, 2, 2, 3, 8, 10)
        tree_attention(q, k, v, p, m, backend="triton")
    with pytest.raises(ValueError, match="num_splits must lie"):
        tree_attention(**args, backend="triton", num_splits=0)
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported by backend 'triton'"):
        a = {n: (t.double() if t.is_floating_point() else t) for n, t in args.items()}
        tree_attention(**a, backend="triton")


# --------------------------------------------------------------------- compiled op, graphs


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_CUDA else []))
def test_opcheck(device):
    g = torch.Generator().manual_seed(8)
    q, k, v, p, m = make_case(2, 4, 2, 5, 64, 24, device=device, gen=g)
    bits = pack_tree_mask(m)
    ns = 1 if device == "cpu" else 2
    if device == "cuda":  # the CUDA op takes fp16/bf16 (tensor cores); fp32 runs the Triton kernel
        q, k, v = q.half(), k.half(), v.half()
    out = torch.empty_like(q)
    po = torch.empty(2, 4, 5, ns, 64, device=device)
    pl = torch.empty(2, 4, 5, ns, device=device)
    torch.nan_to_num_(k), torch.nan_to_num_(v)
    torch.library.opcheck(torch.ops.sequoia_kernels.tree_attention.default,
                          (q, k.contiguous(), v.contiguous(), p, bits, 5, 0.125, out, po, pl))


def test_traces_under_torch_compile():
    q, k, v, p, m = make_case(2, 4, 2, 5, 64, 24)
    bits = pack_tree_mask(m)
    po, pl = torch.empty(2, 4, 5, 1, 64), torch.empty(2, 4, 5, 1)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, k, v, p, bits, out):
        torch.ops.sequoia_kernels.tree_attention(q, k, v, p, bits, 5, 0.125, out, po, pl)
        return out.sum()

    out = torch.empty_like(q)
    step(q, k, v, p, bits, out)
    check_close(out, q, k, v, p, m, scale=0.125, what="compiled")


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_cuda_graph_capture_replay(backend):
    """No host sync or allocation inside: capture once, replay with new prefix lengths and trees."""
    g = torch.Generator().manual_seed(9)
    B, Hq, Hkv, T, D, S = 2, 32, 8, 64, 128, 2048
    q, k, v, p, m = make_case(B, Hq, Hkv, T, D, S, dtype=torch.float16, device="cuda", gen=g,
                              prefix=[100, 1900], mask_kind="planned")
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    bits = pack_tree_mask(m)
    out = torch.empty_like(q)
    ws = tree_attention_workspace(B, Hq, T, D, 16, "cuda")
    kw = dict(backend=backend, out=out, workspace=ws, validate=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tree_attention(q, k, v, p, bits, **kw)  # warm up (compiles)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_attention(q, k, v, p, bits, **kw)
    for prefix, kind in [([0, 5], "chain"), ([1500, 37], "random"), ([1984, 1984], "star")]:
        p.copy_(torch.tensor(prefix))
        m2 = tree_mask(kind, T, g).cuda()
        bits.copy_(pack_tree_mask(m2))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_close(out, q, k, v, p, m2, what=f"graph {backend} {prefix} {kind}")


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("Hq,Hkv,D", [(32, 32, 128), (32, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("T", [1, 64, 256])
def test_gpu_llama_shapes(backend, Hq, Hkv, D, T):
    """Llama-2-7B (MHA) / Llama-3-8B (GQA) shapes against a 4k-8k prefix, fp16 and bf16."""
    g = torch.Generator().manual_seed(T * Hkv)
    for dtype, prefix in ((torch.float16, [4000, 123]), (torch.bfloat16, [8000 - T, 0])):
        q, k, v, p, m = make_case(2, Hq, Hkv, T, D, 8000, dtype=dtype, device="cuda", gen=g, prefix=prefix,
                                  mask_kind="planned")
        out = run(backend, q, k, v, p, pack_tree_mask(m))
        check_close(out, q, k, v, p, m, what=f"{backend} {dtype} Hq={Hq} Hkv={Hkv} D={D} T={T}")


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("Hq,Hkv,T", [(2, 2, 1), (8, 2, 1), (4, 1, 13), (8, 2, 64), (4, 4, 128), (8, 2, 128)])
@pytest.mark.parametrize("splits", [1, 3])
def test_cuda_tensor_core_kernel(dtype, D, Hq, Hkv, T, splits):
    """The CUDA kernel itself (no Triton fallback: a warning would fail the test): MHA and GQA,
    ragged prefixes (0, short, long), T = 1 .. 128 (4- and 8-warp blocks), per-row masks with
    fully masked rows, one split (direct write) and three (merge kernel)."""
    import warnings

    g = torch.Generator().manual_seed(D * 1000 + T * 10 + Hq + splits)
    q, k, v, p, m = make_case(3, Hq, Hkv, T, D, T + 300, dtype=dtype, device="cuda", gen=g, prefix=[0, 37, 300],
                              mask_kind="bernoulli", per_row_mask=True)
    m[0, 0] = False  # row 0 has no prefix: node 0 sees nothing -> zeros
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run("cuda", q, k, v, p, pack_tree_mask(m), num_splits=splits)
    check_close(out, q, k, v, p, m, what=f"cuda {dtype} D={D} Hq={Hq} Hkv={Hkv} T={T} splits={splits}")
    assert torch.equal(out[0, :, 0], torch.zeros_like(out[0, :, 0]))


@requires_cuda
def test_cuda_backend_falls_back_with_a_warning():
    q, k, v, p, m = make_case(1, 2, 2, 3, 80, 10, dtype=torch.float16, device="cuda")
    import sequoia_kernels.ops.tree_attention as ops

    ops._warned.clear()
    with pytest.warns(UserWarning, match="runs the Triton kernel for head dim 80"):
        out = run("cuda", q, k, v, p, m)
    check_close(out, q, k, v, p, m, what="fallback")


@requires_cuda
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_32k_prefix(backend):
    g = torch.Generator().manual_seed(10)
    q, k, v, p, m = make_case(1, 32, 8, 128, 128, 32768, dtype=torch.bfloat16, device="cuda", gen=g,
                              prefix=[32768 - 128], mask_kind="planned")
    out = run(backend, q, k, v, p, pack_tree_mask(m))
    check_close(out, q, k, v, p, m, what=f"{backend} 32k")


# ------------------------------------------------------------------------------- property


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 3), G=st.sampled_from([1, 2, 3]), Hkv=st.integers(1, 2), T=st.integers(1, 20),
       extra=st.integers(0, 40), D=st.sampled_from([16, 64, 80]), ns=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["random", "bernoulli", "chain", "star"]))
def test_property_triton_matches_reference(B, G, Hkv, T, extra, D, ns, seed, kind):
    skip_unless_triton_on_cpu()
    g = torch.Generator().manual_seed(seed)
    q, k, v, p, m = make_case(B, G * Hkv, Hkv, T, D, T + extra, gen=g, mask_kind=kind, per_row_mask=True)
    out = run("triton", q, k, v, p, m, num_splits=ns)
    check_close(out, q, k, v, p, m, what="property")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 4), G=st.sampled_from([1, 2, 4]), Hkv=st.integers(1, 3), T=st.integers(1, 70),
       extra=st.integers(0, 200), D=st.sampled_from([64, 80, 96, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["random", "bernoulli", "chain", "star", "self"]))
def test_property_cpu_matches_reference(B, G, Hkv, T, extra, D, dtype, seed, kind):
    g = torch.Generator().manual_seed(seed)
    q, k, v, p, m = make_case(B, G * Hkv, Hkv, T, D, T + extra, dtype=dtype, gen=g, mask_kind=kind, per_row_mask=True)
    out = run("cpu", q, k, v, p, m)
    check_close(out, q, k, v, p, m, what="property cpu")


@pytest.mark.parametrize("device,backend", backends())
@pytest.mark.parametrize("Tk,Tq", [(7, 3), (40, 33), (70, 1)])
def test_level_queries_see_the_whole_tree_prefix(device, backend, Tk, Tq):
    """tree_len > T: the queries are the newest T of Tk tree nodes (a draft growing the tree
    level by level); equal to the full-tree result restricted to those rows."""
    g = torch.Generator().manual_seed(Tk * 100 + Tq)
    q_full, k, v, p, m = make_case(2, 4, 2, Tk, 64, Tk + 30, device=device, gen=g, mask_kind="random",
                                   per_row_mask=True)
    expected = tree_attention_reference(q_full, k, v, p, m)[:, :, Tk - Tq:]
    q = q_full[:, :, Tk - Tq:].contiguous()
    rows = m[:, Tk - Tq:]  # [B, Tq, Tk]
    for mask in (rows, pack_tree_mask(rows)):
        out = torch.full_like(q, float("nan"))
        tree_attention(q, k, v, p, mask, backend=backend, tree_len=Tk, out=out)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="tree_len"):
        tree_attention(q, k, v, p, rows, backend=backend)  # mask columns != T without tree_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 40])
def test_cpu_query_is_the_same_bits_alone_and_in_a_tree(dtype, D):
    """Batch invariance of the CPU kernel: a tree node's output equals, bitwise, the output of the
    same query run alone (T = 1) after its prefix and ancestors laid out as plain decoding lays
    them out (contiguous, in path order) - what keeps greedy Sequoia decoding on plain decoding's
    tokens in bf16."""
    g = torch.Generator().manual_seed(D)
    Hq, Hkv, P, S = 6, 2, 37, 128
    parents = random_parents(23, g)
    T = len(parents)
    mask = parents_to_mask(parents)  # [T, T] bool: node i sees its ancestors and itself
    q, k, v, _, _ = make_case(1, Hq, Hkv, T, D, S, dtype=dtype, gen=g, prefix=[P])
    tree_out = run("cpu", q, k, v, torch.tensor([P]), mask)
    for i in range(T):
        path = [j for j in range(T) if mask[i, j]]  # ancestors in index (= depth) order, then i
        k1, v1 = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
        k1[:, :, :P], v1[:, :, :P] = k[:, :, :P], v[:, :, :P]
        k1[:, :, P:P + len(path)], v1[:, :, P:P + len(path)] = k[:, :, [P + j for j in path]], v[:, :, [P + j for j in path]]
        alone = run("cpu", q[:, :, i:i + 1], k1, v1, torch.tensor([P + len(path) - 1]), torch.ones(1, 1, dtype=torch.bool))
        assert torch.equal(alone[:, :, 0], tree_out[:, :, i]), f"node {i} ({dtype}, D={D})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_scores_far_below_the_max(dtype):
    """Scores more than 87 below a row's max (exp underflows: the CPU kernel's vector exp hands
    those lanes to std::exp) give finite outputs equal to the reference's."""
    g = torch.Generator().manual_seed(3)
    q, k, v, p, m = make_case(2, 4, 2, 9, 64, 80, dtype=dtype, gen=g, prefix=[40, 17], mask_kind="random")
    q = (q.float() * 40).to(dtype)
    got = run("cpu", q, k, v, p, m)
    assert torch.isfinite(got).all()
    if dtype == torch.bfloat16:
        check_close(got, q, k, v, p, m, what="far scores bf16")
    else:  # scores of ~10^2: an fp32 score's rounding (~10^-5) moves its weight by that much
        exact = tree_attention_reference(q.double(), k.double(), v.double(), p, m)
        assert (got.double() - exact).abs().max() <= 3e-4


_PATHS_SCRIPT = """
import sys, torch
from sequoia_kernels.ops.tree_attention import tree_attention
cases = torch.load(sys.argv[1])
outs = []
for q, k, v, p, m in cases:
    out = torch.full_like(q, float("nan"))
    tree_attention(q, k, v, p, m, backend="cpu", out=out)
    outs.append(out)
torch.save(outs, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_vector_paths_give_the_same_bits(dtype, tmp_path):
    """The AVX-512 path (16 queries in the lanes) runs, lane for lane, the AVX2 path's operations
    (8 lanes): every output is the same bits on either (ragged prefixes, per-row random masks,
    strided caches, D = 64 / 80 / 128, scores far below a row's max for exp's fallback lanes).
    Each path in its own process, chosen by ATEN_CPU_CAPABILITY (read once per process)."""
    skip_without_avx512f()
    g = torch.Generator().manual_seed(17)
    cases = []
    for B, G, Hkv, T, D, S, kind in [(1, 3, 3, 1, 64, 130, "chain"), (1, 3, 3, 32, 64, 130, "chain"),
                                     (2, 3, 1, 17, 64, 90, "random"), (3, 2, 2, 40, 128, 200, "bernoulli"),
                                     (2, 1, 3, 5, 80, 60, "self"), (1, 4, 2, 70, 64, 300, "star")]:
        q, k, v, p, m = make_case(B, G * Hkv, Hkv, T, D, S, dtype=dtype, gen=g, mask_kind=kind, per_row_mask=True)
        if kind == "random":
            q = (q.float() * 40).to(dtype)  # scores ~10^2 apart: exp's std::exp lanes
        cases.append((q, k, v, p, m))
    outs = outputs_per_path(_PATHS_SCRIPT, cases, tmp_path)
    for i, (a, b) in enumerate(zip(outs["avx2"], outs["avx512"])):
        assert not torch.isnan(a).any(), f"case {i}: NaN left in out"
        assert torch.equal(a, b), f"case {i} ({dtype}): paths differ by {(a.double() - b.double()).abs().max()}"
        check_close(b, *cases[i], what=f"avx512 case {i}")


def test_cpu_amx_scores_on_emulated_tiles(tmp_path):
    """``SEQUOIA_KERNELS_AMX=emulate`` takes the AMX path on any AVX-512F CPU, its scores' tile
    code on software tiles (``cpu::EmuTiles``): near the fp64 reference, other roundings than the
    AVX-512 path's FMA chains somewhere (the path was taken), and on an AMX CPU the hardware's bits.
    (``scripts/test.sh`` runs the CPU kernels' tests so too: batch invariance on emulated tiles.)"""
    skip_without_avx512f()
    g = torch.Generator().manual_seed(29)
    cases = []
    for B, G, Hkv, T, D, S, kind in [(1, 3, 3, 1, 64, 130, "chain"), (2, 3, 1, 17, 64, 90, "random"),
                                     (3, 2, 2, 40, 128, 200, "bernoulli"), (1, 4, 2, 70, 32, 300, "star"),
                                     (2, 1, 1, 9, 256, 61, "self")]:
        cases.append(make_case(B, G * Hkv, Hkv, T, D, S, dtype=torch.bfloat16, gen=g, mask_kind=kind,
                               per_row_mask=True))
    outs = outputs_per_path(_PATHS_SCRIPT, cases, tmp_path, caps=("avx512", "emulate", "all"))
    for i, out in enumerate(outs["emulate"]):
        assert not torch.isnan(out).any(), f"case {i}: NaN left in out"
        check_close(out, *cases[i], what=f"emulated AMX case {i}")
    assert any(not torch.equal(a, b) for a, b in zip(outs["avx512"], outs["emulate"])), "the AMX path was not taken"
    if cpu_has_amx():
        for i, (a, b) in enumerate(zip(outs["all"], outs["emulate"])):
            assert torch.equal(a, b), f"case {i}: the emulated tiles are not the hardware's bits"


def test_machine_code_of_the_amx_scores():
    """Static (objdump) check: the bf16 attention's AMX scores issue tile products (tdpbf16ps)
    into four C tiles, one per block of 16 keys (tmm4 .. tmm7, so four blocks' products pipeline),
    with the keys' tiles alternating between tmm0 and tmm1, and the AVX-512 path's scores are FMAs
    on zmm registers with the key element broadcast from memory ({1to16})."""
    import re

    from machine_code import function_body

    def body(name):
        return function_body(name, skip_missing=True)

    amx = body("scores_amx<sequoia_kernels::cpu::HwTiles>(")
    products = set(re.findall(r"tdpbf16ps %tmm(\d),%tmm(\d),%tmm(\d)", amx))  # AT&T: B, A, C
    assert {c for _, _, c in products} == {"4", "5", "6", "7"}, products
    assert {a for _, a, _ in products} == {"0", "1"} and {b for b, _, _ in products} == {"2", "3"}, products
    assert amx.count("tilestored") >= 4 and "tileloadd" in amx
    # the same code on emulated tiles (SEQUOIA_KERNELS_AMX=emulate) has no tile instruction
    emulated = body("scores_amx<sequoia_kernels::cpu::EmuTiles>(")
    assert not re.search(r"%tmm|^\s*[0-9a-f]+:\s+(tile|tdp|ldtilecfg|sttilecfg)", emulated, re.M)
    avx512 = body("attend16_avx512(")
    assert len(re.findall(r"vfmadd231ps .*\{1to16\},%zmm", avx512)) >= 8
