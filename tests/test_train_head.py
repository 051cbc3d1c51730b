"""scripts/draft/train_head.py's data and objective on a tiny target: the labels it stores are
the target's (features, next-token top-k), and a few optimiser steps on its loss make a head
agree with the target where it did not."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import tiny_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "draft"))

import train_head  # noqa: E402
from sequoia_decoding.loading import load_draft  # noqa: E402
from sequoia_decoding.modeling.feature_head import FeatureHead  # noqa: E402


def test_labels_losses_and_a_head_that_learns(tmp_path):
    target = tiny_models.tiny_llama(0, vocab=61, layers=2, sharpen=4.0)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 61, (40,), generator=g).tolist() for _ in range(6)]
    recs = train_head.label(target, seqs, k=8)
    with torch.no_grad():
        out = target(torch.tensor([seqs[0]]))
        feats = target.model(torch.tensor([seqs[0]])).last_hidden_state[0]
    assert recs[0]["topk_ids"][:, 0].tolist() == out.logits[0].argmax(-1).tolist()
    np.testing.assert_allclose(recs[0]["feats"], feats.numpy(), atol=2e-3, rtol=2e-3)  # fp16 storage
    arrays = {k: np.concatenate([r[k] for r in recs]) for k in recs[0]}
    arrays["offsets"] = np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64)
    arrays["prompt_lens"] = np.full(len(seqs), 4, np.int64)
    np.savez(tmp_path / "shard-00000.npz", **arrays)

    c = target.config
    torch.manual_seed(0)
    head = FeatureHead(dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, vocab_size=61, max_position_embeddings=256))
    head.bind(target)
    windows = train_head.Windows([tmp_path / "shard-00000.npz"], torch.arange(61))
    assert windows.tokens == 240
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=1e-2)
    b = windows.batch(random.Random(0), 6, 40)
    first = None
    for _ in range(150):
        out = train_head.head_losses(head, b, 0.0, second=True)
        reg, ce, agree, valid = out[:4]
        reg, ce, agree = (train_head.mean(x, valid) for x in (reg, ce, agree))
        reg2, ce2, agree2 = (train_head.mean(x, out[7]) for x in out[4:7])
        first = first or (reg.item(), agree.item(), agree2.item())
        opt.zero_grad()
        (reg + ce + 0.5 * (reg2 + ce2)).backward()
        opt.step()
    # the teacher's top-1 learnt (from ~1/61), the features regressed (the soft CE stops at the
    # teacher's entropy: not a criterion)
    assert first[1] < 0.1 and agree.item() > 0.8, (first, agree)
    assert reg.item() < 0.5 * first[0], (first, reg)
    # read as a tree's second level reads it (its own predicted feature), learnt as well
    assert first[2] < 0.1 and agree2.item() > 0.6, (first, agree2)
    # ... and that reading is measure-acceptance's --head-level 2 (teacher_forced_logits)
    from sequoia_decoding.feature_drafter import teacher_forced_logits

    with torch.no_grad():
        seq = torch.tensor([seqs[1]])
        q2 = teacher_forced_logits(head, target, seq, predicted=True)[0]  # [N, V]
        one = {k: v[40:80][None] for k, v in windows.seqs[1][0].items()}
        a2 = train_head.head_losses(head, one, 0.0, second=True)[6][0]  # slots 1 .. 37: rows 2 .. 38
    teacher = torch.tensor(recs[1]["topk_ids"][:, 0].astype("int64"))
    assert torch.equal(a2, (q2[2:39].argmax(-1) == teacher[2:39]))


def test_rows_are_drawn_from_the_pools_by_their_shares(tmp_path):
    """``draw_rows``: each row's pool is drawn by its share (answers / drafted / corpus), and every
    batch holds at least one row of the target's own answers."""
    pools = []
    for k, share in enumerate((0.5, 0.3, 0.2)):
        n, L = 4, 12
        arrays = dict(tokens=np.full(n * L, 10 * k, np.uint16), feats=np.zeros((n * L, 4), np.float16),
                      topk_ids=np.zeros((n * L, 2), np.int64), topk_logits=np.zeros((n * L, 2), np.float32),
                      lse=np.zeros(n * L, np.float32), offsets=np.arange(0, n * L + 1, L, dtype=np.int64),
                      prompt_lens=np.zeros(n, np.int64))
        np.savez(tmp_path / f"p{k}.npz", **arrays)
        pools.append((f"pool{k}", train_head.Windows([tmp_path / f"p{k}.npz"], torch.arange(61)), share))
    rng, rows = random.Random(0), torch.zeros(3)
    for _ in range(400):
        b = train_head.draw_rows(pools, rng, 8, 6)
        firsts = b["tokens"][:, 0] // 10  # [8]: each row's pool
        assert b["tokens"].shape == (8, 6) and (firsts == 0).any()
        rows += torch.bincount(firsts, minlength=3)
    share = rows / rows.sum()
    assert torch.allclose(share, torch.tensor([0.5, 0.3, 0.2]), atol=0.03), share
    only = [pools[0]]
    assert (train_head.draw_rows([(n, w, 1.0) for n, w, _ in only], rng, 3, 6)["tokens"] == 0).all()


