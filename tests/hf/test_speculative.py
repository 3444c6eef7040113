"""Speculative decoding (assisted generation, prompt-lookup decoding) on sliding-window models.

``generate`` appends candidate tokens in one update and removes the rejected ones with
``crop(-n)``; it calls ``activate_past_recording()`` first. The default cache keeps a sliding
layer in position order (``SlidingLayer``): while recording it lets nothing since the last crop
leave its buffer. Beside bounded kinds a sliding layer is a ring buffer (``WindowLayer``), which
has by then written the candidates over the slots the shorter sequence needs, so it logs each
update until the next crop (``layers/rollback.py``) and ``trim`` puts the window back exactly.

References: Hugging Face's ``DynamicCache`` on the model's own attention (greedy, token-identical),
torch's ``scaled_dot_product_attention`` over the whole history with the window mask, and a plain
list of every token for the window layer's kept (position, key) pairs.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import kvcache
from kvcache import cache_kwargs
from kvcache.errors import UnsupportedOperation
from kvcache.layers import SlidingLayer, WindowLayer
from kvcache.apps.tiny import tiny_model

from helpers import assert_same_tokens, layer_fingerprint, prompt

WINDOW = 8
NEW_TOKENS = 24


@functools.lru_cache(maxsize=None)
def target_and_assistant(family: str):
    """A tiny sliding model and a noisy copy of it: the copy agrees on some tokens and not on
    others, so rounds end with partial acceptance (crop of some, not all, candidates)."""
    # The default tiny gemma2 (tied embeddings) soon repeats one token, which any draft predicts.
    overrides = {"tie_word_embeddings": False, "initializer_range": 0.2} if family == "gemma2" else {}
    target = tiny_model(family, sliding_window=WINDOW, **overrides)
    assistant = tiny_model(family, sliding_window=WINDOW, **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in assistant.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1 * p.std().clamp(min=1e-3))
    # Draft 5 tokens a round: a random model's confidence is low, and the default threshold (0.4) would stop at 1.
    assistant.generation_config.num_assistant_tokens = 5
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return target, assistant


def repetitive_prompt() -> torch.Tensor:
    """30 tokens (past the window) that repeat, so prompt lookup finds candidates."""
    ids = prompt(15, seed=4)
    return torch.cat([ids, ids], dim=1)


def record_crops(cache):
    """Wrap ``cache.crop`` to log ``(tokens removed, tokens seen before)`` for each call."""
    crops, crop = [], cache.crop

    def logged(n):
        crops.append((-int(n), cache.get_seq_length()))
        return crop(n)

    cache.crop = logged
    return crops


METHODS = {
    "assisted": lambda assistant: {"assistant_model": assistant},
    "prompt_lookup": lambda assistant: {"prompt_lookup_num_tokens": 4},
}


#: (spec, whether the model runs the "kvcache" attention): the default cache on the model's own
#: attention and on ours (sliding layers in order), and a bounded kind whose budget is never reached
#: (sliding layers as rings, rolled back by their logs).
SETUPS = {"default": ("growable", False), "default+switch": ("growable", True), "rings": ("h2o:budget=4096", True)}


def attention(model, switch: bool):
    return kvcache.use_kvcache_attention(model) if switch else contextlib.nullcontext()


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen2"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_speculative_decoding_matches_dynamic_cache(family, method, setup):
    spec, switch = SETUPS[setup]
    target, assistant = target_and_assistant(family)
    ids = repetitive_prompt()
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, **METHODS[method](assistant))
    ref = target.generate(ids, **cache_kwargs(target, DynamicCache(config=target.config)), **kwargs)
    cache = kvcache.make_cache(target, spec)
    crops = record_crops(cache)
    with attention(target, switch):
        ours = target.generate(ids, **cache_kwargs(target, cache), **kwargs)
    assert_same_tokens(ours, ref, f"{family} {method} {setup}")
    # The test took back tokens past the window, and some rounds kept part of their candidates.
    assert any(n > 0 and seen > WINDOW + n for n, seen in crops), crops
    per_token = 2 * 16 * 2 * 4  # [1, 2, 1, 16] keys + values, fp32
    windows = [s for s in cache.kv_layers if isinstance(s, WindowLayer)]
    sliding = [s for s in cache.kv_layers if isinstance(s, SlidingLayer)]
    assert (windows if setup == "rings" else sliding) and not (sliding if setup == "rings" else windows)
    assert all(s.journal is not None and s.journal.nbytes == 0 for s in windows)  # emptied by the last crop
    assert all(s.nbytes == s.max_length * per_token for s in windows)  # the ring
    # In order: the window less one and the spare room, at most twice over once the last crop gave
    # back what recording kept (the 30-token prompt, before the first crop).
    assert all(s.nbytes <= 2 * (WINDOW - 1 + s.spare) * per_token for s in sliding)


def test_assisted_rounds_accept_part_of_their_candidates():
    """The noisy assistant is a real test of partial rollback: some rounds keep some candidates."""
    target, assistant = target_and_assistant("mistral")
    cache = kvcache.make_cache(target)
    crops = record_crops(cache)
    with kvcache.use_kvcache_attention(target):
        target.generate(repetitive_prompt(), **cache_kwargs(target, cache), assistant_model=assistant, max_new_tokens=NEW_TOKENS,
                        do_sample=False)  # fmt: skip
    removed = [n for n, _ in crops]
    assert any(0 < n < 5 for n in removed), removed


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_crop_within_the_log_continues_like_dynamic_cache_and_beyond_it_refuses(family, setup):
    """Manual speculation: feed past the window, record, append 3 candidates, crop 2, continue.
    Cropping more than the layers can take back raises and changes nothing."""
    spec, switch = SETUPS[setup]
    target, _ = target_and_assistant(family)
    ids = prompt(20, seed=9)
    cand, nxt = prompt(3, seed=10), prompt(2, seed=11)
    ref = DynamicCache(config=target.config)
    target(ids, **cache_kwargs(target, ref))
    ref.activate_past_recording()
    target(cand, **cache_kwargs(target, ref))
    ref.crop(-2)
    want = target(nxt, **cache_kwargs(target, ref)).logits

    cache = kvcache.make_cache(target, spec)
    with attention(target, switch):
        target(ids, **cache_kwargs(target, cache))
        cache.activate_past_recording()
        target(cand, **cache_kwargs(target, cache))
        before = [layer_fingerprint(s) for s in cache.kv_layers]
        limit = min(s.rollback_tokens for s in cache.kv_layers if isinstance(s, (WindowLayer, SlidingLayer)))
        assert limit == 3 if setup == "rings" else limit >= 3  # a ring's log; the buffer in order holds more
        with pytest.raises(UnsupportedOperation, match=f"can take back the last {limit}"):
            cache.crop(-(limit + 1))
        assert [layer_fingerprint(s) for s in cache.kv_layers] == before
        cache.crop(-2)
        got = target(nxt, **cache_kwargs(target, cache)).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32, our kernel vs HF's (~1e-6 apart)


def test_without_recording_a_wrapped_window_still_refuses():
    layer = WindowLayer(4)
    layer.update(torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    layer.settle()
    with pytest.raises(UnsupportedOperation, match="activate_past_recording"):
        layer.trim(1)


def test_recording_memory_stays_bounded_and_switching_off_frees_it():
    """No trims for 100 decode steps: the log keeps at most ``window`` tokens (2 slots each)."""
    window, slot = 6, 2 * 8 * 4  # [1, 2, 1, 8] fp32
    layer = WindowLayer(window)
    layer.activate_past_recording()
    for step in range(100):
        layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
        layer.attend(torch.randn(1, 2, 1, 8))
        assert layer.journal.tokens <= window
        assert layer.nbytes <= window * 2 * slot + window * 2 * 2 * slot  # ring + (old + new) K and V per logged token
    layer.trim(window)  # all of the log
    assert layer.seen == 100 - window and layer.nbytes == window * 2 * slot
    layer.activate_past_recording(False)
    assert layer.journal is None


# ---- property: a recording window against the list of every token ------------------------------


def reference_attention(q, hist_k, hist_v, first, window, sinks):
    total = hist_k.shape[2]
    qp = torch.arange(first, first + q.shape[2]).view(-1, 1)
    kp = torch.arange(total).view(1, -1)
    mask = (kp <= qp) & ((kp > qp - window) | (kp < sinks))
    return F.scaled_dot_product_attention(q, hist_k, hist_v, attn_mask=mask, enable_gqa=True)


def check_kept(layer, hist_k, hist_v, window, sinks):
    """The layer holds exactly the sinks and the last ``window`` positions, with their keys."""
    seen = hist_k.shape[2]
    assert layer.seen == seen
    want = {p for p in range(seen) if p >= seen - window or p < sinks}
    keys, values = layer.view()
    if not want:
        assert layer.length == 0
        return
    pos = layer.positions()[0, 0]
    live = [j for j, p in enumerate(pos.tolist()) if p in want]
    assert {pos[j].item() for j in live} == want and len(live) == len(want) == layer.length
    idx = pos[live]
    assert torch.equal(keys[:, :, live], hist_k[:, :, idx]) and torch.equal(values[:, :, live], hist_v[:, :, idx])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 7)),
        st.tuples(st.just("trim"), st.integers(0, 8)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 5), sinks=st.integers(0, 2), record_from=st.integers(0, 12), script=ops, seed=st.integers(0, 2**16))
def test_recording_window_against_every_token(window, sinks, record_from, script, seed):
    """Random appends and trims: attention equals SDPA over every token with the window mask;
    a trim within what the layer says it can take back restores exactly the (position, key) set
    of n tokens ago; a trim beyond it raises and changes nothing."""
    g = torch.Generator().manual_seed(seed)
    layer = WindowLayer(window, sinks=sinks, initial_capacity=2)
    hist_k, hist_v = torch.empty(1, 2, 0, 4), torch.empty(1, 2, 0, 3)
    for op, n in script:
        if hist_k.shape[2] >= record_from and layer.journal is None:
            layer.activate_past_recording()
        if op == "append":
            k, v, q = (torch.randn(1, h, n, d, generator=g) for h, d in ((2, 4), (2, 3), (4, 4)))
            first = hist_k.shape[2]
            hist_k, hist_v = torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2)
            layer.update(k, v)
            torch.testing.assert_close(layer.attend(q), reference_attention(q, hist_k, hist_v, first, window, sinks), atol=1e-5, rtol=1e-5)
        elif n <= layer.rollback_tokens:
            layer.trim(n)
            hist_k, hist_v = hist_k[:, :, : hist_k.shape[2] - n], hist_v[:, :, : hist_v.shape[2] - n]
        else:
            before = layer_fingerprint(layer), layer.state().clone()
            with pytest.raises(UnsupportedOperation):
                layer.trim(n)
            after = layer_fingerprint(layer), layer.state()
            assert after[0] == before[0]
            assert all(torch.equal(after[1].tensors[t], before[1].tensors[t]) for t in before[1].tensors)
        check_kept(layer, hist_k, hist_v, window, sinks)
        # What it can take back: everything while the ring never wrapped, else the tokens logged since the last trim.
        assert layer.rollback_tokens >= (0 if layer.journal is None else layer.journal.tokens)
