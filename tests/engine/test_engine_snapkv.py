"""``Engine(model, "snapkv:budget=...")``: each prompt, once computed, compressed into the blocks of
what SnapKV keeps, the prompt's blocks given back, generated tokens appended.

The reference (``snapkv_reference``): kvcache's own ``snapkv`` cache prefilled in one pass through
the model (its prompt pass attends every token, then keeps the best per KV head), its kept keys
and values moved into a ``DynamicCache``, then greedy decode through Hugging Face's attention with
each new token's true position. Near ties as in ``engine_reference.py``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine, make_cache, use_kvcache_attention
from kvcache.errors import UnsupportedOperation

NEW = 8


def snapkv_reference(model, prompt: list[int], new: int, spec: str):
    """Greedy tokens and top-2 gaps, and the kept keys per layer ``[Hkv, keep, D]``."""
    cache = make_cache(model, spec)
    with torch.inference_mode():
        with use_kvcache_attention(model):
            logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
        kept = [layer.view() for layer in cache.kv_layers]
        dynamic = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kept):
            dynamic.update(k.clone(), v.clone(), i)
        tokens, gaps = [], []
        for step in range(new):
            top = logits.float().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if step + 1 < new:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(prompt) + step]]),
                            past_key_values=dynamic, use_cache=True)
                logits = out.logits[0, -1]
    return (tokens, gaps), [k[0] for k, _ in kept]


def serve(engine: Engine, prompts, new=NEW):
    handles = [engine.submit(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0
    return handles


SPEC = "snapkv:budget=0.4,window=4,pool=3"


@pytest.mark.parametrize("spec", [SPEC, "snapkv:budget=12,window=6,pool=1"])
@pytest.mark.parametrize("budget", [512, 24])
def test_every_request_matches_the_snapkv_reference(model, spec, budget):
    prompts = [ids(n, i) for i, n in enumerate([5, 16, 17, 40, 61, 9])]
    engine = Engine(model, spec, block_size=8, blocks=96, max_batch_tokens=budget, max_seqs=4)
    handles = serve(engine, prompts)
    ties = sum(same_or_near_tie(h.result(), snapkv_reference(model, p, NEW, spec)[0], f"{len(p)} tokens")
               for p, h in zip(prompts, handles))
    assert ties <= 1


def test_a_lone_request_keeps_exactly_what_the_snapkv_cache_keeps(model):
    prompt = ids(45, 3)
    engine = Engine(model, SPEC, block_size=8, blocks=32, max_batch_tokens=16, max_seqs=2)
    seen = []
    compress = engine._compress
    engine._compress = lambda c, reported: seen.append(compress(c, reported)) or seen[-1]  # this instance only
    serve(engine, [prompt], new=2)
    (kept,) = seen
    _, expected = snapkv_reference(model, prompt, 1, SPEC)
    assert len(kept) == len(expected)
    for (k, _), want in zip(kept, expected):
        assert k.shape == want.shape == (want.shape[0], 18, want.shape[2])  # ceil(0.4 * 45)
        torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)  # the same slots (chunked vs one pass: rounding)


def test_a_compressed_prompt_holds_only_the_blocks_of_what_it_keeps(model):
    prompt = ids(80, 4)
    engine = Engine(model, SPEC, block_size=8, blocks=32, max_batch_tokens=512, max_seqs=2, share_prefixes=False)
    handle = engine.submit(prompt, max_new_tokens=NEW, eos_token_id=[])
    engine.step()
    request = handle._request
    assert request.compressed and request.dropped == 80 - 32  # ceil(0.4 * 80) kept
    assert len(request.table) == 4 and engine.pool.owned_count == 4 and engine.pool.free_count == 28
    while engine.step():
        engine.pool.check()
    assert handle.result() == snapkv_reference(model, prompt, NEW, SPEC)[0][0]


def test_a_shared_prompt_is_computed_once_and_then_compressed_per_request(model):
    shared = ids(32, 11)
    prompts = [shared + ids(6, 20 + i) for i in range(4)]
    engine = Engine(model, SPEC, block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    handles = serve(engine, prompts)
    assert [h.stats.reused_pool for h in handles] == [0, 32, 32, 32]
    for p, h in zip(prompts, handles):
        same_or_near_tie(h.result(), snapkv_reference(model, p, NEW, SPEC)[0])


def test_preempted_compressed_requests_are_recomputed_and_compressed_again(model):
    prompts = [ids(30 + 5 * i, 40 + i) for i in range(4)]
    engine = Engine(model, SPEC, block_size=4, blocks=22, max_batch_tokens=64, max_seqs=4, share_prefixes=False)
    handles = serve(engine, prompts, new=16)
    assert engine.stats.preemptions > 0
    ties = sum(same_or_near_tie(h.result(), snapkv_reference(model, p, 16, SPEC)[0]) for p, h in zip(prompts, handles))
    assert ties <= 1


@pytest.mark.parametrize(
    "spec,kw,error,match",
    [
        ("snapkv:budget=0.25,sinks=4", {}, UnsupportedOperation, "not sinks"),
        ("snapkv:budget=0.25,storage=int8", {}, UnsupportedOperation, "not storage"),
        ("snapkv:budget=0.25,window=32", {"max_batch_tokens": 16}, ValueError, "observation window"),
        ("h2o:budget=0.25", {}, UnsupportedOperation, "not built into the engine"),
    ],
)
def test_snapkv_options_the_engine_does_not_take_are_refused(model, spec, kw, error, match):
    with pytest.raises(error, match=match):
        Engine(model, spec, block_size=8, blocks=8, **kw)


def test_a_prompt_one_token_past_a_shared_prefix_still_computes_its_observation_window(model):
    shared = ids(16, 12)
    prompts = [shared, shared + [9]]
    engine = Engine(model, SPEC, block_size=4, blocks=32, max_batch_tokens=64, max_seqs=2)
    first = serve(engine, prompts[:1])[0]
    second = serve(engine, prompts[1:])[0]
    assert second.stats.reused_pool == 12, "the pool gave the observation window's tokens too"
    assert second._request.compressed
    for p, h in zip(prompts, (first, second)):
        same_or_near_tie(h.result(), snapkv_reference(model, p, NEW, SPEC)[0])


def test_a_request_of_a_float_engine_may_ask_for_snapkv_or_growable(model):
    prompts = [ids(40, 13), ids(33, 14)]
    engine = Engine(model, "growable", block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    compressed = engine.submit(prompts[0], max_new_tokens=NEW, eos_token_id=[], cache=SPEC)
    plain = engine.submit(prompts[1], max_new_tokens=NEW, eos_token_id=[], cache="growable")
    while engine.step():
        engine.pool.check()
    assert compressed._request.compressed and not plain._request.compressed
    same_or_near_tie(compressed.result(), snapkv_reference(model, prompts[0], NEW, SPEC)[0])
    same_or_near_tie(plain.result(), reference(model, prompts[1], NEW))
    snap = Engine(model, SPEC, block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    assert not snap.submit(prompts[1], max_new_tokens=2, cache="growable")._request.compression


@pytest.mark.parametrize("spec,cache", [("quantized:bits=8", SPEC), ("growable", "h2o:budget=8"), ("growable", "quantized:bits=8")])
def test_a_request_cannot_ask_for_what_the_pool_does_not_hold(model, spec, cache):
    engine = Engine(model, spec, block_size=8, blocks=16)
    with pytest.raises(UnsupportedOperation, match="a request may ask for"):
        engine.submit(ids(10, 1), cache=cache)
    assert engine.idle
