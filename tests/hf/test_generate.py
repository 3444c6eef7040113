"""Token identity with Hugging Face's ``DynamicCache`` through real (tiny) models.

The reference is always ``transformers``' own ``DynamicCache(config=model.config)`` (which gives
sliding layers to sliding models) driving the same model: our caches must produce the same tokens
through ``model.generate`` (greedy, beam search, ragged left-padded batches) and the same logits in
a manual forward loop. Tiny models: 4 layers, 2 KV heads, head_dim 16, sliding window 16.
"""

from __future__ import annotations


import contextlib

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

import kvcache
from kvcache import cache_kwargs
from kvcache.layers import SlidingLayer, StaticLayer, WindowLayer
from helpers import LOGITS_TOL, assert_same_tokens, attention_for, hf_attention, left_padded, model_for, prompt
from kvcache.apps.tiny import DEFAULT_SLIDING_WINDOW, FAMILIES

SPECS = ("growable", "static:capacity=80", "concat")
PROMPT_LEN = 40  # longer than the sliding window (16)
NEW_TOKENS = 24  # generation crosses the window again
RAGGED_LENGTHS = (40, 23, 9)


# ---- shared helpers ---------------------------------------------------------------------------




def ragged_batch(lengths=RAGGED_LENGTHS, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(lengths, seed)


def reference_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def greedy(model, input_ids, cache, max_new_tokens=NEW_TOKENS, **kwargs):
    """Greedy generate; a reference (non-kvcache) cache runs with Hugging Face's own attention."""
    context = attention_for(model, cache)
    with context:
        return model.generate(
            input_ids, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )


def assert_same_stored(store, layer) -> None:
    """``store`` holds what the DynamicCache ``layer`` holds, matched by absolute position.

    A window layer holds its ``window`` last tokens as a ring; DynamicCache's sliding layer keeps
    ``window - 1`` in order, as the default kinds' sliding layer does: they must agree on every
    position both hold."""
    keys, values = store.view()
    if not isinstance(store, WindowLayer):
        assert keys.shape == layer.keys.shape
        torch.testing.assert_close(keys, layer.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(values, layer.values, rtol=1e-5, atol=1e-5)
        return
    pos = store.positions()[0, 0]
    assert sorted(pos.tolist()) == list(range(max(0, store.seen - store.window), store.seen))
    first_ref = store.seen - layer.keys.shape[2]
    both = (pos >= first_ref).nonzero().flatten()
    torch.testing.assert_close(keys[:, :, both], layer.keys[:, :, pos[both] - first_ref], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[:, :, both], layer.values[:, :, pos[both] - first_ref], rtol=1e-5, atol=1e-5)


def check_cache_shape_after(cache: kvcache.KVCache, total: int) -> None:
    """The cache really was used: it saw every token but the last generated one."""
    assert cache.seen == total - 1
    for store in cache.kv_layers:
        assert store is not None
        assert store.seen == total - 1
        if isinstance(store, WindowLayer):
            assert store.length == min(store.window, total - 1)
        elif isinstance(store, SlidingLayer):  # Hugging Face's sliding layer keeps window - 1
            assert store.length == min(store.window - 1, total - 1)
        else:
            assert store.length == total - 1


# ---- generate: greedy single prompt, ragged batch, beam search -------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_single_prompt_past_window_matches_dynamic_cache(family, spec):
    model = model_for(family)
    ids = prompt(PROMPT_LEN)
    ref = greedy(model, ids, reference_cache(model))
    cache = kvcache.make_cache(model, spec)
    ours = greedy(model, ids, cache)
    assert_same_tokens(ours, ref, f"{family}/{spec}")
    check_cache_shape_after(cache, PROMPT_LEN + NEW_TOKENS)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_left_padded_batch_matches_dynamic_cache(family, spec):
    model = model_for(family)
    ids, mask = ragged_batch()
    ref = greedy(model, ids, reference_cache(model), attention_mask=mask)
    cache = kvcache.make_cache(model, spec)
    ours = greedy(model, ids, cache, attention_mask=mask)
    assert_same_tokens(ours, ref, f"{family}/{spec} ragged batch")
    check_cache_shape_after(cache, ids.shape[1] + NEW_TOKENS)


@pytest.mark.parametrize("spec", ("growable", "static:capacity=80"))
@pytest.mark.parametrize("family", ("qwen2", "qwen3", "phi3", "smollm3"))
def test_optional_sliding_layouts_match_dynamic_cache(family, spec):
    """Families whose sliding window is opt-in: qwen2/qwen3 upper half, phi3 all, smollm3 NoPE layers."""
    model = model_for(family, sliding_window=DEFAULT_SLIDING_WINDOW)
    cache = kvcache.make_cache(model, spec)
    assert any(isinstance(s, SlidingLayer) for s in cache.kv_layers)
    ids = prompt(PROMPT_LEN, seed=2)
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids, reference_cache(model)), f"{family} sliding")
    check_cache_shape_after(cache, PROMPT_LEN + NEW_TOKENS)
    batch, mask = ragged_batch(seed=13)
    ours = greedy(model, batch, kvcache.make_cache(model, spec), attention_mask=mask)
    ref = greedy(model, batch, reference_cache(model), attention_mask=mask)
    assert_same_tokens(ours, ref, f"{family} sliding, ragged batch")


