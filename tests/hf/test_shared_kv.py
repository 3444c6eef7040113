"""Models whose later layers reuse an earlier layer's keys and values (Gemma 3n, Gemma 4).

In ``transformers`` a "store" layer (``config.kv_sharing_modes``) writes the cache and hands what
``update`` returned to the "reuse" layers of its type, which keep no cache and attend those keys
and values with their own queries. A bounded layer (a model's sliding layer, window, eviction)
runs its own attention, so its update's set is read once per reader: the owner first, then each
sharing layer; the layer settles (eviction) only after the last. References: Hugging Face's
``DynamicCache`` on the model's own attention (sdpa).

Tiny models: 4 layers (sliding, full, sliding, full), window 8, the last two layers share the
first two's K/V; prompts of 20 tokens run past the window.
"""

import functools

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3nForCausalLM,
    Gemma3nTextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

import kvcache
from kvcache import cache_kwargs
from kvcache.hf.cache import kv_attended_by
from kvcache.errors import UnsupportedOperation
from kvcache.layers import EvictingLayer, QuantizedLayer, WindowLayer

from helpers import assert_same_tokens, left_padded, prompt

WINDOW = 8
PROMPT = 20
NEW_TOKENS = 10
VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    vocab_size_per_layer_input=VOCAB,
    hidden_size=32,
    hidden_size_per_layer_input=8,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["sliding_attention", "full_attention"] * 2,
    num_kv_shared_layers=2,
    sliding_window=WINDOW,
    max_position_embeddings=512,
    attn_implementation="sdpa",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@functools.lru_cache(maxsize=None)
def shared_model(family: str):
    if family == "gemma3n":
        config = Gemma3nTextConfig(**COMMON, activation_sparsity_pattern=[0.0] * 4, laurel_rank=4, altup_num_inputs=2)
        cls = Gemma3nForCausalLM
    else:
        # 0.05: larger weights saturate this tiny Gemma 4 into repeating one token.
        config = Gemma4TextConfig(**COMMON, global_head_dim=16, initializer_range=0.05)
        cls = Gemma4ForCausalLM
    assert config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(config)
    with torch.no_grad():
        model.get_output_embeddings().weight[config.eos_token_id].zero_()  # never stop early
    return model.eval()


def generate(model, ids, cache, mask=None):
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids) if mask is None else mask,
        **cache_kwargs(model, cache),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
@pytest.mark.parametrize("spec", ["growable", "window:window=64", "h2o:budget=64", "static:capacity=64"])
def test_shared_layers_generate_like_dynamic_cache(family, spec):
    """Greedy tokens identical to DynamicCache, scores within 1e-4 (float32; our kernel and SDPA
    sum in different orders, ~1e-6 apart on these logits of size ~1-10)."""
    model = shared_model(family)
    ids = prompt(PROMPT, seed=3)
    ref, ref_scores = generate(model, ids, DynamicCache(config=model.config))
    cache = kvcache.make_cache(model, spec)
    with kvcache.use_kvcache_attention(model):
        ours, scores = generate(model, ids, cache)
    assert_same_tokens(ours, ref, f"{family} {spec}")
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-4)
    assert ours[0, PROMPT:].unique().numel() > 1, "a degenerate model would not test the attention"


@pytest.mark.parametrize("family", ["gemma3n", "gemma4"])
def test_shared_layers_left_padded_batch(family):
    """The sharing layers get the padding mask of their type and apply it to the shared slots."""
    model = shared_model(family)
    ids, mask = left_padded((PROMPT, 13), seed=5)
    ref, _ = generate(model, ids, DynamicCache(config=model.config), mask)
    with kvcache.use_kvcache_attention(model):
        ours, _ = generate(model, ids, kvcache.make_cache(model), mask)
    assert_same_tokens(ours, ref, f"{family} padded")


def test_readers_of_the_real_gemma3n_layout():
    """Gemma 3n E2B/E4B: 35 layers, 4 sliding then 1 full, the last 15 reuse layers 18 (sliding)
    and 19 (full)."""
    config = Gemma3nTextConfig(activation_sparsity_pattern=[0.0] * 35)
    readers = kv_attended_by(config, 35)
    modes, types = config.kv_sharing_modes, config.layer_types
    assert modes.count("reuse") == 15
    stores = [i for i, m in enumerate(modes) if m == "store"]
    assert sorted(types[i] for i in stores) == ["full_attention", "sliding_attention"]
    for i in stores:
        assert readers[i] == 1 + sum(m == "reuse" and t == types[i] for m, t in zip(modes, types))
    assert sum(readers[i] for i in stores) == 2 + 15
    assert all(readers[i] == 1 for i in range(35) if i not in stores)


def test_cache_gives_the_store_layers_bridges_their_attended_by():
    cache = kvcache.make_cache(shared_model("gemma3n"), "window:window=64")
    assert cache.attended_by == [2, 2, 1, 1]
    assert [None if s is None else h.attended_by for s, h in zip(cache.kv_layers, cache.layers)] == [2, 2, None, None]


LAYERS = {
    "window": lambda: WindowLayer(window=5),
    "h2o": lambda: EvictingLayer(budget=4, policy="h2o"),
    "tova": lambda: EvictingLayer(budget=4, policy="tova", recent=1),
    "quantized": lambda: QuantizedLayer(bits=4, group_size=4, residual=2),
}


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 4, n, 8, generator=g)


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_every_reader_attends_the_set_before_the_layer_settles(kind):
    """With three readers, each reads the same set (same query, same output); the layer then
    ends where a one-reader layer fed the same tokens ends (eviction scored by the owner's weights)."""
    shared, alone = LAYERS[kind](), LAYERS[kind]()
    for step, n in enumerate([6, 1, 1, 3, 1, 1, 1]):
        k, v, q = kv(n, seed=step)
        shared.update(k, v, attended_by=3)
        alone.update(k, v)
        want = alone.attend(q)
        for reader in range(3):
            assert shared.pending is not None
            torch.testing.assert_close(shared.attend(q), want, atol=0, rtol=0, msg=f"step {step} reader {reader}")
        assert shared.pending is None
        torch.testing.assert_close(shared.positions(), alone.positions(), atol=0, rtol=0)
        torch.testing.assert_close(shared.view()[0], alone.view()[0], atol=0, rtol=0)


def test_a_sharing_reader_may_bring_only_the_last_queries():
    """Gemma 4 runs only the last queries through the sharing layers: they sit at the last positions."""
    layer = WindowLayer(window=4)
    k, v, q = kv(7, seed=1)
    full = layer.attend(q) if layer.update(k, v, attended_by=2) else None
    torch.testing.assert_close(layer.attend(q[:, :, -2:]), full[:, :, -2:], atol=1e-6, rtol=1e-6)


def test_the_owner_must_bring_every_query_and_a_refused_read_changes_nothing():
    layer = WindowLayer(window=4)
    k, v, q = kv(7, seed=1)
    layer.update(k, v, attended_by=2)
    with pytest.raises(UnsupportedOperation, match="appended 7 tokens, but attend\\(\\) got 2"):
        layer.attend(q[:, :, -2:])
    layer.attend(q)  # still pending, for the owner
    with pytest.raises(UnsupportedOperation, match="at most 7"):
        layer.attend(torch.cat([q, q], dim=2))
    layer.attend(q)
    assert layer.pending is None


def test_attended_by_must_be_a_positive_count_and_a_refused_update_changes_nothing():
    layer = WindowLayer(window=4)
    k, v, _ = kv(3, seed=2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="attended_by must be a positive integer"):
            layer.update(k, v, attended_by=bad)
    assert layer.seen == 0 and layer.pending is None
