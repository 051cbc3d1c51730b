"""The feature drafter: an EAGLE-style head (``modeling.feature_head.FeatureHead``) growing the
planner's tree from the target's own hidden states (a :class:`drafters.Drafter`).

The head at draft position ``p`` reads (feature of token ``p``, token ``p + 1``) and predicts
token ``p + 1``'s feature, from which the next token's logits are read. Per step:

1. **First forward** (static width ``W`` = the tree's depth, the longest accepted path): the
   *pending* tokens, i.e. the previous step's accepted nodes after its root followed by this
   step's root, each with the target's true feature of its predecessor (kept by :meth:`accept`
   from the target's tree forward: no second target pass). Slots past a row's pending count are
   padding: they come after the real ones in a causal mask, so no real slot sees them. The
   pending slots are then committed to the draft cache (their entries are exact: true
   features), and the root's output feature gives the root's children.
2. **Deeper levels** feed the head's own predicted feature of each node's parent (EAGLE's
   rule), in the tree's slots after the committed root, one forward per level; the leaf level
   is not forwarded. A ``d``-level tree costs ``d - 1`` head forwards, as the standalone draft.
3. :meth:`accept` keeps the accepted path's tokens and features as the next step's pending
   ones; the tree's draft entries are simply not committed (the next first forward rewrites
   the accepted ones with true features), so the draft cache needs no compaction.

Everything is updated in place in fixed-shape buffers (``state()``): the step can be captured
in a CUDA graph. Exactness does not depend on the head: verification reads its q at every node.
Children are drawn over the head's own tokens (its ``vocab_map``: the readout's rows; 8192 of the
target's 49152 for this project's head), q scattered to the target's vocabulary (0 elsewhere).
The tree may change between steps (``adaptive.Replanner``): the pending buffers grow to the
deepest tree seen; a 1-node tree (plain decoding) runs no head forward, and its roots with the
target's features wait until a tree returns (:meth:`FeatureDrafter._catch_up`).
"""

from __future__ import annotations

import torch

from sequoia_kernels.hf import SequoiaCache, cache_kw
from sequoia_kernels.tree_mask import pack_tree_mask

from .drafters import PLACEHOLDER_ID, Proposal, block_eos, draw_children, logits_of, nonfinite, q_columns
from .step_buffers import KeptRows
from .target_head import TargetHead

__all__ = ["FeatureDrafter", "second_level", "target_forward", "teacher_forced_logits"]


def target_forward(target, ids: torch.Tensor, layers: tuple[int, ...] | None, *, logits: bool | str = True,
                   cache=None, **kwargs):
    """The target's logits [B, T, V] and, when ``layers`` names some, its features [B, T, F]
    (the hidden states ``layers`` index, concatenated) from the same forward. ``logits=False``
    (a prefill): no LM head over the positions (None; without features, the last position's).
    ``logits="hidden"``: the final normed hidden states [B, T, H] instead, which the LM head
    reads (``lazy_logits``: the rows verification reads, on demand). ``cache``: the KV cache,
    passed by the keyword the target takes it by (``cache_kw``)."""
    if not layers and logits != "hidden":
        return logits_of(target(ids, **cache_kw(target, cache), **kwargs, **({} if logits else {"logits_to_keep": 1}))), None
    aux = any(i != -1 for i in layers or ())
    decoder = target.get_decoder()
    out = decoder(ids, output_hidden_states=aux, **cache_kw(decoder, cache), **kwargs)
    last = out.last_hidden_state  # [B, T, H] after the final norm: what the LM head reads
    feats = torch.cat([last if i == -1 else out.hidden_states[i] for i in layers], -1) if layers else None
    if logits == "hidden":
        return last, feats
    return (TargetHead(target)(last) if logits else None), feats


@torch.no_grad()
def teacher_forced_logits(head, target, seq: torch.Tensor, *, predicted: bool = False) -> torch.Tensor:
    """The head's logits along ``seq`` [B, N] (a dense forward, sdpa/eager attention), [B, N, V]
    over the target's vocabulary: row i is q of token i + 1 from the slots (true feature of
    token j, token j + 1), j < i (row 0: the slot (0, token 0), as for a one-token prompt), as
    the loop's first draft level reads it. ``predicted=True``: as a second level reads it, the
    last slot fed the head's own prediction of token i's feature (from the true-feature slot
    before it) instead of the target's (rows 0 and 1 as with true features)."""
    head.bind(target)
    _, feats = target_forward(target, seq, head.feature_layers)  # [B, N, F]
    B, N = seq.shape
    pos = torch.arange(N, device=seq.device).expand(B, N)
    first = head(seq[:, :1], torch.zeros_like(feats[:, :1]), fused=False, position_ids=pos[:, :1])  # [B, 1, H]
    if N == 1:
        return head.logits(first)
    rest = head(seq[:, 1:], feats[:, :-1], fused=False, position_ids=pos[:, :-1])  # [B, N - 1, H]
    if predicted and N > 2:  # rows 2 .. N - 1 as a second level reads them
        rest = torch.cat([rest[:, :1], second_level(head, seq[:, 1:], feats[:, :-1], rest, pos[:, :-1])], 1)
    return head.logits(torch.cat([first, rest], 1))


