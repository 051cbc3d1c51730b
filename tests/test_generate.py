"""The decoding loop end to end on tiny random Llama pairs built here (CPU)."""


import pytest
import torch
from transformers import LlamaForCausalLM

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.planner import chain_tree, kxd_tree, plan_tree

import tiny_models
from conftest import pair_counts
from tiny_models import greedy_reference

VOCAB = 61


def tiny_llama(seed: int, **kw) -> LlamaForCausalLM:
    """This file's pair: sharper distributions than the default init (more agreement, less noise)."""
    return tiny_models.tiny_llama(seed, **{"vocab": VOCAB, "sharpen": 8.0, **kw})


@pytest.fixture(scope="module")
def pair():
    return tiny_llama(0), tiny_llama(1, layers=1)


PLANS = {
    "sequoia": lambda: plan_tree([0.5, 0.2, 0.1], 12, 4),
    "chain": lambda: chain_tree(4),
    "kxd": lambda: kxd_tree(2, 3),
}


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_greedy_matches_target_greedy(pair, plan_name):
    target, draft = pair
    prompt = [3, 17, 5, 9, 22]
    expected = greedy_reference(target, prompt, 20)
    gen = SequoiaGenerator(target, draft, PLANS[plan_name](), SamplingParams(temperature=0.0), max_length=128)
    out = gen.generate([prompt], max_new_tokens=20, eos_token_id=[])
    assert out.tokens[0] == expected
    assert all(s.emitted[0] >= 1 for s in out.steps)


def test_autoregressive_baseline_matches(pair):
    target, _ = pair
    prompt = [7, 1, 2]
    gen = SequoiaGenerator(target, None, chain_tree(0), SamplingParams(), max_length=64)
    assert gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0] == greedy_reference(target, prompt, 12)


def test_models_switched_to_another_attention_after_construction(pair):
    """Using the models elsewhere (e.g. HF sdpa) between generate calls must not corrupt decoding."""
    target, draft = pair
    prompt = [4, 8, 15, 16]
    gen = SequoiaGenerator(target, draft, PLANS["sequoia"](), SamplingParams(), max_length=128)
    expected = greedy_reference(target, prompt, 12)  # leaves the target on sdpa
    draft.set_attn_implementation("eager")
    assert gen.generate([prompt], max_new_tokens=12, eos_token_id=[]).tokens[0] == expected
    # the generator uses "sequoia_tree" for the call only: each model is left as it was found
    assert (target.config._attn_implementation, draft.config._attn_implementation) == ("sdpa", "eager")


def test_draft_equal_to_target_accepts_every_chain_token(pair):
    target, _ = pair
    gen = SequoiaGenerator(target, target, chain_tree(4), SamplingParams(), max_length=128)
    out = gen.generate([[4, 8, 15, 16, 23]], max_new_tokens=25, eos_token_id=[])
    # every step accepts all 4 drafted tokens (+ bonus), except where max_new_tokens cuts it
    assert [s.accepted[0] for s in out.steps] == [4] * len(out.steps)
    assert out.tokens[0] == greedy_reference(target, [4, 8, 15, 16, 23], 25)


def test_batch_rows_match_single_rows(pair):
    target, draft = pair
    prompts = [[3, 4, 5, 6, 7, 8, 9], [11], [2, 40, 33]]
    gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2, 0.1], 10, 4), SamplingParams(), max_length=128)
    together = gen.generate(prompts, max_new_tokens=15, eos_token_id=[]).tokens
    alone = [gen.generate([p], max_new_tokens=15, eos_token_id=[]).tokens[0] for p in prompts]
    assert together == alone


def test_eos_stops_a_row_and_rows_finish_independently(pair):
    target, draft = pair
    prompts = [[3, 17, 5], [9, 9, 1, 4]]
    ref = [greedy_reference(target, p, 12) for p in prompts]
    eos = ref[0][4]  # the 5th token of row 0
    gen = SequoiaGenerator(target, draft, chain_tree(3), SamplingParams(), max_length=64)
    out = gen.generate(prompts, max_new_tokens=12, eos_token_id=eos)
    first = ref[0].index(eos)
    assert out.tokens[0] == ref[0][: first + 1]
    cut = ref[1].index(eos) + 1 if eos in ref[1] else 12
    assert out.tokens[1] == ref[1][:cut]


