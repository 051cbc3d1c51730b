"""The feature drafter (EAGLE-style heads under Sequoia trees) as a spec:

* every tree it drafts is the one a naive, cache-free recomputation drafts from the target's
  features (positions, masks, true vs predicted features, the pending tokens across steps);
* greedy output is the target's own greedy decoding; an oracle head (a copy of a bigram target)
  has every chain token accepted;
* sampling at T > 0 with top-k and top-p follows the target's filtered distribution exactly;
* the published EAGLE-1/2 and EAGLE-3 layouts load through ``load_draft``; a head that does not
  fit its target gets a ValueError naming both sides before anything changes.
"""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from conftest import assert_pairs_follow, filtered_two_token_distribution, pair_counts
from tiny_models import greedy_reference

from sequoia_decoding.feature_drafter import FeatureDrafter
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.loading import load_draft
from sequoia_decoding.modeling.feature_head import FeatureHead
from sequoia_decoding.planner import chain_tree, kxd_tree, plan_tree

VOCAB = 61


def head_config(target, **kw) -> dict:
    c = target.config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=c.rms_norm_eps,
               rope_theta=10000.0)
    cfg.update(kw)
    return cfg


def random_head(target, kind: str, seed: int, draft_vocab: int | None = None) -> FeatureHead:
    """``kind``: "eagle1", "eagle3", "eagle1x" (an EAGLE-1 head reading states entering layers
    1 and 3 besides the final feature), "eagle1o" (that head reading out through rows of its own)
    or "eagle1d" (that head with two decoder layers)."""
    torch.manual_seed(seed)
    cfg = head_config(target, **({"draft_vocab_size": draft_vocab} if draft_vocab else {}),
                      **({"num_hidden_layers": 2} if kind == "eagle1d" else {}))
    if kind in ("eagle1x", "eagle1o", "eagle1d"):
        head = FeatureHead(cfg, "eagle1", feature_layers=(1, 3, -1), own_readout=kind == "eagle1o")
    else:
        head = FeatureHead(cfg, kind)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        if draft_vocab:  # a sorted random subset of the target's vocabulary
            ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
            head.d2t.copy_(ids - torch.arange(draft_vocab))
    return head.to(next(target.parameters()).dtype).eval()


# ------------------------------------------------------------------ the naive reference


@torch.no_grad()
def naive_hidden(target, head, ctx: list[int], prompt_len: int, plan, tokens: list[int]) -> dict:
    """The head's predicted feature of every expanded node of the tree ``tokens`` drafted after
    ``ctx`` (last token: the root), recomputed from scratch: the target's features of
    ``ctx[:-1]``, the head's slots (feature of token p, token p + 1) (a one-token prompt: (0, its
    token) first), then the node's ancestors fed with their parents' predicted features."""
    head.set_attn_implementation("sdpa")
    F = len(head.feature_layers) * head.target_hidden_size
    fuse = (lambda f: head.fc(f)) if head.kind == "eagle3" else (lambda f: f)
    # a predicted feature as input: EAGLE-3 as it is (after fc); EAGLE-1 the final feature, zeros before it
    own = (lambda h: h) if head.kind == "eagle3" else (lambda h: torch.cat([h.new_zeros(F - h.shape[-1]), h]))
    toks, xs = [], []
    if prompt_len == 1:
        toks, xs = [ctx[0]], [fuse(torch.zeros(1, F, dtype=torch.float64))]
    if len(ctx) > 1:
        out = target.get_decoder()(torch.tensor([ctx[:-1]]), output_hidden_states=True)
        feats = torch.cat([out.last_hidden_state if i == -1 else out.hidden_states[i] for i in head.feature_layers],
                          -1)[0]
        toks, xs = toks + ctx[1:], xs + [fuse(feats)]
    base_x, hidden, counts = torch.cat(xs), {}, plan.children_counts()
    for v in range(plan.num_nodes):  # BFS: parents first
        if not counts[v]:
            continue
        path = [v]
        while path[-1] != 0:
            path.append(plan.parents[path[-1]])
        path = path[::-1]  # root .. v
        seq_t = toks + [max(tokens[a], 0) for a in path[1:]]  # an absent node: the placeholder id 0
        seq_x = torch.cat([base_x] + [own(hidden[a])[None] for a in path[:-1]])
        hidden[v] = head(torch.tensor([seq_t]), seq_x[None], fused=head.kind == "eagle3",
                         position_ids=torch.arange(len(seq_t))[None])[0, -1]
    return hidden


