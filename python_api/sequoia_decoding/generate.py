"""The Sequoia decoding loop on Hugging Face causal LMs.

One step, for every active sequence at once:

1. **Draft**: the draft model grows the planner's tree level by level. Level ``l``'s nodes are
   forwarded in one call (they see the prefix and their ancestors through the packed tree mask;
   their keys go to the draft cache's tree slots), then the children of each expanded node are
   sampled *without replacement* from the draft distribution q (greedy: the draft's top-k).
   The last level (leaves only) is not forwarded: its logits would go unused. An accepted leaf
   therefore has no draft cache entry, so from the second step on the first draft forward also
   feeds the previous step's last accepted token (the *pending* token, at the position before
   the root), which rewrites that token's entry (unchanged when it was not a leaf): a tree of
   d levels costs d - 1 draft forwards, the first of them one token wider.
   A node can be **absent**: its parent asked for more children than the draft's filtered
   distribution (top-k / top-p) has tokens, or than the vocabulary has, or its parent is
   absent. Its token is -1; the models see a placeholder id in its slot (only its own absent
   descendants can attend to it), it is never accepted, and ``verify_tree`` skips it without
   touching the residual (the rule and why it is exact: ``verify_tree``'s reference spec).
2. **Target**: one forward over the whole tree (``T`` nodes, position ids ``prefix + depth``).
3. **Verify**: ``verify_tree`` picks the accepted path and the bonus token (exact at any
   temperature; greedy at temperature 0).
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

import contextlib
import numbers
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

import sequoia_kernels.hf  # noqa: F401  (registers the "sequoia_tree" attention implementation)
from sequoia_kernels.hf import SequoiaCache
from sequoia_kernels.ops.packed_linear import packed_linear_pays, use_packed_linears
from sequoia_kernels.ops.sampling import check_sampling_params, sample_children, sampling_probs
from sequoia_kernels.ops.verify_tree import verify_tree
from sequoia_kernels.random import draw_uniforms, new_state
from sequoia_kernels.tree_mask import pack_tree_mask

from .tree import TreePlan, chain_tree

__all__ = ["SamplingParams", "StepStats", "GenerationOutput", "SequoiaGenerator", "TreeSpec", "Level",
           "NonFiniteLogitsError"]


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed None = torch's default generator."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        check_sampling_params(self.temperature, self.top_k, self.top_p, "SamplingParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class StepStats:
    """One decoding step. Phase times in seconds (exact only with ``generate(profile=True)``,
    which syncs the device at each phase boundary); a step replayed from a CUDA graph has no
    phase times (``timed`` False, the times None): only ``total_s``."""

    emitted: list[int]  # tokens emitted this step per active row (accepted + bonus, after stops)
    accepted: list[int]  # tree nodes accepted per active row, root excluded (= emitted - 1 before stops)
    draft_s: float | None = 0.0
    target_s: float | None = 0.0
    verify_s: float | None = 0.0
    compact_s: float | None = 0.0
    total_s: float = 0.0
    draft_forward_s: float | None = 0.0  # the draft's model calls alone (draft_s also holds its sampling)
    timed: bool = True

    @property
    def other_s(self) -> float | None:
        """Time outside the two model forwards (sampling, verification, compaction, bookkeeping)."""
        return self.total_s - self.draft_forward_s - self.target_s if self.timed else None


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # the new tokens of each input row
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def num_new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per sequence-step (accepted + bonus), before EOS/length stops."""
        n = sum(len(s.accepted) for s in self.steps)
        return sum(a + 1 for s in self.steps for a in s.accepted) / n if n else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Level:
    """One draft forward: nodes ``[start, end)`` of the draft's tree (the spec's nodes, shifted by
    one when the pending token is node 0) forwarded together, and how the children of its
    expanded nodes (the next level: nodes ``[end, end + C)``) are sampled: row ``child_row[c]``
    of the expanded nodes, rank ``child_col[c]``. Every forwarded level expands some node (the
    leaf level is never forwarded)."""

    start: int
    end: int
    depth: torch.Tensor  # [end - start] int64: the tree depth per node (-1: the pending token)
    pos: torch.Tensor  # [end - start] int64: position per node after the draft cache's prefix_len
    mask: torch.Tensor  # [1, end - start, W] int32: packed tree mask of the level's rows over keys [0, end)
    expanded: torch.Tensor  # [m] int64: the level's nodes with children (draft-tree indices)
    expanded_rel: torch.Tensor  # [m] int64: their rows in the level's logits
    expanded_node: torch.Tensor  # [m] int64: their indices in the plan's tree (rows of q)
    counts: torch.Tensor  # [m] int64: children to sample per expanded node
    max_children: int
    child_row: torch.Tensor  # [C] int64
    child_col: torch.Tensor  # [C] int64