def test_init_from_an_exported_head_folder(tmp_path):
    """``--init-from`` an exported head (fp16, a prefix of the vocabulary) copies its trained
    weights (fc, the layer) into a run's head, whatever the vocabularies; not the readout."""
    target = tiny_models.tiny_llama(1, vocab=61, layers=2)
    c = target.config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
               num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=61,
               max_position_embeddings=256, bias=True)
    torch.manual_seed(1)
    src = FeatureHead(dict(cfg, draft_vocab_size=20), "eagle1")
    src.d2t.copy_(torch.arange(20) * 2 - torch.arange(20))  # draft id i -> target id 2 i
    src.save(tmp_path / "head")
    torch.manual_seed(2)
    dst = FeatureHead(dict(cfg, draft_vocab_size=30), "eagle1")
    d2t = dst.d2t.clone()
    train_head.init_from(dst, tmp_path / "head")
    for k, v in src.state_dict().items():
        if k.startswith(("fc.", "layers.")):
            assert torch.equal(dst.state_dict()[k], v.half().float()), k
    assert torch.equal(dst.d2t, d2t)  # the run's own vocabulary
    torch.save({"head": dst.state_dict()}, tmp_path / "last.pt")  # a checkpoint still works
    other = FeatureHead(dict(cfg, draft_vocab_size=30), "eagle1")
    train_head.init_from(other, tmp_path / "last.pt")
    assert all(torch.equal(other.state_dict()[k], v) for k, v in dst.state_dict().items())


def test_training_prompts_mix_raw_code_in(monkeypatch, tmp_path):
    """``data --raw-frac``: that share of the prompts is raw Python cut from the standard library
    (to continue, as the held-out raw prompts), the rest chat; ``--task-frac``: that share of the
    chat everyday tasks; deterministic; none held out."""
    files = train_head.draft_data.stdlib_files()[:40]  # a few files: parsing all of them takes a minute
    monkeypatch.setattr(train_head.draft_data, "stdlib_files", lambda: files)
    a = train_head.training_prompts(3, 400, raw_frac=0.3)
    assert a == train_head.training_prompts(3, 400, raw_frac=0.3)
    raw = [p for p in a if p["kind"] == "raw"]
    assert len(a) == 400 and 0.22 < len(raw) / len(a) < 0.38
    assert all(p["text"].strip() for p in raw) and all(p["kind"] == "chat" for p in a if p not in raw)
    held = {p["text"].strip() for p in train_head.read_prompts(train_head.draft_data.HELDOUT_REPO)}
    assert not held & {p["text"].strip() for p in a}
    assert all(p["kind"] == "chat" for p in train_head.training_prompts(3, 50))  # the default: chat only
    tasks = {train_head.draft_data.task_prompt(__import__("random").Random(s)) for s in range(2000)}
    mixed = train_head.training_prompts(3, 400, raw_frac=0.3, task_frac=0.5)
    chat = [p["text"] for p in mixed if p["kind"] == "chat"]
    assert mixed == train_head.training_prompts(3, 400, raw_frac=0.3, task_frac=0.5)
    assert 0.38 < sum(t in tasks for t in chat) / len(chat) < 0.62 and not held & set(chat)
    assert not any(p["text"] in tasks for p in a)  # no tasks unless asked
    more = {train_head.draft_data.task_prompt(__import__("random").Random(s), 2) for s in range(4000)}
    assert len(more) > 1.5 * len(tasks) and len(more & tasks) > 0.6 * len(tasks)  # the second set: the first and more
    both = train_head.training_prompts(3, 400, raw_frac=0.3, task_frac=0.5, task_set=2)
    chat2 = [p["text"] for p in both if p["kind"] == "chat"]
    assert any(t in more - tasks for t in chat2) and not held & set(chat2)
    assert mixed == train_head.training_prompts(3, 400, raw_frac=0.3, task_frac=0.5, task_set=1)  # unchanged