def check_against_naive(target, head, plan, ctx, prompt_len, tokens, q, sampling) -> None:
    """One step's drafted tree (``tokens`` [T], ``q`` [T, V] or None) against the recomputation:
    greedy, each node's children are the head's top tokens; sampled, each expanded node's q."""
    from sequoia_kernels.reference.sampling import sampling_probs_reference

    hidden = naive_hidden(target, head, ctx, prompt_len, plan, tokens)
    assert tokens[0] == ctx[-1]
    for v, h in hidden.items():
        logits = head.logits(h)
        if q is None:
            kids = sorted((c for c in range(plan.num_nodes) if plan.parents[c] == v), key=lambda c: plan.rank[c])
            assert [tokens[c] for c in kids] == logits.topk(len(kids)).indices.tolist(), v
        else:
            ref = sampling_probs_reference(logits, sampling.temperature, sampling.top_k, sampling.top_p)
            torch.testing.assert_close(q[v], ref.to(q.dtype), rtol=1e-9, atol=1e-12, msg=f"node {v}")


@pytest.mark.parametrize("kind,draft_vocab,temperature", [
    ("oracle", None, 0.0), ("oracle", None, 0.9), ("eagle1", None, 0.0), ("eagle1", 37, 0.8), ("eagle3", 40, 0.0),
    ("eagle3", 40, 0.8), ("eagle1x", None, 0.0), ("eagle1x", 37, 0.8), ("eagle1o", None, 0.0), ("eagle1o", 37, 0.8),
    ("eagle1d", None, 0.0), ("eagle1d", 37, 0.8)])
def test_every_drafted_tree_is_the_naive_recomputation(kind, draft_vocab, temperature, monkeypatch):
    """fp64, ragged prompts (one of one token), rows finishing at different steps: each step's
    tree (greedy: its tokens; sampled: every expanded node's q) equals the cache-free
    recomputation from the target's features. Random heads check the layouts; the near-oracle
    head gets long paths accepted (the pending tokens and their features)."""
    if kind == "oracle":
        target, head = bigram_target_and_oracle(1, attention=0.5, features=0.3)
    else:
        target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, dtype=torch.float64, sharpen=3.0)
        head = random_head(target, kind, 5, draft_vocab)
    plan = plan_tree([0.5, 0.2, 0.1], 9, 4)
    prompts, n = [[1, 5, 7, 9, 11], [3], [8, 2]], 12
    sampling = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0, seed=3)
    seen = []
    propose = FeatureDrafter.propose

    def recording(self, spec, root, eos, st):
        prop = propose(self, spec, root, eos, st)
        seen.append((prop.tokens.clone(), None if prop.q is None else prop.q.clone()))
        return prop

    monkeypatch.setattr(FeatureDrafter, "propose", recording)
    gen = SequoiaGenerator(target, head, plan, sampling, max_length=128, backend="reference")
    out = gen.generate(prompts, max_new_tokens=n, eos_token_id=[])
    assert len(seen) == len(out.steps)
    emitted, active = [0] * len(prompts), list(range(len(prompts)))
    for s, st in enumerate(out.steps):
        tokens, q = seen[s]
        assert len(st.emitted) == len(active) == tokens.shape[0]
        for r, b in enumerate(active):
            check_against_naive(target, head, plan, prompts[b] + out.tokens[b][:emitted[b]], len(prompts[b]),
                                tokens[r].tolist(), None if q is None else q[r], sampling)
            emitted[b] += st.emitted[r]
        active = [b for b in active if emitted[b] < n]
    if temperature == 0:
        for b, p in enumerate(prompts):
            assert out.tokens[b] == greedy_reference(target, p, n)
    if kind == "oracle":
        assert out.tokens_per_step > 2.0, out.tokens_per_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_the_readout_runs_packed_with_the_heads_linears(dtype, monkeypatch):
    """An EAGLE-1 head's borrowed readout rows run on packed_linear exactly while the head's own
    linears do (sequoia_models), up to the same rows, and give torch's linear's logits (fp64
    within the rounding of one dot product); outside the block torch's linear again."""
    from sequoia_kernels.ops import packed_linear
    from sequoia_kernels.ops.packed_linear import packed_linear_supported

    monkeypatch.setattr(packed_linear, "packed_prefill_pays", lambda dtype: False)  # a row limit, as with AMX

    from sequoia_decoding.patching import sequoia_models

    if not packed_linear_supported(dtype):
        pytest.skip(f"no packed_linear for {dtype} on this CPU")
    target = tiny_models.tiny_llama(vocab=VOCAB, dtype=dtype)
    head = random_head(target, "eagle1", seed=3, draft_vocab=37)
    head.bind(target)
    h = torch.randn(2, 3, target.config.hidden_size).to(dtype)
    exact = h.double() @ head._readout.double().t()
    bound = (h.double().abs() @ head._readout.double().abs().t()) * 2.0 ** -7 + 1e-6
    with sequoia_models(head, packed_linears=True, max_rows=6):
        got = head.draft_logits(h)
        assert head._readout_packed is not None and head._readout_packed[0] is head._readout
        assert bool(((got.double() - exact).abs() <= bound).all())
        assert torch.equal(head.draft_logits(h[:1, :1]), got[:1, :1])  # batch invariant, as the kernel
        head._readout_packed = None
        head.draft_logits(torch.randn(1, 7, target.config.hidden_size).to(dtype))  # 7 rows > 6: torch's
        assert head._readout_packed is None
    head.draft_logits(h)
    assert head._readout_packed is None


