"""PromptStore: generation from a reused prefix is generation from scratch, for every cache kind
the store can hold, single and batched, through every backend."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcache
from helpers import assert_same_tokens, left_padded, model_for, prompt
from kvcache import UnsupportedOperation, cache_kwargs

CHUNK = 16
NEW = 6
CHUNKED = ["growable", "static:capacity=160", "concat"]
#: Kinds whose state depends on the whole prefix: stored whole at chunk boundaries.
STATES = ["quantized:bits=4,group_size=8,residual=8", "window:window=24,sinks=2", "h2o:budget=24", "snapkv:budget=24,window=4"]


def greedy(model, ids, cache=None, mask=None, new=NEW):
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=new, do_sample=False)


@pytest.fixture(params=["memory", "folder", "redis"])
def location(request, tmp_path):
    """Where a test's store lives: each backend, empty."""
    if request.param == "memory":
        return "memory"
    if request.param == "folder":
        return str(tmp_path / "store")
    return request.getfixturevalue("redis_url")


@pytest.mark.parametrize("spec", CHUNKED)
def test_a_reused_prefix_generates_what_a_fresh_prompt_does(spec, location):
    model = model_for("llama")
    store = kvcache.PromptStore(location, chunk=CHUNK)
    first = prompt(45, seed=1)
    cache, reused = store.cache_for(model, first, spec)
    assert (reused, cache.seen) == (0, 0)
    out = greedy(model, first, cache)
    assert_same_tokens(out, greedy(model, first), f"{spec}, nothing stored")
    assert store.put(cache, out) == 48  # 45 + 6 - 1 tokens held: three full chunks
    follow_up = torch.cat([out, prompt(20, seed=2)], dim=1)
    cache, reused = store.cache_for(model, follow_up, spec)
    assert (reused, cache.seen) == (48, 48)
    assert_same_tokens(greedy(model, follow_up, cache), greedy(model, follow_up), f"{spec}, 48 tokens reused")


@pytest.mark.parametrize("family", ["qwen2", "phi3", "gemma", "smollm3"])
def test_reuse_is_exact_on_other_families(family):
    model = model_for(family)
    store = kvcache.PromptStore(chunk=CHUNK)
    ids = prompt(70, seed=3)
    cache, reused = store.prefill(model, ids)
    assert reused == 0 and cache.seen == 69
    longer = torch.cat([ids, prompt(9, seed=4)], dim=1)
    cache, reused = store.cache_for(model, longer)
    assert reused == 64
    assert_same_tokens(greedy(model, longer, cache), greedy(model, longer), family)


def test_the_last_prompt_token_is_always_left_to_compute():
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    ids = prompt(32, seed=5)
    store.prefill(model, torch.cat([ids, prompt(3, seed=6)], dim=1))  # stores chunks 0 and 1
    cache, reused = store.cache_for(model, ids)  # the whole prompt is stored: keep its last token back
    assert reused == 31
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "all stored but the last token")


@pytest.mark.parametrize("spec", CHUNKED)
def test_a_left_padded_batch_reuses_each_rows_own_prefix(spec, location):
    model = model_for("llama")
    store = kvcache.PromptStore(location, chunk=CHUNK)
    ids, mask = left_padded((40, 33, 50), seed=11)
    for r in range(3):  # each prompt stored alone, unpadded
        store.prefill(model, ids[r : r + 1, mask[r].bool()], spec)
    cache, reused = store.cache_for(model, ids, spec, attention_mask=mask)
    # rows padded 10, 17, 0 hold 32, 32, 48 stored tokens: 42 columns are stored for every row
    assert reused == 42
    assert_same_tokens(greedy(model, ids, cache, mask), greedy(model, ids, mask=mask), f"{spec}, batch")


def test_a_batch_stores_its_rows_for_single_requests():
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    ids, mask = left_padded((40, 21), seed=12)
    cache = kvcache.make_cache(model)
    out = greedy(model, ids, cache, mask)
    assert store.put(cache, out, attention_mask=mask) == 32 + 16  # rows hold 45 and 26 tokens
    row = out[1:2, mask[1].bool().tolist() + [True] * NEW]
    more = torch.cat([row, prompt(5, seed=13)], dim=1)
    cache, reused = store.cache_for(model, more)
    assert reused == 16
    assert_same_tokens(greedy(model, more, cache), greedy(model, more), "a batch row reused alone")


def test_a_padded_row_never_matches_by_its_pad_tokens():
    """Pads are not tokens: a row whose pad id equals a real token id still keys its real tokens only."""
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    pads_as_tokens = torch.zeros(1, 16, dtype=torch.long)  # an unpadded prompt of the pad id, stored
    store.prefill(model, torch.cat([pads_as_tokens, prompt(20, seed=14)], dim=1))
    ids, mask = left_padded((20,), seed=14)
    padded = torch.cat([torch.zeros(1, 16, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 16, dtype=torch.long), mask], dim=1)
    cache, reused = store.cache_for(model, padded, attention_mask=mask)
    assert reused == 0
    assert_same_tokens(greedy(model, padded, cache, mask), greedy(model, padded, mask=mask), "padded row")


