"""verify_tree: exactness (statistically, against the target's exact chain distribution),
greedy, backend agreement given the same uniforms, edge cases, random-number sources, bad
input, EOS. Spec and proof: sequoia_kernels/reference/verify_tree.py."""

from __future__ import annotations

import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from conftest import HAS_CUDA, assert_bitwise_equal, cpu_backends, requires_cuda, skip_unless_triton_on_cpu

try:
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree
except ImportError:  # python_api not installed yet: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree

from scipy import stats

from sequoia_kernels.ops.sampling import sample_children, sampling_probs
from sequoia_kernels._backend import compiled_op_available
from sequoia_kernels.ops.verify_tree import verify_tree
from sequoia_kernels.random import counters_used, new_state, philox_uniforms
from sequoia_kernels.reference.verify_tree import verify_tree_reference

COMPILED = compiled_op_available("cpu", "verify_tree")
assert COMPILED, "sequoia_kernels._C must register verify_tree (rebuild the extension)"


def backends_under_test():
    out = [pytest.param("cpu", "triton", id="cpu-triton"),
           pytest.param("cpu", "cpu", id="cpu-cpu")]
    if HAS_CUDA:
        out += [pytest.param("cuda", "triton", id="cuda-triton"),
                pytest.param("cuda", "cuda", id="cuda-cuda")]
    return out


# ----------------------------------------------------------------------------- trees, cases


def planner_tree(budget: int, depth: int) -> list[int]:
    return list(plan_tree(DEFAULT_ACCEPTANCE, budget, depth).parents)


def star(k: int) -> list[int]:
    return [-1] + [0] * k


def chain(d: int) -> list[int]:
    return [-1] + list(range(d - 1))