@pytest.mark.parametrize("kind", ["eagle3", "eagle1x"])
def test_teacher_forced_logits_are_the_first_levels(kind):
    """measure-acceptance's q (``teacher_forced_logits``) is what the loop's first draft level
    reads after the same context (and, ``predicted=True``, its second level); an oracle head's
    first child is the target's argmax."""
    from sequoia_decoding.feature_drafter import teacher_forced_logits
    from sequoia_decoding.tools import measure_acceptance

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, dtype=torch.float64, sharpen=3.0)
    head = random_head(target, kind, 4, 40)
    head.bind(target)
    seq = [4, 9, 1, 33, 7, 21]
    q = teacher_forced_logits(head, target, torch.tensor([seq]))[0]  # [N, V]
    for n in (1, 3, 6):
        h = naive_hidden(target, head, seq[:n], 1 if n == 1 else 2, chain_tree(1), seq[:n] + [0])[0]
        torch.testing.assert_close(q[n - 1], head.logits(h), rtol=1e-9, atol=1e-9)
    q2 = teacher_forced_logits(head, target, torch.tensor([seq]), predicted=True)[0]
    torch.testing.assert_close(q2[:2], q[:2])
    for n in (3, 5, 6):  # q of token n from the second level of a chain rooted at token n - 2
        h = naive_hidden(target, head, seq[:n - 1], 2, chain_tree(2), seq[n - 2:n] + [0])[1]
        torch.testing.assert_close(q2[n - 1], head.logits(h), rtol=1e-9, atol=1e-9)
    assert not torch.allclose(q2[2:], q[2:])
    target, oracle = bigram_target_and_oracle()
    acc = measure_acceptance(target, oracle, [[3, 8, 1], [5]], temperature=0.0, width=2, max_new_tokens=12,
                             progress=False)
    assert acc["acceptance"][0] > 0.95, acc


