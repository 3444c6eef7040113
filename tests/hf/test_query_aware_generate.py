"""Query-aware eviction kinds (snapkv, pyramidkv, tova-layer) through ``generate`` and a plain
forward loop on tiny models, against Hugging Face's ``DynamicCache`` on Hugging Face's own
attention: the budget holds after the prefill and every decode step, a budget at least the
sequence changes nothing, and a saved cache keeps its policy's options.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from helpers import LOGITS_TOL, assert_same_tokens, attention_for, model_for, prompt
from kvcache.layers import EvictingLayer

KINDS = ("snapkv", "pyramidkv", "tova-layer")
#: Bounds well below the sequence (prompt 40, then decode steps).
SMALL = {
    "snapkv": "snapkv:budget=16,window=6,pool=3",
    "pyramidkv": "pyramidkv:budget=16,window=4,pool=5,beta=3",
    "tova-layer": "tova-layer:budget=12,sinks=2",
}
#: Every layer's budget at least the whole sequence (prompt 40 + 16 new): nothing is dropped.
#: (PyramidKV's top layer keeps the protected recent tokens plus 1/beta of the rest: those make it so.)
LARGE = {
    "snapkv": "snapkv:budget=64",
    "pyramidkv": "pyramidkv:budget=64,recent=56",
    "tova-layer": "tova-layer:budget=64",
}
PROMPT_LEN, NEW_TOKENS = 40, 16
#: Each evicting slot: keys and values (float32, head_dim 16), an int64 position, a float32 score.
SLOT_BYTES = 2 * 16 * 4 + 8 + 4


def greedy(model, ids, cache, max_new_tokens=NEW_TOKENS):
    with attention_for(model, cache):
        return model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=max_new_tokens, do_sample=False)


def forward_loop(model, ids, cache, feed, check):
    """Prefill ``ids``, then feed ``feed`` a token at a time; last-position logits ``[calls, B, V]``."""
    out, seen = [], 0
    with torch.no_grad(), attention_for(model, cache):
        for chunk in [ids] + [feed[:, t : t + 1] for t in range(feed.shape[1])]:
            out.append(model(chunk, **cache_kwargs(model, cache), use_cache=True).logits[:, -1])
            seen += chunk.shape[1]
            check(cache, seen)
    return torch.stack(out)


def budget_holds(cache, seen):
    """Every evicting layer holds its own budget (once past it) in ``budget + 1`` slots of memory."""
    evicting = [s for s in cache.kv_layers if isinstance(s, EvictingLayer)]
    assert evicting
    for store in evicting:
        budget = store.budget_now()
        assert store.seen == seen and store.length == min(seen, budget), (store.policy.name, seen, store.length, budget)
        if seen > budget:
            batch, heads = store.positions().shape[:2]
            assert store.nbytes == (budget + 1) * batch * heads * SLOT_BYTES, (seen, store.nbytes, budget)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_budget_holds_after_prefill_and_every_decode_step(family, kind):
    model = model_for(family)
    cache = kvcache.make_cache(model, SMALL[kind])
    forward_loop(model, prompt(PROMPT_LEN, seed=31, batch=2), cache, prompt(12, seed=32, batch=2), budget_holds)
    budgets = [s.budget_now() for s in cache.kv_layers if isinstance(s, EvictingLayer)]
    if kind == "pyramidkv":
        assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
        assert abs(sum(budgets) - 16 * len(budgets)) <= len(budgets) / 2
    if kind == "tova-layer":
        for store in cache.kv_layers:
            if isinstance(store, EvictingLayer):
                pos = store.positions()
                assert torch.equal(pos, pos[:, :1].expand_as(pos)), "tova-layer: the heads of a row keep different positions"
    cache_nbytes = sum(s.nbytes for s in cache.kv_layers if s is not None)
    assert cache.nbytes == cache_nbytes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", ("llama", "gemma2"))
def test_budget_at_least_the_sequence_equals_the_full_cache(family, kind):
    model = model_for(family)
    ids = prompt(PROMPT_LEN, seed=33)
    reference = greedy(model, ids, DynamicCache(config=model.config))
    cache = kvcache.make_cache(model, LARGE[kind])
    ours = greedy(model, ids, cache)
    assert_same_tokens(ours, reference, f"{family}/{LARGE[kind]}")
    assert all(s.length == s.seen for s in cache.kv_layers if isinstance(s, EvictingLayer))

    feed = prompt(NEW_TOKENS, seed=34)
    ref_logits = forward_loop(model, ids, DynamicCache(config=model.config), feed, lambda c, n: None)
    our_logits = forward_loop(model, ids, kvcache.make_cache(model, LARGE[kind]), feed, lambda c, n: None)
    torch.testing.assert_close(our_logits, ref_logits, **LOGITS_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_keeps_options_and_continues_as_uninterrupted(kind, tmp_path):
    model = model_for("llama")
    spec = SMALL[kind]
    ids = prompt(30, seed=35)
    whole = greedy(model, ids, kvcache.make_cache(model, spec), max_new_tokens=20)
    cache = kvcache.make_cache(model, spec)
    first = greedy(model, ids, cache, max_new_tokens=8)
    cache.save(tmp_path / "c.kv")
    loaded = kvcache.load_cache(tmp_path / "c.kv", model)
    assert str(loaded.spec) == str(cache.spec) == spec
    for a, b in zip(cache.kv_layers, loaded.kv_layers):
        assert b.options() == a.options() and b.budget_now() == a.budget_now()
        assert torch.equal(a.positions(), b.positions()) and torch.equal(a.scores(), b.scores())
    rest = greedy(model, first, loaded, max_new_tokens=12)
    assert_same_tokens(rest, whole, f"{spec} saved and loaded")



@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_composes_with_quantized_slot_storage(kind):
    """The same slots chosen over int4 storage: lengths as the budget says, real bytes below full's."""
    model = model_for("llama")
    ids, feed = prompt(PROMPT_LEN, seed=37, batch=2), prompt(6, seed=38, batch=2)

    def lengths_hold(cache, seen):
        for store in cache.kv_layers:
            assert store.seen == seen and store.length == min(seen, store.budget_now())

    full = kvcache.make_cache(model, SMALL[kind])
    packed = kvcache.make_cache(model, SMALL[kind] + ",storage=int4")
    forward_loop(model, ids, full, feed, budget_holds)
    forward_loop(model, ids, packed, feed, lengths_hold)
    assert all(s.storage.name == "int4" for s in packed.kv_layers)
    assert [s.length for s in packed.kv_layers] == [s.length for s in full.kv_layers]
    assert packed.nbytes < full.nbytes / 2
