"""Ada-KV (``adakv``) through Hugging Face ``generate`` on the tiny models.

References: Hugging Face's ``DynamicCache`` with Hugging Face's own attention (a budget at least the
sequence must give its tokens exactly), an evicting layer's rectangular store of the same budget
(memory), and the same cache run uninterrupted (save/load, snapshots, beam search).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

import kvcache
from kvcache import cache_kwargs
from helpers import assert_same_tokens, attention_for, left_padded, model_for, prompt
from kvcache.layers import AdaptiveLayer, EvictingLayer, WindowLayer
from kvcache.layers.policies import POLICIES

HEAD_DIM = 16
#: The rectangular store to compare memory with: SnapKV's where it exists, else H2O's (same layout).
RECTANGULAR = "snapkv" if "snapkv" in POLICIES else "h2o"


def greedy(model, ids, cache, max_new_tokens=16, **kwargs):
    with attention_for(model, cache):
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)


def adaptive_bytes(heads: int, budget: int, batch: int = 1, storage_bytes: int = 2 * HEAD_DIM * 4) -> int:
    """``Hkv * (budget + 1)`` flat slots: keys and values, int32 position, int16 head, float32 score."""
    return batch * heads * (budget + 1) * (storage_bytes + 4 + 2 + 4)


@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_memory_stays_at_the_layer_budget_and_under_a_rectangular_store(family):
    model = model_for(family)
    heads = model.config.num_key_value_heads
    budget = 10
    ours = kvcache.make_cache(model, f"adakv:budget={budget},window=4,pool=3")
    rect = kvcache.make_cache(model, f"{RECTANGULAR}:budget={budget},recent=4")
    ids = prompt(14, seed=1)
    types, _ = get_layer_types_and_kwargs(model.config)
    for cache in (ours, rect):
        out = greedy(model, ids, cache, max_new_tokens=3)
        greedy(model, out, cache, max_new_tokens=100 - out.shape[1] + 1)
        assert cache.seen == 100
    for store, other, layer_type in zip(ours.kv_layers, rect.kv_layers, types):
        if layer_type == "sliding_attention":
            assert isinstance(store, WindowLayer)
            continue
        assert isinstance(store, AdaptiveLayer) and isinstance(other, EvictingLayer)
        assert store.length == heads * budget and store.seen == 100
        assert store.nbytes == adaptive_bytes(heads, budget)
        assert store.nbytes <= other.nbytes
        assert int(store.head_lengths().sum()) == heads * budget
        pos = store.positions()
        assert (pos >= 0).all() and (pos < 100).all()
        # Every head keeps the observation window (the last 4 positions).
        for h in range(heads):
            assert set(range(96, 100)) <= set(pos[0, 0][store.heads()[0, 0] == h].tolist())
    assert ours.nbytes <= rect.nbytes


def test_a_fractional_budget_keeps_its_share_of_the_tokens():
    model = model_for("llama")
    heads = model.config.num_key_value_heads
    cache = kvcache.make_cache(model, "adakv:budget=0.25,window=4")
    greedy(model, prompt(40, seed=2), cache, max_new_tokens=30)
    seen = cache.seen
    for store in cache.kv_layers:
        assert store.length == heads * -(-seen // 4)
        assert store.nbytes <= 2 * adaptive_bytes(heads, -(-seen // 4))


@pytest.mark.parametrize("family", ("llama", "gemma2", "qwen3", "phi3"))
def test_budget_at_least_the_sequence_gives_dynamic_cache_tokens(family):
    model = model_for(family)
    ids, mask = left_padded((40, 31), seed=3)
    with attention_for(model, DynamicCache()):
        ref = model.generate(ids, attention_mask=mask, **cache_kwargs(model, DynamicCache(config=model.config)),
                             max_new_tokens=16, do_sample=False)  # fmt: skip
    cache = kvcache.make_cache(model, "adakv:budget=64,window=8")
    ours = greedy(model, ids, cache, attention_mask=mask)
    assert_same_tokens(ours, ref, f"{family} adakv:budget=64 ragged batch")
    ada = [s for s in cache.kv_layers if isinstance(s, AdaptiveLayer)]
    assert ada and all(s.length == model.config.num_key_value_heads * s.seen for s in ada)


def test_one_kv_head_is_snapkv_with_one_shared_budget():
    model = model_for("llama", num_key_value_heads=1)
    cache = kvcache.make_cache(model, "adakv:budget=8,window=2")
    out = greedy(model, prompt(12, seed=4), cache, max_new_tokens=10)
    assert out.shape == (1, 22)
    for store in cache.kv_layers:
        assert store.length == 8 and store.seen == 21 and (store.heads() == 0).all()


@pytest.mark.parametrize("spec", ("adakv:budget=12,window=4,pool=3", "adakv:budget=0.5,window=4", "adakv:budget=12,window=4,storage=int8"))
def test_save_load_continue_equals_uninterrupted(spec, tmp_path):
    model = model_for("llama")
    ids = prompt(30, seed=5)
    whole = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=24)
    cache = kvcache.make_cache(model, spec)
    first = greedy(model, ids, cache, max_new_tokens=10)
    cache.save(tmp_path / "ada.kv")
    loaded = kvcache.load_cache(tmp_path / "ada.kv", model)
    for a, b in zip(cache.kv_layers, loaded.kv_layers):
        assert a.options() == b.options() and a.seen == b.seen
        sa, sb = a.state(), b.state()
        assert sa.tensors.keys() == sb.tensors.keys()
        assert all(torch.equal(sa.tensors[n], sb.tensors[n]) for n in sa.tensors)
    rest = greedy(model, first, loaded, max_new_tokens=14)
    assert_same_tokens(rest, whole, f"{spec} saved and loaded")


def test_snapshot_restore_and_fork_replay_bit_exactly():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "adakv:budget=8,window=2")
    greedy(model, prompt(20, seed=6), cache, max_new_tokens=6)
    snap, fork = cache.snapshot(), cache.fork()
    xs = prompt(6, seed=7)

    def feed(c):
        with torch.no_grad(), attention_for(model, c):
            return torch.stack([model(xs[:, t : t + 1], **cache_kwargs(model, c), use_cache=True).logits for t in range(6)])

    first = feed(cache)
    assert torch.equal(feed(fork), first)
    cache.restore(snap)
    assert torch.equal(feed(cache), first)


def test_beam_search_and_batch_rows():
    """Beam search repeats and reorders rows (``repeat``/``reorder``); a budget above the sequence
    gives DynamicCache's beams, a small one runs at the layer budget for the beams' batch."""
    model = model_for("llama")
    ids = prompt(40, seed=8)
    kwargs = dict(max_new_tokens=8, num_beams=2, num_return_sequences=2)
    with attention_for(model, DynamicCache()):
        ref = model.generate(ids, **cache_kwargs(model, DynamicCache(config=model.config)), do_sample=False, **kwargs)
    assert_same_tokens(greedy(model, ids, kvcache.make_cache(model, "adakv:budget=64"), **kwargs), ref, "adakv beams")
    cache = kvcache.make_cache(model, "adakv:budget=12,window=4")
    out = greedy(model, ids, cache, **kwargs)
    heads = model.config.num_key_value_heads
    assert out.shape == (2, 48)
    assert all(s.geometry.batch == 2 and s.nbytes == adaptive_bytes(heads, 12, batch=2) for s in cache.kv_layers)


def test_crop_before_eviction_then_refused_after():
    model = model_for("llama")
    cache = kvcache.make_cache(model, "adakv:budget=16,window=4")
    ids = prompt(10, seed=9)
    out = greedy(model, ids, cache, max_new_tokens=3)  # 12 tokens seen: nothing evicted
    cache.crop(-2)
    assert cache.get_seq_length() == 10
    fresh = kvcache.make_cache(model, "adakv:budget=16,window=4")
    a, b = greedy(model, out[:, :11], cache, max_new_tokens=7), greedy(model, ids, fresh, max_new_tokens=8)
    assert_same_tokens(a, b, "adakv after a crop")
    assert cache.seen == 17 and all(s.length < 2 * s.seen for s in cache.kv_layers)
    with pytest.raises(kvcache.UnsupportedOperation, match="evicted"):
        cache.crop(-2)