class TreeSpec:
    """Device tensors of a TreePlan that every step reuses: parents, depth, the packed mask, and
    the draft's forwards (:class:`Level`, built from ``TreePlan.levels()``): ``draft_levels`` for
    the first step, ``draft_levels_pending`` for later ones, whose first forward also feeds the
    pending token (node 0 of the draft's tree, the plan's nodes shifted by one)."""

    def __init__(self, plan: TreePlan, device: torch.device):
        self.plan, self.T, self.device = plan, plan.num_nodes, device
        self.parents = torch.tensor(plan.parents, dtype=torch.int64, device=device)  # [T]
        self.depth = torch.tensor(plan.depth, dtype=torch.int64, device=device)  # [T]
        mask = torch.from_numpy(plan.mask()).to(device)  # [T, T] ancestor-or-self
        self.mask = pack_tree_mask(mask)
        self.draft_levels = self._draft_levels(plan, mask, 0)
        self.draft_levels_pending = self._draft_levels(plan, mask, 1)

    def _draft_levels(self, plan: TreePlan, mask: torch.Tensor, shift: int) -> list[Level]:
        T, device = self.T, self.device
        depth = self.depth
        if shift:  # node 0: the pending token, an ancestor of every node, one position before the root
            ext = torch.zeros(T + 1, T + 1, dtype=mask.dtype, device=device)
            ext[:, 0] = 1
            ext[1:, 1:] = mask
            mask = ext  # [T + 1, T + 1]
            depth = torch.cat([depth.new_full((1,), -1), depth])  # [T + 1]
        pos = depth + shift
        expanded = {plan.depth[nodes[0]]: (nodes, counts) for nodes, counts in plan.levels()}
        t = lambda xs: torch.tensor(list(xs), dtype=torch.int64, device=device)  # noqa: E731
        levels = []
        for d in range(plan.num_levels - 1):  # the last level holds leaves only: never forwarded
            nodes = [i for i in range(T) if plan.depth[i] == d]
            s, e = (0 if d == 0 else nodes[0] + shift), nodes[-1] + 1 + shift
            parents, counts = expanded[d]
            row_of = {node: r for r, node in enumerate(parents)}
            children = range(nodes[-1] + 1, nodes[-1] + 1 + sum(counts))  # BFS: exactly the next level
            levels.append(Level(start=s, end=e, depth=depth[s:e], pos=pos[s:e], mask=pack_tree_mask(mask[s:e, :e]),
                                expanded=t(i + shift for i in parents), expanded_rel=t(i + shift - s for i in parents),
                                expanded_node=t(parents), counts=t(counts), max_children=max(counts),
                                child_row=t(row_of[plan.parents[c]] for c in children),
                                child_col=t(plan.rank[c] - 1 for c in children)))
        return levels


class Uniforms:
    """The loop's random source: fresh uniforms in (0, 1) at every call. Eagerly torch's
    generator (seeded, or torch's default); for CUDA graphs a device-resident Philox
    (seed, offset) that advances on the device, so a replayed graph draws new numbers with no
    host sync."""

    def __init__(self, device: torch.device, seed: int | None, on_device: bool):
        self.device, self.on_device = device, on_device
        self.generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        if on_device:
            self.philox = new_state(seed if seed is not None else int(torch.randint(0, 2**62, (1,))), device)

    def __call__(self, *shape: int) -> torch.Tensor:  # fp32 [*shape] in (0, 1)
        if self.on_device:
            return draw_uniforms(shape, self.device, seed=self.philox[0], offset=self.philox[1])
        return draw_uniforms(shape, self.device, generator=self.generator).clamp_(min=1e-12)