def random_topological(T: int, seed: int) -> list[int]:
    """A random tree in topological but not BFS order: sibling groups are consecutive, but a
    node's children may come before those of a shallower node (e.g. [-1, 0, 0, 2, 2, 1, 1])."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1]
    leaves = [0]
    while len(parents) < T:
        u = leaves.pop(int(torch.randint(0, len(leaves), (1,), generator=g)))
        k = min(int(torch.randint(1, 4, (1,), generator=g)), T - len(parents))
        leaves += list(range(len(parents), len(parents) + k))
        parents += [u] * k
    return parents


def children_of(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for c in range(1, len(parents)):
        kids.setdefault(parents[c], []).append(c)
    return kids


def draft_tokens(draft_probs: torch.Tensor, parents: list[int], root: torch.Tensor, *, seed=None, offset=None,
                 uniforms_gen=None) -> torch.Tensor:
    """tokens [B, T]: each node's children sampled without replacement from its q row
    (draft_probs [B, T, V]) with sample_children, assigned to the children in index order."""
    B, T, V = draft_probs.shape
    tokens = torch.full((B, T), -1, dtype=torch.int64, device=draft_probs.device)
    tokens[:, 0] = root
    for u, ch in children_of(parents).items():
        kw = {}
        if uniforms_gen is not None:
            kw["uniforms"] = 1 - torch.rand(B, V, generator=uniforms_gen)
        else:
            kw.update(seed=seed, offset=offset)
        tokens[:, ch] = sample_children(draft_probs[:, u].contiguous(), len(ch), backend="reference", **kw)
    return tokens


def random_case(B: int, parents: list[int], V: int, seed: int, *, closeness: float = 1.0, device="cpu"):
    """Random per-node target and draft distributions (the draft a noisy copy of the target, so
    paths go deep), with zeros on both sides, and tokens sampled from the draft."""
    g = torch.Generator().manual_seed(seed)
    T = len(parents)
    lp = torch.randn(B, T, V, generator=g) * 2
    lq = lp + torch.randn(B, T, V, generator=g) * closeness
    lp[torch.rand(B, T, V, generator=g) < 0.15] = -float("inf")
    lq[torch.rand(B, T, V, generator=g) < 0.15] = -float("inf")
    lp[..., 0] = lp[..., 0].nan_to_num(neginf=0.0)
    lq[..., 1] = lq[..., 1].nan_to_num(neginf=0.0)
    p = torch.softmax(lp, -1)
    q = torch.softmax(lq, -1)
    tokens = draft_tokens(q, parents, torch.zeros(B, dtype=torch.int64), uniforms_gen=g)
    u = torch.rand(B, T, generator=g)
    dev = torch.device(device)
    return p.to(dev), q.to(dev), tokens.to(dev), torch.tensor(parents, device=dev), u.to(dev)


def run_reference(p, q, tokens, parents, u, greedy=False):
    B, T, V = p.shape
    path = torch.empty(B, T, dtype=torch.int64)
    n = torch.empty(B, dtype=torch.int64)
    bonus = torch.empty(B, dtype=torch.int64)
    margins = verify_tree_reference(p.cpu(), q.cpu(), tokens.cpu(), parents.cpu(), u.cpu(), greedy, path, n, bonus,
                                    return_margins=True)
    return (path, n, bonus), margins


def assert_agree(ref, got, margins, *, tol=1e-5, max_frac=0.02, msg=""):
    """Outputs equal, except on sequences where some decision was within `tol` (relative) of its
    boundary; such sequences must be rare."""
    (pr, nr, br), (pg, ng, bg) = ref, tuple(t.cpu() for t in got)
    diff = (pr != pg).any(1) | (nr != ng) | (br != bg)
    if diff.any():
        bad = diff & ~(margins < tol)
        assert not bad.any(), (f"{msg}: {int(bad.sum())} sequences disagree away from any decision boundary; "
                               f"first {bad.nonzero()[:3, 0].tolist()}: ref {pr[bad][:1].tolist()} {nr[bad][:1].tolist()} "
                               f"{br[bad][:1].tolist()} got {pg[bad][:1].tolist()} {ng[bad][:1].tolist()} {bg[bad][:1].tolist()}")
        assert diff.float().mean() <= max_frac, f"{msg}: {int(diff.sum())} / {diff.numel()} boundary disagreements"


def check_path_invariants(path, n, bonus, tokens, parents, V, greedy_or_eos_free=True):
    B, T = path.shape
    par = parents.tolist()
    for b in range(B):
        k = int(n[b])
        assert 1 <= k <= T and path[b, 0] == 0
        assert (path[b, k:] == -1).all()
        for i in range(1, k):
            node = int(path[b, i])
            assert par[node] == int(path[b, i - 1]), "path must follow parent links"
            assert 0 <= int(tokens[b, node]) < V
        assert 0 <= int(bonus[b]) < V


# ------------------------------------------------------------------------- hand-made examples


def test_reference_hand_example_rejections_exhaust_draft():
    """V = 3. Root: p = [.5, .3, .2], q = [.6, .4, 0]; children tokens 0, 1, then 2 (q = 0).
    r = .9 rejects token 0 (0.54 >= .5): p' = [0, 0, 1], q' = [0, 1, 0].
    Token 1: p'(1) = 0 -> rejected: p'' = [0, 0, 1], remaining q mass 0 -> q'' = 0.
    Token 2 has q = 0 -> skipped (even though p(2) > 0). Bonus ~ p'' = token 2 for any u."""
    p = torch.tensor([[[.5, .3, .2], [1 / 3] * 3, [1 / 3] * 3, [1 / 3] * 3]])
    q = torch.tensor([[[.6, .4, 0.], [1 / 3] * 3, [1 / 3] * 3, [1 / 3] * 3]])
    tokens = torch.tensor([[7, 0, 1, 2]]).clamp(max=2)
    parents = torch.tensor([-1, 0, 0, 0])
    for u0 in (0.0, 0.5, 0.999):
        u = torch.tensor([[u0, 0.9, 0.0, 0.0]])
        for backend in cpu_backends("reference", "triton") + (["cpu"] if COMPILED else []):
            path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend)
            assert path.tolist() == [[0, -1, -1, -1]] and n.tolist() == [1] and bonus.tolist() == [2], backend
    # r = .8 accepts token 0 (0.48 < .5): the walk moves to node 1 (a leaf), bonus ~ p_1
    u = torch.tensor([[0.5, 0.8, 0.0, 0.0]])
    path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend="reference")
    assert path.tolist() == [[0, 1, -1, -1]] and n.tolist() == [2] and bonus.tolist() == [1]


def test_reference_residual_values():
    """One rejection then the bonus: the bonus is the inverse CDF of max(p - q, 0) / Zp."""
    p = torch.tensor([[[.1, .2, .3, .4], [.25] * 4]])
    q = torch.tensor([[[.4, .3, .2, .1], [.25] * 4]])
    parents = torch.tensor([-1, 0])
    tokens = torch.tensor([[0, 0]])
    # token 0: r * .4 < .1 iff r < .25. Residual: [0, 0, .1, .3] / .4 = [0, 0, .25, .75]
    for u0, expect in [(0.0, 2), (0.2499, 2), (0.2501, 3), (0.99, 3)]:
        path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=torch.tensor([[u0, 0.3]]), backend="reference")
        assert n.tolist() == [1] and bonus.tolist() == [expect], u0


def test_residual_multiplies_by_reciprocals_cpu_bitwise():
    """Three rejections at the root (so Sp, Sq != 1 from the second on): the CPU kernel's residual
    in its workspace is bitwise the spec's max(P * rcp(Sp) - Q * rcp(Sq), 0) chain, rcp(s) =
    f32(1 / s), computed here step by step in torch; and that chain differs from the division
    form P / Sp - Q / Sq in some tokens, so this test tells the two specs apart."""
    g = torch.Generator().manual_seed(3)
    V = 1000
    p = torch.softmax(torch.randn(1, 4, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, 4, V, generator=g) * 2, -1)
    xs = q[0, 0].topk(3).indices  # tokens the draft likes most: p(x) < q(x) for these seeds
    assert bool((p[0, 0, xs] < q[0, 0, xs]).all())
    tokens = torch.tensor([[0, *xs.tolist()]])
    parents = torch.tensor([-1, 0, 0, 0])
    u = torch.tensor([[0.5, 0.999999, 0.999999, 0.999999]])  # r q(x) >= p(x): every child rejected
    ws = torch.full((1, 2, V), float("nan"))
    path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend="cpu", workspace=ws)
    assert n.tolist() == [1]

    def chain(reciprocal: bool) -> torch.Tensor:
        P, Q = p[0, 0].clone(), q[0, 0].clone()
        Sp, Sq = torch.tensor(1.0), torch.tensor(1.0)
        for x in xs.tolist():
            if reciprocal:
                D = (P * torch.div(torch.ones(()), Sp) - Q * torch.div(torch.ones(()), Sq)).clamp_min(0.0)
            else:
                D = (P / Sp - Q / Sq).clamp_min(0.0)
            Q[x] = 0.0
            P, Sp, Sq = D, D.double().sum().float(), Q.double().sum().float()
        return P

    assert_bitwise_equal(ws[0, 0], chain(True), "residual after three rejections")  # rejection 3: buffer 0
    assert not torch.equal(chain(True), chain(False))
    ref = verify_tree(p, q, tokens, parents, uniforms=u, backend="reference")
    assert ref[2].tolist() == bonus.tolist()


def test_zero_residual_keeps_target():
    """p - q has no positive entry (p = 0.9995 q, allowed by the 1e-3 sum tolerance) and the
    child is rejected: p is kept (no 0/0), the bonus comes from p. Edge case (c)."""
    q0 = torch.tensor([.5, .25, .25, 0.0])
    p0 = q0 * 0.9995
    p = torch.stack([p0, torch.tensor([.25] * 4)])[None]
    q = torch.stack([q0, torch.tensor([.25] * 4)])[None]
    parents = torch.tensor([-1, 0])
    tokens = torch.tensor([[0, 0]])
    for u0, expect in [(0.1, 0), (0.6, 1), (0.9, 2)]:
        u = torch.tensor([[u0, 0.99999]])
        for backend in cpu_backends("reference", "triton"):
            out = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend)
            assert out[1].tolist() == [1] and out[2].tolist() == [expect], backend


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_zero_residual_spec_all_backends(backend):
    """Edge case (c) with inputs where keeping p and switching to q give different bonuses:
    p = [.4995, .25, .25, 0] <= q = [.5, .25, .25, 0]; the child (token 0) is rejected
    (r = .99999), Zp = 0, p is kept: t = .49985 * .9995 = .49960 > C_0 = .4995 -> token 1
    (drawing from q would give token 0)."""
    p = torch.tensor([[[.4995, .25, .25, 0.0], [.25] * 4]])
    q = torch.tensor([[[.5, .25, .25, 0.0], [.25] * 4]])
    path, n, bonus = verify_tree(p, q, torch.tensor([[0, 0]]), torch.tensor([-1, 0]),
                                 uniforms=torch.tensor([[0.49985, 0.99999]]), backend=backend)
    assert n.tolist() == [1] and bonus.tolist() == [1]


def test_minus_one_and_zero_q_children_are_skipped():
    """-1 children and children whose token has q = 0 are never accepted and change nothing:
    the result equals the result on the tree without them (edge case (a))."""
    p, q, tokens, parents, u = random_case(64, [-1, 0, 0, 0, 1, 1], 12, seed=3)
    # the same tree with padding children inserted: a -1 child and a q = 0 child under the root
    q = q.clone()
    q[:, 0, 11] = 0.0
    q[:, 0] /= q[:, 0].sum(-1, keepdim=True)
    tokens[:, 1:4] = draft_tokens(q, [-1, 0, 0, 0], torch.zeros(64, dtype=torch.int64),
                                  uniforms_gen=torch.Generator().manual_seed(1))[:, 1:4]
    base = verify_tree(p, q, tokens, parents, uniforms=u, backend="reference")
    # padded tree: node order [0, 1, pad(-1), 2, pad(q=0), 3, 4, 5]; children of 1 shift to 6, 7
    pp = torch.tensor([-1, 0, 0, 0, 0, 0, 1, 1])
    idx = [0, 1, 1, 2, 2, 3, 4, 5]  # which original node each padded node copies (pads copy a neighbour)
    P, Q = p[:, idx], q[:, idx]
    tk = tokens[:, idx].clone()
    tk[:, 2] = -1
    tk[:, 4] = 11  # q_root(11) = 0 but p_root(11) may be large
    U = u[:, idx]
    remap = torch.tensor([0, 1, 3, 5, 6, 7])  # original node -> padded node
    for backend in cpu_backends("reference", "triton") + (["cpu"] if COMPILED else []):
        path, n, bonus = verify_tree(P, Q, tk, pp, uniforms=U, backend=backend)
        assert torch.equal(n, base[1]) and torch.equal(bonus, base[2]), backend
        expect = torch.where(base[0] >= 0, remap[base[0].clamp(min=0)], -1)
        assert torch.equal(path[:, :6], expect) and (path[:, 6:] == -1).all(), backend


# -------------------------------------------------------------------------- backend agreement


AGREE_CASES = [
    (planner_tree(24, 6), 7, 0.7),
    (planner_tree(32, 5), 50, 1.0),
    (random_topological(20, 5), 33, 0.5),
    (star(9), 300, 1.0),
    (chain(8), 50, 0.3),
    ([-1], 17, 1.0),
]


@pytest.mark.parametrize("device,backend", backends_under_test())
@pytest.mark.parametrize("case", range(len(AGREE_CASES)))
def test_backends_agree_with_reference(device, backend, case):
    parents, V, closeness = AGREE_CASES[case]
    p, q, tokens, par, u = random_case(12, parents, V, seed=100 + case, closeness=closeness, device=device)
    ref, margins = run_reference(p, q, tokens, par, u)
    got = verify_tree(p, q, tokens, par, uniforms=u, backend=backend)
    assert_agree(ref, got, margins, msg=f"{backend} case {case}")
    check_path_invariants(*[t.cpu() for t in got], tokens.cpu(), par.cpu(), V)
    if len(parents) > 1:
        assert (ref[1] > 1).any(), "test case too easy: nothing accepted"


def test_triton_multi_chunk_vocab():
    """Vocabulary spanning several BLOCK_V chunks (block_v = 16, V = 70): chunked sums, the
    chunked inverse CDF and the chunked argmax."""
    skip_unless_triton_on_cpu()
    from sequoia_kernels.triton_kernels.verify_tree import verify_tree_triton

    p, q, tokens, par, u = random_case(10, planner_tree(16, 4), 70, seed=7, closeness=0.6)
    for greedy in (False, True):
        ref, margins = run_reference(p, q, tokens, par, u, greedy=greedy)
        B, T = tokens.shape
        out = (torch.empty(B, T, dtype=torch.int64), torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
        verify_tree_triton(p, q, tokens, par, u, greedy, *out, block_v=16)
        assert_agree(ref, out, margins, msg=f"greedy={greedy}")


@pytest.mark.parametrize("V", [32000, 128256])
def test_large_vocab_cpu_matches_reference(V):
    parents = planner_tree(8, 3)
    p, q, tokens, par, u = random_case(2, parents, V, seed=V, closeness=0.3)
    ref, margins = run_reference(p, q, tokens, par, u)
    got = verify_tree(p, q, tokens, par, uniforms=u, backend="cpu")
    assert_agree(ref, got, margins, max_frac=0.5)


# ---------------------------------------------------------------------------------- greedy


def greedy_walk(p, tokens, parents):
    """Independent greedy verification: follow the child whose token is argmax p (first max)."""
    B, T, V = p.shape
    kids = children_of(parents)
    out = []
    for b in range(B):
        node, path = 0, [0]
        while True:
            best = int(torch.argmax(p[b, node]))
            nxt = next((c for c in kids.get(node, []) if int(tokens[b, c]) == best), None)
            if nxt is None:
                break
            node = nxt
            path.append(node)
        out.append((path, best))
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"] + (["cpu"] if COMPILED else []))
def test_greedy_follows_argmax(backend):
    for seed, parents, V in [(0, planner_tree(24, 6), 6), (1, random_topological(15, 2), 5), (2, star(5), 9)]:
        p, q, tokens, par, u = random_case(16, parents, V, seed=seed)
        # make matches likely: greedy-drafted children include the argmax often
        am = p.argmax(-1)  # [B, T]
        for c in range(1, len(parents)):
            take = torch.rand(16, generator=torch.Generator().manual_seed(seed * 100 + c)) < 0.5
            tokens[take, c] = am[take, parents[c]]
        q_bad = torch.full_like(q, float("nan"))  # greedy never reads the draft
        path, n, bonus = verify_tree(p, q_bad, tokens, par, greedy=True, backend=backend)
        for b, (gp, gb) in enumerate(greedy_walk(p, tokens, parents)):
            assert path[b, : len(gp)].tolist() == gp and int(n[b]) == len(gp) and int(bonus[b]) == gb
        assert (n > 1).any()


def test_greedy_ties_lowest_index():
    p = torch.tensor([[[0.4, 0.4, 0.2], [0.3, 0.3, 0.4]]])
    q = torch.full_like(p, 1 / 3)
    for tok, expect in [(1, ([0, -1], 1, 0)), (0, ([0, 1], 2, 2))]:
        for backend in cpu_backends("reference", "triton"):
            path, n, bonus = verify_tree(p, q, torch.tensor([[0, tok]]), torch.tensor([-1, 0]), greedy=True,
                                         backend=backend)
            assert (path[0].tolist(), int(n[0]), int(bonus[0])) == expect, backend


# ------------------------------------------------------------------------------ statistics


def markov_tables(V: int, temperature: float, top_k: int, top_p: float, seed: int):
    """Target P[a] = p(. | previous token a) and draft Q[a], [V, V] fp32, from random logits
    through sampling_probs, then with extra zeros: q = 0 where p > 0 and p = 0 where q > 0.
    Every node's p depends only on its own token (the target is a Markov chain), so the exact
    distribution of the first two emitted tokens after root token t0 is P[t0, y1] P[y1, y2]."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(V, V, generator=g) * 1.5
    lq = lp + torch.randn(V, V, generator=g)
    P = sampling_probs(lp, temperature=temperature, top_k=top_k, top_p=top_p, backend="reference")
    Q = sampling_probs(lq, temperature=temperature, top_k=top_k, top_p=top_p, backend="reference")
    rows = torch.arange(V)
    zq = torch.rand(V, V, generator=g) < 0.2
    zq[rows, Q.argmax(1)] = False
    Q = torch.where(zq, 0.0, Q)
    Q = Q / Q.sum(1, keepdim=True)
    zp = torch.rand(V, V, generator=g) < 0.15
    zp[rows, P.argmax(1)] = False
    P = torch.where(zp, 0.0, P)
    P = P / P.sum(1, keepdim=True)
    assert ((Q == 0) & (P > 0)).any() and ((P == 0) & (Q > 0)).any()
    return P, Q


