"""The measurements Sequoia's planner needs: the acceptance vector of a (target, draft) pair and
the hardware's latency curve (``sequoia-kernels measure-acceptance`` and ``profile``).

Acceptance vector: ``p_k`` = probability that the k-th child sampled from the draft (without
replacement) is the one verification accepts, measured along the target's own continuations of
held-out prompts (teacher-forced: the draft and the target see the same prefix). Each position
is verified as a star tree (the position's context as the root, ``width`` sampled children) by
``verify_tree``, the same exact rule the decoding loop uses; ``rejected`` is the mass where no
child is accepted. At temperature 0 the children are the draft's top-``width`` tokens and the
accepted one is the target's argmax.

Latency curve: the target's forward time for ``n`` tree tokens after a ``prefix``-token context
through the tree-attention path, and one draft step (one token), medians over repeats; the knee is
the largest measured ``n`` whose forward costs at most ``KNEE_RATIO`` times a one-token forward.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import sys
import time
from typing import Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

KNEE_RATIO = 1.5
NOISY_SPREAD = 0.25  # (second-slowest - fastest) / median of a size's repeats above which a profile is noisy ...
NOISY_FLOOR_S = 0.005  # ... when the spread is also above this many seconds (timer noise of tiny models)


def _progress(i: int, n: int, what: str) -> None:
    from .tensor_parallel import is_rank0, torchrun_group

    if not is_rank0(torchrun_group()):  # torchrun: rank 0 draws the bar
        return
    width = 30
    done = width * i // max(n, 1)
    sys.stderr.write(f"\r{what} [{'#' * done}{'.' * (width - done)}] {i}/{n}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


@torch.no_grad()
def measure_acceptance(target, draft, prompts: Sequence[Sequence[int]], *, temperature: float, width: int,
                       max_new_tokens: int = 64, runs: int = 4, seed: int = 0, progress: bool = True,
                       top_k: int = 0, top_p: float = 1.0, head_level: int = 1, eos_token_id=None) -> dict:
    """Sequoia's acceptance vector of ``draft`` for ``target`` (see the module docstring).
    ``top_k`` / ``top_p``: the sampling filters in use (sampled temperatures only): the target's
    continuations, its distribution p and the draft's q are filtered as the decoding loop filters
    them, so the vector is the one that setting decodes with (a filter changes acceptance: top-p
    0.9 took SmolLM2's tokens per step from 1.54 expected to 1.44). ``head_level`` (a feature
    head): 1 reads it with the target's true features, as the tree's first level does; 2 with its
    own prediction of the last token's feature, as deeper levels do. A head at level 1 is read
    both ways in the same pass: ``deep_acceptance`` is the second reading, the vector the
    planner prices the levels below the first with (``tree.LevelAcceptance``).

    ``eos_token_id``: where a continuation stops, as decoding stops (default: the target's
    generation config, as :meth:`SequoiaGenerator.generate`). The positions measured are the ones
    decoding verifies: up to the one predicting the end of sequence, not the text a model makes up
    after it (on short answers that text once made up half the positions and read acceptance
    high: 0.33 extra tokens a step expected where decoding got 0.17). ``[]``: never stop (a
    benchmark that decodes past EOS)."""
    from sequoia_kernels.ops.packed_linear import packed_prefill_pays, use_packed_linears
    from sequoia_kernels.ops.sampling import check_sampling_params

    from .drafters import fit_vocab
    from .drafters import logits_of as _logits
    from .feature_drafter import teacher_forced_logits
    from .generate import SamplingParams, SequoiaGenerator
    from .modeling.feature_head import FeatureHead
    from .request_checks import check_draft_vocab, vocab_size

    if width < 1 or runs < 1 or max_new_tokens < 1:
        raise ValueError(f"width, runs and max_new_tokens must be >= 1, got {width}, {runs}, {max_new_tokens}")
    if not prompts:
        raise ValueError("no prompts")
    check_sampling_params(temperature, top_k, top_p)
    if temperature == 0.0:
        top_k, top_p = 0, 1.0  # greedy: the filters do not change the argmax
    gen = SequoiaGenerator(target, None, None, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                                              seed=seed),
                           max_length=max(len(p) for p in prompts) + max_new_tokens + 2)
    check_draft_vocab(draft, gen.vocab)  # the same, or a standalone draft's padded to another size
    g = torch.Generator(device=gen.device).manual_seed(seed)
    # a head is read at the first level (true features) and, in the same pass, as deeper levels read it
    levels = (1, 2) if isinstance(draft, FeatureHead) and head_level == 1 else (head_level,)
    counts = torch.zeros(len(levels), width + 1, dtype=torch.float64)  # [level, accepted rank 1..width | none]
    # the teacher-forced bf16 forwards on the packed linears where torch's bf16 GEMM is the slower
    packed = packed_prefill_pays(next(target.parameters()).dtype)
    for i, prompt in enumerate(prompts):
        cont = gen.generate([prompt], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).tokens[0]
        seq = torch.tensor([list(prompt) + cont], device=gen.device)
        lo, hi = len(prompt) - 1, seq.shape[1] - 1  # positions predicting the continuation
        with use_packed_linears(target, packed), use_packed_linears(draft, packed):
            p_logits = _logits(target(seq))[0, lo:hi]  # [N, V]
            for j, level in enumerate(levels):
                if isinstance(draft, FeatureHead):
                    q_logits = teacher_forced_logits(draft, target, seq, predicted=level > 1)
                else:  # over the target's ids (a draft vocabulary padded to another size)
                    q_logits = fit_vocab(_logits(draft(seq.clamp(max=vocab_size(draft) - 1))), gen.vocab)
                counts[j] += _rank_counts(p_logits, q_logits[0, lo:hi], temperature, top_k, top_p, width, runs, g)
        if progress:
            _progress(i + 1, len(prompts), "measure-acceptance")
    total = counts[0].sum().item()
    vectors = [[c / total for c in row[:width].tolist()] for row in counts]
    return {
        "acceptance": vectors[0],
        "rejected": counts[0, width].item() / total,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "width": width,
        "positions": int(total / (1 if temperature == 0.0 else runs)),
        "stops_at_eos": not (isinstance(eos_token_id, (list, tuple)) and len(eos_token_id) == 0),
        "prompts": len(prompts),
        **({"head_level": head_level} if isinstance(draft, FeatureHead) else {}),
        **({"deep_acceptance": vectors[1], "deep_rejected": counts[1, width].item() / total} if len(levels) > 1 else {}),
    }


def acceptance_of(result: dict) -> tuple[float, ...]:
    """The vector a :func:`measure_acceptance` result plans with: a ``LevelAcceptance`` when it
    holds a head's ``deep_acceptance``, else the plain vector."""
    from .tree import acceptance_from

    return acceptance_from(result["acceptance"], result.get("deep_acceptance"))


