"""Drafters: what proposes a step's tree of tokens to the decoding loop and takes back what the
target accepted (the loop: ``generate.SequoiaGenerator``).

A drafter is an object with these methods (:class:`Drafter`); the loop calls them in this order::

    drafter.prefill(ids, pos, lens, feats)    # once per call: the prompts but their last token
    prop = drafter.propose(spec, root, eos, st)  # every step: tokens [B, T], q [B, T, V] or None
    drafter.accept(prop, path, num, feats)    # after verification: follow the accepted path
    drafter.keep_rows(idx)                    # when rows finish
    drafter.reserve(positions)                # before a step whose rows would pass its caches' end

and ``drafter.rollback(prop)`` instead of ``accept`` when the step is abandoned (non-finite
logits). ``spec`` (a ``spec.TreeSpec``) is the step's tree: it may change from step to step
(``adaptive.Replanner``); a 1-node tree is plain decoding, for which a drafter forwards nothing
and catches up on the skipped tokens when a tree returns (:meth:`Proposal.root_only`). A plain
step with a *peek* (``adaptive``) asks for a star at the root while the target forwards the root
alone: to the drafter it is a tree step whose path is the root (:func:`play_out`). Two
implementations here: :class:`NoDrafter` (plain decoding: the tree is the root alone) and
:class:`ModelDrafter` (a standalone draft model growing the planner's tree level by level); a
third in ``feature_drafter.py`` (an EAGLE-style head reading the target's features, ``feats``:
the target's hidden states the drafter asks for through ``feature_layers``).
A drafter keeps its own state (caches, the pending token) in tensors it updates in place, so a
step that calls it can be captured in a CUDA graph: ``state()`` lists them (the graph's key and
what a warm-up restores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from sequoia_kernels.hf import SequoiaCache, cache_kw
from sequoia_kernels.ops.sampling import overlap_rows, sample_children, sampling_probs
from sequoia_kernels.ops.verify_tree import verify_tree

from .request_checks import vocab_size
from .step_buffers import KeptRows

__all__ = ["Proposal", "Drafter", "NoDrafter", "ModelDrafter", "PLACEHOLDER_ID", "logits_of", "fit_vocab", "nonfinite",
           "filtered_probs", "block_eos", "draw_children", "q_columns", "first_child_acceptance", "play_out"]

PLACEHOLDER_ID = 0  # the token id fed to the models in an absent node's slot (any valid id would do)


def logits_of(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:  # [..., Vd] -> [..., vocab]
    """A standalone draft's logits over the target's ``vocab`` ids (a vocabulary padded to another
    size: ``request_checks.check_draft_vocab``): the draft's ids past the target's dropped, the
    target's past the draft's at -inf (q is 0 there)."""
    extra = vocab - logits.shape[-1]
    if extra == 0:
        return logits
    return logits[..., :vocab] if extra < 0 else torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))


def nonfinite(logits: torch.Tensor) -> torch.Tensor:  # [..., V] -> bool [] on the device, no sync
    """True when some row holds NaN or +inf, or has no finite logit (one reduction: the row max
    propagates NaN and is +-inf exactly in the other two cases)."""
    return ~torch.isfinite(logits.amax(-1)).all()


def filtered_probs(logits: torch.Tensor, sampling, backend: str | None) -> torch.Tensor:  # [..., V] -> fp32
    """The distribution ``sampling`` (a ``generate.SamplingParams``) samples from: temperature,
    top-k, top-p applied (one-hot argmax when greedy)."""
    return sampling_probs(logits, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          backend=backend, validate=False)


def block_eos(logits: torch.Tensor, depth: torch.Tensor, eos) -> None:
    """min_new_tokens: EOS logits -> -inf (in place) at nodes whose next token is one of the row's
    first min_new_tokens new tokens. logits [B, n, V], depth [n] (a node at depth d predicts the
    row's new token number emitted + d); ``eos``: (eos ids [E], new tokens each row must still
    make [B]), or None."""
    if eos is None:
        return
    ids, remaining = eos
    blocked = depth[None, :] < remaining[:, None]  # [B, n]
    logits[:, :, ids] = logits[:, :, ids].masked_fill(blocked[..., None], float("-inf"))


def draw_children(rows: torch.Tensor, lv, tokens: torch.Tensor, q_all: torch.Tensor | None, sampling, rand,
                  backend: str | None, vocab_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """The children of level ``lv``'s expanded nodes (a ``spec.Level``; ``rows`` [B, m, V]: their
    logits): sampled without replacement from q (greedy: the top-k), written in place to
    ``tokens`` [B, *] (the drafter's tree, indexed like ``lv``) and q to ``q_all`` [B, T, V_t].
    ``vocab_map`` (a drafter with a vocabulary of its own: a head's draft tokens): (the target id
    of each of ``rows``' columns and -1 after them [V + 1], the flat indices [m * V] of the
    expanded nodes' q at those ids in a row of ``q_all`` viewed [B, T * V_t]: :func:`q_columns`);
    q is 0 at the target's other tokens (None: V is the target's)."""
    B, m, V = rows.shape
    maxc = lv.max_children
    if sampling.greedy:
        children = rows.topk(min(maxc, V), dim=-1).indices  # [B, m, min(maxc, V)]
        if maxc > V:  # a node with more children than the vocabulary has tokens
            children = torch.cat([children, children.new_full((B, m, maxc - V), -1)], -1)
    else:
        q = filtered_probs(rows, sampling, backend)  # [B, m, V]
        if vocab_map is None:
            q_all.index_copy_(1, lv.expanded_node, q)
        else:  # q_all is 0 off the draft's tokens (one copy to precomputed columns: an index_put with
            # broadcast indices cost ~4x as much on a CPU)
            q_all.view(B, -1).index_copy_(1, vocab_map[1], q.view(B, -1))
        # -1 past the filtered support: absent children
        children = sample_children(q.view(B * m, V), lv.counts if B == 1 else lv.counts.repeat(B), max_children=maxc,
                                   uniforms=rand(B * m, V), backend=backend, validate=False).view(B, m, maxc)
    if vocab_map is not None:  # the draft's ids -> the target's (-1, the table's last entry, stays)
        children = vocab_map[0][children]
    absent_parent = tokens[:, lv.expanded] < 0  # [B, m]: their children are absent too
    children = children.masked_fill(absent_parent[..., None], -1)
    tokens[:, lv.end:lv.end + lv.child_row.numel()] = children[:, lv.child_row, lv.child_col]


def q_columns(expanded_node: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """[m * len(ids)]: where the q of the tree nodes ``expanded_node`` [m] at the target tokens
    ``ids`` go in one batch row of a [B, T, ``vocab``] q viewed [B, T * vocab] (:func:`draw_children`)."""
    return (expanded_node[:, None] * vocab + ids[None, :]).reshape(-1)


def first_child_acceptance(p: torch.Tensor, q: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """[B, D]: at each node of the accepted ``path`` [B, D] (its first D columns: the tree's depth
    bounds it; -1 past its end: any value), the probability that the node's first child is
    accepted, sum_x min(p(x), q(x)) (a child x drawn from q is accepted with probability
    min(1, p(x) / q(x))); p, q [B, T, V] the target's and the draft's filtered distributions by
    node. Reads the path's rows only (``overlap_rows``; on a CPU one compiled pass: 3 rows of
    49152 in 0.05 ms where torch's gather, minimum and sum took 0.13-0.15, warm)."""
    B, T, V = p.shape
    rows = (torch.arange(B, device=p.device)[:, None] * T + path.clamp(min=0)).reshape(-1)  # [B * D]
    return overlap_rows(p.reshape(B * T, V), q.reshape(B * T, V), rows).view(B, -1)


def play_out(parents: torch.Tensor, logits: torch.Tensor, prop: "Proposal", sampling, rand, backend: str | None
             ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """A peek (``adaptive.Replanner.peek``): the star ``prop`` (its tree ``parents``, drafted at the
    root) verified on the root's target distribution (``logits`` [B, 1, V]) with its own random
    numbers: (the path [B, T] and its length [B] a step of the star would have accepted: a child's
    own distribution only draws the bonus token after it, which is dropped, so the root's stands
    in), and when sampling, the root's :func:`first_child_acceptance` [B, 1] (None when greedy)."""
    B, T = prop.tokens.shape
    p = filtered_probs(logits[:, :1], sampling, backend)  # [B, 1, V]
    uniforms = None if sampling.greedy else rand(B, T)
    q = prop.q if prop.q is not None else p.expand(B, T, -1)
    path, num, _ = verify_tree(p.expand(B, T, -1).contiguous(), q, prop.tokens, parents, greedy=sampling.greedy,
                               uniforms=uniforms, backend=backend, validate=False)
    first = None if sampling.greedy else torch.minimum(p[:, 0], q[:, 0]).sum(-1, keepdim=True)
    return (path, num), first


@dataclass
class Proposal:
    """One step's tree as a drafter proposes it."""

    tokens: torch.Tensor  # [B, T] int64: node tokens (column 0 the root; -1: absent node)
    q: torch.Tensor | None  # [B, T, V] fp32: the distributions each node's children were drawn from (None: greedy)
    bad: torch.Tensor  # bool []: the drafter's logits held NaN / +inf this step

    @classmethod
    def root_only(cls, root: torch.Tensor) -> "Proposal":
        """Plain decoding's proposal: the root [B] alone, nothing drafted."""
        return cls(root[:, None], None, torch.zeros((), dtype=torch.bool, device=root.device))


class Drafter(Protocol):
    """What the decoding loop needs from a drafter (module docstring). ``feature_layers``: the
    target hidden states the drafter reads (indices into Hugging Face's ``hidden_states``, -1 the
    final normed one), None for none; the loop hands them to ``prefill`` and ``accept`` as
    ``feats`` [B, T, F] (None when not asked for)."""

    feature_layers: tuple[int, ...] | None

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, feats=None) -> None: ...

    def propose(self, spec, root: torch.Tensor, eos, st) -> Proposal: ...

    def accept(self, prop: Proposal, path: torch.Tensor, num: torch.Tensor, feats=None) -> None: ...

    def rollback(self, prop: Proposal) -> None: ...

    def keep_rows(self, idx: torch.Tensor) -> None: ...

    def reserve(self, positions: int) -> None: ...  # room for positions in its caches (the loop's rows lengthen)

    def state(self) -> list[torch.Tensor]: ...


class NoDrafter:
    """Plain decoding: the tree is the root alone, nothing is drafted."""

    feature_layers = None

    def prefill(self, ids, pos, lens, feats=None) -> None:
        return None

    def propose(self, spec, root: torch.Tensor, eos, st) -> Proposal:
        return Proposal.root_only(root)

    def accept(self, prop, path, num, feats=None) -> None:
        return None

    def rollback(self, prop) -> None:
        return None

    def keep_rows(self, idx) -> None:
        return None

    def reserve(self, positions: int) -> None:
        return None

    def state(self) -> list[torch.Tensor]:
        return []


class ModelDrafter:
    """A standalone draft model (a causal LM sharing the target's tokenizer, its vocabulary possibly
    padded to another size: :func:`fit_vocab`) growing each step's tree (a ``spec.TreeSpec``)
    level by level, in its own ``SequoiaCache``.

    Level ``l``'s nodes are forwarded in one call (they see the prefix and their ancestors through
    the packed tree mask), then the children of each expanded node are sampled without
    replacement from the draft's q (greedy: its top-k). The leaf level is not forwarded (its
    logits would go unused), so an accepted leaf has no draft cache entry: from the second step on
    the first forward also feeds the previous step's last accepted token (the *pending* token, at
    its own position before the root), which rewrites that entry. A d-level tree costs d - 1
    draft forwards. ``pending`` is a device buffer updated in place by :meth:`accept`. A 1-node
    tree (plain decoding) forwards nothing: its roots wait in ``lag`` until a tree returns, and
    the first tree step forwards them first (:meth:`_catch_up`)."""

    feature_layers = None

    def __init__(self, model, sampling, rand, cache: SequoiaCache, vocab: int, backend: str | None):
        self.model, self.sampling, self.rand = model, sampling, rand
        self.cache, self.vocab, self.backend = cache, vocab, backend
        # a draft vocabulary padded to fewer ids than the target's: the target's ids past it are read
        # as its last (the target emits them only where the padding rows have probability)
        draft_vocab = vocab_size(model)
        self.max_id = draft_vocab - 1 if draft_vocab < vocab else None
        self.pending: torch.Tensor | None = None  # [B]: set by the first accept of a tree
        self.lag: list[torch.Tensor] = []  # [B] each: roots of plain-decoding steps not forwarded yet
        self.q_rows = KeptRows(0.0)  # sampling: each step's q [B, T, V] (step_buffers.py)

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token ids as the draft reads them (its vocabulary may be padded to fewer)."""
        return ids if self.max_id is None else ids.clamp(max=self.max_id)

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, feats=None) -> None:
        self.model(self._ids(ids), **cache_kw(self.model, self.cache), position_ids=pos, use_cache=True,
                   logits_to_keep=1)  # keys
        self.cache.commit(lens)

    def propose(self, spec, root: torch.Tensor, eos, st) -> Proposal:
        """root [B] -> the tree's tokens [B, T] (-1: absent), q [B, T, V] (None when greedy), and the
        non-finite flag. With a pending token the cache's prefix_len is one less until
        :meth:`accept` / :meth:`rollback` (the pending token is node 0 of the draft's tree)."""
        B = root.shape[0]
        if spec.T == 1:  # plain decoding: nothing to draft
            return Proposal.root_only(root)
        start = st.now() if st is not None else 0.0
        if self.lag:
            self._catch_up()
        shift = 0 if self.pending is None else 1
        tokens = torch.full((B, spec.T + shift), -1, dtype=torch.int64, device=root.device)  # [B, shift + T]
        tokens[:, shift] = root
        if shift:
            tokens[:, 0] = self.pending
            self.cache.prefix_len.sub_(1)  # the pending token is rewritten at its own position
        q_all = None if self.sampling.greedy else self.q_rows.rows(B, spec.T, self.vocab, root.device)
        bad = torch.zeros((), dtype=torch.bool, device=root.device)
        try:
            for i, lv in enumerate(spec.draft_levels_pending if shift else spec.draft_levels):
                self._level(lv, tokens, q_all, bad, eos, st)
                if i == 0 and st is not None:
                    st.first_level_done(start)
        except BaseException:
            if shift:  # the draft cache as it was
                self.cache.prefix_len.add_(1)
            raise
        return Proposal(tokens[:, shift:], q_all, bad)

    def _level(self, lv, tokens: torch.Tensor, q_all: torch.Tensor | None, bad: torch.Tensor, eos, st) -> None:
        """One draft forward (level ``lv``, a ``spec.Level``): fills the next level's ``tokens``
        [B, shift + T] and the expanded nodes' rows of ``q_all`` [B, T, V] in place, ORs the
        non-finite flag into ``bad``; adds the forward's time to ``st``."""
        t0 = st.now() if st is not None else 0.0
        # absent nodes (-1) are fed as a placeholder: only their own absent descendants see them
        logits = logits_of(self.model(self._ids(tokens[:, lv.start:lv.end].clamp(min=PLACEHOLDER_ID)),
                                      use_cache=True, **cache_kw(self.model, self.cache),
                                      **self.cache.tree_inputs(lv.pos, lv.mask, offset=lv.start)))
        logits = fit_vocab(logits, self.vocab)  # [B, n, V]
        if st is not None:
            st.draft_forward_s += st.now() - t0
        bad |= nonfinite(logits)  # in place: the caller's flag
        block_eos(logits, lv.depth, eos)
        draw_children(logits[:, lv.expanded_rel], lv, tokens, q_all, self.sampling, self.rand, self.backend)

    def _catch_up(self) -> None:
        """Forward what plain-decoding steps skipped: the pending token (when there is one) and the
        roots but the last, which becomes the pending token (its slot counted, as after a tree step)."""
        seq = ([self.pending] if self.pending is not None else []) + self.lag[:-1]
        if self.pending is not None:
            self.cache.prefix_len.sub_(1)  # the pending token is rewritten at its own position
        if seq:
            g, device = len(seq), self.lag[0].device
            causal = torch.ones(g, g, dtype=torch.bool, device=device).tril()
            self.model(self._ids(torch.stack(seq, 1)), **cache_kw(self.model, self.cache), use_cache=True,
                       logits_to_keep=1,
                       **self.cache.tree_inputs(torch.arange(g, device=device), causal))  # keys only
        self.cache.commit(len(seq) + 1)
        self.pending, self.lag = self.lag[-1].clone(), []

    def accept(self, prop: Proposal, path: torch.Tensor, num: torch.Tensor, feats=None) -> None:
        """Compact the accepted nodes' entries (after the pending token's, when there was one) and
        keep the last accepted token as the next step's pending token (in place)."""
        if prop.tokens.shape[1] == 1:  # plain decoding: the root waits for the next tree
            self.lag.append(prop.tokens[:, 0].clone())
            return
        if self.pending is None:
            self.cache.accept(path, num, validate=False)
        else:  # the draft's tree: the pending token, then the plan's nodes
            self.cache.accept(torch.cat([path.new_zeros(path.shape[0], 1), path + 1], 1), num + 1, validate=False)
        last = prop.tokens.gather(1, path.gather(1, (num - 1)[:, None]).clamp(min=0))[:, 0]  # [B]
        if self.pending is None:
            self.pending = last.clone()
        else:
            self.pending.copy_(last)

    def rollback(self, prop: Proposal) -> None:
        if self.pending is not None and prop.tokens.shape[1] > 1:
            self.cache.prefix_len.add_(1)

    def keep_rows(self, idx: torch.Tensor) -> None:
        self.cache.keep_rows(idx)
        if self.pending is not None:
            self.pending = self.pending[idx].contiguous()
        self.lag = [t[idx] for t in self.lag]

    def reserve(self, positions: int) -> None:
        self.cache.grow(positions)

    def state(self) -> list[torch.Tensor]:
        return [self.cache.prefix_len] + ([self.pending] if self.pending is not None else [])