@pytest.mark.parametrize("spec", ("growable",))
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_search_matches_dynamic_cache(family, spec):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=3)
    kwargs = dict(
        max_new_tokens=12, num_beams=3, num_return_sequences=3, return_dict_in_generate=True, output_scores=True
    )
    ref = greedy(model, ids, reference_cache(model), **kwargs)
    cache = kvcache.make_cache(model, spec)
    ours = greedy(model, ids, cache, **kwargs)
    assert_same_tokens(ours.sequences, ref.sequences, f"{family}/{spec} beam search")
    torch.testing.assert_close(ours.sequences_scores, ref.sequences_scores, rtol=1e-5, atol=1e-5)
    assert cache.kv_layers[0].geometry.batch == 3  # one row per beam


@pytest.mark.parametrize("spec", ("static:capacity=80", "concat"))
@pytest.mark.parametrize("family", ("llama", "mistral", "gemma2"))
def test_beam_search_other_specs(family, spec):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=3)
    kwargs = dict(max_new_tokens=12, num_beams=3, num_return_sequences=3)
    ref = greedy(model, ids, reference_cache(model), **kwargs)
    ours = greedy(model, ids, kvcache.make_cache(model, spec), **kwargs)
    assert_same_tokens(ours, ref, f"{family}/{spec} beam search")


def test_beam_search_on_ragged_batch():
    model = model_for("gemma2")
    ids, mask = ragged_batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, num_beams=3, num_return_sequences=2)
    ref = greedy(model, ids, reference_cache(model), **kwargs)
    ours = greedy(model, ids, kvcache.make_cache(model), **kwargs)
    assert_same_tokens(ours, ref, "gemma2 ragged beam search")


def test_continue_generate_from_existing_cache():
    """generate with a used cache and the full ids so far feeds only the uncached suffix."""
    model = model_for("gemma2")
    ids = prompt(PROMPT_LEN, seed=4)
    ref = greedy(model, ids, reference_cache(model), max_new_tokens=30)
    cache = kvcache.make_cache(model)
    first = greedy(model, ids, cache, max_new_tokens=10)
    ours = greedy(model, first, cache, max_new_tokens=20)
    assert_same_tokens(ours, ref, "gemma2 continued")


# ---- manual forward loops: logits -------------------------------------------------------------


