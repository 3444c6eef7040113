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


def test_passes_over_the_whole_context_score_every_slot_and_compress():
    model = model_for("llama")
    context = prompt(CONTEXT, seed=7)
    passes = [kvzip.Chunk(a, b, prompt(5, seed=a)[0].tolist() + context[0, a:b].tolist()) for a, b in ((2, 20), (20, 40))]
    rec = scoring.recording_cache(model, (kvzip.ALL_QUERIES,))
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        model(context, **cache_kwargs(model, rec), use_cache=True)
    got = kvzip.scores(model, rec, passes)
    for mine in (g for g in got if g is not None):
        assert mine.shape[-1] == CONTEXT and bool((mine[..., 2:] > 0).all()) and bool((mine <= 1).all())
    cache = scoring.compress(model, "kvzip:budget=16,recent=0", scoring.keys_values(rec), {scoring.KVZIP_MODE: got})
    for layer, mine in zip(cache.kv_layers, got):
        if layer is None:
            continue
        kept = layer.positions()[0] if hasattr(layer, "positions") else None
        assert layer.length == 16
        if kept is not None:  # the top-16 of each KV head's scores (ties aside)
            want = mine[0].topk(16, dim=-1).indices.sort(dim=-1).values
            assert torch.equal(kept.sort(dim=-1).values.to(want.dtype), want)


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
