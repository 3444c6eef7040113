"""KVzip's scores as its paper computes them (``kvcache.hf.kvzip``), against a reference written from
the equations: Hugging Face's eager attention (``output_attentions``) over the context and one
reconstruction pass, each query row's weights renormalised over the keys KVzip scores with (the
sinks, the pass's chunk of context and the pass's own tokens: a softmax over a subset of the keys
is the full softmax divided by the subset's share), the chunk's columns maximised over the pass's
queries and a KV head's query heads. Tolerance float32: both take the same logits' softmax, ours
from the recorded query rows and stored keys."""

from __future__ import annotations

import pytest
import torch

import kvcache
from helpers import model_for, prompt
from kvcache import cache_kwargs
from kvcache.hf import kvzip, scoring

CONTEXT = 40


def _reference(model, context: torch.Tensor, p: kvzip.Chunk, sinks: int) -> list[torch.Tensor]:
    """Per layer ``[B, Hkv, stop - first]`` from HF's eager attention (the module docstring)."""
    eager = model_for("llama")
    eager.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            ids = torch.cat([context, torch.tensor([p.ids])], dim=1)
            attentions = eager(ids, output_attentions=True).attentions
    finally:
        eager.set_attn_implementation("sdpa")
    T, Q, s = context.shape[1], len(p.ids), min(sinks, p.first)
    columns = [*range(s), *range(p.first, p.stop), *range(T, T + Q)]
    kv_heads = model.config.num_key_value_heads
    out = []
    for a in attentions:
        rows = a[:, :, T:, columns].double()  # [B, Hq, Q, chosen]
        rows = rows / rows.sum(-1, keepdim=True)
        chunk = rows[..., s : s + p.stop - p.first]
        b, hq = chunk.shape[:2]
        out.append(chunk.reshape(b, kv_heads, hq // kv_heads, Q, -1).amax(dim=(2, 3)).float())
    return out


@pytest.mark.parametrize(("first", "stop", "sinks"), [(0, 40, 4), (5, 23, 2), (23, 40, 4)])
def test_scores_are_the_papers_renormalised_maximum(first, stop, sinks):
    model = model_for("llama")
    context = prompt(CONTEXT, seed=5)
    p = kvzip.Chunk(first, stop, prompt(6, seed=6)[0].tolist() + context[0, first:stop].tolist())
    rec = scoring.recording_cache(model, (kvzip.ALL_QUERIES,))
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        model(context, **cache_kwargs(model, rec), use_cache=True)
    before = [s.view()[0].clone() for s in rec.kv_layers if s is not None]
    got = kvzip.scores(model, rec, [p], sinks=sinks)
    assert rec.seen == CONTEXT and all(torch.equal(s.view()[0], b) for s, b in zip([s for s in rec.kv_layers if s is not None], before))
    for layer, (mine, ref) in enumerate(zip([g for g in got if g is not None], _reference(model, context, p, sinks))):
        torch.testing.assert_close(mine[..., first:stop], ref, rtol=1e-4, atol=1e-5, msg=f"layer {layer}")
        assert torch.all(mine[..., : min(sinks, CONTEXT)][..., : max(0, min(sinks, first))] == 1.0)  # sinks kept
        outside = torch.ones(CONTEXT, dtype=torch.bool)
        outside[first:stop] = False
        outside[:sinks] = False
        assert torch.all(mine[..., outside] == 0.0)


def test_passes_over_the_whole_context_score_every_slot():
    model = model_for("llama")
    context = prompt(CONTEXT, seed=7)
    passes = [kvzip.Chunk(a, b, prompt(5, seed=a)[0].tolist() + context[0, a:b].tolist()) for a, b in ((2, 20), (20, 40))]
    rec = scoring.recording_cache(model, (kvzip.ALL_QUERIES,))
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        model(context, **cache_kwargs(model, rec), use_cache=True)
    got = kvzip.scores(model, rec, passes)  # the sinks: the 2 slots before the first pass
    for mine in (g for g in got if g is not None):
        assert mine.shape[-1] == CONTEXT and bool((mine[..., 2:] > 0).all()) and bool((mine <= 1).all())
        assert bool((mine[..., :2] == 1).all())


class _Tokenizer:
    """Characters as token ids, and a chat template that closes a user turn with ``<end>`` then opens the reply."""

    chat_template = "stub"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<user>{m['content']}<end>" for m in messages) + ("<reply>" if add_generation_prompt else "")


def test_chunks_cover_the_context_from_start_each_asking_for_its_part():
    tok = _Tokenizer()
    context = list(range(1000, 1050))
    passes = kvzip.chunks(tok, context, start=5, chunk=20, overlap=3)
    assert [(p.first, p.stop) for p in passes] == [(5, 25), (25, 45), (45, 50)]
    turn = [ord(c) for c in "<end><reply>"]
    first = [ord(c) for c in kvzip.FIRST_REQUEST] + turn + context[5:25]
    assert passes[0].ids == first
    assert passes[1].ids == [ord(c) for c in kvzip.LATER_REQUEST] + context[22:25] + turn + context[25:45]
    with pytest.raises(ValueError, match="start must be a context position"):
        kvzip.chunks(tok, context, start=50)


# ---- the choice over the whole cache, and the cache that holds it ------------------------------


def _scores(layers=3, heads=2, length=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [torch.rand(1, heads, length, generator=g) * (1 + i) for i in range(layers)]  # deeper layers score higher
    return [None, *out]


def test_select_pair_keeps_the_top_share_over_every_layer_and_head():
    scores, start, ratio = _scores(), 4, 0.3
    masks = kvzip.select(scores, ratio, start)
    assert masks[0] is None
    ranked = sorted(((float(s[0, h, t]), i, h, t) for i, s in enumerate(scores) if s is not None
                     for h in range(s.shape[1]) for t in range(start, s.shape[2])), reverse=True)  # fmt: skip
    want = {(i, h, t) for _, i, h, t in ranked[: int(len(ranked) * ratio)]}
    got = {(i, h, t) for i, m in enumerate(masks) if m is not None for h, t in m[0, :, start:].nonzero().tolist()}
    assert got == {(i, h, t - start) for i, h, t in want}
    assert all(bool(m[..., :start].all()) for m in masks if m is not None)  # the opening is always kept
    counts = [int(m[..., start:].sum()) for m in masks if m is not None]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # layers keep different counts


def test_select_head_keeps_the_same_share_in_every_head():
    scores, start = _scores(), 4
    masks = kvzip.select(scores, 0.5, start, level="head")
    for s, m in zip(scores[1:], masks[1:]):
        assert m[..., start:].sum(-1).eq((30 - start) // 2).all()
        for h in range(s.shape[1]):  # each head's best
            kept = s[0, h, start:][m[0, h, start:]]
            assert float(kept.min()) >= float(s[0, h, start:][~m[0, h, start:]].max())


@pytest.mark.parametrize(("ratio", "start", "level", "match"), [(0, 2, "pair", "ratio"), (1.5, 2, "pair", "ratio"), (0.5, 30, "pair", "start"), (0.5, 2, "layer", "level")])
def test_select_refuses_bad_arguments(ratio, start, level, match):
    with pytest.raises(ValueError, match=match):
        kvzip.select(_scores(), ratio, start, level)


def _context_cache(model, context):
    rec = scoring.recording_cache(model, (kvzip.ALL_QUERIES,))
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        model(context, **cache_kwargs(model, rec), use_cache=True)
    return rec


def _logits(model, cache, ids):
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        return model(ids, **cache_kwargs(model, cache), use_cache=True).logits


def test_the_kept_cache_holds_the_chosen_slots_and_grows_until_its_room():
    model = model_for("llama")
    context = prompt(CONTEXT, seed=8)
    rec = _context_cache(model, context)
    masks = kvzip.select([None if s is None else torch.rand(1, s.view()[0].shape[1], CONTEXT) for s in rec.kv_layers], 0.4, 3)
    cache = kvzip.kept_cache(model, scoring.keys_values(rec), masks, room=12)
    assert cache.seen == CONTEXT
    for layer, mask, pair in zip(cache.kv_layers, masks, scoring.keys_values(rec)):
        if layer is None:
            continue
        head, position = mask[0].nonzero(as_tuple=True)
        assert layer.kind == "adakv" and layer.compressed == head.numel()
        assert torch.equal(layer.heads()[0, 0], head) and torch.equal(layer.positions()[0, 0], position)
        assert torch.equal(layer.view()[0][0, 0], pair[0][0, head, position])
    kv_heads = masks[1].shape[1] if masks[0] is None else masks[0].shape[1]
    _logits(model, cache, prompt(10, seed=9))  # a question: nothing evicted
    assert [s.length for s in cache.kv_layers if s is not None] == [s.compressed + kv_heads * 10 for s in cache.kv_layers if s is not None]
    _logits(model, cache, prompt(10, seed=10))  # past the room: Ada-KV's rule keeps compressed + Hkv * room
    assert [s.length for s in cache.kv_layers if s is not None] == [s.compressed + kv_heads * 12 for s in cache.kv_layers if s is not None]


def test_the_kept_cache_of_every_slot_answers_as_the_full_cache():
    model = model_for("llama")
    context, question = prompt(CONTEXT, seed=11), prompt(7, seed=12)
    rec = _context_cache(model, context)
    masks = [None if s is None else torch.ones(1, s.view()[0].shape[1], CONTEXT, dtype=torch.bool) for s in rec.kv_layers]
    cache = kvzip.kept_cache(model, scoring.keys_values(rec), masks)
    full = kvcache.make_cache(model, "growable")
    _logits(model, full, context)
    torch.testing.assert_close(_logits(model, cache, question), _logits(model, full, question), rtol=1e-5, atol=1e-5)


def test_the_kept_cache_saves_and_loads_with_each_layers_count(tmp_path):
    model = model_for("llama")
    context, question = prompt(CONTEXT, seed=13), prompt(6, seed=14)
    rec = _context_cache(model, context)
    masks = kvzip.select([None if s is None else torch.rand(1, s.view()[0].shape[1], CONTEXT) for s in rec.kv_layers], 0.3, 2)
    cache = kvzip.kept_cache(model, scoring.keys_values(rec), masks)
    cache.save(tmp_path / "c.kv")
    loaded = kvcache.load_cache(tmp_path / "c.kv", model)
    assert [s.compressed for s in loaded.kv_layers if s is not None] == [s.compressed for s in cache.kv_layers if s is not None]
    torch.testing.assert_close(_logits(model, loaded, question), _logits(model, cache.fork(), question))


def test_opening_is_the_chat_templates_start_when_the_context_has_it():
    tok = _Tokenizer()
    ids = tok("<user>some context")["input_ids"]
    assert kvzip.opening(tok, ids) == len("<user>")
    assert kvzip.opening(tok, tok("no template here")["input_ids"]) == 0


def test_compress_context_is_the_choice_of_the_papers_scores():
    model, tok = model_for("llama"), _Tokenizer()
    context = tok("<user>")["input_ids"] + prompt(CONTEXT, seed=15)[0].tolist()
    cache = kvzip.compress_context(model, tok, context, 0.5, chunk=20)
    rec = _context_cache(model, torch.tensor([context]))
    start = len("<user>")
    want = kvzip.select(kvzip.scores(model, rec, kvzip.chunks(tok, context, start, 20)), 0.5, start)
    kept = total = 0
    for layer, mask in zip(cache.kv_layers, want):
        if layer is None:
            continue
        head, position = mask[0].nonzero(as_tuple=True)
        assert torch.equal(layer.heads()[0, 0], head) and torch.equal(layer.positions()[0, 0], position)
        kept += int(mask[..., start:].sum())
        total += mask[..., start:].numel()
    assert kept == total // 2
    with pytest.raises(ValueError, match="ratio"):
        kvzip.compress_context(model, tok, context, 0.0)


def test_a_model_with_sliding_windows_is_refused_before_it_runs():
    model, tok = model_for("gemma2"), _Tokenizer()
    context = tok("<user>")["input_ids"] + prompt(20, seed=16)[0].tolist()
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="sliding windows"):
            kvzip.compress_context(model, tok, context, 0.5)
    finally:
        hook.remove()
    assert not calls