def forward_logits(model, ids: torch.Tensor, cache, feed: torch.Tensor, context=None) -> list[torch.Tensor]:
    """Prefill ``ids`` then feed ``feed`` one token at a time; the last-position logits of each call.
    Runs inside ``context`` (default: ``attention_for(model, cache)``)."""
    out = []
    context = attention_for(model, cache) if context is None else context
    with torch.no_grad(), context:
        logits = model(ids, **cache_kwargs(model, cache), use_cache=True).logits
        out.append(logits[:, -1])
        for t in range(feed.shape[1]):
            logits = model(feed[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits
            out.append(logits[:, -1])
    return out


@pytest.mark.parametrize("decode_kernel", ("chosen", "attend"))
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", ("llama", "gemma2", "mistral", "qwen2"))
def test_manual_forward_loop_logits_match_dynamic_cache(family, spec, decode_kernel, monkeypatch):
    """``chosen``: the kvcache attention picks SDPA or ``attend`` by size, as users get it (SDPA
    for these tiny caches); ``attend``: every decode step forced through ``attend``."""
    if decode_kernel == "attend":
        monkeypatch.setattr("kvcache.attention.choice.GQA_ATTEND_FROM_BYTES", 0)
        monkeypatch.setattr("kvcache.attention.choice.MHA_ATTEND_FROM", 0)
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=5)
    ref_tokens = greedy(model, ids, reference_cache(model))[:, PROMPT_LEN:]
    # Both loops are fed the same tokens (teacher forcing), so every step compares like with like.
    ref = forward_logits(model, ids, reference_cache(model), ref_tokens)
    cache = kvcache.make_cache(model, spec)
    ours = forward_logits(model, ids, cache, ref_tokens)
    assert len(ours) == len(ref) == NEW_TOKENS + 1
    for step, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, **LOGITS_TOL, msg=lambda m: f"step {step}: {m}")
        assert torch.equal(a.argmax(-1), b.argmax(-1)), f"step {step}: argmax differs"
    # The greedy tokens the reference generated are the argmax of our logits, too.
    ours_tokens = torch.stack([x.argmax(-1) for x in ours[:-1]], dim=1)
    assert torch.equal(ours_tokens, ref_tokens)
    assert cache.seen == PROMPT_LEN + NEW_TOKENS


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("family", ("llama", "qwen2"))
def test_unbounded_cache_on_the_models_own_attention_gives_its_logits_exactly(family, spec):
    """Without ``use_kvcache_attention`` (models with no sliding layers), an unbounded cache hands
    SDPA the same keys and values in the same order as DynamicCache: the logits are bit-identical."""
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=5)
    feed = prompt(NEW_TOKENS, seed=6)
    with hf_attention(model):
        ref = forward_logits(model, ids, reference_cache(model), feed)
        cache = kvcache.make_cache(model, spec)
        assert not cache.needs_kvcache_attention
        ours = forward_logits(model, ids, cache, feed, context=contextlib.nullcontext())
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert torch.equal(a, b), f"step {step}: logits differ by {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_manual_loop_cache_contents_match_dynamic_cache(family):
    """The stored keys/values equal what DynamicCache holds (kept window for sliding layers)."""
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=6)
    feed = prompt(10, seed=7)
    ref = reference_cache(model)
    forward_logits(model, ids, ref, feed)
    cache = kvcache.make_cache(model)
    forward_logits(model, ids, cache, feed)
    for store, layer in zip(cache.kv_layers, ref.layers):
        assert_same_stored(store, layer)


# ---- the "kvcache" attention implementation ----------------------------------------------------


@pytest.mark.parametrize("family", ("llama", "mistral"))
def test_kvcache_attention_matches_sdpa_with_dynamic_cache(family):
    sdpa = model_for(family)
    ours_model = model_for(family, attn_implementation="kvcache")
    assert ours_model.config._attn_implementation == "kvcache"
    # Same weights: the two models differ only in their attention implementation.
    for (name, a), (_, b) in zip(sdpa.state_dict().items(), ours_model.state_dict().items()):
        assert torch.equal(a, b), name

    ids = prompt(PROMPT_LEN, seed=8)
    ref = greedy(sdpa, ids, reference_cache(sdpa))
    ours = greedy(ours_model, ids, kvcache.make_cache(ours_model))
    assert_same_tokens(ours, ref, f"{family} kvcache attention, single prompt")

    batch, mask = ragged_batch(seed=9)
    ref = greedy(sdpa, batch, reference_cache(sdpa), attention_mask=mask)
    ours = greedy(ours_model, batch, kvcache.make_cache(ours_model), attention_mask=mask)
    assert_same_tokens(ours, ref, f"{family} kvcache attention, ragged batch")

    # Logits in a manual loop, too.
    feed = ref[:1, batch.shape[1] :]
    ref_logits = forward_logits(sdpa, batch[:1], reference_cache(sdpa), feed)
    our_logits = forward_logits(ours_model, batch[:1], kvcache.make_cache(ours_model), feed)
    for step, (a, b) in enumerate(zip(our_logits, ref_logits)):
        torch.testing.assert_close(a, b, **LOGITS_TOL, msg=lambda m: f"step {step}: {m}")