def test_measure_acceptance_reads_a_head_at_both_levels(tmp_path):
    """A head's vector carries the deeper levels' (its own predicted features): the same numbers
    as a separate ``head_level=2`` measurement, planned with through ``parse_acceptance``."""
    import json

    from sequoia_decoding.loading import parse_acceptance
    from sequoia_decoding.planner import LevelAcceptance
    from sequoia_decoding.tools import acceptance_of, measure_acceptance

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, dtype=torch.float64, sharpen=3.0)
    head = random_head(target, "eagle3", 4, 40)
    head.bind(target)
    prompts = [[4, 9, 1, 33], [7], [21, 5, 2]]
    for temperature in (0.0, 0.8):
        both = measure_acceptance(target, head, prompts, temperature=temperature, width=3, max_new_tokens=10,
                                  progress=False, runs=2)
        deep = measure_acceptance(target, head, prompts, temperature=temperature, width=3, max_new_tokens=10,
                                  progress=False, runs=2, head_level=2)
        assert "deep_acceptance" not in deep and len(both["deep_acceptance"]) == 3
        if temperature == 0.0:  # deterministic: the same numbers
            assert both["deep_acceptance"] == deep["acceptance"]
        (tmp_path / "acc.json").write_text(json.dumps(both))
        acc = parse_acceptance(str(tmp_path / "acc.json"))
        assert isinstance(acc, LevelAcceptance) and acc == tuple(both["acceptance"])
        assert acc.deep == tuple(both["deep_acceptance"]) and acceptance_of(both).deep == acc.deep



def test_measure_acceptance_stops_where_decoding_stops():
    """The positions measured are the ones decoding verifies: each continuation ends at the
    target's EOS (its generation config by default), the position predicting EOS included;
    ``eos_token_id=[]`` measures the whole ``max_new_tokens``."""
    from sequoia_decoding.tools import measure_acceptance

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=2, dtype=torch.float64, sharpen=3.0)
    head = random_head(target, "eagle1", 4, 40)
    head.bind(target)
    prompt = [4, 9, 1, 33]
    gen = SequoiaGenerator(target, None, None, SamplingParams(temperature=0.0), max_length=32)
    cont = gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0]
    eos = cont[3]
    stop = cont.index(eos) + 1  # positions up to the one predicting the first EOS
    kw = dict(temperature=0.0, width=2, max_new_tokens=12, progress=False)
    full = measure_acceptance(target, head, [prompt], eos_token_id=[], **kw)
    cut = measure_acceptance(target, head, [prompt], eos_token_id=eos, **kw)
    assert full["positions"] == 12 and not full["stops_at_eos"]
    assert cut["positions"] == stop < 12 and cut["stops_at_eos"]
    target.generation_config.eos_token_id = eos  # the default: the target's own EOS, as generate()
    assert measure_acceptance(target, head, [prompt], **kw) == cut


# ------------------------------------------------------------------ an oracle head


def bigram_target_and_oracle(seed: int = 0, dtype=torch.float64, attention: float = 0.0, features: float = 0.0,
                             draft_ids: list[int] | None = None, feature_layers=None, own_readout: bool = False,
                             head_layers: int = 1):
    """A one-layer target with its attention switched off (a bigram model of unit-RMS embeddings)
    and an EAGLE-1 head that copies it: fc picks the token's embedding, the layer is the target's,
    so the head's logits are the target's before its final norm (the same argmax, similar q).
    ``attention`` > 0 keeps that much of the target's attention, ``features`` > 0 mixes that much
    of the feature into fc: a head that is right most of the time and reads everything.
    ``draft_ids`` (sorted): the head drafts only these tokens (a vocabulary of its own);
    ``feature_layers``: the states it reads (EAGLE-1 ending in -1; ``features`` mixes all in);
    ``own_readout``: it reads out through rows of its own, the target's rows of its tokens perturbed;
    ``head_layers`` > 1: more decoder layers after the copy, random with small residual branches."""
    target = tiny_models.tiny_llama(seed, vocab=VOCAB, layers=1, dtype=dtype, sharpen=4.0)
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
        target.model.layers[0].self_attn.o_proj.weight.mul_(attention)
    extra = {"draft_vocab_size": len(draft_ids)} if draft_ids else {}
    head = FeatureHead(head_config(target, rms_norm_eps=target.config.rms_norm_eps, num_hidden_layers=head_layers,
                                   **extra), "eagle1", feature_layers=feature_layers, own_readout=own_readout)
    H, F = target.config.hidden_size, head.feature_width
    with torch.no_grad():
        if draft_ids:
            head.d2t.copy_(torch.tensor(draft_ids) - torch.arange(len(draft_ids)))
        head.fc.weight.copy_(torch.cat([torch.eye(H), features * torch.randn(H, F) / F ** 0.5], 1))
        head.fc.bias.zero_()
        src = target.model.layers[0]
        head.layers[0].self_attn.load_state_dict(src.self_attn.state_dict())
        head.layers[0].mlp.load_state_dict(src.mlp.state_dict())
        head.layers[0].post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
        for layer in head.layers[1:]:  # small branches: the oracle stays mostly right
            layer.self_attn.o_proj.weight.normal_(0, 0.02)
            layer.mlp.down_proj.weight.normal_(0, 0.02)
        if own_readout:
            rows = target.lm_head.weight[head.token_ids()]
            head.lm_head.weight.copy_(rows + 0.2 * rows.std() * torch.randn_like(rows))
    return target, head.to(dtype).eval()