def test_train_holds_out_the_shards_asked(tmp_path, monkeypatch, capsys):
    """``train --held-out 4``: shard 4 is the held-out set (its tokens in none of the training
    pools), the others train; a held-out shard that does not exist is refused."""
    from safetensors.torch import save_file

    target = tiny_models.tiny_llama(0, vocab=61, layers=2, sharpen=4.0)
    g = torch.Generator().manual_seed(2)
    tokens = {}
    for i, n in ((0, 3), (4, 2), (7, 4)):
        seqs = [torch.randint(0, 61, (24,), generator=g).tolist() for _ in range(n)]
        tokens[i] = train_head.write_shard(tmp_path / f"shard-{i:05d}.npz", train_head.label(target, seqs, k=8), [4] * n)
    save_file({"draft_to_full": torch.randperm(61, generator=g)}, str(tmp_path / "vocab.safetensors"))
    monkeypatch.setattr(train_head, "VOCAB_FILE", tmp_path / "vocab.safetensors")
    monkeypatch.setattr(train_head, "load_target", lambda **kw: (target, None))
    common = ["--data-dir", str(tmp_path), "train", "--steps", "2", "--rows", "2", "--length", "16", "--vocab", "40",
              "--chat-frac", "1.0", "--log-every", "1", "--ckpt-dir", str(tmp_path / "ck")]
    train_head.main(common + ["--held-out", "4", "--export", str(tmp_path / "head")])
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "head" / "config.json").read_text())["sequoia"]["args"]["held_out"] == [4]
    assert f"answers: {tokens[0] + tokens[7]} tokens in 7 sequences (100% of rows); held out: {tokens[4]}" in out
    assert "step 2/2" in out
    with pytest.raises(SystemExit, match=r"need the held-out shards \[9\]"):
        train_head.main(common + ["--held-out", "9", "--ckpt-dir", str(tmp_path / "ck2")])
    with pytest.raises(SystemExit, match=r"need the held-out shards \[0, 9\]"):  # one of them missing
        train_head.main(common + ["--held-out", "0,9", "--ckpt-dir", str(tmp_path / "ck2")])


def test_keep_best_holds_the_best_held_out_weights(tmp_path):
    head = torch.nn.Linear(3, 2)
    path = tmp_path / "best.pt"
    for step, agree in ((50, 0.30), (100, 0.35), (150, 0.33)):
        with torch.no_grad():
            head.weight.fill_(step)
        train_head.keep_best(head, path, step, agree)
    best = torch.load(path, weights_only=False)
    assert (best["step"], best["held_out"]) == (100, 0.35) and bool((best["head"]["weight"] == 100).all())


def test_a_head_reading_more_layers_relabels_and_starts_as_the_one_reading_fewer(tmp_path, monkeypatch):
    """``relabel --feature-layers 1,-1``: the shard keeps its tokens and labels, its features are
    the states entering layer 1 and the final one (the final exactly as before); ``Windows``
    refuses shards of other layers; ``--init-from`` a one-layer head gives the wider head the
    same losses (its fc columns for layer 1 zero), and a head reading other layers is refused."""
    target = tiny_models.tiny_llama(0, vocab=61, layers=3, sharpen=4.0)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 61, (30,), generator=g).tolist() for _ in range(4)]
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    train_head.write_shard(src / "shard-00000.npz", train_head.label(target, seqs, k=8), [5] * 4)
    monkeypatch.setattr(train_head, "load_target", lambda **kw: (target, None))
    train_head.main(["--data-dir", str(dst), "relabel", "--from", str(src), "--feature-layers", "1,-1"])
    a, b = np.load(src / "shard-00000.npz"), np.load(dst / "shard-00000.npz")
    assert list(b["feature_layers"]) == [1, -1] and b["feats"].shape == (120, 2 * target.config.hidden_size)
    for k in ("tokens", "topk_ids", "topk_logits", "lse", "offsets", "prompt_lens"):
        assert np.array_equal(a[k], b[k]), k
    H = target.config.hidden_size
    assert np.array_equal(b["feats"][:, H:], a["feats"])
    with torch.no_grad():
        enter1 = target.model(torch.tensor([seqs[2]]), output_hidden_states=True).hidden_states[1][0]
    np.testing.assert_allclose(b["feats"][60:90, :H], enter1.numpy(), rtol=2e-3, atol=2e-3)
    with pytest.raises(SystemExit, match=r"layers \[1, -1\].*reads \[-1\]"):
        train_head.Windows([dst / "shard-00000.npz"], torch.arange(61))

    c = target.config
    cfg = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=61, max_position_embeddings=256, bias=True)
    torch.manual_seed(3)
    one = FeatureHead(cfg, "eagle1")
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0, 0.2)
    one.save(tmp_path / "one", dtype=torch.float32)
    wide = FeatureHead(cfg, "eagle1", feature_layers=(1, -1))
    train_head.init_from(wide, tmp_path / "one")
    for h in (one, wide):
        h.bind(target)
    batch_one = train_head.Windows([src / "shard-00000.npz"], torch.arange(61)).batch(random.Random(0), 3, 30)
    batch_wide = train_head.Windows([dst / "shard-00000.npz"], torch.arange(61), (1, -1)).batch(random.Random(0), 3, 30)
    with torch.no_grad():
        lo = train_head.head_losses(one, batch_one, 0.0, second=True)
        lw = train_head.head_losses(wide, batch_wide, 0.0, second=True)
    for x, y in zip(lo, lw):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    wide.save(tmp_path / "wide")
    with pytest.raises(SystemExit, match="cannot start a head reading layers"):
        train_head.init_from(FeatureHead(cfg, "eagle1", feature_layers=(2, -1)), tmp_path / "wide")