def test_kv_cache_after_every_step_equals_target_run_over_accepted_tokens(pair):
    """After each step's compaction, both caches hold what a plain run of each model over the
    prompt and the emitted tokens (all but the newest, the next root) computes; the draft's
    newest entry excepted (an accepted leaf is never forwarded: the next step rewrites that
    entry along with the root, so it is checked in every later snapshot)."""
    target, draft = pair
    prompt = [5, 6, 7, 8]
    gen = SequoiaGenerator(target, draft, plan_tree([0.5, 0.2, 0.1], 8, 3),
                           SamplingParams(temperature=0.9, seed=3), max_length=64)
    snapshots = tiny_models.record_cache_snapshots(gen)  # (model, prefix_len, cache tensor) after every accept
    out = gen.generate([prompt], max_new_tokens=12, eos_token_id=[])
    assert len(snapshots) == 2 * len(out.steps)
    tiny_models.check_cache_snapshots(snapshots, prompt + out.tokens[0], draft)


def test_every_cache_holds_what_a_call_can_write(pair):
    """The target's and the draft's caches per call: the positions the request can write
    (check_request's need) rounded up to 64, capped at max_length, not max_length itself; outputs
    as with a cache of max_length (greedy), the capacity check unchanged; ``max_length=None``: no
    cap and no capacity error, the same caches and tokens."""
    target, draft = pair
    plan = plan_tree([0.5, 0.2, 0.1], 8, 3)
    prompts = [[5, 6, 7, 8], [9] * 70]
    outs = []
    for max_length in (2048, None):
        sizes = {}
        gen = SequoiaGenerator(target, draft, plan, max_length=max_length)
        orig = gen._cache

        def spy(model, batch, need):
            cache = orig(model, batch, need)
            sizes["target" if model is target else "draft"] = cache.tensor.shape[3]
            return cache

        gen._cache = spy
        outs.append(gen.generate(prompts, max_new_tokens=12, eos_token_id=[]).tokens)
        assert sizes == {"target": 128, "draft": 128}  # 70 + 12 + 8 - 2 = 88 positions, in 64s
    assert outs[0] == outs[1]
    full = SequoiaGenerator(target, draft, plan, max_length=88)
    assert full.generate(prompts, max_new_tokens=12, eos_token_id=[]).tokens == outs[0]
    with pytest.raises(ValueError, match="needs 89 cache positions"):
        full.generate(prompts, max_new_tokens=13, eos_token_id=[])
    assert len(gen.generate(prompts, max_new_tokens=200, eos_token_id=[]).tokens[1]) == 200


def exact_two_token_distribution(target, prompt, temperature):
    """P(first two new tokens) of the target's own sampling, by enumeration: [V, V]."""
    target.set_attn_implementation("sdpa")
    with torch.no_grad():
        p1 = (target(torch.tensor([prompt])).logits[0, -1].double() / temperature).softmax(-1)
        ids = torch.tensor([prompt + [x] for x in range(VOCAB)])
        p2 = (target(ids).logits[:, -1].double() / temperature).softmax(-1)
    return p1[:, None] * p2


def test_sampling_is_exact_end_to_end(pair):
    """The first two generated tokens follow the target's own distribution (chi-square and TV)."""
    from scipy.stats import chisquare

    target, draft = pair
    prompt, temp, n = [3, 17, 5], 1.0, 3000
    exact = exact_two_token_distribution(target, prompt, temp)
    gen = SequoiaGenerator(target, draft, plan_tree([0.4, 0.2, 0.1], 6, 3),
                           SamplingParams(temperature=temp, seed=1234), max_length=64)
    # one batch of n identical prompts: every row is an independent sample
    out = gen.generate([prompt] * n, max_new_tokens=2, eos_token_id=[])
    counts = pair_counts(out.tokens, VOCAB)
    # first token alone: exact test on all V cells
    c1, e1 = counts.sum(1), exact.sum(1) * n
    keep = e1 > 5
    stat1 = chisquare(c1[keep].numpy(), e1[keep].numpy() * c1[keep].sum().item() / e1[keep].sum().item())
    assert stat1.pvalue > 1e-3, stat1
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    # TV of the empirical 2-token distribution at n draws is dominated by sampling noise:
    # compare with what an exact sampler gets at the same n
    g = torch.Generator().manual_seed(7)
    ideal = torch.multinomial(exact.flatten(), n, replacement=True, generator=g)
    ideal_counts = torch.bincount(ideal, minlength=VOCAB * VOCAB).view(VOCAB, VOCAB).double()
    tv_ideal = 0.5 * (ideal_counts / n - exact).abs().sum().item()
    assert tv < tv_ideal * 1.25 + 0.02, (tv, tv_ideal)


