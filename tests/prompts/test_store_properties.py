"""Random sequences of stores and lookups against a simple reference: the set of stored prefixes."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcache
from kvcache import cache_kwargs
from helpers import model_for

CHUNK = 4
#: Two token ids, so random prompts share prefixes often.
prompts = st.lists(st.sampled_from([5, 6]), min_size=1, max_size=14)
operations = st.lists(st.tuples(st.sampled_from(["prefill", "put after generate", "look up"]), prompts), min_size=1, max_size=8)


def reference_reuse(stored: set[tuple[int, ...]], tokens: list[int]) -> int:
    """Longest stored chunk-aligned prefix of ``tokens``, less the last token if it is in it (that
    one is left to compute)."""
    n = 0
    while (n + 1) * CHUNK <= len(tokens) and tuple(tokens[: (n + 1) * CHUNK]) in stored:
        n += 1
    return min(n * CHUNK, len(tokens) - 1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations)
def test_lookups_reuse_exactly_the_longest_stored_prefix(ops):
    model = model_for("llama")
    store = kvcache.PromptStore(chunk=CHUNK)
    stored: set[tuple[int, ...]] = set()
    for op, tokens in ops:
        ids = torch.tensor([tokens])
        cache, reused = store.cache_for(model, ids)
        assert reused == reference_reuse(stored, tokens), (op, tokens)
        if reused:  # the reused slots hold what a fresh prefill of those tokens computes
            fresh = kvcache.make_cache(model)
            kvcache.prefill(model, ids[:, :reused], fresh)
            for ours, theirs in zip(cache.kv_layers, fresh.kv_layers):
                # fp32 rounding of passes of different lengths; the values are O(1)
                torch.testing.assert_close(ours.view()[0], theirs.view()[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(ours.view()[1], theirs.view()[1], atol=1e-5, rtol=1e-5)
        if op == "look up":
            continue
        if op == "prefill":
            store.prefill(model, ids)
            held = tokens[:-1]
        else:
            with torch.no_grad():
                out = model.generate(ids, **cache_kwargs(model, cache), max_new_tokens=3, do_sample=False)
            store.put(cache, out)
            held = out[0, : cache.seen].tolist()
        stored |= {tuple(held[: (j + 1) * CHUNK]) for j in range(len(held) // CHUNK)}
        assert len(store.backend) == len(stored)