# ---- static caches: caller-owned buffers, the full error --------------------------------------


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "mistral"])  # mistral has no full layer
def test_static_with_caller_owned_buffers(family):
    model = model_for(family)
    config = model.config
    layer_types, _ = get_layer_types_and_kwargs(config)  # transformers' own reading of the config
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    assert full, "this family should have full-attention layers"
    capacity, batch = 70, 1
    heads, dim = config.num_key_value_heads, 16
    # NaN-filled: reading anything past the stored length would poison the output.
    buffers = [
        (torch.full((batch, heads, capacity, dim), float("nan")), torch.full((batch, heads, capacity, dim), float("nan")))
        for _ in full
    ]
    ids = prompt(PROMPT_LEN, seed=10)
    ref_cache = reference_cache(model)
    ref = greedy(model, ids, ref_cache)
    cache = kvcache.make_cache(model, "static", buffers=buffers)
    ours = greedy(model, ids, cache)
    assert_same_tokens(ours, ref, f"{family} static with caller buffers")

    stored = PROMPT_LEN + NEW_TOKENS - 1
    for (kbuf, vbuf), i in zip(buffers, full):
        store = cache.kv_layers[i]
        assert isinstance(store, StaticLayer)
        keys, values = store.view()
        # The store is a view into the caller's buffers, not a copy.
        assert keys.data_ptr() == kbuf.data_ptr() and values.data_ptr() == vbuf.data_ptr()
        assert keys.untyped_storage().data_ptr() == kbuf.untyped_storage().data_ptr()
        assert store.nbytes == kbuf.nbytes + vbuf.nbytes
        assert store.reallocations == 0
        # The caller's buffers hold the keys/values DynamicCache holds, and nothing past them.
        torch.testing.assert_close(kbuf[:, :, :stored], ref_cache.layers[i].keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vbuf[:, :, :stored], ref_cache.layers[i].values, rtol=1e-5, atol=1e-5)
        assert torch.isnan(kbuf[:, :, stored:]).all() and torch.isnan(vbuf[:, :, stored:]).all()


def test_static_buffers_count_must_match_full_layers():
    model = model_for("gemma2")  # 2 full-attention layers
    pair = (torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16))
    with pytest.raises(kvcache.SpecError, match="per full-attention layer"):
        kvcache.make_cache(model, "static", buffers=[pair] * 4)


@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_static_cache_full_error_during_generate(family):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=11)
    capacity = 50
    cache = kvcache.make_cache(model, f"static:capacity={capacity}")
    with pytest.raises(kvcache.CacheFullError) as info:
        greedy(model, ids, cache, max_new_tokens=NEW_TOKENS)
    message = str(info.value)
    assert "capacity" in message and str(capacity) in message, message

    # The failing step wrote nothing, in any layer: the cache is left consistent, holding exactly
    # `capacity` tokens in every layer, equal to what DynamicCache holds after feeding the same
    # prompt and the 10 generated tokens that fitted (11 generated, the last one not fed back).
    seen = [store.seen for store in cache.kv_layers]
    assert seen == [capacity] * len(seen), f"layers disagree after CacheFullError: seen per layer {seen}"
    ref_cache = reference_cache(model)
    greedy(model, ids, ref_cache, max_new_tokens=capacity - PROMPT_LEN + 1)
    assert ref_cache.get_seq_length() == capacity
    for i, store in enumerate(cache.kv_layers):
        if isinstance(store, StaticLayer):
            assert store.length == capacity
        assert_same_stored(store, ref_cache.layers[i])


def test_static_cache_smaller_than_prompt_raises():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "static:capacity=30")
    with pytest.raises(kvcache.CacheFullError, match="30"):
        greedy(model, prompt(PROMPT_LEN), cache, max_new_tokens=2)
    assert cache.seen == 0


# ---- memory of sliding layers ------------------------------------------------------------------


@pytest.mark.parametrize("family", ("mistral", "gemma2"))
def test_sliding_layers_memory_bounded_while_generating(family):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=12)
    cache = kvcache.make_cache(model)
    after_50 = greedy(model, ids, cache, max_new_tokens=50)
    bytes_50 = [s.nbytes for s in cache.kv_layers]
    after_150 = greedy(model, after_50, cache, max_new_tokens=100)
    bytes_150 = [s.nbytes for s in cache.kv_layers]

    # The continued run is still token-identical to an uninterrupted DynamicCache run.
    ref = greedy(model, ids, reference_cache(model), max_new_tokens=150)
    assert_same_tokens(after_150, ref, f"{family} 150 tokens")

    per_token = 2 * model.config.num_key_value_heads * 16 * 4  # keys + values, fp32, batch 1
    sliding = [i for i, s in enumerate(cache.kv_layers) if isinstance(s, SlidingLayer)]
    assert sliding
    if family == "mistral":
        assert len(sliding) == len(cache.kv_layers)
    for i in sliding:
        # The window less one in order, and the spare room that spares a copy per step: the same
        # bytes whatever the prompt and however long the run.
        bound = per_token * (DEFAULT_SLIDING_WINDOW - 1 + cache.kv_layers[i].spare)
        assert bytes_150[i] == bytes_50[i] == bound, f"layer {i}: {bytes_50[i]}, {bytes_150[i]} bytes, bound {bound}"
        assert cache.kv_layers[i].length == DEFAULT_SLIDING_WINDOW - 1
    for i, store in enumerate(cache.kv_layers):
        if i not in sliding:  # full layers keep everything
            assert store.length == PROMPT_LEN + 150 - 1