PLACEHOLDER_ID = 0  # the token id fed to the models in an absent node's slot (any valid id would do)


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _nonfinite(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> bool [] on the device, no sync
    """True when some row holds NaN or +inf, or has no finite logit (one reduction: the row max
    propagates NaN and is +-inf exactly in the other two cases)."""
    return ~torch.isfinite(logits.amax(-1)).all()


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _as_prompts(input_ids) -> list[list[int]]:
    """``input_ids`` (a list of prompts, each a sequence of int token ids, or a [B, L] integer
    tensor) as lists of ints; a clear ``ValueError`` for anything else (float ids, a flat list)."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must hold integer token ids, got a {input_ids.dtype} tensor")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids as a tensor must be [batch, length], got shape {tuple(input_ids.shape)} "
                             "(a single prompt: input_ids[None])")
        return input_ids.tolist()
    if isinstance(input_ids, (str, bytes)) or not isinstance(input_ids, Sequence):
        raise ValueError(f"input_ids must be a list of prompts (lists of token ids) or a [batch, length] tensor, "
                         f"got {type(input_ids).__name__}")
    if len(input_ids) and all(_is_token_id(t) for t in input_ids):
        raise ValueError("input_ids must be a list of prompts, got a flat list of token ids: pass [ids] for one prompt")
    prompts = []
    for i, p in enumerate(input_ids):
        if isinstance(p, torch.Tensor):
            if p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool or p.dim() != 1:
                raise ValueError(f"prompt {i}: a tensor prompt must be 1-D with integer token ids, "
                                 f"got {p.dtype} of shape {tuple(p.shape)}")
            p = p.tolist()
        elif isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise ValueError(f"prompt {i} must be a sequence of token ids, got {type(p).__name__}")
        for t in p:
            if not _is_token_id(t):
                raise ValueError(f"prompt {i}: token ids must be integers, got {t!r} ({type(t).__name__})")
        prompts.append([int(t) for t in p])
    return prompts


class NonFiniteLogitsError(ValueError):
    """A model returned NaN or +inf logits (or a row without a finite logit) during decoding."""


def _vocab_size(model) -> int:
    """The vocabulary the model's logits cover (a reduced-vocabulary draft declares the full
    one it maps back to as ``full_vocab_size``)."""
    if getattr(model, "full_vocab_size", None) is not None:
        return int(model.full_vocab_size)
    emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if emb is not None and hasattr(emb, "weight"):
        return int(emb.weight.shape[0])
    return int(model.config.vocab_size)


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, int):
        return [eos_token_id]
    return [int(x) for x in eos_token_id]


THREADS_CHECK_STEPS = 32  # adapt_threads: how often a call re-reads the machine's load


def _own_running_threads() -> int:
    """This process's threads in state R (running or runnable) now, from /proc/self/task: its
    OpenMP workers keep spinning for a while after each parallel region."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                st = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        state = st.rindex(")") + 2  # the field after "(comm)", which may itself hold ")"
        n += st[state:state + 1] == "R"
    return n