@pytest.mark.parametrize("plan", [chain_tree(4), kxd_tree(2, 3)], ids=["chain4", "2x3"])
def test_an_oracle_head_has_its_first_children_accepted(plan):
    target, head = bigram_target_and_oracle()
    prompts = [[1, 5, 7, 9], [3], [8, 2, 6]]
    out = SequoiaGenerator(target, head, plan, max_length=128, backend="reference").generate(
        prompts, max_new_tokens=24, eos_token_id=[])
    for b, p in enumerate(prompts):
        assert out.tokens[b] == greedy_reference(target, p, 24)
    # every step but a row's last accepts the first-child chain: depth tokens per step
    assert out.tokens_per_step == pytest.approx(plan.num_levels, abs=0.35), out.tokens_per_step


def test_eos_and_min_new_tokens_with_a_feature_head():
    target, head = bigram_target_and_oracle()
    prompts = [[1, 5, 7, 9], [3], [8, 2, 6]]
    ref = {b: greedy_reference(target, p, 30) for b, p in enumerate(prompts)}
    eos = ref[0][5]
    out = SequoiaGenerator(target, head, kxd_tree(2, 3), max_length=128, backend="reference").generate(
        prompts, max_new_tokens=30, eos_token_id=[eos])
    for b in range(len(prompts)):
        r = ref[b]
        assert out.tokens[b] == (r[: r.index(eos) + 1] if eos in r else r)


@pytest.mark.parametrize("in_vocab", [True, False], ids=["eos-drafted", "eos-not-drafted"])
def test_min_new_tokens_with_a_head_of_its_own_vocabulary(in_vocab, monkeypatch):
    """A head drafting a subset of the vocabulary: min_new_tokens blocks EOS in its own ids where
    it has EOS (the first step's tree, all of it within the first 8 tokens, never holds it), and
    has nothing to block where it has not; the tokens are plain decoding's under the same rule
    (NoDrafter through the loop), EOS never among a row's first tokens."""
    trees = []
    propose = FeatureDrafter.propose
    monkeypatch.setattr(FeatureDrafter, "propose", lambda self, *a: trees.append(propose(self, *a)) or trees[-1])
    target, _ = bigram_target_and_oracle()
    prompts = [[1, 5, 7, 9], [3], [8, 2, 6]]
    path = greedy_reference(target, prompts[0], 6)
    eos = path[2]  # within the first step's tree of row 0, unless blocked
    dropped = {eos} if not in_vocab else set(sorted(set(range(VOCAB)) - set(path))[:3])  # low ids: EOS renumbered
    ids = sorted(set(range(VOCAB)) - dropped)
    _, head = bigram_target_and_oracle(draft_ids=ids)
    kw = dict(max_new_tokens=20, eos_token_id=[eos], min_new_tokens=8)
    want = SequoiaGenerator(target, None, max_length=128, backend="reference").generate(prompts, **kw)
    out = SequoiaGenerator(target, head, kxd_tree(2, 3), max_length=128, backend="reference").generate(prompts, **kw)
    assert out.tokens == want.tokens
    assert all(eos not in t[:8] for t in out.tokens) and out.tokens_per_step > 1.2
    assert not (trees[0].tokens[:, 1:] == eos).any()


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p,drafted,layers,own,depth", [
    (0.8, 0, 1.0, None, None, False, 1), (0.7, 0, 0.85, None, None, False, 1), (0.6, 4, 1.0, None, None, False, 1),
    (0.7, 0, 0.85, 2, None, False, 1), (0.6, 4, 1.0, 3, None, False, 1), (0.7, 0, 0.85, None, (0, -1), False, 1),
    (0.6, 4, 1.0, 2, (0, -1), False, 1), (0.7, 0, 0.85, 2, (0, -1), True, 1), (0.6, 4, 1.0, None, None, True, 1),
    (0.7, 0, 0.85, None, (0, -1), False, 2), (0.6, 4, 1.0, 2, None, False, 2)])
