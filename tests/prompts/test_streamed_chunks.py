"""Chunk entries are copied straight into the cache's buffers with their digest checked on the way:
damage found there leaves no half-filled cache (the prefix ends before the damaged chunk, and what
the cache holds is what a fresh prefill computes), every way of copying gives the same cache, and the
layers' ``next_slots`` / ``commit_slots`` change nothing until the commit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache
from helpers import assert_same_tokens, left_padded, model_for, prompt
from kvcache import CacheFullError
from kvcache.layers.checks import Geometry
from kvcache.prompts import chunk_fill, stream
from test_prompt_store import greedy
from test_untrusted_entries import keys_of

CHUNK = 16


def fresh_kv(model, ids, tokens, spec="growable"):
    cache = kvcache.make_cache(model, spec)
    kvcache.prefill(model, ids[:, :tokens], cache)
    return [layer.view() for layer in cache.kv_layers]


def assert_holds(cache, expected):
    for layer, (keys, values) in zip(cache.kv_layers, expected):
        # fp32 rounding of passes of different lengths; the values are O(1)
        torch.testing.assert_close(layer.view()[0], keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.view()[1], values, atol=1e-5, rtol=1e-5)


def flipped(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1 :]


@pytest.mark.parametrize("damaged", [0, 1, 2])
def test_a_chunk_damaged_in_its_data_ends_the_prefix_before_it(damaged):
    """Its digest fails while its bytes are being copied, after earlier chunks were: the cache holds
    the chunks before it, as a fresh prefill does, and the request recomputes the rest."""
    model = model_for("llama")
    ids = prompt(60, seed=41)
    store = kvcache.PromptStore(chunk=CHUNK)
    store.prefill(model, ids)
    key = keys_of(store, model, ids)[damaged]
    raw = store.backend.get(key)
    store.backend.put(key, flipped(raw, len(raw) - 100))  # a key/value byte: the header still passes
    cache, reused = store.cache_for(model, ids)
    assert reused == cache.seen == damaged * CHUNK and store.stats.bad_entries == 1
    assert all(layer.length == reused for layer in cache.kv_layers)
    if reused:
        assert_holds(cache, fresh_kv(model, ids, reused))
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), f"chunk {damaged} damaged")


def test_a_damaged_chunk_two_rows_share_ends_both_rows_prefixes():
    model = model_for("llama")
    shared = prompt(40, seed=42)
    ids = torch.cat([torch.cat([shared, prompt(10, seed=43)], 1), torch.cat([shared, prompt(10, seed=44)], 1)], 0)
    store = kvcache.PromptStore(chunk=CHUNK)
    store.prefill(model, ids[:1])
    store.prefill(model, ids[1:])
    key = keys_of(store, model, ids[:1])[1]
    raw = store.backend.get(key)
    store.backend.put(key, flipped(raw, len(raw) - 5))
    cache, reused = store.cache_for(model, ids)
    assert reused == CHUNK and store.stats.bad_entries == 1
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "a shared chunk damaged")


@pytest.mark.parametrize("spec", ["growable", "static:capacity=160", "concat"])
@pytest.mark.parametrize("way", ["library", "numpy and memmove", "torch copies"])
def test_every_way_of_copying_fills_the_same_cache(spec, way, monkeypatch):
    if way == "library" and stream._fused() is None:
        pytest.skip("the entry_stream library did not build here")
    if way == "numpy and memmove":
        monkeypatch.setattr(stream, "_fused", lambda: None)
    if way == "torch copies":  # the path for buffers a CPU address cannot reach (another device)
        monkeypatch.setattr(chunk_fill, "_plain_cpu", lambda t: False)
    model = model_for("llama")
    ids, mask = left_padded((50, 37), seed=45)
    store = kvcache.PromptStore(chunk=CHUNK)
    for r in range(2):
        store.prefill(model, ids[r : r + 1, mask[r].bool()], spec)
    cache, reused = store.cache_for(model, ids, spec, attention_mask=mask)
    assert reused == 45  # rows padded 0 and 13 hold 48 and 32 stored tokens
    pads = [layer.view()[0][1, :, :13] for layer in cache.kv_layers]
    assert all(not p.any() for p in pads)  # the padding columns are zeros, never a stale buffer
    assert_same_tokens(greedy(model, ids, cache, mask), greedy(model, ids, mask=mask), f"{spec}, {way}")


def test_a_signed_store_checks_every_byte_while_copying():
    model = model_for("llama")
    ids = prompt(40, seed=46)
    store = kvcache.PromptStore(chunk=CHUNK, secret="s3cret")
    store.prefill(model, ids)
    key = keys_of(store, model, ids)[1]
    raw = store.backend.get(key)
    store.backend.put(key, flipped(raw, len(raw) - 3))
    cache, reused = store.cache_for(model, ids)
    assert reused == 16 and store.stats.bad_entries == 1
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "signed, chunk 1 damaged")


#: Bytes of an entry to damage, as fractions of its length (its magic, digest, header or data).
damage_at = st.floats(0, 1, exclude_max=True)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(2, 60), chunk=st.integers(0, 3), where=damage_at)
def test_a_damaged_byte_anywhere_leaves_exactly_the_chunks_before_it(tokens, chunk, where):
    model = model_for("llama")
    ids = prompt(tokens, seed=tokens)
    store = kvcache.PromptStore(chunk=CHUNK)
    store.prefill(model, ids)
    keys = keys_of(store, model, ids[:, : tokens - 1])
    if chunk < len(keys):
        raw = store.backend.get(keys[chunk])
        store.backend.put(keys[chunk], flipped(raw, int(where * len(raw))))
    cache, reused = store.cache_for(model, ids)
    expected = min(chunk, len(keys)) * CHUNK if chunk < len(keys) else min(len(keys) * CHUNK, tokens - 1)
    assert reused == cache.seen == expected
    assert store.stats.bad_entries == (1 if chunk < len(keys) else 0)
    if reused:
        assert_holds(cache, fresh_kv(model, ids, reused))


# ---- the layers' hook ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["growable", "static:capacity=64", "concat"])
def test_slots_filled_in_place_count_only_once_committed(spec):
    model = model_for("llama")
    cache = kvcache.make_cache(model, spec)
    kvcache.prefill(model, prompt(10, seed=47), cache)
    layer = cache.kv_layers[0]
    before = [t.clone() for t in layer.view()]
    keys, values = layer.next_slots(5, layer.geometry)
    assert keys.shape[2] == values.shape[2] == 5
    keys.fill_(1.5)
    values.fill_(-2.5)
    assert layer.length == layer.seen == 10 and all(torch.equal(a, b) for a, b in zip(layer.view(), before))
    layer.commit_slots(5)
    assert layer.length == layer.seen == 15
    assert torch.equal(layer.view()[0][:, :, :10], before[0]) and bool((layer.view()[0][:, :, 10:] == 1.5).all())
    assert bool((layer.view()[1][:, :, 10:] == -2.5).all())


def test_next_slots_refuses_what_does_not_fit_changing_nothing():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "static:capacity=8")
    layer = cache.kv_layers[0]
    geometry = Geometry(1, model.config.num_key_value_heads, 16, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(CacheFullError):
        layer.next_slots(9, geometry)
    assert layer.length == layer.seen == 0
    keys, _ = layer.next_slots(8, geometry)
    assert keys.shape[2] == 8
    with pytest.raises(ValueError, match="next_slots"):
        layer.next_slots(1, Geometry(2, geometry.heads, 16, 16, torch.float32, torch.device("cpu")))
    window = kvcache.make_cache(model, "window:window=8").kv_layers[0]
    with pytest.raises(kvcache.UnsupportedOperation, match="position order"):
        window.next_slots(1, geometry)