def busy_cores(samples: int = 5, interval_s: float = 0.001) -> int | None:
    """How many cores *other* processes keep busy right now (Linux): the fewest runnable tasks seen
    in ``samples`` reads of /proc/stat's ``procs_running`` ``interval_s`` apart, minus this
    process's own runnable threads at each read (the reading thread, and OpenMP workers still
    spinning after a parallel region: counting those made a decoding call drop to one thread on a
    quiet machine, 25% slower, at its first re-check mid-generation). None elsewhere."""
    seen = []
    try:
        for i in range(samples):
            with open("/proc/stat") as f:
                for line in f:
                    if line.startswith("procs_running"):
                        seen.append(int(line.split()[1]) - _own_running_threads())
                        break
            if i + 1 < samples:
                time.sleep(interval_s)
    except (OSError, ValueError):
        return None
    return max(0, min(seen)) if seen else None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class SequoiaGenerator:
    """Speculative decoding of ``target`` with ``draft`` over the trees of ``plan``.

    ``target`` and ``draft`` are Hugging Face causal LMs with Llama-style attention (Llama-2,
    Llama-3, Qwen2, Mistral, ...), switched to the ``"sequoia_tree"`` attention implementation
    here, sharing a tokenizer (same vocabulary size, checked). ``draft=None`` runs the
    autoregressive baseline (the plan must be a single node). ``max_length``: the caches'
    capacity in tokens (prompt + new tokens + one tree).

    Checks: the request is validated once per ``generate`` call (prompts, lengths, capacity);
    inside a step only the models' logits can go wrong (every other tensor is made by our own
    ops, valid by construction), so a step runs the kernels unvalidated and, with
    ``validate=True``, checks the logits for NaN / +inf before it compacts the caches (one
    device sync per step; ``validate=False`` folds that check into the step's one host read).

    ``adapt_threads`` (CPU): run each call with no more intra-op threads than the cores other
    processes leave free (``busy_cores``), re-checked every ``THREADS_CHECK_STEPS`` steps, and
    restore torch's setting afterwards: a busy core otherwise stalls every one of a step's
    thousands of OpenMP regions. ``packed_linears`` (CPU, fp32; default: where it is faster than
    torch's GEMM, ``packed_linear_pays``): the models' few-row linears on ``packed_linear`` for
    the call (the packed weights, one fp32 copy, stay with the models for later calls;
    ``sequoia_kernels.ops.packed_linear.release_packed_linears`` frees them).

    ``cuda_graphs=True`` (CUDA devices; ignored elsewhere, where the same code runs eagerly):
    the whole step (every draft level, the target forward, sampling, verification, both
    compactions) is captured once per batch size into one CUDA graph and replayed; its random
    numbers come from a device-resident Philox (seed, offset) advanced inside the graph, and
    nothing in it syncs with the host (checks are skipped, the kernels stay in bounds).
    """

    def __init__(
        self,
        target,
        draft=None,
        plan: TreePlan | None = None,
        sampling: SamplingParams = SamplingParams(),
        *,
        max_length: int = 2048,
        backend: str | None = None,
        validate: bool = True,
        device: torch.device | str | None = None,
        cuda_graphs: bool = False,
        packed_linears: bool | None = None,
        adapt_threads: bool = True,
    ):
        plan = plan if plan is not None else chain_tree(0)
        if draft is None and plan.num_nodes != 1:
            raise ValueError("a tree of more than one node needs a draft model")
        self.vocab = _vocab_size(target)
        if draft is not None and _vocab_size(draft) != self.vocab:
            raise ValueError(f"draft and target vocabularies differ ({_vocab_size(draft)} vs {self.vocab}): "
                             "they must share a tokenizer")
        # a 1-node plan is plain decoding: the draft is not run at all (running it would only cost time)
        draft = draft if plan.num_nodes > 1 else None
        self.target, self.draft, self.plan, self.sampling = target, draft, plan, sampling
        self.device = torch.device(device) if device is not None else next(target.parameters()).device
        self.max_length = int(max_length)
        self.backend = backend  # every op of the step: tree_attention (through the caches), sampling, verify, compact
        self.validate = validate
        self.spec = TreeSpec(plan, self.device)
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.rand = Uniforms(self.device, sampling.seed, on_device=self.cuda_graphs)
        self._check = validate and not self.cuda_graphs  # the logits check before compaction (one sync)
        self._profile = False  # generate(profile=True): sync at phase boundaries
        self._eos_block = None  # (eos ids [E], new tokens each row must still make [B]) under min_new_tokens
        self.packed_linears = packed_linear_pays() if packed_linears is None else bool(packed_linears)
        self.adapt_threads = bool(adapt_threads) and self.device.type == "cpu"

    # ------------------------------------------------------------------ helpers

    @contextlib.contextmanager
    def _sequoia_attention(self):
        """Both models on the ``"sequoia_tree"`` attention for the duration of a call (the
        preallocated caches only work with it) and, on the CPU in fp32 with ``packed_linears``,
        their ``nn.Linear`` products of <= 64 rows on ``packed_linear`` (weights packed by the
        first call and kept with the model for later calls: ``use_packed_linears``; the AR
        baseline runs the same loop, so both sides get it); then back as each was, so that plain
        Hugging Face calls on them behave afterwards exactly as before."""
        models = [m for m in (self.target, self.draft) if m is not None]
        if self.draft is self.target:
            models = models[:1]
        before = [getattr(m.config, "_attn_implementation", None) for m in models]
        try:
            with contextlib.ExitStack() as packed:
                for m, impl in zip(models, before):
                    if impl != "sequoia_tree":
                        m.set_attn_implementation("sequoia_tree")
                    packed.enter_context(use_packed_linears(m, self.packed_linears))
                yield
        finally:
            for m, impl in zip(models, before):
                if impl is not None and getattr(m.config, "_attn_implementation", None) != impl:
                    m.set_attn_implementation(impl)

    @contextlib.contextmanager
    def _cpu_threads(self):
        """On the CPU with ``adapt_threads``: the call runs with no more intra-op threads than there
        are cores other processes leave free (checked now and every ``THREADS_CHECK_STEPS`` steps),
        then torch's thread count is restored. A step makes ~2,000-4,000 framework calls, each an
        OpenMP region whose threads wait for each other: with one thread sharing its core with
        another process every region waits for the scheduler (measured on 2 cores beside one busy
        process: 6.0 tok/s with 2 threads, 18.9 with 1, 21-23 with 2 on a quiet machine)."""
        if not self.adapt_threads:
            yield
            return
        self._threads0 = torch.get_num_threads()
        try:
            self._adapt_threads()
            yield
        finally:
            if torch.get_num_threads() != self._threads0:
                torch.set_num_threads(self._threads0)

    def _adapt_threads(self) -> None:
        busy = busy_cores()
        if busy is None:
            return
        want = max(1, min(self._threads0, _usable_cores() - busy))
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    def _cache(self, model, batch: int) -> SequoiaCache:
        return SequoiaCache(model.config, batch_size=batch, max_cache_len=self.max_length,
                            dtype=next(model.parameters()).dtype, device=self.device,
                            backend=self.backend, validate=False)  # capacity checked once per call

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> fp32 [..., V]
        s = self.sampling
        return sampling_probs(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                              backend=self.backend, validate=False)

    def _block_eos(self, logits: torch.Tensor, depth: torch.Tensor) -> None:
        """min_new_tokens: EOS logits -> -inf (in place) at nodes whose next token is one of the
        row's first min_new_tokens new tokens. logits [B, n, V], depth [n] (a node at depth d
        predicts the row's new token number emitted + d)."""
        if self._eos_block is None:
            return
        ids, remaining = self._eos_block
        blocked = depth[None, :] < remaining[:, None]  # [B, n]
        logits[:, :, ids] = logits[:, :, ids].masked_fill(blocked[..., None], float("-inf"))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _now(self, st: StepStats | None) -> float:
        """A phase boundary: the time (after a device sync when profiling); 0 when not timed."""
        if st is None:
            return 0.0
        if self._profile:
            self._sync()
        return time.perf_counter()

    # ------------------------------------------------------------------ one step

    def _draft_tree(self, dcache, root: torch.Tensor, pending: torch.Tensor | None, st: StepStats | None):
        """root [B] (and the pending token [B], None on the first step) -> tokens [B, T] (-1: absent
        node), q [B, T, V] (None when greedy), and a device flag: some draft logits were NaN / +inf.
        With a pending token, the draft cache's prefix_len is one less on return (the pending
        token is node 0 of the draft's tree: see ``_step``). Adds the draft's forward time to ``st``."""
        spec, B = self.spec, root.shape[0]
        shift = 0 if pending is None else 1
        tokens = torch.full((B, spec.T + shift), -1, dtype=torch.int64, device=self.device)  # [B, shift + T]
        tokens[:, shift] = root
        if pending is not None:
            tokens[:, 0] = pending
            dcache.prefix_len.sub_(1)  # the pending token is rewritten at its own position
        q_all = None if self.sampling.greedy else torch.zeros(B, spec.T, self.vocab, device=self.device)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        try:
            self._grow(dcache, tokens, q_all, bad, pending is None, st)
        except BaseException:
            if pending is not None:  # the draft cache as it was
                dcache.prefix_len.add_(1)
            raise
        return tokens[:, shift:], q_all, bad

    def _grow(self, dcache, tokens: torch.Tensor, q_all: torch.Tensor | None, bad: torch.Tensor, first: bool,
              st: StepStats | None) -> None:
        """_draft_tree's level loop: fills ``tokens`` [B, shift + T] and ``q_all`` [B, T, V] in place
        and ORs the draft's non-finite-logits flag into ``bad``."""
        B = tokens.shape[0]
        for lv in (self.spec.draft_levels if first else self.spec.draft_levels_pending):
            t0 = self._now(st)
            # absent nodes (-1) are fed as a placeholder: only their own absent descendants see them
            logits = _logits(self.draft(tokens[:, lv.start:lv.end].clamp(min=PLACEHOLDER_ID), past_key_values=dcache,
                                        use_cache=True, **dcache.tree_inputs(lv.pos, lv.mask, offset=lv.start)))
            if st is not None:
                st.draft_forward_s += self._now(st) - t0
            bad |= _nonfinite(logits)  # in place: the caller's flag
            self._block_eos(logits, lv.depth)
            rows = logits[:, lv.expanded_rel]  # [B, m, V]
            m, maxc, V = rows.shape[1], lv.max_children, rows.shape[-1]
            if self.sampling.greedy:
                children = rows.topk(min(maxc, V), dim=-1).indices  # [B, m, min(maxc, V)]
                if maxc > V:  # a node with more children than the vocabulary has tokens
                    children = torch.cat([children, children.new_full((B, m, maxc - V), -1)], -1)
            else:
                q = self._probs(rows)  # [B, m, V]
                q_all[:, lv.expanded_node] = q
                # -1 past the filtered support: absent children
                children = sample_children(q.reshape(B * m, -1), lv.counts.repeat(B), max_children=maxc,
                                           uniforms=self.rand(B * m, V), backend=self.backend,
                                           validate=False).view(B, m, maxc)
            absent_parent = tokens[:, lv.expanded] < 0  # [B, m]: their children are absent too
            children = children.masked_fill(absent_parent[..., None], -1)
            tokens[:, lv.end:lv.end + lv.child_row.numel()] = children[:, lv.child_row, lv.child_col]

    def _step(self, caches, root: torch.Tensor, pending: torch.Tensor | None = None, st: StepStats | None = None):
        """One speculation step for the rows of ``root`` [B]: draft, target, verify, compact.
        ``pending`` [B]: the previous step's last accepted token, whose draft cache entry is
        rewritten (None on the first step, after the prefill). Returns (tokens [B, T], path [B, T],
        num_accepted [B], bonus [B], bad [2]: the draft's / the target's logits held NaN or +inf)
        and leaves both caches compacted and advanced by the same count. Fills ``st``'s phase
        times when given. With host checks on, non-finite logits raise ``NonFiniteLogitsError``
        before the caches are compacted (the draft cache's prefix_len restored)."""
        spec, tcache = self.spec, caches[0]
        t0 = self._now(st)
        if self.draft is not None:
            tokens, q, draft_bad = self._draft_tree(caches[1], root, pending, st)
        else:
            tokens, q = root[:, None], None
            draft_bad = torch.zeros((), dtype=torch.bool, device=self.device)
        t1 = self._now(st)
        logits = _logits(self.target(tokens.clamp(min=PLACEHOLDER_ID), past_key_values=tcache, use_cache=True,
                                     **tcache.tree_inputs(spec.depth, spec.mask)))
        bad = torch.stack([draft_bad, _nonfinite(logits)])
        if self._check and bool(bad.any()):
            if pending is not None:
                caches[1].prefix_len.add_(1)
            raise NonFiniteLogitsError("the " + ("draft" if bool(bad[0]) else "target") +
                                       " model returned NaN or +inf logits (or a row without a finite logit)")
        self._block_eos(logits, spec.depth)
        t2 = self._now(st)
        p = self._probs(logits)
        uniforms = None if self.sampling.greedy else self.rand(root.shape[0], spec.T)
        path, num, bonus = verify_tree(p, q if q is not None else p, tokens, spec.parents, greedy=self.sampling.greedy,
                                       uniforms=uniforms, backend=self.backend, validate=False)
        t3 = self._now(st)
        tcache.accept(path, num, validate=False)
        if self.draft is not None:
            if pending is None:
                caches[1].accept(path, num, validate=False)
            else:  # the draft's tree: the pending token, then the plan's nodes
                caches[1].accept(torch.cat([path.new_zeros(path.shape[0], 1), path + 1], 1), num + 1,
                                 validate=False)
        if st is not None:
            st.draft_s, st.target_s, st.verify_s, st.compact_s = t1 - t0, t2 - t1, t3 - t2, self._now(st) - t3
        return tokens, path, num, bonus, bad

    def _graphed_step(self, caches, root: torch.Tensor, pending: torch.Tensor):
        """_step (after the first: with a pending token) captured in a CUDA graph (once per batch
        size and cache set) and replayed."""
        g = getattr(self, "_graph", None)
        # the graph bakes in these exact tensors; g holds the caches, so their ids stay unique
        key = (root.shape[0],) + tuple((id(c), c.tensor.data_ptr(), c.prefix_len.data_ptr()) for c in caches)
        if g is None or g["key"] != key:
            static_root, static_pending = root.clone(), pending.clone()
            saved = [c.prefix_len.clone() for c in caches]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, allocates workspaces
                self._step(caches, static_root, static_pending)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            # the warm-up only wrote beyond the committed prefix (the draft's pending entry: the same values)
            for c, p in zip(caches, saved):
                c.prefix_len.copy_(p)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = self._step(caches, static_root, static_pending)
            for c, p in zip(caches, saved):
                c.prefix_len.copy_(p)
            g = self._graph = {"key": key, "graph": graph, "root": static_root, "pending": static_pending,
                               "outs": outs, "caches": caches}
        g["root"].copy_(root)
        g["pending"].copy_(pending)
        g["graph"].replay()
        return g["outs"]

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
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

        ``eos_token_id``: default the target's generation config. ``min_new_tokens``: the EOS
        ids get probability 0 (logit -inf, in the target and the draft) for a row's first
        ``min_new_tokens`` new tokens, as Hugging Face's ``MinNewTokensLengthLogitsProcessor``
        does. ``callback(row, tokens)`` is called with each row's new tokens after every step
        (streaming). ``stop(row, tokens)`` (optional) is asked after every step, before the
        callback, with the row's newly accepted tokens (already cut at EOS and the length
        limit): it returns ``None`` to go on, or ``k``: keep ``tokens[:k]`` and end the row.
        ``profile`` synchronises the device around each phase so the per-phase times in the
        step stats are exact. The models are switched to the ``"sequoia_tree"`` attention for
        the call and switched back afterwards.

        Raises ``ValueError`` (before touching any state) on input that is not a list of prompts
        of integer token ids in the vocabulary, an empty prompt or a request that would not fit
        in ``max_length``. A model that returns NaN or +inf logits raises
        ``NonFiniteLogitsError`` (a ``ValueError``) naming the step and the model: with
        ``validate=True`` before that step changes the caches; with ``validate=False`` or CUDA
        graphs when the step's tokens are read (that step's tokens are discarded, never emitted).
        """
        prompts = _as_prompts(input_ids)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not _is_token_id(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not _is_token_id(min_new_tokens) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an int >= 0, got {min_new_tokens}")
        if min_new_tokens and self.cuda_graphs:
            raise ValueError("min_new_tokens is not supported with cuda_graphs=True")
        if any(t < 0 or t >= self.vocab for p in prompts for t in p):
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab})")
        need = max(len(p) for p in prompts) + max_new_tokens + self.spec.T - 2
        if need > self.max_length:
            raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens + {max_new_tokens} new tokens + a "
                             f"{self.spec.T}-node tree needs {need} cache positions; max_length is {self.max_length}")
        eos = _eos_ids(self.target, eos_token_id)
        if any(not 0 <= t < self.vocab for t in eos):
            raise ValueError(f"eos_token_id must lie in [0, {self.vocab}), got {eos}")
        self._profile = bool(profile)
        with self._sequoia_attention(), self._cpu_threads():
            return self._generate(prompts, max_new_tokens, eos, callback, min_new_tokens, stop)

    def _generate(self, prompts, max_new_tokens, eos_ids, callback, min_new_tokens, stop) -> GenerationOutput:
        eos = set(eos_ids)
        suppress = torch.tensor(eos_ids, dtype=torch.int64, device=self.device) if min_new_tokens and eos else None
        B = len(prompts)
        out = GenerationOutput(tokens=[[] for _ in prompts])

        # prefill prompt[:-1] into both caches; the last prompt token is the first root
        t_start = time.perf_counter()
        caches = [self._cache(self.target, B)] + ([self._cache(self.draft, B)] if self.draft is not None else [])
        lens = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        width = int(lens.max())
        if width > 0:
            ids = torch.zeros(B, width, dtype=torch.int64, device=self.device)
            for b, p in enumerate(prompts):
                ids[b, : len(p) - 1] = torch.tensor(p[:-1])
            pos = torch.arange(width, device=self.device).expand(B, width)
            for model, cache in zip((self.target, self.draft), caches):
                model(ids, past_key_values=cache, position_ids=pos, use_cache=True)
                cache.commit(lens)
        root = torch.tensor([p[-1] for p in prompts], device=self.device)
        self._sync()
        out.prefill_s = time.perf_counter() - t_start

        active = list(range(B))  # input row of each cache row
        pending = None  # [B]: the token whose draft cache entry the next step rewrites (module docstring)
        t_decode = time.perf_counter()
        while active:
            if self.adapt_threads and len(out.steps) % THREADS_CHECK_STEPS == THREADS_CHECK_STEPS - 1:
                self._adapt_threads()
            t0 = time.perf_counter()
            # min_new_tokens: per row, how many more new tokens must not be EOS
            self._eos_block = None if suppress is None else (suppress, torch.tensor(
                [max(0, min_new_tokens - len(out.tokens[b])) for b in active], device=self.device))
            if self.cuda_graphs:  # no phase boundaries inside a replayed graph
                st = StepStats([], [], draft_s=None, target_s=None, verify_s=None, compact_s=None,
                               draft_forward_s=None, timed=False)
                if pending is None and self.draft is not None:  # the first step runs eagerly
                    tokens, path, num, bonus, bad = self._step(caches, root)
                else:
                    tokens, path, num, bonus, bad = self._graphed_step(
                        caches, root, pending if pending is not None else root)
            else:
                st = StepStats([], [])
                try:
                    tokens, path, num, bonus, bad = self._step(caches, root, pending, st)
                except NonFiniteLogitsError as e:
                    raise NonFiniteLogitsError(f"decoding step {len(out.steps)}: {e}") from None
            root = bonus.clone()

            # the one host sync of the step: the accepted tokens (and the non-finite-logits flags)
            acc_tok = torch.where(path >= 0, tokens.gather(1, path.clamp(min=0)), -1)
            if self.draft is not None:  # the last accepted node's token: the next step's pending token
                pending = acc_tok.gather(1, (num.long() - 1)[:, None])[:, 0]
            rows = torch.cat([acc_tok[:, 1:], bonus[:, None]], 1).tolist()
            nums = num.tolist()
            draft_bad, target_bad = bad.tolist()
            if draft_bad or target_bad:
                raise NonFiniteLogitsError(
                    f"decoding step {len(out.steps)}: the {'draft' if draft_bad else 'target'} model returned NaN or "
                    "+inf logits (or a row without a finite logit); the step's tokens were discarded")
            keep = []
            for r, b in enumerate(active):
                st.accepted.append(nums[r] - 1)
                new, done = self._emit([t for t in rows[r][: nums[r] - 1] if t >= 0] + [rows[r][-1]], eos,
                                       max_new_tokens - len(out.tokens[b]))
                if stop is not None and (k := stop(b, new)) is not None:
                    new, done = new[: max(0, int(k))], True
                out.tokens[b].extend(new)
                st.emitted.append(len(new))
                if callback is not None:
                    callback(b, new)
                if not done:
                    keep.append(r)
            if len(keep) < len(active):  # finished rows cost nothing from here on
                idx = torch.tensor(keep, dtype=torch.int64, device=self.device)
                for cache in caches:
                    cache.keep_rows(idx)
                root = root[idx]
                pending = pending[idx] if pending is not None else None
                active = [active[r] for r in keep]
            st.total_s = time.perf_counter() - t0
            out.steps.append(st)
        self._sync()
        out.decode_s = time.perf_counter() - t_decode
        self._graph = None  # release the captured graph and the caches it holds
        return out

    @staticmethod
    def _emit(new: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
        """A row's accepted tokens + bonus, cut after the first EOS and at ``room`` tokens:
        (tokens to emit, whether the row is done)."""
        for j, t in enumerate(new):
            if t in eos:
                return new[: min(j + 1, room)], True
        return new[:room], len(new) >= room