def _rank_counts(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 width: int, runs: int, g: torch.Generator) -> torch.Tensor:
    """How often the child of each sampling rank 1..width (or none: the last entry) is accepted
    at each position, float64 ``[width + 1]``: the draft's top-``width`` at T = 0, else ``runs``
    draws of ``width`` children without replacement verified by the exact sampler."""
    from sequoia_kernels.ops.sampling import sample_children, sampling_probs
    from sequoia_kernels.ops.verify_tree import verify_tree

    N, V = p_logits.shape  # [N, V]: positions x vocabulary
    dev = p_logits.device
    if temperature == 0.0:
        children = q_logits.topk(width, dim=-1).indices  # [N, W]
        hit = children == p_logits.argmax(-1, keepdim=True)
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), width)
        return torch.bincount(rank.cpu(), minlength=width + 1).double()
    counts = torch.zeros(width + 1, dtype=torch.float64)
    parents = torch.tensor([-1] + [0] * width, device=dev)
    p = sampling_probs(p_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    q = sampling_probs(q_logits, temperature=temperature, top_k=top_k, top_p=top_p)
    for _ in range(runs):
        kids = sample_children(q, width, uniforms=torch.rand(N, V, generator=g, device=dev).clamp_(min=1e-12),
                               validate=False)  # [N, W]
        tokens = torch.cat([torch.zeros(N, 1, dtype=torch.int64, device=dev), kids], 1)
        path, num, _ = verify_tree(p[:, None].expand(N, width + 1, V), q[:, None].expand(N, width + 1, V), tokens,
                                   parents, uniforms=torch.rand(N, width + 1, generator=g, device=dev), validate=False)
        rank = torch.where(num > 1, path[:, 1] - 1, width)
        counts += torch.bincount(rank.cpu(), minlength=width + 1).double()
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# _time_sizes: a target's LM head over this many of a lazily verified tree's rows (``lazy_logits``:
# the root's first-child chain, ~4-6 rows; the loop's second passes are in its calibrated step overhead)
LAZY_PROFILE_ROWS = 6
# _time_sizes: forwards of up to this many tokens are timed 3 x the repeats (~3 s more for a
# target profile): 5 repeats on a 2-core VM read T(1) above T(2) and a draft's 3.3 ms one-token
# step next to a 2.2 ms two-token one, and the small trees are planned on these points
SMALL_SIZES_UP_TO = 32
SMALL_SIZES_EXTRA_S = 10.0  # ... when those extra rounds take at most this long (an offloaded target's do not)


def _time_sizes(model, ns: Sequence[int], *, prefix: int, repeats: int, device: torch.device,
                packed_linears: bool, what: str, progress: bool, lazy_from: int | None = None) -> dict[int, list[float]]:
    """``repeats`` timings of ``model``'s forward of each n in ``ns`` tree tokens (a chain) after a
    random ``prefix``-token context, interleaved across the sizes after one warm-up each (a slow
    spell of the machine hits every size alike), as the loop runs the model (``sequoia_models``;
    from ``lazy_from`` tokens on, a target's LM head over ``LAZY_PROFILE_ROWS`` of them, as the
    loop's first verification pass: ``lazy_logits``)."""
    from sequoia_kernels.hf import SequoiaCache, cache_kw, text_config
    from sequoia_kernels.tree_mask import pack_tree_mask

    from .feature_drafter import target_forward
    from .modeling.feature_head import FeatureHead
    from .patching import sequoia_models
    from .target_head import TargetHead
    from .tensor_parallel import local_kv_heads

    head = isinstance(model, FeatureHead)  # a level: the head's forward, its logits over its own tokens (as the loop)
    if head and model._embed_weight is None:
        raise ValueError("profile: bind the draft head to its target first (FeatureHead.bind)")

    def run(cache, ids, mask, feats, depth):
        kw = cache.tree_inputs(depth, mask)
        if head:
            model.draft_logits(model(ids, feats, fused=True, past_key_values=cache, use_cache=True, **kw))
        elif lazy_from is not None and ids.shape[1] >= lazy_from:
            hidden, _ = target_forward(model, ids, None, logits="hidden", cache=cache, use_cache=True, **kw)
            TargetHead(model)(hidden[:, :LAZY_PROFILE_ROWS])
        else:
            model(ids, **cache_kw(model, cache), use_cache=True, **kw)

    # restored after; every size's linears as the loop runs them (packed up to the largest tree)
    with sequoia_models(model, packed_linears=packed_linears, max_rows=max(ns)):
        cache = SequoiaCache(model.config, batch_size=1, max_cache_len=prefix + max(ns) + 1,
                             num_kv_heads=None if head else local_kv_heads(model),
                             dtype=next(model.parameters()).dtype, device=device, validate=False)
        vocab = int(getattr(model, "full_vocab_size", None) or text_config(model.config).vocab_size)
        g = torch.Generator().manual_seed(0)
        if prefix > 0:
            ctx = torch.randint(0, vocab, (1, prefix), generator=g).to(device)
            pos = torch.arange(prefix, device=device)[None]
            if head:
                feats = torch.zeros(1, prefix, model.feature_width, device=device)
                model(ctx, feats, fused=False, position_ids=pos, past_key_values=cache, use_cache=True)
            else:
                model(ctx, **cache_kw(model, cache), position_ids=pos, use_cache=True)
            cache.commit(prefix)
        inputs = {}
        for n in ns:
            inputs[n] = (torch.randint(0, vocab, (1, n), generator=g).to(device),
                         pack_tree_mask(torch.ones(n, n, dtype=torch.bool, device=device).tril()),  # once, as the loop
                         torch.zeros(1, n, model.config.hidden_size, device=device) if head else None,  # own features
                         torch.arange(n, device=device))
            run(cache, *inputs[n])  # warm-up
        times: dict[int, list[float]] = {n: [] for n in ns}
        small = [n for n in ns if n <= SMALL_SIZES_UP_TO]
        rounds, r = repeats, 0
        while r < rounds:
            order = list(ns[r % len(ns):]) + list(ns[: r % len(ns)])
            for n in (order if r < repeats else [n for n in order if n in small]):
                _sync(device)
                t0 = time.perf_counter()
                run(cache, *inputs[n])
                _sync(device)
                times[n].append(time.perf_counter() - t0)
            if r == 0 and small and 2 * repeats * sum(times[n][0] for n in small) <= SMALL_SIZES_EXTRA_S:
                rounds = 3 * repeats  # the small sizes' extra rounds are cheap here (not offloaded, say)
            if progress:
                _progress(r + 1, rounds, what)
            r += 1
    return times


@torch.inference_mode()  # as the loop runs its forwards (SequoiaGenerator.generate)
def profile_latency(target, draft, *, sizes: Sequence[int], prefix: int = 256, repeats: int = 5,
                    device=None, progress: bool = True, packed_linears: bool | None = None) -> dict:
    """The target's forward time for each n in ``sizes`` (a chain of n tree tokens after ``prefix``
    tokens of context), the draft's for the same sizes (``draft_latency_s``; ``draft_step_s`` is
    its one-token step), in seconds: medians of ``repeats`` timings (3 x for up to 32 tokens) taken
    interleaved across the sizes (after one warm-up each). ``spread`` holds each size's
    (second-slowest - fastest) / median over the repeats (one outlier forgiven); ``noisy`` is
    True when one exceeds ``NOISY_SPREAD`` and ``NOISY_FLOOR_S`` seconds (another process
    competed for the CPU: such a curve should not be cached). ``packed_linears``: as the
    decoding loop's option of that name (the same default: time what the loop runs)."""
    from sequoia_kernels.ops.packed_linear import packed_linear_pays

    from .lazy_logits import lazy_from
    from .tensor_parallel import rank0s, tensor_parallel_of

    dtype = next(target.parameters()).dtype
    packed_linears = packed_linear_pays(dtype) if packed_linears is None else packed_linears
    sizes = sorted({int(n) for n in sizes})
    if not sizes or sizes[0] < 1:
        raise ValueError("sizes must be positive integers")
    if prefix < 0 or repeats < 1:
        raise ValueError(f"prefix must be >= 0 and repeats >= 1, got {prefix}, {repeats}")
    if 1 not in sizes:
        sizes = [1] + sizes
    device = torch.device(device) if device is not None else next(target.parameters()).device
    kw = dict(prefix=prefix, repeats=repeats, device=device, packed_linears=packed_linears, progress=progress)
    lazy = lazy_from(None, device, tensor_parallel_of(target), False)  # the loop's default
    target_t = _time_sizes(target, sizes, what="profile target", lazy_from=lazy, **kw)
    # the draft at every size too: a tree's level of w nodes is one draft forward of w tokens
    from .modeling.feature_head import FeatureHead

    if isinstance(draft, FeatureHead):
        draft.bind(target)  # it borrows the target's embedding (and LM head rows)
    draft_t = _time_sizes(draft, sizes, what="profile draft", **kw) if draft is not None else {n: [0.0] for n in sizes}
    target_s = {n: statistics.median(t) for n, t in target_t.items()}
    # relative spread of the repeats per size, one outlier forgiven: a busy machine shows here first
    width = {n: sorted(t)[-2] - min(t) if len(t) > 2 else max(t) - min(t) for n, t in target_t.items()}
    spread = {n: width[n] / max(target_s[n], 1e-12) for n in target_t}
    noisy = any(spread[n] > NOISY_SPREAD and width[n] > NOISY_FLOOR_S for n in target_t)
    knee = max(n for n in sizes if target_s[n] <= KNEE_RATIO * target_s[1])
    return rank0s({
        "draft_step_s": statistics.median(draft_t[1]),
        "draft_latency_s": {str(n): statistics.median(t) for n, t in draft_t.items()},
        "target_latency_s": {str(n): t for n, t in target_s.items()},
        "spread": {str(n): v for n, v in spread.items()},
        "noisy": noisy,
        "prefix": prefix,
        "knee": knee,
        "knee_ratio": KNEE_RATIO,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads(),
    }, tensor_parallel_of(target))  # a TP target: every rank timed the same forwards; rank 0's times


class _CountOps(TorchDispatchMode):
    """Counts the dispatcher's operator calls (aten and custom ops) made inside the block."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def measure_step_overhead(target, draft, plans: dict, sampling, *, prefix: int = 256, steps: int = 8,
                          seed: int = 0, detail: bool = False, count_calls: bool = True, rounds: int = 3) -> dict:
    """Seconds per decoding step spent outside the two models' forwards (sampling the draft
    levels and the target's distributions at this vocabulary, verification, compaction, the
    loop's own bookkeeping), measured on the real loop: ``plans`` maps a node count n to a tree
    (a TreePlan; n = 1 runs the autoregressive loop), each run for ``steps`` timed steps with
    ``sampling`` (a SamplingParams) after a ``prefix``-token random prompt, in ``rounds`` rounds
    interleaved across the trees (one short run alone was at the mercy of a slow spell: the
    calibrated T(1) moved by 13% between two runs on a 2-core VM); medians of
    ``StepStats.other_s``. The planner adds these to each candidate's step (``choose_plan``'s
    ``step_overhead_s``), which the model forwards alone (``profile_latency``) leave out.
    Returns ``{n: seconds}``; with ``detail`` ``{"overhead_s": {n: s}, "target_s": {n: s},
    "draft_forward_s": {n: s}, "first_forward_s": {n: s}, "deep_forward_s": {n: s}, "level_s": {n: s},
    "levels": {n: d}, "draft_widths": {n: [w, ...]}, "calls_per_step": {n: c}}``: the loop's own
    medians of the forwards too, for :func:`calibrate_latency`, the draft's by level (trees only,
    :func:`_draft_levels`); and the framework calls (torch
    dispatcher ops, ours included) one step makes, counted on two extra untimed runs: each
    call is a parallel region or more on a CPU, which is what a busy machine makes slow
    (``count_calls=False`` skips those runs; ``calls_per_step`` is then empty)."""
    from sequoia_kernels.hf import text_config

    from .generate import SequoiaGenerator
    from .planner import level_widths

    vocab = int(getattr(target, "full_vocab_size", None) or text_config(target.config).vocab_size)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prefix,), generator=g).tolist()
    res_all = {"overhead_s": {}, "target_s": {}, "draft_forward_s": {}, "first_forward_s": {}, "deep_forward_s": {},
               "level_s": {}, "levels": {}, "draft_widths": {}, "calls_per_step": {}}
    gens, news, per_steps, stats = {}, {}, {}, {}
    for n, plan in sorted(plans.items()):
        # tokens for steps + 2 steps at up to twice the plan's expected acceptance (a deep chain is not
        # forced through steps x levels tokens: on a random prompt it accepts little)
        per_step = min(max(plan.num_levels, 1), math.ceil(2.0 * max(plan.expected_tokens, 1.0)))
        news[n], per_steps[n] = (steps + 2) * per_step, per_step
        gens[n] = SequoiaGenerator(target, draft if plan.num_nodes > 1 else None, plan, sampling,
                                   max_length=prefix + news[n] + plan.num_nodes + 8)
        gens[n].generate([prompt], max_new_tokens=2, eos_token_id=[])  # warm-up
        stats[n] = []
    for _ in range(rounds):  # interleaved: a slow spell of the machine hits every tree alike
        for n, gen in gens.items():
            res = gen.generate([prompt], max_new_tokens=news[n], min_new_tokens=news[n], eos_token_id=[],
                               profile=True)
            stats[n] += [s for s in res.steps[1:] if s.timed] or [s for s in res.steps if s.timed]
    for n, plan in sorted(plans.items()):
        gen, new, st = gens[n], news[n], stats[n]

        def med(key):
            return float(statistics.median(getattr(s, key) for s in st)) if st else 0.0

        if detail and count_calls:  # framework calls per step: two counted runs, the difference per extra step
            # (a few steps apart: every op goes through Python while counted, ~2x a step's time)
            counts = []
            for k in (2, min(new, 2 + 3 * per_steps[n])):
                with _CountOps() as c:
                    r = gen.generate([prompt], max_new_tokens=k, min_new_tokens=k, eos_token_id=[])
                counts.append((len(r.steps), c.calls))
            (s1, c1), (s2, c2) = counts
            res_all["calls_per_step"][int(n)] = (c2 - c1) / (s2 - s1) if s2 > s1 else float(c2) / max(s2, 1)
        res_all["overhead_s"][int(n)] = med("other_s")
        res_all["target_s"][int(n)] = med("target_s")
        res_all["draft_forward_s"][int(n)] = med("draft_forward_s")
        for key, v in (_draft_levels(st, plan.num_levels) if plan.num_levels > 1 and st else {}).items():
            res_all[key][int(n)] = v
        res_all["levels"][int(n)] = plan.num_levels
        res_all["draft_widths"][int(n)] = level_widths(plan) if plan.num_nodes > 1 else []
    return res_all if detail else res_all["overhead_s"]


def _draft_levels(steps: Sequence, levels: int) -> dict[str, float]:
    """A tree's draft time by level from its timed ``steps`` (``StepStats``) of ``levels`` levels,
    medians: the first level's forward (``first_forward_s``: the pending tokens too, it costs
    more than a later level of its width), a later level's forward (``deep_forward_s``) and the
    drafter's own time outside its forwards per later level (``level_s``: sampling a level's
    children and their q, which grows with a tree's depth, not its size: at n = 4 on a Zen 4,
    T = 0.6, 0.44 / 0.81 / 1.14 ms a step at 2 / 3 / 4 levels, the rest outside the forwards
    0.90-0.92 ms at every depth). A 2-level tree has no later level: its ``level_s`` is its one
    level's own time."""
    def med(f):
        return float(statistics.median(f(s) for s in steps))

    out = {"first_forward_s": med(lambda s: s.first_forward_s)}
    if levels == 2:
        return {**out, "level_s": med(lambda s: max(s.draft_s - s.draft_forward_s, 0.0))}
    k = levels - 2
    return {**out, "deep_forward_s": med(lambda s: (s.draft_forward_s - s.first_forward_s) / k),
            "level_s": med(lambda s: max(s.draft_s - s.draft_forward_s - s.first_level_s + s.first_forward_s, 0.0) / k)}


