"""DraftLM (the reduced-vocabulary draft wrapper) on a tiny inner Llama: id mapping, save/load,
and use as the draft of the decoding loop (greedy output identical to the target's)."""

import torch

from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.modeling.draft import DraftLM, build_draft_llama
from sequoia_decoding.planner import plan_tree

from test_generate import VOCAB, greedy_reference, tiny_llama


def tiny_draft(seed=0, kept=(3, 5, 7, 11, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59)) -> DraftLM:
    torch.manual_seed(seed)
    inner = build_draft_llama(len(kept), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=16, intermediate_size=64,
                              max_position_embeddings=256)
    return DraftLM(inner, torch.tensor(kept), full_vocab_size=VOCAB).eval()


def test_ids_and_logits_map_between_vocabularies():
    d = tiny_draft()
    ids = torch.tensor([[3, 4, 59, 0]])
    assert d.to_draft_ids(ids).tolist() == [[0, d.unk_id, 14, d.unk_id]]
    with torch.no_grad():
        logits = d(ids).logits  # [1, 4, VOCAB]
    assert logits.shape == (1, 4, VOCAB)
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[d.draft_to_full] = True
    assert torch.isinf(logits[..., ~kept]).all() and torch.isfinite(logits[..., kept]).all()


def test_save_load_round_trip(tmp_path):
    d = tiny_draft()
    d.save(tmp_path / "draft")
    e = DraftLM.load(tmp_path / "draft")
    ids = torch.tensor([[3, 5, 9, 7]])
    with torch.no_grad():
        torch.testing.assert_close(e(ids).logits, d(ids).logits, atol=5e-3, rtol=5e-3)  # fp16 weights


def test_reduced_vocab_draft_in_the_decoding_loop():
    """Tokens outside the draft's vocabulary have q = 0 and are never drafted; verification stays
    exact, so greedy output still equals the target's own greedy decoding."""
    target = tiny_llama(0)
    prompt = [3, 17, 5, 9]
    gen = SequoiaGenerator(target, tiny_draft(), plan_tree([0.5, 0.2, 0.1], 10, 4), SamplingParams(), max_length=96)
    assert gen.generate([prompt], max_new_tokens=16, eos_token_id=[]).tokens[0] == greedy_reference(target, prompt, 16)
    sampled = SequoiaGenerator(target, tiny_draft(), plan_tree([0.5, 0.2, 0.1], 10, 4),
                               SamplingParams(temperature=1.0, seed=0), max_length=96)
    assert len(sampled.generate([prompt], max_new_tokens=16, eos_token_id=[]).tokens[0]) == 16