def test_seeded_sampling_is_reproducible_and_fresh_each_step(pair):
    target, draft = pair
    plan = chain_tree(3)
    a = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=0.8, seed=5), max_length=64)
    b = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=0.8, seed=5), max_length=64)
    ta = a.generate([[1, 2, 3]] * 4, max_new_tokens=12, eos_token_id=[]).tokens
    tb = b.generate([[1, 2, 3]] * 4, max_new_tokens=12, eos_token_id=[]).tokens
    assert ta == tb
    assert len({tuple(t) for t in ta}) > 1  # identical prompts, different samples


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_requests_leave_state_untouched(pair):
    target, draft = pair
    gen = SequoiaGenerator(target, draft, chain_tree(3), SamplingParams(), max_length=32)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"row\(s\) \[1\] are empty"):  # names the row
        gen.generate([[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_length"):
        gen.generate([list(range(1, 30))], max_new_tokens=8)
    with pytest.raises(ValueError, match="token ids"):
        gen.generate([[VOCAB + 3]], max_new_tokens=4)
    for bad in (0, True, 2.0, torch.tensor(4)):  # a 0-d tensor is named as such, not as "got 4 < 1"
        with pytest.raises(ValueError, match=rf"max_new_tokens must be an int >= 1, got .* \({type(bad).__name__}\)"):
            gen.generate([[1, 2]], max_new_tokens=bad)
    with pytest.raises(ValueError, match="min_new_tokens must be an int >= 0"):
        gen.generate([[1, 2]], max_new_tokens=4, min_new_tokens=-1)
    # still usable afterwards
    assert len(gen.generate([[1, 2]], max_new_tokens=4, eos_token_id=[]).tokens[0]) == 4


def test_vocab_mismatch_is_refused(pair):
    """A draft vocabulary more than a padding away from the target's (test_padded_vocab.py: within it)."""
    target, _ = pair
    other = tiny_llama(3, layers=1, vocab=VOCAB + 257)
    with pytest.raises(ValueError, match="vocabularies differ"):
        SequoiaGenerator(target, other, chain_tree(2))


def test_gqa_mha_and_other_llama_like_configs():
    """Llama-2 (MHA), Llama-3-style GQA, Qwen2 and Mistral attention all run through the loop."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, max_position_embeddings=128, eos_token_id=None)
    models = [
        tiny_llama(0, kv_heads=4),  # MHA
        tiny_llama(0, kv_heads=1),  # MQA / GQA
        Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common)).eval(),
        MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=None, **common)).eval(),
    ]
    for m in models:
        m.config._attn_implementation = "sdpa"
        prompt = [1, 5, 9]
        expected = greedy_reference(m, prompt, 8)
        gen = SequoiaGenerator(m, m, kxd_tree(2, 2), SamplingParams(), max_length=64)
        assert gen.generate([prompt], max_new_tokens=8, eos_token_id=[]).tokens[0] == expected, type(m).__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_step_matches_eager():
    """The step captured in one CUDA graph gives the eager loop's greedy tokens, across batch-size
    changes (rows finishing at different times force a re-capture); sampling is reproducible."""
    target, draft = tiny_llama(0).cuda(), tiny_llama(1, layers=1).cuda()
    prompts = [[3, 17, 5, 9], [2, 2], [40, 1, 7, 7, 8]]
    plan = plan_tree([0.5, 0.2, 0.1], 10, 4)
    eager = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=128)
    graphed = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=128, cuda_graphs=True)
    for n in (5, 17):
        expected = eager.generate(prompts, max_new_tokens=n, eos_token_id=[]).tokens
        assert graphed.generate(prompts, max_new_tokens=n, eos_token_id=[]).tokens == expected
    a = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=0.8, seed=3), max_length=128, cuda_graphs=True)
    b = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=0.8, seed=3), max_length=128, cuda_graphs=True)
    assert a.generate(prompts, max_new_tokens=12, eos_token_id=[]).tokens == \
        b.generate(prompts, max_new_tokens=12, eos_token_id=[]).tokens


def test_the_graphed_branch_of_the_loop_on_the_cpu(pair):
    """The loop's cuda_graphs branch (first step eager, later steps through _graphed_step with the
    pending token, rows finishing at different times) checked on the CPU: the capture replaced by
    a plain step, the greedy tokens must be the eager loop's."""
    target, draft = pair
    prompts = [[3, 17, 5, 9], [2, 2], [40, 1, 7, 7, 8]]
    plan = plan_tree([0.5, 0.2, 0.1], 10, 4)
    expected = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=128).generate(
        prompts, max_new_tokens=17, eos_token_id=[3, 4]).tokens
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(), max_length=128)
    gen.cuda_graphs, seen = True, []

    def graphed(graphs, tcache, drafter, spec, root):
        assert drafter.pending.shape == root.shape and drafter.pending.dtype == torch.int64
        seen.append(root.shape[0])
        return gen._step(tcache, drafter, spec, root)

    gen._graphed_step = graphed
    assert gen.generate(prompts, max_new_tokens=17, eos_token_id=[3, 4]).tokens == expected
    assert seen[0] == len(prompts) and min(seen) < len(prompts)  # a row finished early: a smaller batch


