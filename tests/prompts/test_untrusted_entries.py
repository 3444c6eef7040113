"""Store entries are untrusted input: every damaged, foreign, other-model, other-prefix or crafted
entry is a miss that is logged, deleted and recomputed; never a crash, a wrong continuation, a
huge allocation or code execution."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

import kvcache
from helpers import assert_same_tokens, model_for, prompt
from kvcache.prompts.entry import MAGIC, seal
from kvcache.prompts.keys import chain, salt
from test_prompt_store import greedy

CHUNK = 16


def keys_of(store, model, ids, spec="growable", prefix=""):
    cache = kvcache.make_cache(model, spec)
    s = salt(cache.fingerprint, next(model.parameters()).dtype, str(cache.spec), store.chunk)
    return [prefix + k for k in chain(s, ids[0].tolist(), store.chunk)]


def stored(model, ids, spec="growable", **kw):
    store = kvcache.PromptStore(chunk=CHUNK, **kw)
    with kvcache.use_kvcache_attention(model):
        store.prefill(model, ids, spec)
    return store


def resealed(raw: bytes, key: str, secret=None) -> bytes:
    """``raw``'s payload under ``key``, with a valid digest: what a writer of the store can forge."""
    return seal(key, raw[len(MAGIC) + 32 :], secret)


def chunk_payload(model, ids, start):
    """A chunk entry's payload for ``ids[:, start:start + CHUNK]`` computed by ``model``."""
    cache = kvcache.make_cache(model)
    kvcache.prefill(model, ids[:, : start + CHUNK], cache)
    piece = kvcache.make_cache(model)
    piece.extend([(s.view()[0][:, :, start:].clone(), s.view()[1][:, :, start:].clone()) for s in cache.kv_layers])
    return piece.to_bytes(token_ids=ids[0, start : start + CHUNK].tolist())


IDS = prompt(40, seed=31)