def speculative_step(root, parents, P, Q, seed, offset, gen, *, uniforms=None, validate=True, backend=None):
    """One full step on N independent sequences: draft the tree (sample_children per node, with
    uniforms from the generator `gen`), verify (default backend, Philox stream (seed, offset))."""
    T = len(parents)
    N, V = root.shape[0], P.shape[0]
    tokens = torch.full((N, T), -1, dtype=torch.int64)
    tokens[:, 0] = root
    for u, ch in children_of(parents).items():
        tu = tokens[:, u]
        q = Q[tu.clamp(min=0)] * (tu >= 0)[:, None]  # a missing (-1) node has no children
        tokens[:, ch] = sample_children(q, len(ch), uniforms=1 - torch.rand(N, V, generator=gen),
                                        backend="reference", validate=validate)
    tc = tokens.clamp(min=0)
    kw = dict(uniforms=uniforms) if uniforms is not None else dict(seed=seed, offset=offset)
    path, n, bonus = verify_tree(P[tc], Q[tc], tokens, torch.tensor(parents), validate=validate, backend=backend, **kw)
    return tokens, path, n, bonus


def emitted_pairs(N, parents, P, Q, t0, seed, *, chunk=50_000, validate=True, reuse=None, backend=None):
    """First two emitted tokens of N sequences starting after token t0: this step's path tokens
    then its bonus; when the step emitted only one token, the second comes from a second step."""
    seed_t, offset = new_state(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(0, N, chunk):
        m = min(chunk, N - s)
        root = torch.full((m,), t0, dtype=torch.int64)
        u = None
        if reuse == "children":  # the known flaw: one uniform reused for every child of a step
            u = philox_uniforms(seed_t, offset, (m, 1), advance=True).expand(m, len(parents)).contiguous()
        tokens, path, n, bonus = speculative_step(root, parents, P, Q, seed_t, offset, gen, uniforms=u,
                                                  validate=validate, backend=backend)
        ptok = tokens.gather(1, path.clamp(min=0))
        y1 = torch.where(n >= 2, ptok[:, 1], bonus)
        y2 = torch.where(n >= 3, ptok[:, 2], torch.where(n == 2, bonus, -1))
        need = (n == 1).nonzero()[:, 0]
        if need.numel():
            t2, p2, n2, b2 = speculative_step(y1[need], parents, P, Q, seed_t, offset, gen,
                                              uniforms=None if u is None else u[need], validate=validate,
                                              backend=backend)
            y2[need] = torch.where(n2 >= 2, t2.gather(1, p2.clamp(min=0))[:, 1], b2)
        out.append(torch.stack([y1, y2], 1))
    return torch.cat(out)


def goodness_of_fit(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, float]:
    """(total variation, chi-square p-value); cells with probability 0 must be empty; cells with
    expected count < 5 are pooled."""
    counts = counts.double()
    N = counts.sum()
    e = expected_p.double() / expected_p.double().sum()
    assert counts[e == 0].sum() == 0, f"{int(counts[e == 0].sum())} draws of tokens the target gives probability 0"
    tv = 0.5 * float((counts / N - e).abs().sum())
    m = e > 0
    obs, exp = counts[m], e[m] * N
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if obs.numel() < 2:  # a single possible outcome: nothing to test beyond the empty zero cells
        return tv, 1.0
    return tv, float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


STAT_CASES = {
    # name: (V, temperature, top_k, top_p, tree, root token, pairs?)
    "T1-planner": (8, 1.0, 0, 1.0, planner_tree(20, 5), 3, True),
    "T0.7-topk-star": (8, 0.7, 5, 1.0, star(6), 1, True),
    "T0.3-topk-chain": (8, 0.3, 4, 1.0, chain(5), 0, True),
    "T0.7-topk-topp-random": (10, 0.7, 7, 0.9, random_topological(14, 11), 4, True),
    "T1-topp-planner-V50": (50, 1.0, 0, 0.9, planner_tree(24, 5), 7, False),
    "T0.3-planner-V12": (12, 0.3, 0, 1.0, planner_tree(16, 4), 2, True),
}


def run_stat_case(name: str, N: int, seed: int, validate=True, backend=None):
    V, temp, k, topp, parents, t0, pairs = STAT_CASES[name]
    P, Q = markov_tables(V, temp, k, topp, seed=zlib.crc32(name.encode()) % 1000)
    ys = emitted_pairs(N, parents, P, Q, t0, seed, validate=validate, backend=backend)
    tv1, p1 = goodness_of_fit(torch.bincount(ys[:, 0], minlength=V), P[t0])
    res = {"first": (tv1, p1)}
    if pairs:
        joint = (P[t0][:, None] * P).flatten()
        tv2, p2 = goodness_of_fit(torch.bincount(ys[:, 0] * V + ys[:, 1], minlength=V * V), joint)
        res["pair"] = (tv2, p2)
    return res


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name", list(STAT_CASES))
def test_exact_distribution_small(name, backend, all_cores):
    """2e5 sequences per case: first emitted token and first two (path tokens, then bonus, then
    the next step) match the target's exact distribution (chi-square at a fixed seed)."""
    res = run_stat_case(name, 200_000, seed=1234, backend=backend)
    for what, (tv, pval) in res.items():
        assert pval > 1e-3, f"{name} {what}: chi-square p = {pval:.2e} (TV {tv:.4f})"
        assert tv < 0.015, f"{name} {what}: TV {tv:.4f}"


@pytest.mark.parametrize("name", ["T1-planner", "T1-topp-planner-V50"])
def test_exact_distribution_1e6(name, all_cores):
    """10^6 sequences on the fastest available backend (the default: the compiled CPU kernel
    once built, else the reference): TV < 0.005 and chi-square."""
    t = time.time()
    res = run_stat_case(name, 1_000_000, seed=99, validate=False)
    for what, (tv, pval) in res.items():
        assert pval > 1e-3, f"{name} {what}: chi-square p = {pval:.2e} (TV {tv:.4f})"
        assert tv < 0.005, f"{name} {what}: TV {tv:.4f}"
    print(f"{name}: {res} in {time.time() - t:.1f}s")


def test_statistics_detect_reused_uniforms(all_cores):
    """Power check of the statistical test: reusing one uniform for all children of a step (a
    flaw of earlier implementations) biases the output and the same test catches it."""
    name = "T1-planner"
    V, temp, k, topp, parents, t0, _ = STAT_CASES[name]
    P, Q = markov_tables(V, temp, k, topp, seed=zlib.crc32(name.encode()) % 1000)
    ys = emitted_pairs(200_000, parents, P, Q, t0, 1234, reuse="children")
    tv, pval = goodness_of_fit(torch.bincount(ys[:, 0] * V + ys[:, 1], minlength=V * V), (P[t0][:, None] * P).flatten())
    assert pval < 1e-6, f"reused uniforms not detected: p = {pval}, TV {tv}"


# ----------------------------------------------------------------------- random-number sources


def test_random_sources():
    p, q, tokens, par, _ = random_case(6, planner_tree(12, 4), 9, seed=5)
    B, T = tokens.shape
    seed, offset = new_state(42, offset=10)
    out = verify_tree(p, q, tokens, par, seed=seed, offset=offset, backend="reference")
    assert offset.item() == 10 + counters_used(B * T)  # advanced in place
    u = philox_uniforms(torch.tensor([42]), torch.tensor([10]), (B, T))
    same = verify_tree(p, q, tokens, par, uniforms=u, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(out, same))
    # consecutive calls use fresh numbers; the same (seed, offset) repeats them
    outs = [verify_tree(p, q, tokens, par, seed=seed, offset=offset, backend="reference") for _ in range(20)]
    assert len({tuple(o[2].tolist()) for o in outs}) > 1
    # default generator: torch.manual_seed makes it reproducible, consecutive calls differ
    torch.manual_seed(3)
    a = [verify_tree(p, q, tokens, par, backend="reference")[2] for _ in range(10)]
    torch.manual_seed(3)
    b = [verify_tree(p, q, tokens, par, backend="reference")[2] for _ in range(10)]
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and len({tuple(x.tolist()) for x in a}) > 1
    with pytest.raises(ValueError, match="either uniforms or"):
        verify_tree(p, q, tokens, par, uniforms=u, seed=seed, offset=offset)
    with pytest.raises(ValueError, match="go together"):
        verify_tree(p, q, tokens, par, seed=seed)
    with pytest.raises(ValueError, match="int64"):
        verify_tree(p, q, tokens, par, seed=seed, offset=torch.tensor([1.0]))


def test_greedy_consumes_no_random_numbers():
    p, q, tokens, par, _ = random_case(4, star(3), 5, seed=1)
    seed, offset = new_state(1)
    verify_tree(p, q, tokens, par, greedy=True, seed=seed, offset=offset)
    assert offset.item() == 0


# ------------------------------------------------------------------------------------ EOS


def test_eos_stops_the_walk():
    """EOS accepted inside the tree: the path ends there, bonus = -1; several EOS ids."""
    V = 6
    parents = torch.tensor([-1, 0, 0, 1, 3])
    p = torch.zeros(3, 5, V)
    p[..., 0] = 1.0  # the target always wants token 0 ...
    p[:, 1] = torch.eye(V)[4]  # ... except after node 1, where it wants 4
    q = p.clone()
    tokens = torch.tensor([[5, 0, 1, 4, 0]] * 3)
    u = torch.full((3, 5), 0.5)
    for backend in cpu_backends("reference", "triton") + (["cpu"] if COMPILED else []):
        path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend)
        assert path[0].tolist() == [0, 1, 3, 4, -1] and n[0] == 4 and bonus[0] == 0
        path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend,
                                     eos_ids=torch.tensor([4, 5]))
        assert path.tolist() == [[0, 1, 3, -1, -1]] * 3 and n.tolist() == [3] * 3 and bonus.tolist() == [-1] * 3
        # no EOS among the accepted tokens: unchanged (an EOS bonus is simply emitted)
        path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend,
                                     eos_ids=torch.tensor([3]))
        assert n.tolist() == [4] * 3 and bonus.tolist() == [0] * 3
        path, n, bonus = verify_tree(p, q, tokens, parents, uniforms=u, backend=backend, greedy=True,
                                     eos_ids=torch.tensor([0]))
        assert path[0].tolist() == [0, 1, -1, -1, -1] and n[0] == 2 and bonus[0] == -1