@pytest.mark.parametrize("bad,match", [
    ([[1.0, 2.0]], "token ids must be integers"),
    ([[3, 2.5]], "token ids must be integers"),
    ([[True, 2]], "token ids must be integers"),
    ([1, 2, 3], "flat list of token ids"),
    (torch.tensor([[1.0, 2.0]]), "integer token ids"),
    (torch.tensor([1, 2]), r"\[batch, length\]"),
    ("1 2 3", "list of prompts"),
    ([[1, 2], "3 4"], "prompt 1 must be a sequence"),
    ([torch.tensor([1.0])], "prompt 0: a tensor prompt must be 1-D with integer token ids"),
])
def test_malformed_input_ids_get_a_clear_error(pair, bad, match):
    target, draft = pair
    gen = SequoiaGenerator(target, draft, chain_tree(2), SamplingParams(), max_length=32)
    with pytest.raises(ValueError, match=match):
        gen.generate(bad, max_new_tokens=3)
    assert gen.generate([[1, 2]], max_new_tokens=3, eos_token_id=[]).tokens[0] == greedy_reference(target, [1, 2], 3)


def _poison_logits_on_call(model, call: int, value: float):
    """A forward hook that writes ``value`` into the logits of the model's ``call``-th forward."""
    seen = {"n": 0}

    def hook(module, args, out):
        if seen["n"] == call:
            out.logits[..., 2] = value
        seen["n"] += 1
        return out

    return model.register_forward_hook(hook)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("which,value", [("target", float("nan")), ("draft", float("inf")), ("target", float("inf"))])
def test_nonfinite_logits_raise_naming_the_step_and_model(pair, validate, which, value):
    """NaN / +inf logits never turn into tokens: a ValueError names the decoding step and the model
    (validated: before the step compacts the caches; unvalidated: when the step's tokens are read,
    which are discarded); the generator works as before afterwards."""
    from sequoia_decoding.generate import NonFiniteLogitsError

    target, draft = pair
    plan = chain_tree(2)  # the draft forwards 3 levels per step, the target 1 forward
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=0.8, seed=1), max_length=64,
                           validate=validate)
    model = target if which == "target" else draft
    # call 0 is the prefill; the target's call 2 is step 1's forward, the draft's call 4 is in step 1
    handle = _poison_logits_on_call(model, 2 if which == "target" else 4, value)
    try:
        with pytest.raises(NonFiniteLogitsError, match=f"decoding step 1: the {which} model returned NaN or \\+inf"):
            gen.generate([[3, 4, 5]], max_new_tokens=20, eos_token_id=[])
    finally:
        handle.remove()
    assert issubclass(NonFiniteLogitsError, ValueError)
    out = gen.generate([[3, 4, 5]], max_new_tokens=6, eos_token_id=[])
    assert len(out.tokens[0]) == 6


def test_a_row_without_a_finite_logit_is_refused(pair):
    from sequoia_decoding.generate import NonFiniteLogitsError

    target, draft = pair
    gen = SequoiaGenerator(target, draft, chain_tree(1), SamplingParams(temperature=1.0, seed=0), max_length=64)
    def all_minus_inf(module, args, out):
        out.logits.fill_(float("-inf"))
        return out

    handle = target.register_forward_hook(all_minus_inf)
    try:
        with pytest.raises(NonFiniteLogitsError, match="decoding step 0: the target model"):
            gen.generate([[3, 4]], max_new_tokens=4, eos_token_id=[])
    finally:
        handle.remove()


def test_busy_cores_reads_the_machine():
    from sequoia_decoding.cpu_threads import busy_cores

    n = busy_cores()
    assert n is None or (isinstance(n, int) and n >= 0)


def test_busy_cores_does_not_count_our_own_spinning_threads():
    """Right after a parallel region this process's OpenMP workers still spin (runnable): they
    are not another process's load. Counting them made a decoding call on a quiet machine drop to
    one thread at its first mid-generation re-check. And a spinning process is seen."""
    import subprocess
    import sys
    import time

    import sequoia_decoding.cpu_threads as gen_mod

    if gen_mod.busy_cores() is None or gen_mod._usable_cores() < 2:
        pytest.skip("needs Linux /proc and two cores")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(1500, 1500)
        time.sleep(0.5)  # our workers asleep: what other processes load now
        idle = gen_mod.busy_cores(samples=20, interval_s=0.002)
        after = []
        for _ in range(5):
            a @ a  # a 2-thread region; its workers spin for a while after it
            after.append((gen_mod.busy_cores(samples=3, interval_s=0.0), gen_mod._own_running_threads()))
        assert max(o for _, o in after) >= 1
        assert min(b for b, _ in after) <= idle, after
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)
            assert gen_mod.busy_cores(samples=20, interval_s=0.002) >= 1
        finally:
            spinner.kill()
            spinner.wait()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("adapt", [True, False])