def damage(case: str, model, store, key: str, raw: bytes) -> bytes:
    """The entry the case plants under ``key`` (chunk 1 of IDS) in place of ``raw``."""
    body = len(MAGIC) + 32
    if case == "truncated":
        return raw[: len(raw) // 2]
    if case == "empty":
        return b""
    if case == "bit flipped in the data":
        return raw[:-9] + bytes([raw[-9] ^ 1]) + raw[-8:]
    if case == "bit flipped in the digest":
        return raw[:body - 1] + bytes([raw[body - 1] ^ 1]) + raw[body:]
    if case == "foreign bytes":
        return b"GIF89a" + bytes(range(256)) * 4
    if case == "another version":
        return MAGIC[:-2] + b"\x09\x00" + raw[len(MAGIC) :]
    if case == "another key's entry":
        other = keys_of(store, model, IDS)[0]
        return store.backend.get(other)  # chunk 0, under chunk 1's key: its digest names chunk 0
    if case == "another prefix, resealed":
        return resealed(store.backend.get(keys_of(store, model, IDS)[0]), key)
    if case == "another model, resealed":
        qwen = model_for("qwen2")
        return seal(key, chunk_payload(qwen, IDS, 16))
    if case == "another dtype, resealed":
        double = model_for("llama").to(torch.float64)
        try:
            return seal(key, chunk_payload(double, IDS, 16))
        finally:
            double.to(torch.float32)
    if case == "fewer tokens than a chunk, resealed":
        cache = kvcache.make_cache(model)
        kvcache.prefill(model, IDS[:, :31], cache)
        piece = kvcache.make_cache(model)
        piece.extend([(s.view()[0][:, :, 16:], s.view()[1][:, :, 16:]) for s in cache.kv_layers])
        return seal(key, piece.to_bytes(token_ids=IDS[0, 16:32].tolist()))  # 15 slots, 16 ids
    if case == "token ids outside the vocabulary, resealed":
        from kvcache.persist import SavedCache, encode_cache

        cache = kvcache.make_cache(model)
        kvcache.prefill(model, IDS[:, :CHUNK], cache)
        states = [s.state() for s in cache.kv_layers]
        return seal(key, encode_cache(SavedCache("growable", cache.config_summary, states, [10**6] * CHUNK)))
    if case == "huge shape claimed, resealed":
        payload = bytearray(raw[body:])
        at = payload.find(b'"shape":[1,2,16,16]')
        assert at > 0
        payload[at : at + 19] = b'"shape":[1,2,99,99]'  # the header lies about the tensor's size
        return seal(key, bytes(payload))
    if case == "a pickle, resealed":
        return seal(key, pickle.dumps(Boom()))
    raise AssertionError(case)


class Boom:
    """Unpickling this would create a file: it must never be unpickled."""

    def __reduce__(self):
        return (open, ("/tmp/kvcache-store-pickle-ran", "w"))


CASES = [
    "truncated", "empty", "bit flipped in the data", "bit flipped in the digest", "foreign bytes", "another version",
    "another key's entry", "another prefix, resealed", "another model, resealed", "another dtype, resealed",
    "fewer tokens than a chunk, resealed", "token ids outside the vocabulary, resealed", "huge shape claimed, resealed",
    "a pickle, resealed",
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_chunk_entry_is_a_logged_miss_that_is_recomputed(case, caplog):
    model = model_for("llama")
    store = stored(model, IDS)
    key = keys_of(store, model, IDS)[1]
    store.backend.put(key, damage(case, model, store, key, store.backend.get(key)))
    with caplog.at_level(logging.WARNING, logger="kvcache.prompts"):
        cache, reused = store.cache_for(model, IDS)
    assert reused == 16  # chunk 0 is good; the prefix ends before the bad chunk
    assert store.stats.bad_entries == 1 and "recomputing" in caplog.text
    assert store.backend.contains_many([key]) == [False]  # deleted, so the next put writes it again
    assert_same_tokens(greedy(model, IDS, cache), greedy(model, IDS), case)
    store.prefill(model, IDS)
    assert store.cache_for(model, IDS)[1] == 32
    import os

    assert not os.path.exists("/tmp/kvcache-store-pickle-ran")


@pytest.mark.parametrize("case", ["another spec, resealed", "another prefix, resealed", "truncated"])
def test_a_bad_state_entry_falls_back_to_an_earlier_boundary(case):
    model = model_for("llama")
    spec = "h2o:budget=12"
    store = stored(model, IDS, spec)
    first, second = keys_of(store, model, IDS, spec, prefix="s-")[:2]
    raw = store.backend.get(second)
    if case == "another spec, resealed":
        other = stored(model, IDS, "h2o:budget=13")
        bad = resealed(other.backend.get(keys_of(other, model, IDS, "h2o:budget=13", prefix="s-")[1]), second)
    elif case == "another prefix, resealed":
        bad = resealed(store.backend.get(first), second)
    else:
        bad = raw[:100]
    store.backend.put(second, bad)
    with kvcache.use_kvcache_attention(model):
        cache, reused = store.cache_for(model, IDS, spec)
    assert reused == 16 and store.stats.bad_entries == 1


def test_with_a_secret_only_entries_signed_with_it_are_used():
    model = model_for("llama")
    unsigned = stored(model, IDS)
    signed = kvcache.PromptStore(unsigned.backend, chunk=CHUNK, secret="s3cret")
    assert signed.cache_for(model, IDS)[1] == 0  # written without the secret: refused (and deleted)
    signed.prefill(model, IDS)
    assert signed.cache_for(model, IDS)[1] == 32
    other = kvcache.PromptStore(unsigned.backend, chunk=CHUNK, secret="another")
    assert other.cache_for(model, IDS)[1] == 0
    assert kvcache.PromptStore(unsigned.backend, chunk=CHUNK).cache_for(model, IDS)[1] == 0