def merge_loops(loops: Sequence[dict]) -> dict:
    """Several ``measure_step_overhead(..., detail=True)`` results as one: per quantity and node
    count, the median over the results that measured it (for :func:`calibrate_latency`)."""
    out: dict[str, dict[int, float]] = {}
    for key in ("overhead_s", "target_s", "draft_forward_s", "first_forward_s", "deep_forward_s", "level_s", "levels"):
        ns = sorted({n for lp in loops for n in lp.get(key, {})})
        out[key] = {n: float(statistics.median(lp[key][n] for lp in loops if n in lp.get(key, {}))) for n in ns}
    out["draft_widths"] = {n: w for lp in loops for n, w in lp.get("draft_widths", {}).items()}
    return out


def _between_measured(n: int, t: float, measured: list) -> float:
    """A calibrated T(n) held between the loop's own times ``measured`` ([(node count, seconds)],
    sorted) at the counts around n (a < n < b: T(a) <= T(n) <= T(b), a forward of more tokens never
    costing less): the ratio interpolated between a and b can carry a noisy profile point past them
    (a streamed target's small-n profile times spread by 40-60%: its calibrated T(32) came out above
    the loop's T(64), its T(2) below both the loop's T(1) and T(8))."""
    below = [s for m, s in measured if m < n]
    above = [s for m, s in measured if m > n]
    if not below or not above or any(m == n for m, _ in measured):  # outside the measured range, or measured
        return t
    lo, hi = sorted((below[-1], above[0]))  # (the loop's own noise may invert them)
    return min(max(t, lo), hi)