def test_adapt_threads_uses_the_free_cores_and_restores(pair, monkeypatch, adapt):
    """adapt_threads: with every core but one busy elsewhere the call runs on one intra-op thread
    (checked at the start and every THREADS_CHECK_STEPS steps), and torch's setting is restored
    afterwards; adapt_threads=False leaves the thread count alone."""
    import sequoia_decoding.cpu_threads as gen_mod

    target, draft = pair
    if gen_mod._usable_cores() < 2:
        pytest.skip("needs two cores")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        busy = {"n": gen_mod._usable_cores() - 1}
        monkeypatch.setattr(gen_mod, "busy_cores", lambda: busy["n"])
        monkeypatch.setattr(gen_mod, "THREADS_CHECK_STEPS", 2)
        seen = []

        def cb(row, toks):
            seen.append(torch.get_num_threads())
            busy["n"] = 0  # the other process went away: the next check may use both threads again

        g = SequoiaGenerator(target, draft, chain_tree(2), SamplingParams(temperature=0.0), max_length=64,
                             adapt_threads=adapt)
        g.generate([[1, 2, 3]], max_new_tokens=12, eos_token_id=[], callback=cb)
        if adapt:
            assert seen[0] == 1 and seen[-1] == 2, seen
        else:
            assert set(seen) == {2}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_draft_equal_to_the_target_accepts_every_leaf(temperature, batch):
    """The leaf level is never forwarded to the draft; the next step's first draft forward
    rewrites the last accepted token's entry (the pending token). With a draft that is the
    target, every node is accepted (p = q), so every step ends on a leaf whose entry the draft
    lacks: a wrong rewrite (position, mask, compaction) would show as a rejected node. Also: a
    step runs num_levels - 1 draft forwards, the first of a later step one token wider."""
    import copy

    target = tiny_llama(0)
    draft = copy.deepcopy(target)
    plan = chain_tree(3)  # 4 levels
    widths = []
    forward = draft.forward

    def counted(input_ids, *a, **kw):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *a, **kw)

    draft.forward = counted
    gen = SequoiaGenerator(target, draft, plan, SamplingParams(temperature=temperature, seed=5), max_length=128)
    prompts = [[5, 6, 7], [9], [3, 4, 5, 6, 7, 8]][:batch]
    widths.clear()
    out = gen.generate(prompts, max_new_tokens=40, eos_token_id=[])
    assert all(a == plan.num_levels - 1 for st in out.steps for a in st.accepted)
    assert [len(t) for t in out.tokens] == [40] * batch
    if temperature == 0:
        for p, toks in zip(prompts, out.tokens):
            assert toks == greedy_reference(target, p, 40)
    prefill = max(len(p) for p in prompts) - 1  # prompt[:-1], one forward
    assert widths[0] == prefill
    per_step = widths[1:]
    assert len(per_step) == len(out.steps) * (plan.num_levels - 1)
    assert per_step == [1, 1, 1] + [2, 1, 1] * (len(out.steps) - 1)


def test_a_request_past_the_targets_positions_is_said_once_and_decodes_on(caplog):
    """A request longer than the target's ``max_position_embeddings`` decodes on (as plain
    ``generate()`` does, which warns once past them) with one warning in the log; a request within
    them says nothing (before, nothing was said at all)."""
    import logging

    target, draft = tiny_llama(0, max_pos=24), tiny_llama(1, layers=1, max_pos=24)
    gen = SequoiaGenerator(target, draft, kxd_tree(2, 2), SamplingParams(), max_length=128)
    prompt = [3, 17, 5, 9, 22]
    with caplog.at_level(logging.WARNING, logger="sequoia_decoding"):
        assert gen.generate([prompt], max_new_tokens=19, eos_token_id=[]).tokens[0] == greedy_reference(target, prompt, 19)
        assert not caplog.records
        for _ in range(2):
            assert gen.generate([prompt], max_new_tokens=30, eos_token_id=[]).tokens[0] == \
                greedy_reference(target, prompt, 30)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "runs past the target's 24 positions (config.max_position_embeddings)" in said[0], said