def second_level(head, ids: torch.Tensor, feats: torch.Tensor, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Dense slots read as a tree's second level reads them. Slot j holds token ``ids[:, j]``
    with the target's feature ``feats[:, j]`` of its predecessor and gave ``h[:, j]`` (the
    head's prediction of token j's feature; ``pos`` [B, S] its position). Returns [B, S - 1, H]:
    slot j >= 1 fed ``h[:, j - 1]`` instead of its true feature, seeing the true slots 0 .. j - 1
    and itself (one dense forward of 2S - 1 slots, a mask per query)."""
    B, S = ids.shape
    j = torch.arange(S - 1, device=ids.device)
    see = torch.zeros(2 * S - 1, 2 * S - 1, dtype=torch.bool, device=ids.device)
    see[:S, :S] = torch.ones(S, S, dtype=torch.bool, device=ids.device).tril()
    see[S + j[:, None], j[None, :]] = j[None, :] <= j[:, None]  # true slots 0 .. j
    see[S + j, S + j] = True
    if head.kind == "eagle3":  # fused: every slot's input H wide
        x, fused = torch.cat([head.fc(feats), h[:, :-1]], 1), True
    else:  # raw: the predictions as the final feature (zeros for earlier layers)
        x, fused = torch.cat([feats, head.own_features(h[:, :-1])], 1), False
    out = head(torch.cat([ids, ids[:, 1:]], 1), x, fused=fused, position_ids=torch.cat([pos, pos[:, 1:]], 1),
               attention_mask=see[None, None].expand(B, 1, -1, -1))
    return out[:, S:]


class FeatureDrafter:
    """A ``FeatureHead`` over each step's tree (module docstring), for ``batch`` rows; ``width``:
    the pending buffers' first width (the deepest tree expected: they grow when a deeper one comes)."""

    def __init__(self, head, sampling, rand, cache: SequoiaCache, vocab: int, backend: str | None, batch: int,
                 width: int, device: torch.device):
        self.head, self.sampling, self.rand = head, sampling, rand
        self.cache, self.vocab, self.backend = cache, vocab, backend
        self.feature_layers = head.feature_layers
        # the head's tokens: target id of each draft id [Vd] (None: the target's whole vocabulary),
        # and back [V] (-1: not a draft token)
        self.ids = None if head.vocab_map is None else head.vocab_map.to(device)
        if self.ids is not None:
            self._to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=device)
            self._to_draft[self.ids] = torch.arange(self.ids.numel(), device=device)
            self._to_target = torch.cat([self.ids, self.ids.new_full((1,), -1)])  # [Vd + 1]: -1 stays -1
        self._q_cols: dict[int, tuple] = {}  # per level (by id, the level kept): its q_columns
        self.device, self.width = device, 0
        self.q_rows = KeptRows(0.0)  # sampling: each step's q [B, T, V], 0 off the head's tokens (step_buffers.py)
        self.tokens = torch.zeros(batch, 0, dtype=torch.int64, device=device)  # [B, W] pending tokens
        self.feats = torch.zeros(batch, 0, head.feature_width, dtype=head.fc.weight.dtype,
                                 device=device)  # [B, W, F] predecessors'
        self.count = torch.ones(batch, dtype=torch.int64, device=device)  # [B] pending tokens (the root's slot too)
        self._single = True  # every row's count is 1 (known on the host: after a prefill, plain steps, peeks)
        self._grow(width)
        self._levels: dict[int, tuple] = {}  # (spec, its deeper levels) of each tree seen, by id of the spec kept
        self.lag: list[tuple[torch.Tensor, torch.Tensor]] = []  # plain-decoding roots [B] and features [B, F]

    def _grow(self, W: int) -> None:
        """The pending buffers at least ``W`` wide (new buffers: a captured graph is re-captured)."""
        if W <= self.width:
            return
        B, old = self.tokens.shape[0], self.width
        tokens, feats = self.tokens.new_zeros(B, W), self.feats.new_zeros(B, W, self.feats.shape[-1])
        tokens[:, :old], feats[:, :old] = self.tokens, self.feats
        self.tokens, self.feats, self.width = tokens, feats, W
        self.slots = torch.arange(W, device=self.device)  # [W]
        self.causal = pack_tree_mask(torch.ones(W, W, dtype=torch.bool, device=self.device).tril())

    def levels(self, spec) -> list:
        """``spec``'s deeper levels: the tree's nodes 1.. in the slots after the committed root (its
        column dropped), with their depths and packed masks."""
        seen = self._levels.get(id(spec))
        if seen is None:  # the spec is kept with them: its id names no other while cached
            mask = torch.from_numpy(spec.plan.mask()).to(self.device)  # [T, T] ancestor-or-self
            seen = self._levels[id(spec)] = (spec, [(lv, lv.depth - 1, pack_tree_mask(mask[lv.start:lv.end, 1:lv.end]))
                                                    for lv in spec.draft_levels[1:]])
        return seen[1]

    def prefill(self, ids: torch.Tensor, pos: torch.Tensor, lens: torch.Tensor, feats=None) -> None:
        """ids [B, S] (each row's prompt but its last token, ``lens`` [B] long), feats [B, S, F]:
        the draft reads (feature of token p, token p + 1) for p < lens - 1; the root's pending
        feature is the last prompt token's (zeros for a one-token prompt)."""
        if ids.shape[1] > 1:
            self.head(ids[:, 1:], feats[:, :-1], fused=False, position_ids=pos[:, :-1], past_key_values=self.cache,
                      use_cache=True)
            self.cache.commit((lens - 1).clamp(min=0))
        last = feats.gather(1, (lens - 1).clamp(min=0)[:, None, None].expand(-1, 1, feats.shape[-1]))[:, 0]
        self.feats[:, 0] = last * (lens > 0)[:, None]

    def propose(self, spec, root: torch.Tensor, eos, st) -> Proposal:
        B = root.shape[0]
        if spec.T == 1:  # plain decoding: nothing to draft
            return Proposal.root_only(root)
        self._grow(spec.plan.num_levels)
        start = t0 = st.now() if st is not None else 0.0
        h = self._first_forward(root)  # [B, H]: the root's output
        hidden = h.new_empty(B, spec.T, h.shape[-1])  # [B, T, H]: each node's predicted feature
        hidden[:, 0] = h
        tokens = torch.full((B, spec.T), -1, dtype=torch.int64, device=root.device)  # [B, T]
        tokens[:, 0] = root
        q_all = None if self.sampling.greedy else self.q_rows.rows(B, spec.T, self.vocab, root.device)
        bad = torch.zeros((), dtype=torch.bool, device=root.device)
        try:
            self._children(spec.draft_levels[0], hidden[:, :1], tokens, q_all, bad, eos, st, t0)
            if st is not None:
                st.first_level_done(start)
            for lv, pos, mask in self.levels(spec):
                t0 = st.now() if st is not None else 0.0
                h = self.head(tokens[:, lv.start:lv.end].clamp(min=PLACEHOLDER_ID), hidden[:, spec.parents[lv.start:lv.end]],
                              fused=True, past_key_values=self.cache, use_cache=True,
                              **self.cache.tree_inputs(pos, mask, offset=lv.start - 1))
                hidden[:, lv.start:lv.end] = h
                self._children(lv, h[:, lv.expanded_rel], tokens, q_all, bad, eos, st, t0)
        except BaseException:
            self.rollback(None)
            raise
        return Proposal(tokens, q_all, bad)

    def _children(self, lv, h, tokens, q_all, bad, eos, st, t0) -> None:
        """The children of level ``lv``'s expanded nodes from their predicted features h [B, m, H]."""
        logits = self.head.draft_logits(h)  # [B, m, Vd]: over the head's own tokens (target ids: self.ids)
        if st is not None:
            st.draft_forward_s += st.now() - t0
        bad |= nonfinite(logits)
        block_eos(logits, lv.depth[lv.expanded_rel], self._draft_eos(eos))
        draw_children(logits, lv, tokens, q_all, self.sampling, self.rand, self.backend, self._vocab_map(lv))

    def _vocab_map(self, lv) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``draw_children``'s map of the head's tokens to the target's for level ``lv``."""
        if self.ids is None:
            return None
        hit = self._q_cols.get(id(lv))
        if hit is None or hit[0] is not lv:  # (the level is held: its id names no other meanwhile)
            if len(self._q_cols) >= 64:  # the trees of a long re-planned call: not all kept
                self._q_cols.clear()
            hit = self._q_cols[id(lv)] = (lv, q_columns(lv.expanded_node, self.ids, self.vocab))
        return self._to_target, hit[1]

    def _draft_eos(self, eos):
        """min_new_tokens' (eos ids, remaining) with the ids as the head's own (those it has)."""
        if eos is None or self.ids is None:
            return eos
        ids = self._to_draft[eos[0]]
        return ids[ids >= 0], eos[1]

    def _first_forward(self, root: torch.Tensor) -> torch.Tensor:
        """The root's output [B, H] after the pending slots and what plain-decoding steps skipped:
        all in one forward when every row's pending count is 1 (after plain steps and peeks: the
        pending slot is the first skipped root's), else :meth:`_catch_up`, then the pending slots."""
        if self.lag and self._single:
            toks = torch.stack([t for t, _ in self.lag] + [root], 1)  # [B, g + 1]
            fts = torch.cat([self.feats[:, :1], torch.stack([f for _, f in self.lag], 1).to(self.feats.dtype)], 1)
            self.lag = []
            h = self._chain_forward(toks, fts)  # [B, g + 1, H]; the root's slot committed as the pending one
            self.feats[:, 0] = fts[:, -1]  # (rollback takes it back: count 1)
            return h[:, -1]
        if self.lag:
            self._catch_up()
        h = self._pending_forward(root)  # [B, W, H]
        return h.gather(1, (self.count - 1)[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0]

    def _pending_forward(self, root: torch.Tensor) -> torch.Tensor:
        """The pending slots with ``root`` [B] after them, forwarded and committed (their entries
        are exact: kept, undone by rollback); the head's output [B, W, H]."""
        pending = self.tokens.scatter(1, (self.count - 1)[:, None], root[:, None])  # [B, W]
        h = self.head(pending, self.feats, fused=False, past_key_values=self.cache, use_cache=True,
                      **self.cache.tree_inputs(self.slots, self.causal))
        self.cache.commit(self.count)
        return h

    def _chain_forward(self, toks: torch.Tensor, fts: torch.Tensor) -> torch.Tensor:
        """``toks`` [B, n], each after the one before, with their predecessors' features ``fts``
        [B, n, F]: forwarded causally after the cache and committed; the head's output [B, n, H]."""
        n = toks.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        h = self.head(toks, fts, fused=False, past_key_values=self.cache, use_cache=True,
                      **self.cache.tree_inputs(torch.arange(n, device=self.device), causal))
        self.cache.commit(n)
        return h

    def _catch_up(self) -> None:
        """Forward what plain-decoding steps skipped: the pending slots with the first skipped root,
        then each later skipped root with its predecessor's feature; the last root's feature is
        left pending for this step's root."""
        toks = torch.stack([t for t, _ in self.lag], 1)  # [B, g]
        fts = torch.stack([f for _, f in self.lag], 1).to(self.feats.dtype)  # [B, g, F]
        self.lag = []
        self._pending_forward(toks[:, 0])
        if toks.shape[1] > 1:
            self._chain_forward(toks[:, 1:], fts[:, :-1])
        self.feats[:, 0] = fts[:, -1]
        self.count.fill_(1)
        self._single = True

    def accept(self, prop: Proposal, path: torch.Tensor, num: torch.Tensor, feats=None) -> None:
        """The accepted nodes after the root become the next pending tokens (the next root goes
        after them), each with the target's feature of its predecessor on the path."""
        if prop.tokens.shape[1] == 1:  # plain decoding: the root and its feature wait for the next tree
            self.lag.append((prop.tokens[:, 0].clone(), feats[:, 0].clone()))
            return
        W, F = min(self.width, path.shape[1]), self.feats.shape[-1]
        p = path[:, :W].clamp(min=0)  # [B, W]: accepted nodes, the root first
        self.tokens[:, :W - 1].copy_(prop.tokens.gather(1, p[:, 1:]).clamp(min=PLACEHOLDER_ID))
        self.feats[:, :W].copy_(feats.gather(1, p[..., None].expand(-1, -1, F)))
        self.count.copy_(num)
        self._single = path.shape[1] == 1  # a plain step's path (a peek's star): the root alone

    def rollback(self, prop) -> None:
        if prop is None or prop.tokens.shape[1] > 1:
            self.cache.prefix_len.sub_(self.count.to(self.cache.prefix_len.dtype))

    def reserve(self, positions: int) -> None:
        self.cache.grow(positions)

    def keep_rows(self, idx: torch.Tensor) -> None:
        self.cache.keep_rows(idx)
        self.tokens, self.feats, self.count = (t[idx].contiguous() for t in (self.tokens, self.feats, self.count))
        self.lag = [(t[idx], f[idx]) for t, f in self.lag]

    def state(self) -> list[torch.Tensor]:
        return [self.cache.prefix_len, self.tokens, self.feats, self.count]