def calibrate_latency(profile: dict, loop: dict) -> dict:
    """The profile's forward times rescaled to what the decoding loop measured (``loop``: a
    ``measure_step_overhead(..., detail=True)`` result at the profile's prefix): T(n) times the
    loop's / the profile's ratio at the measured node counts (interpolated in n, constant
    beyond); the draft's curve (``draft_latency_s``, and ``draft_step_s``, its one-token point)
    times the median over the measured trees of the loop's draft forwards / what the curve
    predicts for that tree's levels (one level per width; a profile without the curve: the
    draft step becomes the loop's time per draft forward). The profile times isolated forwards
    interleaved across sizes; the loop runs the same forwards back to back with its caches
    warm, which on a CPU was ~5% faster at n = 1."""
    import numpy as np

    from .planner import _draft_s

    lat = {int(k): float(v) for k, v in profile["target_latency_s"].items()}
    measured = sorted((n, t) for n, t in loop["target_s"].items() if n in lat and lat[n] > 0 and t > 0)
    out = dict(profile)
    if measured:
        xs, cs = [float(n) for n, _ in measured], [t / lat[n] for n, t in measured]
        out["target_latency_s"] = {str(n): _between_measured(n, t * float(np.interp(float(n), xs, cs)), measured)
                                   for n, t in sorted(lat.items())}
    trees = [n for n in loop["draft_forward_s"] if loop["levels"].get(n, 1) > 1 and loop["draft_forward_s"][n] > 0]
    curve = {int(k): float(v) for k, v in (profile.get("draft_latency_s") or {}).items()}
    widths = loop.get("draft_widths", {})
    # fitted on a tree's later levels where they were timed apart (the first one also forwards the pending
    # tokens: its excess is every tree's, :func:`first_level_excess`), else on all of its forwards
    deep = [n for n in trees if loop.get("deep_forward_s", {}).get(n, 0.0) > 0]
    if curve and trees and all(widths.get(n) for n in trees):
        def charged(n, skip=0):  # what the curve charges the tree's draft forwards (the planner's sum)
            return _draft_s(widths[n][skip:], 0.0, curve)

        scale = float(statistics.median(loop["deep_forward_s"][n] * (len(widths[n]) - 1) / charged(n, 1) for n in deep)
                      if deep else statistics.median(loop["draft_forward_s"][n] / charged(n) for n in trees))
        out["draft_latency_s"] = {str(n): t * scale for n, t in sorted(curve.items())}
        out["draft_step_s"] = float(profile["draft_step_s"]) * scale
    elif trees and profile.get("draft_step_s"):
        # a tree of d levels runs d - 1 draft forwards
        out["draft_step_s"] = float(statistics.median(loop["deep_forward_s"][n] for n in deep) if deep else
                                    statistics.median(loop["draft_forward_s"][n] / (loop["levels"][n] - 1)
                                                      for n in trees))
    out["calibrated"] = True
    return out


