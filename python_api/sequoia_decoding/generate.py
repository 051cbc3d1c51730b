"""The Sequoia decoding loop on Hugging Face causal LMs.

One step, for every active sequence at once:

1. **Draft**: a drafter (``drafters.py``: an object the loop asks for a tree and tells what
   was accepted; plain decoding is :class:`drafters.NoDrafter`) proposes the tree: a standalone
   draft model (:class:`drafters.ModelDrafter`) or an EAGLE-style head reading the target's
   features (``feature_drafter.FeatureDrafter``: the target's forward of step 2 also returns the
   features it asks for) grows the planner's tree level by level, one forward per level (its
   nodes see the prefix and their ancestors through the packed tree mask), the children of each
   expanded node sampled *without replacement* from the draft distribution q (greedy: its
   top-k). The leaf level is not forwarded (its logits would go unused), so from the second
   step on the first draft forward also feeds the previous step's last accepted token (the
   *pending* token, at its own position), which rewrites that entry: a tree of d levels costs
   d - 1 draft forwards. A node can be **absent** (its parent asked for more children than the
   filtered q or the vocabulary has, or its parent is absent): its token is -1, the models see
   a placeholder id in its slot (only its own absent descendants attend to it), and
   ``verify_tree`` never accepts it nor touches the residual for it (why that is exact: its spec).
2. **Target**: one forward over the whole tree (``T`` nodes, position ids ``prefix + depth``).
3. **Verify**: ``verify_tree`` picks the accepted path and the bonus token (exact at any temperature).
4. **Compact**: ``compact_kv_`` moves the accepted nodes' K/V right after the prefix in both
   caches (the draft's with the pending token in front of the tree, and the last accepted node's
   entry left to be rewritten by the next step when it is a leaf).

The bonus token becomes the next step's root. The only host sync per step reads the accepted
tokens (to emit them and to stop rows at EOS / ``max_new_tokens``) together with one flag per
model that says whether its logits held NaN or +inf this step. Baselines use the same loop
with other trees: autoregressive (a 1-node tree, no draft), chain speculation
(``chain_tree(k)``), SpecInfer-style ``kxd_tree(k, d)``, and Sequoia's DP tree (``plan_tree``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from sequoia_kernels.hf import SequoiaCache
from sequoia_kernels.ops.packed_linear import MAX_ROWS, packed_linear_pays
from sequoia_kernels.ops.verify_tree import verify_tree

from .adaptive import AdaptiveConfig, Replanner, adaptive_costs, default_config
from .cpu_threads import adapted_threads
from .drafters import (PLACEHOLDER_ID, Drafter, ModelDrafter, NoDrafter, Proposal, block_eos, filtered_probs,
                       first_child_acceptance, nonfinite, play_out)
from .feature_drafter import FeatureDrafter, target_forward
from .lazy_logits import lazy_from, verify_reading
from .modeling.feature_head import FeatureHead
from .outputs import GenerationOutput, NonFiniteLogitsError, SamplingParams, StepResult, StepStats
from .patching import sequoia_models
from .prefill import prefill
from .request_checks import cache_length, call_room, check_draft_vocab, check_request, make_room, vocab_size
from .rng import Uniforms
from .spec import Level, TreeSpec  # noqa: F401  (Level: part of this module's API)
from .step_buffers import KeptRows
from .target_head import TargetHead
from .tensor_parallel import (all_reached, check_same_tokens, local_kv_heads, peer_failure, rank0s, same_request,
                              shared_seed, slowest_rank, tensor_parallel_of)
from .tree import TreePlan, chain_tree

__all__ = ["SamplingParams", "StepStats", "StepResult", "GenerationOutput", "SequoiaGenerator", "TreeSpec", "Level",
           "NonFiniteLogitsError"]


class SequoiaGenerator:
    """Speculative decoding of ``target`` with ``draft`` over the trees of ``plan``.

    ``target`` and ``draft`` are Hugging Face causal LMs with Llama-style attention (Llama-2,
    Llama-3, Qwen2, Mistral, ...), switched to the ``"sequoia_tree"`` attention implementation
    here, sharing a tokenizer (the same vocabulary size, or a standalone draft's padded to within 256
    ids, as Qwen2's are; checked); ``draft`` may be a feature head (``modeling.feature_head.FeatureHead``,
    checked against the target here). ``draft=None`` runs the autoregressive baseline (the plan must
    be a single node). ``max_length``: the most cache positions a call may use (prompt + new tokens +
    the largest tree a step may verify; a call's caches grow to its need as its rows lengthen,
    ``request_checks.make_room``); None: no limit.

    Checks: the request is validated once per call (prompts, lengths, capacity); in a step only the
    models' logits can go wrong (every other tensor comes from our own ops), so a step runs the kernels
    unvalidated and, with ``validate=True``, checks the logits for NaN / +inf before it compacts the
    caches (one device sync; ``validate=False`` folds it into the step's host read).

    ``adapt_threads`` (CPU): run each call with no more intra-op threads than the cores other
    processes leave free (``cpu_threads.busy_cores``), re-checked every ``THREADS_CHECK_STEPS``
    steps, and restore torch's setting afterwards (a busy core stalls every OpenMP region of a step).
    ``packed_linears`` (CPU, fp32 and bf16; default: where faster than torch's GEMM for the target's
    dtype, ``packed_linear_pays``): the models' few-row linears on ``packed_linear`` for the call
    (the packed weights, one copy, stay with the models; ``release_packed_linears`` frees them).

    ``cuda_graphs=True`` (CUDA; elsewhere the same code runs eagerly): the whole step (every draft
    level, the target forward, sampling, verification, both compactions) is captured once per batch
    size into one CUDA graph and replayed; its random numbers come from a device-resident Philox
    (seed, offset) advanced in the graph; nothing in it syncs with the host (no checks, in bounds).

    ``adaptive`` (True: ``adaptive.default_config``, sampled requests between ``plan`` and plain
    decoding; or an ``adaptive.AdaptiveConfig``): each step's tree is re-planned online from the
    live acceptance of the call's rows (``plan``'s vector the prior, ``plan`` the first tree) and
    the loop's step times, with the cost model of this machine's cached, calibrated profile (or the
    config's); without one the plan stays static, said once in the log. Exact: a step's tree
    depends only on earlier steps (``adaptive``'s docstring). Outputs carry the re-planning record
    (``GenerationOutput.replan``). A generator's next call continues its last one (tree, evidence,
    live costs: ``AdaptiveConfig.carry``): sampled tokens depend on earlier calls, not their law.

    ``lazy_logits``: the target's LM head and p only at the nodes verification reads (the same
    tokens; ``lazy_logits.py``); default: on a CPU for trees of ``LAZY_MIN_NODES`` nodes or more.
    """

    def __init__(
        self,
        target,
        draft=None,
        plan: TreePlan | None = None,
        sampling: SamplingParams = SamplingParams(),
        *,
        max_length: int | None = 2048,
        backend: str | None = None,
        validate: bool = True,
        device: torch.device | str | None = None,
        cuda_graphs: bool = False,
        packed_linears: bool | None = None,
        adapt_threads: bool = True,
        adaptive: bool | AdaptiveConfig = False,
        lazy_logits: bool | None = None,
    ):
        plan = plan if plan is not None else chain_tree(0)
        if draft is None and plan.num_nodes != 1:
            raise ValueError("a tree of more than one node needs a draft model")
        if adaptive is not False and not isinstance(adaptive, (bool, AdaptiveConfig)):
            raise ValueError(f"adaptive must be a bool or an AdaptiveConfig, got {adaptive!r}")
        if adaptive is not False and draft is None:
            raise ValueError("adaptive=True re-plans the draft's trees: it needs a draft model")
        self.vocab = vocab_size(target)
        if draft is not None:
            check_draft_vocab(draft, self.vocab)  # the same, or a standalone draft's padded to another size
        if isinstance(draft, FeatureHead) and (plan.num_nodes > 1 or adaptive is not False):
            draft.bind(target)  # checks the head against the target (ValueError before any state)
        self.device = torch.device(device) if device is not None else next(target.parameters()).device
        self.tp = tensor_parallel_of(target)  # a target sharded by Hugging Face's TP plan (None: one process)
        self._kv_heads = local_kv_heads(target)  # ValueError before any state
        # the re-planning config with its cost model (None: the plan is static, also when no profile has one)
        config = default_config(sampling) if adaptive is True else adaptive
        self.adaptive = None if adaptive is False else rank0s(
            adaptive_costs(config, target, draft, sampling, self.device), self.tp)
        # a static 1-node plan is plain decoding: the draft is not run at all (running it would only cost time)
        draft = draft if plan.num_nodes > 1 or self.adaptive is not None else None
        self.target, self.draft, self.plan, self.sampling = target, draft, plan, sampling
        self.max_length = None if max_length is None else int(max_length)
        self.backend = backend  # every op of the step: tree_attention (through the caches), sampling, verify, compact
        self.spec = TreeSpec(plan, self.device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.rand = Uniforms(self.device, shared_seed(sampling.seed, self.tp, self.device), on_device=self.cuda_graphs)
        self._check = validate and not self.cuda_graphs  # the logits check before compaction (one sync)
        self._lazy_from = lazy_from(lazy_logits, self.device, self.tp, self.cuda_graphs)
        self._placeholders = KeptRows()  # lazy verification's p, kept across a call's steps (step_buffers.py)
        dtype = next(target.parameters()).dtype
        self.packed_linears = packed_linear_pays(dtype) if packed_linears is None else bool(packed_linears)
        self.adapt_threads = bool(adapt_threads) and self.device.type == "cpu"
        self._specs = {plan.parents: self.spec}  # the device tensors of each tree run (adaptive: several)
        self._last_replan = None  # adaptive: the last call's re-planner, which the next one continues

    def continue_adaptive(self, other: "SequoiaGenerator") -> None:
        """This generator's next call continues ``other``'s online re-planning (its last call's
        tree, evidence and live costs), as ``other``'s own next call would: for callers that build
        a generator per request (``SequoiaDecoding``). Both must serve the same pair and setting."""
        if self.adaptive is None or other.adaptive is None or not self.adaptive.carry:
            return
        if (other.target, other.draft, other.sampling) != (self.target, self.draft, self.sampling):
            raise ValueError("continue_adaptive: the other generator serves another model pair or sampling setting")
        self._last_replan = other._last_replan

    # ------------------------------------------------------------------ parts of a call

    def _cache(self, model, batch: int, need: int) -> SequoiaCache:  # need: positions (the draft's <= the target's)
        return SequoiaCache(model.config, batch_size=batch, max_cache_len=cache_length(need, self.max_length, model),
                            num_kv_heads=self._kv_heads if model is self.target else None,
                            dtype=next(model.parameters()).dtype, device=self.device,
                            backend=self.backend, validate=False)  # capacity checked once per call

    def _drafter(self, batch: int, need: int) -> Drafter:
        if self.draft is None:
            return NoDrafter()
        args = (self.draft, self.sampling, self.rand, self._cache(self.draft, batch, need), self.vocab, self.backend)
        if isinstance(self.draft, FeatureHead):
            return FeatureDrafter(*args, batch, self.spec.plan.num_levels, self.device)
        return ModelDrafter(*args)

    def _largest_tree(self) -> int:
        """The most nodes a step may verify (re-planning any tree: the profile's largest budget)."""
        if self.adaptive is None or self.adaptive.trees != "any":  # "size": a tree of the plan's budget
            return max(self.spec.T, self.spec.plan.budget)
        return max(self.spec.T, *map(int, self.adaptive.latency["target_latency_s"]))

    def _replanner(self, batch: int) -> Replanner | None:
        """This call's re-planner (adaptive; None: every step runs ``plan``): the last call's
        continued (``AdaptiveConfig.carry``), or a new one from the static plan."""
        if self.adaptive is None:
            return None
        cfg = self.adaptive
        if cfg.carry and self._last_replan is not None:
            return self._last_replan.continued(batch)
        return Replanner(self.plan.acceptance, cfg.latency, cfg.overhead_s, batch, cfg, start=self.plan)

    def _spec_of(self, plan: TreePlan) -> TreeSpec:
        """The device tensors of ``plan`` (made once per tree)."""
        if plan.parents not in self._specs:
            self._specs[plan.parents] = TreeSpec(plan, self.device)
        return self._specs[plan.parents]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _clock(self, profile: bool) -> Callable[[], float]:
        def now() -> float:
            self._sync()
            return time.perf_counter()
        return now if profile else time.perf_counter

    # ------------------------------------------------------------------ one step

    def _step(self, tcache: SequoiaCache, drafter: Drafter, spec: TreeSpec, root: torch.Tensor, eos=None,
              st: StepStats | None = None, peek: TreeSpec | None = None) -> StepResult:
        """One speculation step over the tree ``spec`` for the rows of ``root`` [B]: draft, target,
        verify, compact. ``eos``: min_new_tokens' (eos ids, new tokens each row must still make) or
        None. Leaves both caches and the drafter past the accepted path; fills ``st``'s phase times;
        non-finite logits (host checks on) raise ``NonFiniteLogitsError`` before any state changes.
        ``peek`` (a 1-node ``spec``): the star drafted for ``play_out`` (``adaptive``'s peeks)."""
        t0 = st.now() if st else 0.0
        prop = drafter.propose(peek or spec, root, eos, st)  # tokens [B, T], q [B, T, V] or None
        t1 = st.now() if st else 0.0
        lazy = spec.T >= self._lazy_from and peek is None  # logits: the final hidden states [B, T, H] then
        logits, feats = target_forward(self.target, prop.tokens[:, :spec.T].clamp(min=PLACEHOLDER_ID),
                                       drafter.feature_layers, logits="hidden" if lazy else True, cache=tcache,
                                       use_cache=True, **tcache.tree_inputs(spec.depth, spec.mask))  # [B, T, V], [B, T, F]
        t2 = st.now() if st else 0.0
        path, num, bonus, p, bad_t = self._verify(spec, logits, Proposal.root_only(root) if peek else prop, eos, lazy)
        bad = torch.stack([prop.bad, bad_t])
        if self._check and bool(bad.any()):
            drafter.rollback(prop)
            raise NonFiniteLogitsError("the " + ("draft" if bool(bad[0]) else "target") +
                                       " model returned NaN or +inf logits (or a row without a finite logit)")
        seen, first = self._observed(peek, logits, prop, p, path[:, :spec.plan.num_levels])
        t3 = st.now() if st else 0.0
        if spec.T == 1:
            tcache.commit(1)  # plain decoding: the root's entry is already in place
        else:
            tcache.accept(path, num, validate=False)
        drafter.accept(prop, path, num, feats)
        if st is not None:
            st.draft_s, st.target_s, st.verify_s, st.compact_s = t1 - t0, t2 - t1, t3 - t2, st.now() - t3
        return StepResult(prop.tokens, path, num, bonus, bad, seen, first)

    def _observed(self, peek: TreeSpec | None, logits, prop, p, path) -> tuple:
        """For the re-planner: (a peek's played-out (path, length) or None, first-child acceptance or None)."""
        if peek is not None:
            return play_out(peek.parents, logits, prop, self.sampling, self.rand, self.backend)
        return None, first_child_acceptance(p, prop.q, path) if self.adaptive and prop.q is not None else None

    def _tell(self, replan: Replanner, spec: TreeSpec, res: StepResult, st: StepStats, keep: list[int]) -> None:
        """What a step accepted (a peek: what the star ``spec`` would have) and cost, to the re-planner."""
        path, n = (res.path, [a + 1 for a in st.accepted]) if res.seen is None else (res.seen[0], res.seen[1].tolist())
        replan.observe(spec.plan, path.tolist(), n, slowest_rank(st.total_s, self.tp, self.device), keep,
                       peeked=res.seen is not None, first=None if res.first is None else res.first.tolist())

    def _verify(self, spec: TreeSpec, x: torch.Tensor, prop, eos, lazy: bool) -> tuple[torch.Tensor, ...]:
        """The accepted path [B, T], its length [B], the bonus token [B] (``verify_tree``; plain
        greedy decoding is the argmax, with nothing to verify), p [B, T, V] (None then) and whether
        the target's logits held NaN / +inf []: of the logits ``x`` [B, T, V], or (``lazy``) of the
        final hidden states ``x`` [B, T, H] at the rows verification reads (``lazy_logits``)."""
        B = x.shape[0]
        if lazy:
            uniforms = None if self.sampling.greedy else self.rand(B, spec.T)
            return verify_reading(TargetHead(self.target), x, prop.q, prop.tokens, spec.parents,
                                  spec.first_child, spec.depth, self.sampling, uniforms, self.backend, eos,
                                  stop_on_bad=self._check, placeholders=self._placeholders)
        bad = nonfinite(x)
        block_eos(x, spec.depth, eos)
        if spec.T == 1 and self.sampling.greedy:
            path = torch.zeros(B, 1, dtype=torch.int64, device=x.device)
            return path, path[:, 0] + 1, x[:, 0].argmax(-1), None, bad
        p = filtered_probs(x, self.sampling, self.backend)
        uniforms = None if self.sampling.greedy else self.rand(B, spec.T)
        return *verify_tree(p, prop.q if prop.q is not None else p, prop.tokens, spec.parents,
                            greedy=self.sampling.greedy, uniforms=uniforms, backend=self.backend, validate=False), p, bad

    def _graphed_step(self, graphs: dict, tcache: SequoiaCache, drafter: Drafter, spec: TreeSpec,
                      root: torch.Tensor) -> StepResult:
        """_step captured in a CUDA graph (once per tree, batch size and state buffers) and replayed;
        ``graphs``: the call's captures by key (a dict, empty at first; adaptive: one per tree run)."""
        state = [tcache.prefix_len] + drafter.state()  # what the step reads and advances in place
        key = (id(spec), root.shape[0], id(tcache), tcache.tensor.data_ptr()) + tuple(t.data_ptr() for t in state)
        graph = graphs.setdefault(key, {})
        if not graph:
            static_root, saved = root.clone(), [t.clone() for t in state]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, allocates workspaces
                self._step(tcache, drafter, spec, static_root)
            torch.cuda.synchronize(self.device)  # the warm-up done, side streams too (a streamed target's copies)
            # the warm-up only wrote beyond the committed prefix (the draft's pending entry: the same values)
            for t, s in zip(state, saved):
                t.copy_(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = self._step(tcache, drafter, spec, static_root)
            for t, s in zip(state, saved):
                t.copy_(s)
            graph.update(graph=g, root=static_root, outs=outs)
        graph["root"].copy_(root)
        graph["graph"].replay()
        return graph["outs"]

    # ------------------------------------------------------------------ generate

    @torch.inference_mode()  # not no_grad: no version counters to bump, 3-6% of a CPU step (docs/decoding_loop.md)
    def generate(
        self,
        input_ids: Sequence[Sequence[int]] | torch.Tensor,
        max_new_tokens: int = 128,
        eos_token_id: int | Sequence[int] | None = None,
        callback: Callable[[int, list[int]], None] | None = None,
        profile: bool = False,
        *,
        min_new_tokens: int = 0,
        stop: Callable[[int, list[int]], int | None] | None = None,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` for every prompt (rows may differ in length).

        ``eos_token_id``: default the target's generation config. ``min_new_tokens``: the EOS ids get
        probability 0 (logit -inf, in the target and the draft) for a row's first ``min_new_tokens``
        new tokens, as Hugging Face's ``MinNewTokensLengthLogitsProcessor`` does. ``callback(row,
        tokens)`` is called with each row's new tokens after every step (streaming). ``stop(row,
        tokens)`` (optional) is asked after every step, before the callback, with the row's newly
        accepted tokens (already cut at EOS and the length limit): it returns ``None`` to go on, or
        ``k``: keep ``tokens[:k]`` and end the row. ``profile`` synchronises the device around each
        phase (exact per-phase step times). The models run our attention for the call only.

        Raises ``ValueError`` (before touching any state) on input that is not a list of prompts
        of integer token ids in the vocabulary, an empty prompt or a request that would not fit
        in ``max_length``. A model that returns NaN or +inf logits raises
        ``NonFiniteLogitsError`` (a ``ValueError``) naming the step and the model: with
        ``validate=True`` before that step changes the caches; with ``validate=False`` or CUDA
        graphs when the step's tokens are read (that step's tokens are discarded, never emitted).
        """
        prompts, eos = same_request(self.tp, self.device, lambda: check_request(  # TP: every rank's, or none
            input_ids, max_new_tokens, min_new_tokens, eos_token_id, target=self.target, draft=self.draft,
            vocab=self.vocab, tree_nodes=self._largest_tree(), max_length=self.max_length, cuda_graphs=self.cuda_graphs),
            extra=(max_new_tokens, min_new_tokens))
        # every tree step's linears on packed_linear (a row's bits must not depend on the tree's size)
        with sequoia_models(self.target, self.draft, packed_linears=self.packed_linears,
                            max_rows=max(MAX_ROWS, len(prompts) * self._largest_tree())), \
                adapted_threads(self.adapt_threads) as threads, self._placeholders.held():
            try:
                out = self._generate(prompts, max_new_tokens, eos, callback, min_new_tokens, stop, bool(profile),
                                     threads)
            except Exception as e:
                if (failed := peer_failure(e, self.tp)) is None:  # this rank's own error (or one process): as it is
                    raise
                raise failed from e  # TP: another rank failed; this one stops with a clear error, not a hang
        check_same_tokens(out.tokens, self.tp, self.device)
        return out

    def _generate(self, prompts, max_new_tokens, eos_ids, callback, min_new_tokens, stop, profile,
                  threads) -> GenerationOutput:
        B, eos = len(prompts), set(eos_ids)
        suppress = torch.tensor(eos_ids, dtype=torch.int64, device=self.device) if min_new_tokens and eos else None
        out = GenerationOutput(tokens=[[] for _ in prompts])
        t_start = time.perf_counter()
        need, room = call_room(prompts, max_new_tokens, self._largest_tree(), all_at_once=self.cuda_graphs)
        tcache, drafter, replan = self._cache(self.target, B, room), self._drafter(B, room), self._replanner(B)
        root = prefill(self.target, tcache, drafter, prompts)
        self._sync()
        out.prefill_s = time.perf_counter() - t_start
        active, graphs, spec = list(range(B)), {}, self.spec  # input row of each cache row; CUDA graphs; the tree
        clock, t_decode = self._clock(profile), time.perf_counter()
        while active:
            if threads is not None:
                threads.step(len(out.steps))
            t0 = time.perf_counter()
            make_room(tcache, drafter, need, max(len(prompts[b]) + len(out.tokens[b]) for b in active) - 1,
                      self._largest_tree(), self.max_length, self.target, self.draft)
            prev, spec = spec, self._spec_of(replan.next_plan()) if replan is not None else spec
            peek = self._spec_of(star) if replan is not None and (star := replan.peek()) is not None else None
            # min_new_tokens: per row, how many more new tokens must not be EOS
            block = None if suppress is None else (suppress, torch.tensor(
                [max(0, min_new_tokens - len(out.tokens[b])) for b in active], device=self.device))
            if self.cuda_graphs and out.steps and spec is prev and peek is None:  # eager: the first step, a new tree
                st, res = StepStats.untimed(), self._graphed_step(graphs, tcache, drafter, spec, root)
            else:
                st = StepStats.untimed() if self.cuda_graphs else StepStats([], [], clock=clock)
                try:
                    res = self._step(tcache, drafter, spec, root, block, None if self.cuda_graphs else st, peek)
                except NonFiniteLogitsError as e:
                    raise NonFiniteLogitsError(f"decoding step {len(out.steps)}: {e}") from None
            root = res.bonus.clone()
            if callback is not None or stop is not None:
                all_reached(self.tp, self.device)  # TP: no rank streams a step that another rank did not reach
            keep = self._emit(res, active, out, eos, max_new_tokens, stop, callback, st)
            if len(keep) < len(active):  # finished rows cost nothing from here on
                idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
                tcache.keep_rows(idx)
                drafter.keep_rows(idx)
                root, active = root[idx], [active[r] for r in keep]
            st.total_s = time.perf_counter() - t0
            out.steps.append(st)
            if replan is not None:  # the next steps' trees
                self._tell(replan, spec if peek is None else peek, res, st, keep)
        out.replan = replan.stats if replan is not None else None
        self._last_replan = replan  # where the next call's re-planning starts (carry)
        self._sync()
        out.decode_s = time.perf_counter() - t_decode
        return out

    def _emit(self, res: StepResult, active: list[int], out: GenerationOutput, eos: set[int], max_new_tokens: int,
              stop, callback, st: StepStats) -> list[int]:
        """The step's one host read (the accepted tokens, the non-finite flags), then per row: its
        new tokens cut at EOS / the length limit / ``stop``, emitted to ``out`` and ``callback``.
        Returns the step's rows that go on."""
        acc_tok = torch.where(res.path >= 0, res.tokens.gather(1, res.path.clamp(min=0)), -1)  # [B, T]
        rows = torch.cat([acc_tok[:, 1:], res.bonus[:, None]], 1).tolist()
        nums = res.num.tolist()
        draft_bad, target_bad = res.bad.tolist()
        if draft_bad or target_bad:
            raise NonFiniteLogitsError(
                f"decoding step {len(out.steps)}: the {'draft' if draft_bad else 'target'} model returned NaN or "
                "+inf logits (or a row without a finite logit); the step's tokens were discarded")
        keep = []
        for r, b in enumerate(active):
            st.accepted.append(nums[r] - 1)
            new, done = self._cut([t for t in rows[r][: nums[r] - 1] if t >= 0] + [rows[r][-1]], eos,
                                  max_new_tokens - len(out.tokens[b]))
            if stop is not None and (k := stop(b, new)) is not None:
                new, done = new[: max(0, int(k))], True
            out.tokens[b].extend(new)
            st.emitted.append(len(new))
            if callback is not None:
                callback(b, new)
            if not done:
                keep.append(r)
        return keep

    @staticmethod
    def _cut(new: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
        """A row's accepted tokens + bonus, cut after the first EOS and at ``room`` tokens:
        (tokens to emit, whether the row is done)."""
        for j, t in enumerate(new):
            if t in eos:
                return new[: min(j + 1, room)], True
        return new[:room], len(new) >= room