def test_answers_from_the_loop_are_hugging_faces_greedy_ones_in_prompt_order():
    """``answer_in_loop`` (the data command's ``--generator loop``): prompts grouped by length, each
    answer back at its prompt's index, cut after the first EOS as ``answer`` cuts it."""
    target = tiny_models.tiny_llama(8, vocab=61, layers=2, sharpen=4.0)  # (ids 0 and 2 are EOS)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (int(n),), generator=g).tolist() for n in (9, 3, 14, 5, 7, 12, 4)]
    want = train_head.answer(target, prompts, 24, 0.0, seed=0)
    got = train_head.answer_in_loop(target, prompts, 24, 0.0, seed=0, group=3)
    assert got == want
    ended = [a for a in want if len(a) < 24]
    assert len(ended) >= 3 and all(a[-1] in train_head.draft_data.EOS_IDS for a in ended)


def test_a_head_with_its_own_readout_starts_as_the_target_rows_trains_and_exports_a_prefix(tmp_path, monkeypatch):
    """``train --own-readout``: the head's readout rows start as the target's LM head rows of its
    tokens (the same losses as a head borrowing them), are trained (the target's stay as they
    were), and are exported as ``lm_head.weight`` cut to ``--export-vocab`` rows, which
    ``load_draft`` reads back as a head of its own readout; ``--init-from`` it copies them."""
    from safetensors.torch import save_file

    target = tiny_models.tiny_llama(0, vocab=61, layers=2, sharpen=4.0)
    g = torch.Generator().manual_seed(3)
    for i, n in ((0, 3), (1, 2)):
        seqs = [torch.randint(0, 61, (24,), generator=g).tolist() for _ in range(n)]
        train_head.write_shard(tmp_path / f"shard-{i:05d}.npz", train_head.label(target, seqs, k=8), [4] * n)
    kept = torch.randperm(61, generator=g)
    save_file({"draft_to_full": kept}, str(tmp_path / "vocab.safetensors"))
    monkeypatch.setattr(train_head, "VOCAB_FILE", tmp_path / "vocab.safetensors")
    monkeypatch.setattr(train_head, "load_target", lambda **kw: (target, None))
    borrowed, own = (train_head.build_head(target, 40, own_readout=o) for o in (False, True))
    assert not borrowed.own_readout and own.own_readout and own._readout is None
    assert torch.equal(own.lm_head.weight, target.lm_head.weight[kept[:40]])
    own.load_state_dict(borrowed.state_dict(), strict=False)
    batch = train_head.Windows([tmp_path / "shard-00000.npz"], train_head.draft_index(borrowed)).batch(
        random.Random(0), 2, 20)
    with torch.no_grad():
        for x, y in zip(train_head.head_losses(borrowed, batch, 0.0, True), train_head.head_losses(own, batch, 0.0, True)):
            torch.testing.assert_close(x, y)
    before = target.lm_head.weight.clone()
    train_head.main(["--data-dir", str(tmp_path), "train", "--steps", "3", "--rows", "2", "--length", "16", "--vocab",
                     "40", "--chat-frac", "1.0", "--log-every", "3", "--lr", "1e-2", "--ckpt-dir", str(tmp_path / "ck"),
                     "--held-out", "1", "--own-readout", "--export", str(tmp_path / "head"), "--export-vocab", "25"])
    assert torch.equal(target.lm_head.weight, before)
    trained = torch.load(tmp_path / "ck" / "last.pt", weights_only=False)["head"]["lm_head.weight"]  # [40, H]
    assert not torch.allclose(trained, before[kept[:40]])
    head = load_draft(str(tmp_path / "head"))
    assert isinstance(head, FeatureHead) and head.own_readout and head.draft_vocab_size == 25
    assert torch.equal(head.lm_head.weight, trained[:25].half().float())
    assert torch.equal(head.token_ids(), kept[:25])
    run = train_head.build_head(target, 40, own_readout=True)
    train_head.init_from(run, tmp_path / "head")
    assert torch.equal(run.lm_head.weight[:25], trained[:25].half().float())
    assert torch.equal(run.lm_head.weight[25:], target.lm_head.weight[kept[25:40]])
    other = train_head.build_head(target, 40, own_readout=True)
    with torch.no_grad():
        other.d2t.copy_(kept.flip(0)[:40] - torch.arange(40))  # rows for other tokens
    with pytest.raises(SystemExit, match="readout rows are for other tokens"):
        train_head.init_from(other, tmp_path / "head")


