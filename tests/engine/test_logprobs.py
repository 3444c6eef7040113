"""Log-probabilities from the engine (issue 39): each generated and prompt token's log-probability
and its top alternatives equal the log-softmax of Hugging Face's own forward pass over the whole
sequence, whether the prompt is computed in one pass or in chunks, and a prompt to be scored is
computed, not taken from blocks another request left in the pool."""

from __future__ import annotations

import pytest
import torch

import kvcache
from engine_reference import ids

TOL = 1e-4  # float32: chunked paged attention against one dense pass


def reference(model, tokens: list[int]) -> torch.Tensor:
    """Log-softmax of the model's logits at every position of ``tokens`` ``[T, V]``."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("max_batch_tokens", [512, 24])  # one pass, or chunks of 24 across blocks of 16
def test_prompt_and_generated_logprobs_equal_the_models_own(model, max_batch_tokens):
    engine = kvcache.Engine(model, "growable", blocks=32, block_size=16, max_batch_tokens=max_batch_tokens)
    prompt = ids(70, seed=1)
    handle = engine.submit(prompt, max_new_tokens=6, logprobs=3, prompt_logprobs=2)
    generated = handle.result()
    ref = reference(model, prompt + generated)
    scores = handle.prompt_logprobs
    assert len(scores) == len(prompt) and scores[0] is None
    for p in range(1, len(prompt)):
        s = scores[p]
        assert s.token == prompt[p] and abs(s.logprob - ref[p - 1, prompt[p]].item()) < TOL
        top = ref[p - 1].topk(2)
        assert [t for t, _ in s.top] == top.indices.tolist() or abs(top.values[0] - top.values[1]) < TOL
        assert all(abs(v - ref[p - 1, t].item()) < TOL for t, v in s.top)
    assert [s.token for s in handle.logprobs] == generated
    for i, s in enumerate(handle.logprobs):
        assert abs(s.logprob - ref[len(prompt) - 1 + i, generated[i]].item()) < TOL and len(s.top) == 3


def test_a_scored_prompt_is_computed_even_when_the_pool_holds_it(model):
    engine = kvcache.Engine(model, "growable", blocks=32, block_size=16)
    prompt = ids(50, seed=2)
    engine.submit(prompt, max_new_tokens=2).result()
    plain = engine.submit(prompt, max_new_tokens=2)
    plain.result()
    assert plain.stats.reused_pool == 48  # three whole blocks of 16 were there to reuse
    scored = engine.submit(prompt, max_new_tokens=2, prompt_logprobs=0)
    scored.result()
    assert scored.stats.reused_pool == 0 and all(s is not None for s in scored.prompt_logprobs[1:])
    assert scored.prompt_logprobs[1].top == ()


def test_nothing_asked_nothing_recorded(model):
    engine = kvcache.Engine(model, "growable", blocks=16, block_size=16)
    handle = engine.submit(ids(20, seed=3), max_new_tokens=3)
    handle.result()
    assert handle.logprobs == [] and handle.prompt_logprobs == []


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "3"])
def test_bad_counts_are_refused_naming_the_option(model, bad):
    engine = kvcache.Engine(model, "growable", blocks=16, block_size=16)
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        engine.submit(ids(10, seed=4), max_new_tokens=2, logprobs=bad)
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        engine.submit(ids(10, seed=4), max_new_tokens=2, prompt_logprobs=bad)
    assert engine.idle
