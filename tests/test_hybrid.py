"""Per-layer configs (Gemma 4) and hybrid families (linear attention, convolution, mamba, indexed
attention): ``make_cache`` keeps Hugging Face's own layers for what is not plain attention and
ours for the rest; every cache operation works for them or refuses, changing nothing."""

import copy

import pytest
import torch
import transformers
from transformers import DynamicCache

import kvcache
from kvcache import ModelMismatchError, UnsupportedOperation

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