def first_level_excess(calibrated: dict, loop: dict) -> dict[int, float]:
    """{n: seconds} by which the loop's first draft forward of each tree (``loop``: as
    :func:`calibrate_latency` reads it) exceeds what ``calibrated`` (its result) charges a forward
    of that width: the first level also forwards the previous step's accepted tokens (a feature
    head's pending slots), once per tree step, so it belongs with a tree's overhead. Empty when the
    curve was not fitted on later levels alone (then it was fitted on every level, the first too)."""
    from .planner import _draft_s

    deep = [n for n, v in loop.get("deep_forward_s", {}).items() if v > 0 and n in loop.get("first_forward_s", {})]
    curve = {int(k): float(v) for k, v in (calibrated.get("draft_latency_s") or {}).items()} or None
    widths = loop.get("draft_widths", {})
    return {n: loop["first_forward_s"][n] - _draft_s(widths[n][:1], float(calibrated["draft_step_s"]), curve)
            for n in deep if widths.get(n)}


def time_decoding(gen, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id=None) -> dict:
    """Warm ``gen`` (a SequoiaGenerator) up, then generate each prompt alone: the outputs,
    tokens/s over decode time, tokens per sequence-step (accepted + bonus, before stops), seconds
    per step (``step_s``), the phases of an average step (``phase_s``: the draft's forwards, the
    target's forward, the rest; None when the steps have no phase times: CUDA graphs) and the
    share of decode time outside the two models' forwards (``other_share``, None likewise)."""
    return time_decoding_interleaved({0: gen}, prompts, max_new_tokens, eos_token_id)[0]