def test_two_specs_or_two_models_never_share_an_entry():
    llama, qwen = model_for("llama"), model_for("qwen2")
    store = kvcache.PromptStore(chunk=CHUNK)
    ids = prompt(40, seed=15)
    store.prefill(llama, ids, "growable")
    assert store.cache_for(llama, ids, "concat")[1] == 0
    assert store.cache_for(qwen, ids, "growable")[1] == 0
    assert store.cache_for(llama, ids, "growable")[1] == 32


@pytest.mark.parametrize("spec", STATES)
def test_state_kinds_reuse_the_state_at_a_chunk_boundary(spec, location):
    """A whole-state entry is the cache after exactly that many tokens: generation from it is a
    generation whose prefill was split at that boundary."""
    model = model_for("llama")
    store = kvcache.PromptStore(location, chunk=CHUNK)
    ids = prompt(40, seed=16)
    with kvcache.use_kvcache_attention(model):
        cache, reused = store.prefill(model, ids, spec)
        assert reused == 0 and cache.seen == 39
        longer = torch.cat([ids, prompt(10, seed=17)], dim=1)
        cache, reused = store.cache_for(model, longer, spec)
        assert reused == 32 and str(cache.spec) == str(kvcache.parse_spec(spec))
        reference = kvcache.make_cache(model, spec)
        kvcache.prefill(model, longer[:, :16], reference, chunk=CHUNK)
        kvcache.prefill(model, longer[:, 16:32], reference, chunk=CHUNK)
        assert_same_tokens(greedy(model, longer, cache), greedy(model, longer, reference), f"{spec} from 32 tokens")


def test_models_with_sliding_layers_store_whole_states():
    model = model_for("gemma2")  # alternating sliding and full layers
    store = kvcache.PromptStore(chunk=CHUNK)
    ids = prompt(40, seed=18)
    with kvcache.use_kvcache_attention(model):
        cache, _ = store.prefill(model, ids)
        assert store.mode(cache) == "states"
        cache, reused = store.cache_for(model, ids)
        assert reused == 32
        reference = kvcache.make_cache(model)
        kvcache.prefill(model, ids[:, :16], reference)
        kvcache.prefill(model, ids[:, 16:32], reference)
        assert_same_tokens(greedy(model, ids, cache), greedy(model, ids, reference), "gemma2 states")


def test_state_kinds_refuse_batches_and_say_what_works():
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    ids, mask = left_padded((20, 18))
    with pytest.raises(UnsupportedOperation, match=r"one unpadded row.*use growable, static or concat"):
        store.cache_for(model, ids, "h2o:budget=8", attention_mask=mask)
    with pytest.raises(UnsupportedOperation, match="one unpadded row"):
        store.cache_for(model, prompt(20, batch=2), "quantized")


def test_put_off_a_chunk_boundary_stores_no_state():
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    cache = kvcache.make_cache(model, "quantized")
    ids = prompt(20, seed=19)
    kvcache.prefill(model, ids, cache)
    assert store.put(cache, ids) == 0 and len(store.backend) == 0


def test_models_with_non_attention_layers_are_refused():
    from families import build_model

    model = build_model("jamba")
    store = kvcache.PromptStore(chunk=CHUNK)
    with pytest.raises(UnsupportedOperation, match="non-attention layers"):
        store.cache_for(model, prompt(20, seed=20) % model.config.vocab_size)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda s, m: s.cache_for(m, prompt(20), attention_mask=torch.tensor([[1] * 19 + [0]])), ValueError, "not left padding"),
        (lambda s, m: s.cache_for(m, prompt(20).float()), ValueError, r"input_ids must be token ids \[B, T\]"),
        (lambda s, m: s.cache_for(m, prompt(20), attention_mask=torch.ones(2, 20)), ValueError, r"attention_mask must be \[B, T'\]"),
        (lambda s, m: s.put("cache", prompt(20)), TypeError, "put expects a kvcache.KVCache"),
        (lambda s, m: kvcache.PromptStore(chunk=0), ValueError, "chunk must be a whole number"),
    ],
)
def test_bad_arguments_are_refused_with_what_was_expected(call, error, message):
    with pytest.raises(error, match=message):
        call(kvcache.PromptStore(chunk=CHUNK), model_for("llama"))


def test_put_refuses_token_ids_that_do_not_cover_the_cache():
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    cache = kvcache.make_cache(model)
    kvcache.prefill(model, prompt(40), cache)
    with pytest.raises(ValueError, match="the cache holds 40 tokens"):
        store.put(cache, prompt(30))
    with pytest.raises(ValueError, match="the cache holds a batch of 1"):
        store.put(cache, prompt(40, batch=2))
    assert len(store.backend) == 0


def test_padded_rows_of_a_model_that_takes_no_position_ids_are_refused():
    llama = model_for("llama")

    class NoPositionIds(type(llama)):
        def forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(llama, past_key_values),
                                   **kwargs)  # fmt: skip

    model = NoPositionIds(llama.config).eval()
    store = kvcache.PromptStore(chunk=CHUNK)
    ids, mask = left_padded((20, 18))
    with pytest.raises(UnsupportedOperation, match="takes no position_ids"):
        store.cache_for(model, ids, attention_mask=mask)
    assert store.cache_for(model, prompt(20))[1] == 0  # unpadded rows are fine
