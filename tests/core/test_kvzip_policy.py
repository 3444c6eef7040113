"""The ``kvzip`` policy used plainly (no repetition pass): scores are the largest weight any query
of a pass paid a slot, the newest tokens protected. Against a reference in plain torch.

The regression (issue 38): with nothing protected, every token generated after a prompt longer than
the budget was evicted on arrival, since under causal attention an early query spreads its weight
over few keys and the early slots' maxima beat anything one later query pays a new token; the model
then answered "TheTheThe...".
"""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache.apps.tiny import tiny_model
from kvcache.layers import EvictingLayer
from kvcache.layers.policies import RepeatScores, get_policy
from test_query_aware import KV_HEADS, Q_HEADS, crafted, probs

PROMPT = 40


def kvzip_reference(q, k, budget: int, recent: int) -> list[set[int]]:
    """Kept positions per KV head after one pass over ``T`` tokens (one batch row, ``q`` ``[Hq, T, D]``):
    the last ``recent`` always, the rest by the largest causal weight any query of any of the KV
    head's query heads paid the slot."""
    group = Q_HEADS // KV_HEADS
    total = k.shape[1]
    out = []
    for h in range(KV_HEADS):
        w = torch.stack([probs(q[g], k[h], list(range(total)), range(total)) for g in range(h * group, (h + 1) * group)])
        score = w.sum(0).amax(0)  # summed over the head's query heads, the max over queries
        free = sorted(range(total - recent), key=lambda p: -float(score[p]))
        out.append(set(range(total - recent, total)) | set(free[: budget - recent]))
    return out


@pytest.mark.parametrize(("budget", "recent"), [(16, 8), (64, 32), (80, 32)])
def test_kvzip_protects_min_of_32_and_half_the_budget(budget, recent):
    assert get_policy("kvzip", queries="prompt").recent_for(budget) == recent
    assert RepeatScores.RECENT == 32


@pytest.mark.parametrize("budget", [12, 20])
def test_kvzip_prefill_keeps_the_references_slots(budget):
    q, k, v = crafted(seed=3, total=PROMPT, heavy=({3, 11, 20}, {6, 15, 24}))
    layer = EvictingLayer(budget, policy="kvzip", queries="prompt")
    layer.update(k.float(), v.float())
    assert layer.pending.weights == "max"
    layer.attend(q.float())
    kept = [set(layer.positions()[0, h].tolist()) for h in range(KV_HEADS)]
    assert kept == kvzip_reference(q[0], k[0], budget, min(32, budget // 2))


def test_kvzip_keeps_the_tokens_it_generates_while_they_are_recent():
    q, k, v = crafted(seed=4, total=PROMPT + 12, heavy=({3, 11}, {6, 15}))
    budget = 16
    recent = min(32, budget // 2)
    layer = EvictingLayer(budget, policy="kvzip", queries="prompt")
    layer.update(k[:, :, :PROMPT].float(), v[:, :, :PROMPT].float())
    layer.attend(q[:, :, :PROMPT].float())
    for t in range(PROMPT, PROMPT + 12):
        layer.update(k[:, :, t : t + 1].float(), v[:, :, t : t + 1].float())
        layer.attend(q[:, :, t : t + 1].float())
        for h in range(KV_HEADS):
            kept = set(layer.positions()[0, h].tolist())
            assert set(range(t + 1 - recent, t + 1)) <= kept, f"step {t}, head {h}: a recent token was evicted"
            assert len(kept) == budget


def test_an_explicit_recent_still_wins():
    layer = EvictingLayer(16, policy="kvzip", recent=2, queries="prompt")
    assert layer.recent_now() == 2


def test_plain_kvzip_is_refused_with_how_to_run_kvzip_itself():
    with pytest.raises(ValueError, match=r"compress_context\(model, tokenizer, context_ids, ratio\).*queries=prompt"):
        EvictingLayer(16, policy="kvzip")
    with pytest.raises(kvcache.SpecError, match="compress_context"):
        kvcache.make_cache(tiny_model("llama"), "kvzip:budget=16")
    with pytest.raises(ValueError, match="takes 'prompt' only"):
        get_policy("kvzip", queries="context")