# ----------------------------------------------------------------------------- bad inputs


def _good():
    p, q, tokens, par, u = random_case(2, [-1, 0, 0, 1], 6, seed=0)
    return dict(target_probs=p, draft_probs=q, tokens=tokens, parents=par, uniforms=u)


def _set(key, fn):
    def f(kw):
        kw[key] = fn(kw[key].clone())
        return kw
    return f


def _idx(t, i, v):
    t[i] = v
    return t


BAD_VALUES = {
    "nan target": (_set("target_probs", lambda t: _idx(t, (0, 1, 2), float("nan"))), "NaN"),
    "negative draft": (_set("draft_probs", lambda t: _idx(t, (1, 0, 0), -0.1)), "negative"),
    "inf target": (_set("target_probs", lambda t: _idx(t, (0, 0, 0), float("inf"))), "infinite"),
    "unnormalised target": (_set("target_probs", lambda t: t * 1.5), "sum to 1"),
    "token too large": (_set("tokens", lambda t: _idx(t, (0, 2), 6)), r"tokens\[:, 1:\]"),
    "token below -1": (_set("tokens", lambda t: _idx(t, (1, 3), -2)), r"tokens\[:, 1:\]"),
    "parent after child": (_set("parents", lambda t: torch.tensor([-1, 0, 3, 1])), "topological"),
    "self parent": (_set("parents", lambda t: torch.tensor([-1, 1, 0, 1])), "topological"),
    "split siblings": (_set("parents", lambda t: torch.tensor([-1, 0, 1, 0])), "consecutive"),
    "root parent": (_set("parents", lambda t: torch.tensor([0, 0, 0, 1])), r"parents\[0\]"),
    "uniform 1": (_set("uniforms", lambda t: _idx(t, (0, 1), 1.0)), r"uniforms must lie in \[0, 1\)"),
    "uniform nan": (_set("uniforms", lambda t: _idx(t, (0, 0), float("nan"))), "uniforms"),
}


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_bad_values_raise_and_write_nothing(backend, case):
    fn, match = BAD_VALUES[case]
    kw = fn(_good())
    B, T = kw["tokens"].shape
    out = (torch.full((B, T), 77), torch.full((B,), 77), torch.full((B,), 77))
    with pytest.raises(ValueError, match=match):
        verify_tree(**kw, backend=backend, out=out)
    assert all((t == 77).all() for t in out)


