"""Per-layer configs (Gemma 4) and hybrid families (linear attention, convolution, mamba, indexed
attention): ``make_cache`` keeps Hugging Face's own layers for what is not plain attention and
ours for the rest; every cache operation works for them or refuses, changing nothing."""

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

import kvcache
from kvcache import ModelMismatchError, UnsupportedOperation, cache_kwargs

from families import build_model, greedy


def gemma4_text_config(**overrides):
    settings = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=16,
    )
    return transformers.Gemma4TextConfig(**(settings | overrides))


# ---- defect 1: configs whose settings vary per layer ------------------------------------------


def test_make_cache_reads_per_layer_settings_of_gemma4():
    # Before the fix: AmbiguousGlobalPerLayerAttributeError (a RuntimeError) from config.head_dim.
    cache = kvcache.make_cache(transformers.Gemma4TextConfig())
    per_layer = cache.config_summary["head_dim"]
    assert per_layer == {"per_layer": [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512]}


def test_saved_cache_is_refused_by_a_model_whose_per_layer_settings_differ(tmp_path):
    cache = kvcache.make_cache(gemma4_text_config())
    cache.save(tmp_path / "c.kv")
    kvcache.load_cache(tmp_path / "c.kv", gemma4_text_config())  # the same settings load
    with pytest.raises(ModelMismatchError, match="head_dim"):
        kvcache.load_cache(tmp_path / "c.kv", gemma4_text_config(global_head_dim=64))


# ---- defect 6: hybrid families (linear attention, conv, mamba, hybrid layers) -----------------


@pytest.fixture(scope="module")
def jamba():
    return build_model("jamba")  # mamba (linear_attention) and attention layers


@pytest.fixture(scope="module")
def falcon_h1():
    return build_model("falcon_h1")  # "hybrid" layers: mamba and attention side by side


def _prefilled(model, tokens=10):
    cache = kvcache.make_cache(model)
    ids = torch.randint(3, 128, (2, tokens), generator=torch.Generator().manual_seed(1))
    with kvcache.use_kvcache_attention(model), torch.no_grad():
        model(ids, **cache_kwargs(model, cache), use_cache=True)
    return cache


@pytest.mark.parametrize("family", ["jamba", "falcon_h1"])
def test_hybrid_default_cache_generates_like_dynamic_cache(family, request):
    # Before the fix: UnsupportedOperation from make_cache for 'linear_attention' / 'hybrid' layers.
    model = request.getfixturevalue(family)
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    expected = greedy(model, ids, torch.ones_like(ids), DynamicCache(config=model.config))
    with kvcache.use_kvcache_attention(model):
        got = greedy(model, ids, torch.ones_like(ids), kvcache.make_cache(model))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["jamba", "falcon_h1"])
def test_hybrid_cache_counts_tokens_from_attention_and_bytes_from_every_layer(family, request):
    cache = _prefilled(request.getfixturevalue(family))
    assert cache.get_seq_length() == 10
    kv_bytes = sum(s.nbytes for s in cache.kv_layers if s is not None)
    assert cache.nbytes > kv_bytes > 0  # the linear states count too


def test_hybrid_batch_select_and_repeat_keep_linear_states_in_step(falcon_h1):
    cache = _prefilled(falcon_h1)
    i, linear = next(iter(cache.linear.items()))
    conv = linear.conv_states[0].clone()
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(linear.conv_states[0], conv[1:2]) and cache.kv_layers[i].view()[0].shape[0] == 1
    cache.batch_repeat_interleave(2)
    assert torch.equal(linear.conv_states[0], conv[1:2].repeat(2, 1, 1))
    with pytest.raises(ValueError):
        cache.batch_select_indices(torch.tensor([5]))
    assert torch.equal(linear.conv_states[0], conv[1:2].repeat(2, 1, 1))  # unchanged


def test_hybrid_snapshot_restore_and_fork_are_independent(jamba):
    cache = _prefilled(jamba)
    snap = cache.snapshot()
    fork = cache.fork()
    i, linear = next(iter(cache.linear.items()))
    before = linear.recurrent_states[0].clone()
    with kvcache.use_kvcache_attention(jamba), torch.no_grad():
        jamba(torch.tensor([[5], [6]]), **cache_kwargs(jamba, cache), use_cache=True)
    assert not torch.equal(cache.linear[i].recurrent_states[0], before)
    assert torch.equal(fork.linear[i].recurrent_states[0], before) and fork.get_seq_length() == 10
    cache.restore(snap)
    assert torch.equal(cache.linear[i].recurrent_states[0], before) and cache.get_seq_length() == 10
    assert cache.layers[i] is cache.linear[i]  # the slot holds the restored layer


def test_hybrid_cache_refuses_what_it_cannot_cover_changing_nothing(jamba, tmp_path):
    cache = _prefilled(jamba)
    seen, nbytes = cache.get_seq_length(), cache.nbytes
    with pytest.raises(UnsupportedOperation, match="linear_attention.*recurrent"):
        cache.crop(-2)
    with pytest.raises(UnsupportedOperation, match="save.*linear_attention"):
        cache.save(tmp_path / "c.kv")
    assert not (tmp_path / "c.kv").exists()
    with pytest.raises(UnsupportedOperation, match="extend.*linear_attention"):
        cache.extend([None] * len(cache.kv_layers))
    assert (cache.get_seq_length(), cache.nbytes) == (seen, nbytes)


def test_bounded_spec_beside_fixed_size_layers_is_allowed_and_beside_growing_ones_refused(jamba):
    cache = kvcache.make_cache(jamba, "window", window=4)  # mamba state is fixed-size anyway
    assert cache.needs_kvcache_attention
    config = transformers.DeepseekV32Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert get_layer_types_and_kwargs(config)[0] == ["indexed_attention"] * 2  # a growing indexer per layer
    with pytest.raises(UnsupportedOperation, match="indexed_attention.*growable"):
        kvcache.make_cache(config, "window", window=4)
    assert kvcache.make_cache(config).other_kinds == {0: "indexed_attention", 1: "indexed_attention"}


def test_model_without_attention_layers_is_refused():
    config = copy.deepcopy(transformers.JambaConfig(num_hidden_layers=2, attn_layer_period=8))
    with pytest.raises(UnsupportedOperation, match="no attention layer"):
        kvcache.make_cache(config)
