"""The prompt store on a real pretrained model (SmolLM2-135M-Instruct): a shared system prompt reused
from every backend gives the tokens a fresh prompt gives, single and batched. Deselect with
``-m "not real_model"``."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from helpers import assert_same_tokens
from kvcache.apps.bench.workload import corpus
from kvcache.models import load

#: SmolLM2 through the prompt store (about 30 s): the slow lane's; every backend x kind on the tiny
#: families (tests/prompts/) runs on every run.
pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CHUNK = 64
NEW = 12
QUESTIONS = ["What is the text above about?", "Name one word the text uses twice.", "Is the text above long?"]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load("smollm2", progress=True)
    tokenizer.padding_side = "left"
    system = corpus()[:1200]
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS]
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    return model, tokenizer, batch


def greedy(model, tokenizer, ids, mask, cache=None):
    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.inference_mode():
        return model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=tokenizer.pad_token_id)


@pytest.fixture
def location(request, tmp_path):
    if request.param == "memory":
        return "memory"
    return str(tmp_path / "store") if request.param == "folder" else request.getfixturevalue("redis_url")


# A backend moves bytes and never sees the model: every backend x kind runs on the tiny families
# (test_prompt_store.py). On SmolLM2 every kind goes through memory, and the persistent and the
# networked backends carry the default kind: what only a real model's entries can show.
@pytest.mark.parametrize(
    ("location", "spec"),
    [("memory", "growable"), ("memory", "static:capacity=512"), ("memory", "concat"), ("folder", "growable"), ("redis", "growable")],
    indirect=["location"],
)
def test_a_stored_system_prompt_gives_smollm2_the_same_answer(smollm2, location, spec):
    model, tokenizer, batch = smollm2
    rows = [batch["input_ids"][r : r + 1, batch["attention_mask"][r].bool()] for r in range(len(QUESTIONS))]
    store = kvcache.PromptStore(location, chunk=CHUNK)
    store.prefill(model, rows[0], spec)
    ids = rows[1]
    cache, reused = store.cache_for(model, ids, spec)
    assert reused >= 4 * CHUNK  # the system prompt's chunks (the questions differ after it)
    assert_same_tokens(greedy(model, tokenizer, ids, None, cache), greedy(model, tokenizer, ids, None), f"{spec} at {location}")


@pytest.mark.parametrize("location", ["redis"], indirect=True)
def test_a_left_padded_batch_reuses_the_system_prompt(smollm2, location):
    model, tokenizer, batch = smollm2
    ids, mask = batch["input_ids"], batch["attention_mask"]
    store = kvcache.PromptStore(location, chunk=CHUNK)
    store.prefill(model, ids[:1, mask[0].bool()])
    cache, reused = store.cache_for(model, ids, attention_mask=mask)
    assert reused >= 4 * CHUNK
    assert_same_tokens(greedy(model, tokenizer, ids, mask, cache), greedy(model, tokenizer, ids, mask), f"batch at {location}")