BAD_LAYOUTS = {
    "vocab mismatch": (lambda kw: {**kw, "draft_probs": kw["draft_probs"][..., :5].contiguous()}, "same batch, tree and vocab"),
    "fp16 probs": (lambda kw: {**kw, "target_probs": kw["target_probs"].half()}, "float32"),
    "tokens int32": (lambda kw: {**kw, "tokens": kw["tokens"].int()}, "int64"),
    "tokens shape": (lambda kw: {**kw, "tokens": kw["tokens"][:, :3]}, r"tokens must be \[B, T\]"),
    "parents per batch": (lambda kw: {**kw, "parents": kw["parents"][None].expand(2, -1)}, r"parents must be \[T\]"),
    "uniforms shape": (lambda kw: {**kw, "uniforms": kw["uniforms"][:, :2]}, "uniforms must be"),
    "2-D probs": (lambda kw: {**kw, "target_probs": kw["target_probs"][0]}, r"\[B, T, V\]"),
    "list tokens": (lambda kw: {**kw, "tokens": kw["tokens"].tolist()}, "torch.Tensor"),
    "strided vocab": (lambda kw: {**kw, "target_probs": torch.cat([kw["target_probs"]] * 2, -1)[..., ::2]}, "contiguous"),
    "meta tokens": (lambda kw: {**kw, "tokens": kw["tokens"].to("meta")}, "is on meta"),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUTS))
def test_bad_layout_raises(case):
    fn, match = BAD_LAYOUTS[case]
    with pytest.raises((ValueError, TypeError), match=match):
        verify_tree(**fn(_good()))