def paired_ratio(a: dict, b: dict) -> float:
    """Median over prompts of ``a``'s tokens/s over ``b``'s on the same prompt (two results of one
    :func:`time_decoding_interleaved` call): the calls of one prompt ran back to back, so a slow
    spell of the machine (this 2-core VM's forwards vary up to 2x between seconds) cancels in each
    ratio, and the median drops the prompt it hit mid-way."""
    import statistics

    return float(statistics.median(x / y for x, y in zip(a["prompt_tokens_per_s"], b["prompt_tokens_per_s"])))


def turn_order(names: Sequence, turn: int) -> list:
    """The order of ``names`` in the ``turn``-th turn of an interleaved comparison: rotated by one
    from each turn to the next (each runs first once in every ``len(names)`` turns), every other
    cycle of rotations reversed (so that no method always runs right after the same other one)."""
    names = list(names)
    shift, base = turn % len(names), names if turn // len(names) % 2 == 0 else names[::-1]
    return base[shift:] + base[:shift]


def time_decoding_interleaved(gens: Mapping, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                              eos_token_id=None, rounds: int = 1) -> dict:
    """:func:`time_decoding` of several generators (``{name: gen}``), taken in turns prompt by
    prompt (every generator decodes prompt 1, then every one prompt 2, ...), so that a slow spell
    of the machine hits every method alike instead of whichever ran during it: a comparison of
    methods measured this way is fairer than one measured block after block. ``{name: result}``;
    ``prompt_tokens_per_s``: each prompt's rate, for ratios paired by prompt (:func:`paired_ratio`).

    ``rounds`` > 1 goes over the prompts that many times. The order of the generators within a
    prompt's turn rotates from one turn to the next (each runs first once in every ``len(gens)``
    turns), and every other cycle of rotations runs in reverse, so that no method always runs
    right after the same other one (a rotation alone kept that): ``prompt_tokens_per_s`` then holds one
    rate per (round, prompt), in the same order for every generator, and the totals count every
    round; ``outputs`` are the first round's (a generator's output does not depend on the round).
    Python's garbage is collected before every call (untimed), so that a full collection, which
    whichever call tripped it paid (~200 ms with two models loaded), does not land on one method."""
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
    acc = {}
    for name, gen in gens.items():
        gen.generate([prompts[0]], max_new_tokens=4, eos_token_id=[])  # first-call allocations, kernel choice
        acc[name] = {"outputs": [], "tokens": 0, "steps": 0, "emitted": 0, "decode": 0.0, "n_steps": 0, "rates": [],
                     "phases": {"draft_forward_s": 0.0, "target_s": 0.0, "other_s": 0.0}, "replan": []}
    names = list(gens)
    for turn, p in enumerate(p for _ in range(rounds) for p in prompts):
        for name in turn_order(names, turn):
            a = acc[name]
            gc.collect()  # no call inherits another's garbage: a full collection here costs ~200 ms, ~2% of a method
            res = gens[name].generate([p], max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)
            if turn < len(prompts):
                a["outputs"].append(res.tokens[0])
            a["tokens"] += len(res.tokens[0])
            a["steps"] += sum(len(s.accepted) for s in res.steps)
            a["emitted"] += sum(k + 1 for s in res.steps for k in s.accepted)
            a["decode"] += res.decode_s
            a["rates"].append(len(res.tokens[0]) / res.decode_s if res.decode_s > 0 else float("nan"))
            a["n_steps"] += len(res.steps)
            if res.replan is not None:  # adaptive: what re-planning did, and the first prompt's trees by step
                a["replan"].append(res.replan)
                if len(a["replan"]) == 1:
                    a["first_steps"], a["first_n_steps"] = list(res.replan.history), len(res.steps)
            if a["phases"] is not None and all(s.timed for s in res.steps):
                for k in a["phases"]:
                    a["phases"][k] += sum(getattr(s, k) for s in res.steps)
            else:
                a["phases"] = None
    out = {}
    for name, a in acc.items():
        n_steps, ph = max(a["n_steps"], 1), a["phases"]
        out[name] = {"outputs": a["outputs"], "tokens_per_s": a["tokens"] / a["decode"],
                     "tokens_per_step": a["emitted"] / max(a["steps"], 1), "step_s": a["decode"] / n_steps,
                     "phase_s": None if ph is None else {k: v / n_steps for k, v in ph.items()},
                     "other_share": None if ph is None else ph["other_s"] / a["decode"], "replan": a["replan"],
                     "first_steps": a.get("first_steps"), "first_n_steps": a.get("first_n_steps"),
                     "prompt_tokens_per_s": a["rates"]}
    return out


def write_json(obj: dict, path: str | None) -> str:
    text = json.dumps(obj, indent=2)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return text
