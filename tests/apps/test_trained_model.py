"""The model shipped in ``src/kvcache/apps/weights/tiny``: it loads through the normal
``from_pretrained(directory)`` path, its tokenizer is the byte-level one, and it still does what it
was trained for (a regression guard for the weights and the loading path).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

import kvcache
from kvcache import cache_kwargs, make_cache
from kvcache.apps import tasks
from kvcache.apps.trained import MODEL_DIR, load_trained

LENGTH = 512  # tokens of each prompt: a length the model was trained on, inside the harness's range
N = 20  # held-out instances, needle depths evenly spread over [0, 1]


@pytest.fixture(scope="module")
def trained():
    return load_trained()


def test_the_checkpoint_is_a_small_safetensors_model_folder():
    names = {p.name for p in MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert not names & {"trainer_state.pt", "train_log.jsonl", "pytorch_model.bin"}
    assert (MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert config["max_position_embeddings"] >= 2048


def test_it_loads_as_a_plain_llama_with_a_byte_level_tokenizer(trained):
    model, tokenizer = trained
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    text = "pass key: 4721\n\tdef f(x): return x"
    ids = tokenizer.encode(text)
    assert ids == [tokenizer.bos_token_id, *text.encode("utf-8")]
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)


def _greedy_answers(model, tokenizer, task: str, spec: str) -> list[tuple[str, str]]:
    insts = [tasks.make_instance(task, 1000 + i, length=LENGTH, depth=i / (N - 1)) for i in range(N)]
    ids = torch.tensor([tokenizer.encode(inst.prompt) for inst in insts])
    new = max(len(inst.answer) for inst in insts) + 2
    with torch.inference_mode(), kvcache.use_kvcache_attention(model):
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            **cache_kwargs(model, make_cache(model, spec)),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    return [(inst.answer, tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True)) for inst, row in zip(insts, out)]


def test_full_cache_passkey_accuracy_stays_at_least_95_percent(trained):
    model, tokenizer = trained
    answers = _greedy_answers(model, tokenizer, "passkey", "growable")
    right = sum(tasks.score(answer, text) for answer, text in answers)
    assert right / N >= 0.95, answers


def test_a_window_that_drops_the_needle_loses_the_pass_key(trained):
    # The same check with a cache that keeps only the last quarter: needles before it are gone,
    # so the accuracy above is the model reading the needle, not guessing.
    model, tokenizer = trained
    answers = _greedy_answers(model, tokenizer, "passkey", f"window:window={LENGTH // 4},sinks=4")
    early = answers[: N // 2]  # depths < 0.5: outside the window when the question is asked
    assert sum(tasks.score(answer, text) for answer, text in early) == 0, early