def test_bad_out_and_backend():
    kw = _good()
    with pytest.raises(ValueError, match="out path"):
        verify_tree(**kw, out=(torch.empty(2, 3, dtype=torch.int64), torch.empty(2, dtype=torch.int64),
                               torch.empty(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="unknown backend"):
        verify_tree(**kw, backend="tpu")
    if not COMPILED:
        with pytest.raises(ValueError, match="does not have"):
            verify_tree(**kw, backend="cpu")


@pytest.mark.parametrize("backend", ["reference", "triton"] + (["cpu"] if COMPILED else []))
def test_unvalidated_garbage_stays_in_range(backend):
    """validate=False with NaN probabilities and out-of-range tokens: nothing out of range is read
    or written; outputs are well-formed (tokens in [0, V) or -1)."""
    p, q, tokens, par, u = random_case(16, planner_tree(12, 4), 10, seed=9)
    p[0, 0] = float("nan")
    q[1, 0, :5] = float("nan")
    p[2] = 0.0  # no positive entry anywhere: bonus -1
    tokens[3, 1:] = 10**9
    tokens[4, 1:] = -5
    q[5, 0] = 0.0
    path, n, bonus = verify_tree(p, q, tokens, par, uniforms=u, validate=False, backend=backend)
    assert ((bonus >= -1) & (bonus < 10)).all() and ((n >= 1) & (n <= tokens.shape[1])).all()
    assert ((path >= -1) & (path < tokens.shape[1])).all()
    assert n[3] == 1 and n[4] == 1 and n[5] == 1
    assert bonus[2] == -1  # p has no positive entry: spec says -1 (see test_zero_residual_spec_all_backends)


@pytest.mark.parametrize("V", [5, 1500, 4099])
def test_cpu_many_rejections_duplicates_poisoned_workspace(V):
    """The CPU kernel's rejection bookkeeping: up to 12 rejections at one node (the rejected tokens
    are gaps between SIMD segments, the residual alternates between the two workspace halves),
    duplicate sibling tokens (q = 0 the second time: skipped), a bonus scan over several
    1024-token blocks; workspace and outputs poisoned first. Equal to the reference."""
    parents = [-1] + [0] * 12 + [1] * 4 + [2] * 4
    p, q, tokens, par, u = random_case(24, parents, V, seed=V, closeness=3.0)
    tokens[::2, 6] = tokens[::2, 3]  # a sibling token repeated
    tokens[1::4, 4] = tokens[1::4, 1]
    ref, margins = run_reference(p, q, tokens, par, u)
    B, T, _ = p.shape
    out = (torch.full((B, T), -7), torch.full((B,), -7), torch.full((B,), -7))
    ws = torch.full((B, 2, V), float("nan"))
    got = verify_tree(p, q, tokens, par, uniforms=u, backend="cpu", out=out, workspace=ws)
    assert_agree(ref, got, margins, max_frac=0.1, msg=f"V={V}")
    assert (ref[1] == 1).any() and (ref[1] > 1).any(), "want sequences rejecting every root child and others not"


def many_rejections_case(B: int, V: int, K: int = 24, seed: int = 0, device="cpu"):
    """A wide root (K children) under a poor draft: the draft puts ~99% of its mass on K tokens
    the target barely wants, and the root's children are those tokens, so every child is tried
    and rejected (K rejections at one node: the residual rewritten K - 1 times, from the second
    rejection on in the workspace). Odd rows: the target also wants the last child's token, which
    is accepted after K - 1 rejections (small uniform), then its 4 children are tried. Returns
    (p, q, tokens, parents, u, expect): expect[b] the reference's num_accepted that the
    construction forces (1 in even rows: all K rejected; >= 2 in odd rows)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [0] * K + [K] * 4
    T = len(parents)
    lp = torch.randn(B, T, V, generator=g)
    lq = torch.randn(B, T, V, generator=g)
    bad = torch.randperm(V, generator=g)[:K]  # [K] the draft's favourites at the root
    lq[:, 0, bad[:-1]] += 16.0
    lq[:, 0, bad[-1]] += 10.0  # the last child's q stays below the residual p it ends with
    lp[:, 0, bad] -= 6.0
    p = torch.softmax(lp, -1)
    q = torch.softmax(lq, -1)
    want = torch.zeros(V)
    want[bad[-1]] = 1.0
    p[1::2, 0] = 0.5 * p[1::2, 0] + 0.5 * want  # odd rows: the target wants the last child
    tokens = torch.full((B, T), -1, dtype=torch.int64)
    tokens[:, 0] = 0
    tokens[:, 1:K + 1] = bad
    tokens[:, K + 1:] = q[:, K].topk(4, -1).indices
    u = 0.5 + 0.5 * torch.rand(B, T, generator=g)  # [0.5, 1): far from every boundary
    u[1::2, K] = 0.02
    expect = torch.tensor([1 if b % 2 == 0 else 2 for b in range(B)])
    dev = torch.device(device)
    return p.to(dev), q.to(dev), tokens.to(dev), torch.tensor(parents, device=dev), u.to(dev), expect


def check_many_rejections(B, V, device, run, K=24):
    """Reference vs ``run(p, q, tokens, parents, u, out)`` on many_rejections_case, bit for bit
    (outputs poisoned first); the construction is checked to force K rejections at the root."""
    p, q, tokens, par, u, expect = many_rejections_case(B, V, K, seed=V + B, device=device)
    ref, _ = run_reference(p, q, tokens, par, u)
    assert (ref[1][0::2] == 1).all() and (ref[1][1::2] >= 2).all(), f"construction failed: {ref[1].tolist()}"
    assert (ref[0][1::2, 1] == K).all(), "odd rows accept the last root child after K - 1 rejections"
    T = len(par)
    out = (torch.full((B, T), -7, dtype=torch.int64, device=device),
           torch.full((B,), -7, dtype=torch.int64, device=device), torch.full((B,), -7, dtype=torch.int64, device=device))
    run(p, q, tokens, par, u, out)
    for name, a, b in zip(("path", "num_accepted", "bonus"), ref, out):
        assert torch.equal(a, b.cpu()), f"V={V} B={B}: {name} differs: ref {a.tolist()} got {b.cpu().tolist()}"


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("backend,V", [("cpu", 3001), ("cpu", 50000), ("triton", 3001), ("triton-block-v", 3001)])
def test_many_rejections_at_one_node(backend, V, B):
    """>= 12 rejections at one node (24 at the root, every one rewriting the residual; issue 21's
    stress case) on the CPU kernel and in Triton's interpreter (several BLOCK_V chunks with
    block_v = 512): the reference's outputs bit for bit, B in {1, 8}. On a GPU the same case runs
    on every CUDA verifier in test_many_rejections_at_one_node_gpu."""
    if backend.startswith("triton"):
        skip_unless_triton_on_cpu()
    from sequoia_kernels.triton_kernels.verify_tree import verify_tree_triton

    def run(p, q, tokens, par, u, out):
        if backend == "triton-block-v":
            verify_tree_triton(p, q, tokens, par, u, False, *out, block_v=512)
        else:
            ws = torch.full((p.shape[0], 2, V), float("nan"))
            verify_tree(p, q, tokens, par, uniforms=u, backend=backend, out=out, workspace=ws)

    check_many_rejections(B, V, "cpu", run)


@requires_cuda
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("kernel,V", [("cuda", 32000), ("cuda", 32003), ("cuda", 128256), ("cuda", 300001),
                                      ("cuda", 524288), ("triton-1cta", 32000), ("triton-1cta", 128256),
                                      ("triton-8cta", 32000), ("triton-8cta", 128256)])
def test_many_rejections_at_one_node_gpu(kernel, V, B):
    """The stress case on every GPU verifier: the CUDA cluster kernel (V <= 152064; 32003
    unaligned), the CUDA one-block kernel (V = 300001 unaligned: scalar loads; 524288 aligned:
    128-bit loads), Triton with one CTA and as an 8-CTA cluster. Bit for bit as the reference."""
    from sequoia_kernels.triton_kernels.verify_tree import cluster_build_supported, verify_tree_triton

    if kernel == "cuda" and not CUDA_VERIFY:
        pytest.skip("needs the CUDA build of sequoia_kernels._C")
    if kernel == "triton-8cta" and not cluster_build_supported():
        pytest.skip("this Triton cannot compile the cluster build (needs >= 3.8)")

    def run(p, q, tokens, par, u, out):
        if kernel == "cuda":
            verify_tree(p, q, tokens, par, uniforms=u, backend="cuda", out=out)
        else:
            verify_tree_triton(p, q, tokens, par, u, False, *out, num_ctas=8 if kernel == "triton-8cta" else 1)
        torch.cuda.synchronize()

    check_many_rejections(B, V, "cuda", run)


def test_preallocated_out_and_workspace():
    p, q, tokens, par, u = random_case(5, planner_tree(12, 4), 40, seed=2)
    B, T, V = p.shape
    out = (torch.empty(B, T, dtype=torch.int64), torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
    ws = torch.empty(B, 2, V)
    ref = verify_tree(p, q, tokens, par, uniforms=u, backend="reference")
    for backend in cpu_backends("triton", "reference") + (["cpu"] if COMPILED else []):
        got = verify_tree(p, q, tokens, par, uniforms=u, backend=backend, out=out, workspace=ws)
        assert all(g is o for g, o in zip(got, out))
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), backend


def test_empty_batch_and_root_only():
    p = torch.full((0, 3, 4), 0.25)
    out = verify_tree(p, p, torch.zeros(0, 3, dtype=torch.int64), torch.tensor([-1, 0, 0]), backend="reference")
    assert [t.shape for t in out] == [(0, 3), (0,), (0,)]
    p = torch.tensor([[[0.0, 1.0, 0.0]]])
    for backend in cpu_backends("reference", "triton"):
        path, n, bonus = verify_tree(p, p, torch.tensor([[5]]), torch.tensor([-1]), backend=backend)
        assert path.tolist() == [[0]] and n.tolist() == [1] and bonus.tolist() == [1]


# ------------------------------------------------------------------------- compiled / graph


AOT_SCRIPT = r"""
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sequoia_kernels.triton_kernels.verify_tree import _verify_tree_kernel as k
types = ["*fp32", "*fp32", "*i64", "*i64", "*fp32", "*i64", "*i64", "*i64", "*fp32"] + ["i32"] * 2 + ["i64"] * 14
from sequoia_kernels.triton_kernels.verify_tree import cluster_build_supported
# one CTA per sequence (BLOCK_V 2048), and the 8-CTA cluster launch (BLOCK_V 16384) where this
# Triton compiles it (>= 3.8)
for greedy in (False, True):
    for ctas, bv, groups in ((1, 2048, 64),) + (((8, 16384, 128),) if cluster_build_supported() else ()):
        sig = dict(zip(k.arg_names, types + ["constexpr"] * 6))
        src = ASTSource(fn=k, signature=sig, constexprs={"GREEDY": greedy, "BLOCK_V": bv, "BLOCK_T": 128,
                                                         "NCHUNK": 64, "GROUPS": groups, "GROUP_W": bv // groups})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_ctas": ctas})
        assert "cubin" in c.asm
        if ctas > 1:
            assert "barrier.cluster" in c.asm["ptx"], "no cluster barrier: the tensors were not split"
print("compiled")
"""


def run_aot(script: str) -> None:
    """Compile Triton kernels for sm_90 in a subprocess without the interpreter (no GPU needed):
    the interpreter accepts code the real compiler rejects."""
    import os
    import subprocess

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                       cwd=str(Path(__file__).resolve().parents[1]))
    if r.returncode != 0 and "ptxas" in r.stderr and "not found" in r.stderr:
        pytest.skip("triton has no ptxas here")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


@pytest.mark.aot
def test_triton_kernel_compiles_for_sm90():
    run_aot(AOT_SCRIPT)


def test_opcheck_compiled_op():
    p, q, tokens, par, u = random_case(3, planner_tree(8, 3), 16, seed=1)
    B, T, V = p.shape
    args = [p, q, tokens, par, u, False, torch.empty(B, T, dtype=torch.int64), torch.empty(B, dtype=torch.int64),
            torch.empty(B, dtype=torch.int64)]
    schema = torch.ops.sequoia_kernels.verify_tree.default._schema
    if any(a.name == "workspace" for a in schema.arguments):
        args.append(torch.empty(B, 2, V))
    torch.library.opcheck(torch.ops.sequoia_kernels.verify_tree.default, tuple(args),
                          test_utils=("test_schema", "test_faketensor"))


@requires_cuda
@pytest.mark.parametrize("backend", ["triton"] + (["cuda"] if COMPILED else []))
def test_cuda_graph_fresh_numbers_every_replay(backend):
    """Captured with (seed, offset): every replay advances offset and draws new numbers; replay k
    equals an eager call at offset0 + k * counters."""
    p, q, tokens, par, _ = random_case(64, planner_tree(16, 4), 300, seed=4, device="cuda")
    B, T, V = p.shape
    seed, offset = new_state(7, device="cuda")
    out = (torch.empty(B, T, dtype=torch.int64, device="cuda"), torch.empty(B, dtype=torch.int64, device="cuda"),
           torch.empty(B, dtype=torch.int64, device="cuda"))
    ws = torch.empty(B, 2, V, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        verify_tree(p, q, tokens, par, seed=seed, offset=offset, out=out, workspace=ws, validate=False, backend=backend)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        verify_tree(p, q, tokens, par, seed=seed, offset=offset, out=out, workspace=ws, validate=False, backend=backend)
    offset.fill_(0)
    bonuses = []
    for k in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert offset.item() == (k + 1) * counters_used(B * T)
        u = philox_uniforms(seed, torch.tensor([k * counters_used(B * T)], device="cuda"), (B, T))
        ref = verify_tree(p, q, tokens, par, uniforms=u, backend="reference")
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(out, ref))
        bonuses.append(out[2].clone())
    assert not torch.equal(bonuses[0], bonuses[1])


# ------------------------------------------------------------------ store ordering (Triton)


class _StoreRecorder:
    """Records, under Triton's CPU interpreter, which store wrote each address: the shape of the
    stored block and the element's position (lane) in it. On a GPU a block store's lane i and a
    scalar store are issued by threads that need not be the same, so two stores of one address
    with different (shape, lane) are unordered without a barrier (a write-write race that the
    interpreter, which runs stores in program order, would otherwise hide)."""

    def __init__(self):
        import numpy as np

        from triton.runtime import interpreter

        self.np = np
        self.builder = interpreter.interpreter_builder
        self.writers: dict[int, set] = {}

    def __enter__(self):
        orig = self.builder.create_masked_store
        np = self.np

        def store(ptrs, value, mask, cache_modifier, eviction_policy):
            addr = np.asarray(ptrs.data).reshape(-1)
            m = np.broadcast_to(np.asarray(mask.data), np.asarray(ptrs.data).shape).reshape(-1)
            shape = tuple(np.asarray(ptrs.data).shape)
            for lane in np.nonzero(m)[0].tolist():
                self.writers.setdefault(int(addr[lane]), set()).add((shape, lane))
            return orig(ptrs, value, mask, cache_modifier, eviction_policy)

        self.builder.create_masked_store = store
        return self

    def __exit__(self, *exc):
        del self.builder.create_masked_store  # back to the class method

    def conflicts(self) -> list[int]:
        return [a for a, w in self.writers.items() if len(w) > 1]


@pytest.mark.parametrize("greedy", [False, True])
def test_triton_each_address_written_by_one_lane(greedy):
    """Every output element of the Triton kernel is written by stores of one (shape, lane) only
    (issue 12: path[i] = -1 by a block store and path[n] = c by a scalar store, unordered)."""
    from sequoia_kernels._backend import triton_interpreted

    if not triton_interpreted():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
    from sequoia_kernels.triton_kernels.verify_tree import verify_tree_triton

    p, q, tokens, par, u = random_case(3, planner_tree(16, 4), 40, seed=11, closeness=0.3)
    B, T = tokens.shape
    if greedy:
        tokens[:, 1:] = p.argmax(-1)[:, par[1:]]  # every first child matches: deep paths
    out = tuple(torch.full(s, -7, dtype=torch.int64) for s in ((B, T), (B,), (B,)))
    with _StoreRecorder() as rec:
        verify_tree_triton(p, q, tokens, par, u, greedy, *out, block_v=16)
    assert rec.writers, "the recorder saw no stores"
    assert not rec.conflicts(), f"{len(rec.conflicts())} addresses written by stores of different lanes"
    ref, margins = run_reference(p, q, tokens, par, u, greedy=greedy)
    assert_agree(ref, out, margins)
    assert (ref[1] > 1).any()


def test_triton_bonus_two_level_search():
    """Root-only trees: the bonus alone, with 16-wide chunks (V = 70: five chunks, two of them
    all zero, the last one partial), for uniforms over the whole range, including 0 and the
    largest float below 1, equals the reference's inverse CDF."""
    skip_unless_triton_on_cpu()
    from sequoia_kernels.triton_kernels.verify_tree import verify_tree_triton

    B, V = 66, 70
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(B, 1, V, generator=g) * 2, -1)
    p[..., 16:48] = 0.0
    p[-1, 0, :] = 0.0
    p[-1, 0, 69] = 1.0  # all the mass on the very last token
    p = p / p.sum(-1, keepdim=True)
    u = torch.linspace(0, 1, B)[:, None].clone()
    u[-2, 0] = 1 - 2 ** -24
    u[-1, 0] = 0.5
    tokens = torch.zeros(B, 1, dtype=torch.int64)
    par = torch.tensor([-1])
    ref, margins = run_reference(p, p, tokens, par, u)
    out = (torch.empty(B, 1, dtype=torch.int64), torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
    verify_tree_triton(p, p, tokens, par, u, False, *out, block_v=16)
    assert_agree(ref, out, margins, max_frac=0.05)
    assert not ((16 <= out[2]) & (out[2] < 48)).any() and int(out[2][-1]) == 69


@requires_cuda
@pytest.mark.parametrize("num_ctas", [1, 8])
@pytest.mark.parametrize("V,B", [(32000, 1), (32003, 3), (128256, 1), (49152, 16), (300, 2)])
def test_triton_cuda_cluster_and_single_cta_match_reference(V, B, num_ctas):
    """The Triton kernel on a GPU with one CTA per sequence and as an 8-CTA cluster (batch 1 on
    8 SMs; Triton's num_ctas splits every chunk over the cluster): the reference's outputs,
    sampling and greedy, outputs poisoned first; a 128-node planner tree."""
    import warnings as _w

    from sequoia_kernels.triton_kernels.verify_tree import cluster_build_supported, verify_tree_triton

    if num_ctas > 1 and not cluster_build_supported():
        pytest.skip("this Triton cannot compile the cluster build (needs >= 3.8)")

    parents = planner_tree(128, 6)
    p, q, tokens, par, u = random_case(B, parents, V, seed=V + B + num_ctas, closeness=0.3, device="cuda")
    for greedy in (False, True):
        if greedy:
            tokens[:, 1:] = p.argmax(-1)[:, par[1:]]
        ref, margins = run_reference(p, q, tokens, par, u, greedy=greedy)
        T = len(parents)
        out = (torch.full((B, T), -7, dtype=torch.int64, device="cuda"),
               torch.full((B,), -7, dtype=torch.int64, device="cuda"), torch.full((B,), -7, dtype=torch.int64, device="cuda"))
        with _w.catch_warnings():
            _w.simplefilter("error")  # num_ctas given: a failed cluster launch raises, never falls back
            verify_tree_triton(p, q, tokens, par, u, greedy, *out, num_ctas=num_ctas)
        assert_agree(ref, out, margins, max_frac=0.5, msg=f"V={V} B={B} greedy={greedy} num_ctas={num_ctas}")


CUDA_VERIFY = HAS_CUDA and compiled_op_available("cuda", "verify_tree")


@pytest.mark.skipif(not CUDA_VERIFY, reason="needs a CUDA device and the CUDA build of sequoia_kernels._C")
@pytest.mark.parametrize("V,B", [(32000, 1), (32000, 8), (32003, 3), (49152, 2), (128256, 1), (152064, 2),
                                 (300001, 1)])
def test_cuda_large_vocab_matches_reference(V, B):
    """The cluster kernel (clusters of 8 or 16 depending on V and B, the rows' 16-byte alignment
    broken by V = 32003) and, at V = 300001, the one-block fallback: same outputs as the
    reference, sampling and greedy, with outputs poisoned first."""
    parents = planner_tree(32, 5)
    p, q, tokens, par, u = random_case(B, parents, V, seed=V + B, closeness=0.3, device="cuda")
    for greedy in (False, True):
        if greedy:
            tokens[:, 1:] = p.argmax(-1)[:, par[1:]]
        ref, margins = run_reference(p, q, tokens, par, u, greedy=greedy)
        out = (torch.full((B, len(parents)), -7, dtype=torch.int64, device="cuda"),
               torch.full((B,), -7, dtype=torch.int64, device="cuda"), torch.full((B,), -7, dtype=torch.int64, device="cuda"))
        got = verify_tree(p, q, tokens, par, uniforms=u, greedy=greedy, backend="cuda", out=out)
        assert_agree(ref, got, margins, max_frac=0.5, msg=f"V={V} B={B} greedy={greedy}")


@pytest.mark.skipif(not CUDA_VERIFY, reason="needs a CUDA device and the CUDA build of sequoia_kernels._C")
def test_cuda_more_nodes_than_cached_tables():
    """T = 1100 > kVerifyMaxT = 1024 (node tables past 1024 are read from global memory): a
    chain, so the walk can reach the end, and a wide star."""
    for parents in (chain(1100), star(1099)):
        p, q, tokens, par, u = random_case(2, parents, 64, seed=len(parents), closeness=0.05, device="cuda")
        for greedy in (False, True):
            ref, margins = run_reference(p, q, tokens, par, u, greedy=greedy)
            got = verify_tree(p, q, tokens, par, uniforms=u, greedy=greedy, backend="cuda")
            assert_agree(ref, got, margins, max_frac=0.5)


@pytest.mark.skipif(not CUDA_VERIFY, reason="needs a CUDA device and the CUDA build of sequoia_kernels._C")
def test_cuda_unvalidated_garbage_terminates():
    """validate=False with repeated tokens among siblings, NaN rows and out-of-range parents:
    every block of a cluster must take the same branches (or the cluster barriers deadlock)."""
    p, q, tokens, par, u = random_case(4, planner_tree(24, 5), 32000, seed=9, device="cuda")
    tokens[:, 2] = tokens[:, 1]  # a sibling repeats a rejected token: tried with q = 0
    q[1, 0, :100] = float("nan")
    out = verify_tree(p, q, tokens, par, uniforms=u, backend="cuda", validate=False)
    torch.cuda.synchronize()
    path, n, bonus = (t.cpu() for t in out)
    assert ((bonus >= -1) & (bonus < 32000)).all() and ((n >= 1) & (n <= len(par))).all()
    keep = torch.tensor([0, 2, 3])  # rows without NaN: as the reference
    ref, margins = run_reference(p[keep], q[keep], tokens[keep], par, u[keep])
    assert_agree(ref, (path[keep], n[keep], bonus[keep]), margins, max_frac=0.5)


# ------------------------------------------ model of the CUDA cluster kernel (runs without a GPU)


def cluster_kernel_model(p, q, tokens, parents, u, C: int, threads: int = 8):
    """Line-by-line torch model of verify_tree_cluster_kernel (sampling mode) for one sequence
    (p, q [T, V] fp32): C blocks own slices of L = ceil4(V / C) tokens, zero padded; P is
    double-buffered, Q[x] = 0 is applied lazily by the next rejection pass (a try of the pending
    token reads q = 0), block sums combined in rank order, and the bonus C_j = base_rank + (the
    block's exclusive prefix of per-thread run sums + the thread's running sum; runs of an odd
    number R of float4 groups). Returns (path list, bonus)."""
    T, V = p.shape
    L = ((V + C - 1) // C + 3) // 4 * 4

    def slices(row):
        pad = torch.zeros(C * L, dtype=torch.float32)
        pad[:V] = row
        return pad.view(C, L).clone()

    par = parents.tolist()
    tok = tokens.tolist()
    cur, path = 0, [0]
    P = [slices(p[0]), torch.zeros(C, L)]
    Q = slices(q[0])
    pb, pend, Sp, Sq = 0, -1, torch.tensor(1.0), torch.tensor(1.0)
    for c in range(1, T):
        if par[c] != cur:
            continue
        x = tok[c]
        if not 0 <= x < V:
            continue
        o, xl = divmod(x, L)
        Px = P[pb][o, xl]
        Qx = torch.tensor(0.0) if x == pend else Q[o, xl]
        qx = Qx / Sq if Sq > 0 else torch.tensor(0.0)
        px = Px / Sp
        if not qx > 0:
            continue
        if u[c] * qx < px:
            cur = c
            path.append(c)
            P[0], Q, pb, pend, Sp, Sq = slices(p[c]), slices(q[c]), 0, -1, torch.tensor(1.0), torch.tensor(1.0)
        else:
            if pend >= 0:  # the pass applies the pending Q[pend] = 0 first
                Q[pend // L, pend % L] = 0.0
            if Sp == 1 and Sq == 1:
                D = (P[pb] - Q).clamp_min(0.0)
            else:
                D = (P[pb] / Sp - Q / Sq).clamp_min(0.0)
            P[pb ^ 1] = D
            Qs = Q.clone()
            Qs[o, xl] = 0.0
            zp = sum(float(D[r].double().sum()) for r in range(C))  # block sums, rank order
            zq = sum(float(Qs[r].double().sum()) for r in range(C))
            if zp > 0:
                pb ^= 1
                Sp = torch.tensor(zp, dtype=torch.float32)
            Sq = torch.tensor(zq, dtype=torch.float32)
            pend = x
    # bonus
    n4 = L // 4
    R = ((n4 + threads - 1) // threads) | 1  # odd: conflict-free float4 reads of the runs
    block_tot, runs = [], []
    for r in range(C):
        Pr = P[pb][r]
        rs = []
        for t in range(threads):
            i0, i1 = min(t * R, n4) * 4, min(t * R + R, n4) * 4
            rs.append((i0, i1, float(Pr[i0:i1].double().sum())))
        runs.append(rs)
        block_tot.append(sum(s for _, _, s in rs))
    S = 0.0
    bases = []
    for r in range(C):
        bases.append(S)
        S += block_tot[r]
    t = float(u[0]) * S
    pick, last = V, -1
    for r in range(C):
        Pr = P[pb][r].tolist()
        excl = 0.0
        for i0, i1, s in runs[r]:
            acc = excl
            for i in range(i0, i1):
                acc += Pr[i]
                if Pr[i] > 0:
                    last = max(last, r * L + i)
                    if bases[r] + acc > t:
                        pick = min(pick, r * L + i)
                        break
            excl += s
    return path, (pick if pick < V else last)


@pytest.mark.parametrize("C", [8, 16])
@pytest.mark.parametrize("case", range(len(AGREE_CASES)))
def test_cuda_cluster_kernel_model_matches_reference(case, C):
    """The cluster kernel's organisation (slices, spare P buffer, lazy Q[x] = 0, rank-order sums,
    the parallel bonus) reproduces the reference, including V < C * 4 (empty slices)."""
    parents, V, closeness = AGREE_CASES[case]
    p, q, tokens, par, u = random_case(6, parents, V, seed=200 + case, closeness=closeness)
    if len(parents) > 1:  # row 1: every node has the token x where q_root - p_root is largest, and
        # r ~ 1, so the root's first child is rejected and its siblings repeat the rejected token
        # (validate=False input): the lazy Q[x] = 0 path decides them
        x = int((q[1, 0] - p[1, 0]).argmax())
        tokens[1, 1:] = x
        u[1, 1:] = 0.99999
    ref, margins = run_reference(p, q, tokens, par, u)
    paths, bonuses = [], []
    for b in range(6):
        path, bonus = cluster_kernel_model(p[b], q[b], tokens[b], par, u[b], C)
        paths.append(path + [-1] * (len(parents) - len(path)))
        bonuses.append(bonus)
    got = (torch.tensor(paths), torch.tensor([len([x for x in pth if x >= 0]) for pth in paths]), torch.tensor(bonuses))
    assert_agree(ref, got, margins, max_frac=0.34, msg=f"case {case} C {C}")