def test_a_deeper_head_trains_exports_and_starts_as_the_shallower_one(tmp_path, monkeypatch):
    """``train --head-layers 2``: the added layer starts as the identity (both residual branches
    zero), so ``--init-from`` a trained one-layer head gives the same losses; a few steps move
    the new layer, which learns at ``--added-lr`` (a param group of its own, kept in the
    checkpoint); the export loads back with its two layers; a head of more layers than the run's
    is refused."""
    from safetensors.torch import save_file

    target = tiny_models.tiny_llama(0, vocab=61, layers=2, sharpen=4.0)
    g = torch.Generator().manual_seed(4)
    for i, n in ((0, 3), (1, 2)):
        seqs = [torch.randint(0, 61, (24,), generator=g).tolist() for _ in range(n)]
        train_head.write_shard(tmp_path / f"shard-{i:05d}.npz", train_head.label(target, seqs, k=8), [4] * n)
    save_file({"draft_to_full": torch.randperm(61, generator=g)}, str(tmp_path / "vocab.safetensors"))
    monkeypatch.setattr(train_head, "VOCAB_FILE", tmp_path / "vocab.safetensors")
    monkeypatch.setattr(train_head, "load_target", lambda **kw: (target, None))
    one = train_head.build_head(target, 40)
    with torch.no_grad():
        for p in one.parameters():
            p.add_(0.1 * torch.randn_like(p))
    one.save(tmp_path / "one", dtype=torch.float32)
    deep = train_head.build_head(target, 40, head_layers=2)
    assert len(deep.layers) == 2 and not deep.layers[1].self_attn.o_proj.weight.any()
    train_head.init_from(deep, tmp_path / "one")
    batch = train_head.Windows([tmp_path / "shard-00000.npz"], train_head.draft_index(one)).batch(
        random.Random(0), 2, 20)
    with torch.no_grad():
        for x, y in zip(train_head.head_losses(one, batch, 0.0, True), train_head.head_losses(deep, batch, 0.0, True)):
            torch.testing.assert_close(x, y)
    train_head.main(["--data-dir", str(tmp_path), "train", "--steps", "3", "--rows", "2", "--length", "16", "--vocab",
                     "40", "--chat-frac", "1.0", "--log-every", "3", "--lr", "1e-2", "--ckpt-dir", str(tmp_path / "ck"),
                     "--held-out", "1", "--head-layers", "2", "--init-from", str(tmp_path / "one"),
                     "--added-lr", "5e-2", "--export", str(tmp_path / "head")])
    ck = torch.load(tmp_path / "ck" / "last.pt", weights_only=False)
    assert ck["inherited"] == 1 and [g["scale"] for g in ck["opt"]["param_groups"]] == [1.0, 5.0]
    assert len(ck["opt"]["param_groups"][1]["params"]) == len(list(deep.layers[1].parameters()))
    trained = ck["head"]
    assert trained["layers.1.self_attn.o_proj.weight"].any() and trained["layers.1.mlp.down_proj.weight"].any()
    head = load_draft(str(tmp_path / "head"))
    assert isinstance(head, FeatureHead) and len(head.layers) == 2
    assert torch.equal(head.layers[1].mlp.down_proj.weight, trained["layers.1.mlp.down_proj.weight"].half().float())
    with pytest.raises(SystemExit, match="has 2 decoder layers, this run's head 1"):
        train_head.init_from(train_head.build_head(target, 40), tmp_path / "head")