def test_sampling_with_a_feature_head_is_exact(temperature, top_k, top_p, drafted, layers, own, depth):
    """The first two new tokens follow the target's filtered distribution (chi-square), on a DP
    tree, with an oracle head whose drafts are mostly accepted (the deep paths get exercised);
    ``drafted`` k: the head drafts every k-th token only (a vocabulary of its own: q is 0 at the
    others, which only the residual can emit); ``layers``: a head reading the embedding's state
    besides the final feature; ``own``: a head reading out through rows of its own; ``depth``: its
    decoder layers."""
    target, head = bigram_target_and_oracle(dtype=torch.float32, features=0.3 if layers else 0.0,
                                            draft_ids=list(range(0, VOCAB, drafted)) if drafted else None,
                                            feature_layers=layers, own_readout=own, head_layers=depth)
    prompt, n = [3, 17, 5], 3000
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    exact = filtered_two_token_distribution(target, prompt, sampling)
    gen = SequoiaGenerator(target, head, plan_tree([0.6, 0.2, 0.1], 8, 4), sampling, max_length=64)
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])
    assert out.tokens_per_step > 1.5  # the drafts are accepted: the tree's deeper nodes are exercised
    counts = pair_counts(out.tokens, VOCAB)
    assert_pairs_follow(counts, exact, n)


