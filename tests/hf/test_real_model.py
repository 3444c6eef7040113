"""A real pretrained model: SmolLM2-135M-Instruct from the registry (downloaded and converted once
into ``$KVCACHE_HOME``, then found there), greedy with kvcache's caches against ``DynamicCache``.

Not skipped when the network is down: a missing model is a failure that prints the
ModelUnavailableError's one line. Deselect with ``-m "not real_model"``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from helpers import assert_same_tokens
from kvcache import cache_kwargs, make_cache, use_kvcache_attention
from kvcache.models import load

pytestmark = pytest.mark.real_model

PROMPTS = [
    "The capital of France is",
    "Here is a short list of three fruits, each with its colour:",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load("smollm2", progress=True)
    tokenizer.padding_side = "left"
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return model, tokenizer, batch


def generate(model, tokenizer, batch, cache):
    with torch.inference_mode():
        return model.generate(
            **batch,
            **cache_kwargs(model, cache),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )


@pytest.fixture(scope="module")
def reference(smollm2):
    model, tokenizer, batch = smollm2
    return generate(model, tokenizer, batch, DynamicCache(config=model.config))


def test_the_model_is_smollm2_and_the_prompts_are_left_padded(smollm2, reference):
    model, tokenizer, batch = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert model.config._attn_implementation != "kvcache"
    mask = batch["attention_mask"]
    assert mask[:, 0].tolist().count(0) == 1 and mask[:, -1].tolist() == [1, 1]  # one row is padded
    assert reference.shape == (2, batch["input_ids"].shape[1] + NEW_TOKENS)
    answer = tokenizer.decode(reference[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer  # a real model, not random weights


@pytest.mark.parametrize("kvcache_attention", [True, False], ids=["kvcache-attention", "model-attention"])
@pytest.mark.parametrize("spec", ["growable", "static:capacity=64"])
def test_kvcache_gives_dynamic_caches_tokens(smollm2, reference, spec, kvcache_attention):
    model, tokenizer, batch = smollm2
    before = model.config._attn_implementation
    switch = use_kvcache_attention(model) if kvcache_attention else contextlib.nullcontext()
    with switch:
        ours = generate(model, tokenizer, batch, make_cache(model, spec))
    assert model.config._attn_implementation == before
    assert_same_tokens(ours, reference, f"{spec}, {'kvcache' if kvcache_attention else 'model'} attention")
