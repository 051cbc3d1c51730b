"""verify_tree vs the original Sequoia verification loop, on the CPU.

Shapes: planner-shaped trees of 16, 64 and 128 nodes, vocabularies 32000 (Llama 2) and 49152
(SmolLM2), batch 1 and 8; fp32. The target and draft distributions are random but LLM-like
(peaked; the draft a noisy copy of the target, so paths are a few nodes deep), the children
sampled from the draft without replacement. One ``benchmark.group`` per shape; the baseline is
``test_sequoia_python_loop`` (bench/report.py prints every row's speedup over it).

Run with ``make bench`` (or ``pytest bench/bench_verify_tree.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

try:
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree
except ImportError:  # python_api not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_api"))
    from sequoia_decoding.planner import DEFAULT_ACCEPTANCE, plan_tree

from sequoia_kernels.ops.sampling import sample_children
from sequoia_kernels.ops.verify_tree import verify_tree

SHAPES = [(T, V, B) for T in (16, 64, 128) for V in (32000, 49152) for B in (1, 8)]
IDS = [f"T{T}-V{V}-B{B}" for T, V, B in SHAPES]
_cache: dict = {}


def make_case(T: int, V: int, B: int):
    """target_probs, draft_probs, draft_logits [B, T, V], tokens [B, T], parents [T], uniforms [B, T]."""
    if (T, V, B) in _cache:
        return _cache[(T, V, B)]
    _cache.clear()  # one shape in memory at a time (B = 8, T = 128, V = 49152: 0.6 GB)
    plan = plan_tree(DEFAULT_ACCEPTANCE, T, 12)
    parents = list(plan.parents)
    assert len(parents) == T, f"planner used {len(parents)} of {T} nodes"
    g = torch.Generator().manual_seed(T * V + B)
    p = torch.empty(B, T, V)
    q = torch.empty(B, T, V)
    for t in range(T):  # row by row: no [B, T, V] temporaries
        z = torch.randn(B, V, generator=g) * 3.0
        p[:, t] = torch.softmax(z, -1)
        q[:, t] = torch.softmax(z + torch.randn(B, V, generator=g) * 0.6, -1)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    kids: dict[int, list[int]] = {}
    for c in range(1, T):
        kids.setdefault(parents[c], []).append(c)
    for u, ch in kids.items():
        tokens[:, ch] = sample_children(q[:, u].contiguous(), len(ch), uniforms=1 - torch.rand(B, V, generator=g),
                                        backend="reference", validate=False)
    draft_logits = q.log().clamp(min=torch.finfo(torch.float32).min)
    u = torch.rand(B, T, generator=g)
    case = (p, q, draft_logits, tokens, torch.tensor(parents), u, kids)
    _cache[(T, V, B)] = case
    return case


def get_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Sequoia's residual: normalise(relu(p - q))."""
    residual = (p - q).relu_()
    return residual / residual.sum(dim=-1).unsqueeze(-1)


def sequoia_python_loop(target_probs, draft_logits, tokens, kids, uniforms, temperature: float = 1.0):
    """The structure of Sequoia's SpecTree.verify / accept_step (github.com/Infini-AI-Lab/Sequoia),
    in fp32: one sequence at a time; per node, per child in sampling order, the draft softmax is
    recomputed, ``p[token] > r * q[token]`` is read back to the host (``.item()``), a rejection
    replaces p by the normalised residual and masks the token in the draft logits; the bonus is
    drawn with ``multinomial`` from the final p after a NaN check (Sequoia ends the text on NaN)."""
    B = target_probs.shape[0]
    accepted = []
    bonus = []
    for b in range(B):
        dl = draft_logits[b].clone()  # accept_step masks rejected tokens in place
        accept_list = [0]
        while True:
            parent = accept_list[-1]
            p = target_probs[b, parent]
            nxt = -1
            for pos in kids.get(parent, []):
                token = tokens[b, pos]
                q = torch.softmax(dl[parent] / temperature, dim=-1)
                r = uniforms[b, pos]
                if (p[token] > r * q[token]).item():
                    nxt = pos
                    break
                p = get_residual(p, q)
                dl[parent, token] = torch.finfo(torch.float32).min
            if nxt < 0:
                residual = p
                break
            accept_list.append(nxt)
        if torch.isnan(residual).any().item():
            bonus.append(-1)
        else:
            bonus.append(int(residual.multinomial(num_samples=1, replacement=True)))
        accepted.append(accept_list)
    return accepted, bonus


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_sequoia_python_loop(benchmark, shape):
    T, V, B = shape
    p, q, dl, tokens, parents, u, kids = make_case(*shape)
    benchmark.group = f"verify_tree T{T} V{V} B{B}"
    benchmark.pedantic(sequoia_python_loop, args=(p, dl, tokens, kids, u), rounds=3, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_verify_tree_op(benchmark, shape):
    """Default backend: the compiled CPU kernel when built (else the reference), validated."""
    T, V, B = shape
    p, q, dl, tokens, parents, u, kids = make_case(*shape)
    benchmark.group = f"verify_tree T{T} V{V} B{B}"
    out = (torch.empty(B, T, dtype=torch.int64), torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
    benchmark(verify_tree, p, q, tokens, parents, uniforms=u, out=out)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_verify_tree_op_unvalidated(benchmark, shape):
    """As the captured decoding loop calls it: validate=False, preallocated outputs and workspace."""
    T, V, B = shape
    p, q, dl, tokens, parents, u, kids = make_case(*shape)
    benchmark.group = f"verify_tree T{T} V{V} B{B}"
    out = (torch.empty(B, T, dtype=torch.int64), torch.empty(B, dtype=torch.int64), torch.empty(B, dtype=torch.int64))
    ws = torch.empty(B, 2, V)
    benchmark(verify_tree, p, q, tokens, parents, uniforms=u, out=out, workspace=ws, validate=False)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=IDS[:2])
def test_results_agree(shape):
    """Same uniforms: the loop and the op accept the same paths (the loop recomputes q from
    logits, so a decision within rounding of its boundary may differ: allow one sequence)."""
    p, q, dl, tokens, parents, u, kids = make_case(*shape)
    accepted, _ = sequoia_python_loop(p, dl, tokens, kids, u)
    path, n, _ = verify_tree(p, q, tokens, parents, uniforms=u)
    same = sum(path[b, : n[b]].tolist() == accepted[b] for b in range(p.shape[0]))
    assert same >= p.shape[0] - 1