def test_the_graphed_branch_with_a_feature_head():
    """The loop's cuda_graphs branch on the CPU (the capture replaced by a plain step): same tokens."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0)
    head = random_head(target, "eagle3", 2, 50)
    prompts, plan = [[3, 17, 5, 9], [2, 2], [40]], plan_tree([0.5, 0.2, 0.1], 10, 4)
    expected = SequoiaGenerator(target, head, plan, max_length=128).generate(prompts, max_new_tokens=13,
                                                                            eos_token_id=[]).tokens
    gen = SequoiaGenerator(target, head, plan, max_length=128)
    gen.cuda_graphs = True
    gen._graphed_step = lambda graphs, tcache, drafter, spec, root: gen._step(tcache, drafter, spec, root)
    assert gen.generate(prompts, max_new_tokens=13, eos_token_id=[]).tokens == expected


# ------------------------------------------------------------------ published layouts, bad input

EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
               "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
               "layers.0.post_attention_layernorm.weight"}
EAGLE3_KEYS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
               "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
               "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
               "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
               "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}


def _published(tmp_path, head: FeatureHead, config: dict, keys: set, fmt: str):
    """``head``'s weights written under the published key names (checked against ``keys``)."""
    from safetensors.torch import save_file

    state = {k: v.float().contiguous() if v.is_floating_point() else v for k, v in head.state_dict().items()
             if not k.startswith("rotary.")}
    if head.kind == "eagle3":
        t2d = torch.zeros(VOCAB, dtype=torch.bool)
        t2d[head.token_ids()] = True
        state["t2d"] = t2d
    else:
        state.pop("d2t")
    assert set(state) == keys
    (tmp_path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("kind,fmt", [("eagle1", "bin"), ("eagle3", "safetensors")])
def test_published_layouts_load_and_decode_the_same(tmp_path, kind, fmt):
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0)
    head = random_head(target, kind, 3, 45 if kind == "eagle3" else None)
    config = head_config(target, architectures=["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"],
                         num_hidden_layers=1, bias=kind == "eagle1")
    if kind == "eagle3":
        config.update(draft_vocab_size=45, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
        head.feature_layers = (1, 3, 4)
    folder = _published(tmp_path, head, config, EAGLE1_KEYS if kind == "eagle1" else EAGLE3_KEYS, fmt)
    loaded = load_draft(str(folder))
    assert isinstance(loaded, FeatureHead) and loaded.kind == kind
    prompts, plan = [[3, 17, 5, 9], [2, 2]], plan_tree([0.5, 0.2, 0.1], 8, 3)
    s = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    a = SequoiaGenerator(target, head, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    b = SequoiaGenerator(target, loaded, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    assert a.tokens == b.tokens


def test_an_eagle1_head_reading_more_layers_saves_loads_and_decodes_the_same(tmp_path):
    """This project's EAGLE-1 layout with earlier states (``eagle_config`` layer ids ending in
    -1): ``save`` / ``load_draft`` keep the layers and decode the same tokens; its deeper levels
    feed the prediction as the final feature with zeros before it; layers not ending in -1, or
    repeated, are refused."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0)
    head = random_head(target, "eagle1x", 3, 41)
    loaded = load_draft(str(head.save(tmp_path / "h", dtype=torch.float32)))
    assert isinstance(loaded, FeatureHead) and loaded.kind == "eagle1" and loaded.feature_layers == (1, 3, -1)
    assert loaded.fc.weight.shape == (target.config.hidden_size, 4 * target.config.hidden_size)
    prompts, plan = [[3, 17, 5, 9], [2, 2]], plan_tree([0.5, 0.2, 0.1], 8, 3)
    s = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    a = SequoiaGenerator(target, head, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    b = SequoiaGenerator(target, loaded, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    assert a.tokens == b.tokens
    H = target.config.hidden_size
    h = torch.randn(2, 3, H)
    assert torch.equal(head.own_features(h), torch.cat([torch.zeros(2, 3, 2 * H), h], -1))
    for bad in ((1, 3), (1, -1, -1)):
        with pytest.raises(ValueError, match="end with the final feature -1"):
            FeatureHead(head_config(target), "eagle1", feature_layers=bad)


def test_an_eagle1_head_of_two_layers_saves_loads_and_decodes_the_same(tmp_path):
    """This project's deeper EAGLE-1 head (``layers.0`` without an input norm, ``layers.1`` a
    Llama layer with one): ``load_draft`` counts its layers from the weights (a config naming
    another count is overruled), the drafter's cache holds both, and it decodes the same tokens
    as the head it was saved from, in the loop's default (lean, packed) path."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0)
    head = random_head(target, "eagle1d", 4, 41)
    folder = head.save(tmp_path / "h", dtype=torch.float32)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    (folder / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=6)))
    loaded = load_draft(str(folder))
    assert isinstance(loaded, FeatureHead) and len(loaded.layers) == 2 and loaded.config.num_hidden_layers == 2
    assert not hasattr(loaded.layers[0], "input_layernorm") and hasattr(loaded.layers[1], "input_layernorm")
    assert [l.self_attn.layer_idx for l in loaded.layers] == [0, 1]
    prompts, plan = [[3, 17, 5, 9], [2, 2]], plan_tree([0.5, 0.2, 0.1], 8, 3)
    s = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    a = SequoiaGenerator(target, head, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    b = SequoiaGenerator(target, loaded, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    assert a.tokens == b.tokens
    with pytest.raises(ValueError, match="num_hidden_layers must be >= 1"):
        FeatureHead(head_config(target, num_hidden_layers=0), "eagle1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_eagle1_head_with_its_own_readout_saves_loads_and_reads_out_packed(tmp_path, dtype):
    """An EAGLE-1 head with rows of its own (``lm_head.weight``): borrows no target rows, saves and
    loads as such (``load_draft``), decodes the same tokens loaded; inside the loop's block its
    readout runs on packed_linear (batch invariant) and gives torch's linear's logits; an EAGLE-3
    head cannot be asked for one (it always has its own)."""
    from sequoia_kernels.ops.packed_linear import packed_linear_supported

    from sequoia_decoding.patching import sequoia_models

    if not packed_linear_supported(dtype):
        pytest.skip(f"no packed_linear for {dtype} on this CPU")
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0).to(dtype)
    head = random_head(target, "eagle1o", 4, 41)
    head.bind(target)
    assert head.own_readout and head._readout is None and head.lm_head.weight.shape == (41, target.config.hidden_size)
    loaded = load_draft(str(head.save(tmp_path / "h", dtype=dtype))).to(dtype)
    assert isinstance(loaded, FeatureHead) and loaded.own_readout and torch.equal(loaded.lm_head.weight,
                                                                                 head.lm_head.weight)
    prompts, plan = [[3, 17, 5, 9], [2, 2]], plan_tree([0.5, 0.2, 0.1], 8, 3)
    s = SamplingParams(temperature=0.9, top_p=0.9, seed=5)
    a = SequoiaGenerator(target, head, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    b = SequoiaGenerator(target, loaded, plan, s, max_length=96).generate(prompts, max_new_tokens=10)
    assert a.tokens == b.tokens
    h = torch.randn(2, 3, target.config.hidden_size).to(dtype)
    with torch.no_grad():
        exact = h.double() @ head.lm_head.weight.double().t()
        bound = (h.double().abs() @ head.lm_head.weight.double().abs().t()) * 2.0 ** -7 + 1e-6
        with sequoia_models(head, packed_linears=True, max_rows=6):
            got = head.draft_logits(h)
            assert head.lm_head._sequoia_packed[2] is not None  # the packed kernel ran
            assert bool(((got.double() - exact).abs() <= bound).all())
            assert torch.equal(head.draft_logits(h[:1, :1]), got[:1, :1])
    with pytest.raises(ValueError, match="own_readout is for EAGLE-1"):
        FeatureHead(head_config(target), "eagle3", own_readout=True)


def test_eagle3_reads_its_default_layers_and_maps_its_vocabulary():
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=8)
    head = random_head(target, "eagle3", 1, 30)
    SequoiaGenerator(target, head, chain_tree(2), max_length=64)
    assert head.feature_layers == (2, 4, 5)
    assert head.logits(torch.randn(2, head.config.hidden_size)).isfinite().sum(-1).tolist() == [30, 30]


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=48), r"width 64.*48|48.*64"),
    (dict(vocab_size=70), r"70 vs 61"),
    (dict(layers=(1, 3, 9)), r"feature layers \[1, 3, 9\].*6 layers"),
    (dict(eagle1_layers=(2, 7, -1)), r"feature layers \[2, 7, -1\].*6 layers"),
    (dict(d2t_out_of_range=True), r"vocabulary map .* 61 tokens"),
])
def test_a_head_that_does_not_fit_its_target_is_refused(change, match):
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6)
    kind = "eagle3" if "layers" in change or "d2t_out_of_range" in change else "eagle1"
    cfg = head_config(target, **{k: v for k, v in change.items() if k in ("hidden_size", "vocab_size")})
    if kind == "eagle3":
        cfg["draft_vocab_size"] = 20
    head = FeatureHead(cfg, kind, feature_layers=change.get("layers") or change.get("eagle1_layers"))
    if change.get("d2t_out_of_range"):
        head.d2t.fill_(50)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        SequoiaGenerator(target, head, chain_tree(2), max_length=64)
    assert head._embed_weight is None and all(torch.equal(v, head.state_dict()[k]) for k, v in before.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_feature_head_matches_eager():
    """On a GPU: the step with a feature head captured in one CUDA graph gives the eager loop's
    greedy tokens (rows finishing at different times force re-captures)."""
    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0).cuda()
    head = random_head(target, "eagle3", 2, 50).cuda()
    prompts, plan = [[3, 17, 5, 9], [2, 2], [40]], plan_tree([0.5, 0.2, 0.1], 10, 4)
    for n in (5, 17):
        eager = SequoiaGenerator(target, head, plan, max_length=128).generate(prompts, max_new_tokens=n,
                                                                             eos_token_id=[]).tokens
        graphed = SequoiaGenerator(target, head, plan, max_length=128, cuda_graphs=True).generate(
            prompts, max_new_tokens=n, eos_token_id=[]).tokens
        assert graphed == eager


def test_hf_generate_with_a_feature_head():
    """``target.generate(..., custom_generate=SequoiaDecoding(head))``: greedy equals plain
    ``generate`` with ragged (left-padded) rows."""
    from sequoia_decoding import SequoiaDecoding

    target = tiny_models.tiny_llama(0, vocab=VOCAB, layers=6, sharpen=3.0, pad_token_id=0)
    head = random_head(target, "eagle3", 1, 45)
    ids = torch.tensor([[3, 4, 5, 6], [0, 0, 9, 8]])
    mask = (ids != 0).long()
    ref = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                          custom_generate=SequoiaDecoding(head, budget=6, max_depth=3))
    assert out.tolist() == ref.tolist()
