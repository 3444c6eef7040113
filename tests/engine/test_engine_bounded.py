"""``Engine(model, "h2o:budget=...")`` and every other bounded kind: each prompt, once computed in
the pool's blocks, becomes the request's own cache of that kind, which then evicts as it does
under ``generate``; the pool holds the cache's bytes as a lease of blocks.

The reference (``bounded_reference``): ``make_cache`` of the same spec, the prompt in one pass
through the model, then greedy decode one token at a time through the same cache: what ``generate``
does. Near ties as in ``engine_reference.py``.
"""

from __future__ import annotations

import pytest
import torch

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine, cache_kwargs, make_cache, use_kvcache_attention
from kvcache.errors import UnsupportedOperation
from kvcache.hf.scoring import keys_values

NEW = 8


def bounded_reference(model, prompt: list[int], new: int, spec: str, keep: int | None = None):
    """Greedy tokens and top-2 gaps through ``make_cache(model, spec)``; with ``keep``, also every
    layer's stored keys ``[Hkv, slots, D]`` after ``keep`` generated tokens were fed back."""
    cache, kept = make_cache(model, spec), None
    tokens, gaps = [], []
    with torch.inference_mode(), use_kvcache_attention(model):
        logits = model(input_ids=torch.tensor([prompt]), use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
        for step in range(new):
            if step == keep:
                kept = [k[0].clone() for k, _ in keys_values(cache)]
            top = logits.float().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
            if step + 1 < new:
                out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[len(prompt) + step]]),
                            use_cache=True, **cache_kwargs(model, cache))  # fmt: skip
                logits = out.logits[0, -1]
    return (tokens, gaps), kept


def serve(engine: Engine, prompts, new=NEW):
    handles = [engine.submit(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0
    return handles


SPEC = "snapkv:budget=0.4,window=4,pool=3"

#: One spec per bounded kind the engine serves (and a storage, sinks and a fixed budget).
KINDS = [
    "h2o:budget=12,recent=3",
    "tova:budget=0.5",
    "tova-layer:budget=14",
    "lastrec:budget=10,sinks=2",
    SPEC,
    "snapkv:budget=12,window=6,pool=1,sinks=2",
    "pyramidkv:budget=0.5,window=4",
    "adakv:budget=0.4,window=4",
    "auto:bytes=0.3,window=4",
    "auto-heads:bytes=0.3,window=4",
    "h2o:budget=0.5,storage=int8",
    "snapkv:budget=0.5,window=4,storage=int4",
    "snapkv:budget=0.5,window=4,storage=int4,fine=int8,fine_share=0.25",
    "adakv:budget=0.4,window=4,storage=int2,fine=full,fine_share=0.5",
    "auto:bytes=0.2,window=4,fine_share=0.25,drop=1",  # by distortion, mixes are taken
    "auto-heads:bytes=0.15,window=4,fine_share=0.25,drop=1",
    "auto:bytes=0.2,window=4,codes=rotated",
    "auto-heads:bytes=0.2,window=4,drop=1",
    "window:window=12,sinks=2",
    "window:window=20",
]


@pytest.mark.parametrize("spec", KINDS)
@pytest.mark.parametrize("budget", [512, 24])
def test_every_request_matches_generate_with_the_same_spec(model, spec, budget):
    prompts = [ids(n, i) for i, n in enumerate([5, 16, 17, 40, 61, 9])]
    engine = Engine(model, spec, block_size=8, blocks=96, max_batch_tokens=budget, max_seqs=4)
    handles = serve(engine, prompts)
    ties = sum(same_or_near_tie(h.result(), bounded_reference(model, p, NEW, spec)[0], f"{spec}, {len(p)} tokens")
               for p, h in zip(prompts, handles))  # fmt: skip
    assert ties <= 1


@pytest.mark.parametrize("spec", ["h2o:budget=12,recent=3", SPEC, "tova:budget=0.5", "adakv:budget=0.4,window=4"])
def test_a_lone_request_keeps_exactly_what_the_cache_of_its_spec_keeps(model, spec):
    prompt = ids(45, 3)
    engine = Engine(model, spec, block_size=8, blocks=32, max_batch_tokens=16, max_seqs=2)
    handle = engine.submit(prompt, max_new_tokens=4, eos_token_id=[])
    while handle._request.stats.generated < 3:  # then it has fed back the first 2
        engine.step()
    kept = [k[0] for k, _ in keys_values(handle._request.cache)]
    _, expected = bounded_reference(model, prompt, 4, spec, keep=2)
    assert len(kept) == len(expected)
    for k, want in zip(kept, expected):
        assert k.shape == want.shape
        torch.testing.assert_close(k, want, rtol=1e-5, atol=1e-5)  # the same slots (chunked vs one pass: rounding)
    engine.run()


def test_a_bounded_request_gives_its_prompt_blocks_back_and_leases_its_cache_bytes(model):
    prompt = ids(80, 4)
    engine = Engine(model, SPEC, block_size=8, blocks=32, max_batch_tokens=512, max_seqs=2, share_prefixes=False)
    handle = engine.submit(prompt, max_new_tokens=NEW, eos_token_id=[])
    engine.step()
    request = handle._request
    assert request.table == [] and request.cache is not None and request.cache.seen == 80
    lease = -(-request.cache.nbytes // engine.pool.block_nbytes)
    assert len(request.lease) == lease < 10 and engine.pool.owned_count == lease
    while engine.step():
        engine.pool.check()
        if not handle.done:
            assert len(request.lease) * engine.pool.block_nbytes >= request.cache.nbytes
    assert handle.result() == bounded_reference(model, prompt, NEW, SPEC)[0][0]
    assert engine.pool.owned_count == 0


def test_a_shared_prompt_is_computed_once_and_then_compressed_per_request(model):
    shared = ids(32, 11)
    prompts = [shared + ids(6, 20 + i) for i in range(4)]
    engine = Engine(model, SPEC, block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    handles = serve(engine, prompts)
    assert [h.stats.reused_pool for h in handles] == [0, 32, 32, 32]
    for p, h in zip(prompts, handles):
        same_or_near_tie(h.result(), bounded_reference(model, p, NEW, SPEC)[0])


def test_a_kind_scored_by_every_query_computes_its_whole_prompt(model):
    shared = ids(32, 11)
    prompts = [shared + ids(6, 20 + i) for i in range(2)]
    spec = "h2o:budget=12,recent=3"
    engine = Engine(model, spec, block_size=8, blocks=64, max_batch_tokens=16, max_seqs=4)
    handles = serve(engine, prompts)
    assert [h.stats.reused_pool for h in handles] == [0, 0]
    for p, h in zip(prompts, handles):
        same_or_near_tie(h.result(), bounded_reference(model, p, NEW, spec)[0])


@pytest.mark.parametrize("spec", [SPEC, "h2o:budget=0.8,recent=3"])
def test_preempted_bounded_requests_are_recomputed_and_decode_their_tokens_again_one_a_step(model, spec):
    prompts = [ids(30 + 5 * i, 40 + i) for i in range(4)]
    engine = Engine(model, spec, block_size=4, blocks=22, max_batch_tokens=64, max_seqs=4, share_prefixes=False)
    handles = serve(engine, prompts, new=16)
    assert engine.stats.preemptions > 0
    ties = sum(same_or_near_tie(h.result(), bounded_reference(model, p, 16, spec)[0]) for p, h in zip(prompts, handles))
    assert ties <= 1


@pytest.mark.parametrize(
    "spec,kw,error,match",
    [
        ("kvzip:budget=0.25", {}, UnsupportedOperation, "second pass"),
        ("static:capacity=64", {}, UnsupportedOperation, "growable blocks or bounded kinds"),
        ("snapkv:budget=0.25,window=32", {"max_batch_tokens": 16}, ValueError, "observation window"),
        ("quantized:bits=8,residual=16", {}, UnsupportedOperation, "drop the residual option"),
    ],
)
def test_kinds_and_options_the_engine_does_not_take_are_refused(model, spec, kw, error, match):
    with pytest.raises(error, match=match):
        Engine(model, spec, block_size=8, blocks=8, **kw)


def test_a_prompt_one_token_past_a_shared_prefix_still_computes_its_observation_window(model):
    shared = ids(16, 12)
    prompts = [shared, shared + [9]]
    engine = Engine(model, SPEC, block_size=4, blocks=32, max_batch_tokens=64, max_seqs=2)
    first = serve(engine, prompts[:1])[0]
    second = serve(engine, prompts[1:])[0]
    assert second.stats.reused_pool == 12, "the pool gave the observation window's tokens too"
    for p, h in zip(prompts, (first, second)):
        same_or_near_tie(h.result(), bounded_reference(model, p, NEW, SPEC)[0])


def test_a_request_of_a_float_engine_may_ask_for_any_bounded_kind_or_growable(model):
    prompts = [ids(40, 13), ids(33, 14), ids(37, 15)]
    engine = Engine(model, "growable", block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    specs = [SPEC, "growable", "h2o:budget=12,recent=3"]
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[], cache=s) for p, s in zip(prompts, specs)]
    while engine.step():
        engine.pool.check()
    same_or_near_tie(handles[0].result(), bounded_reference(model, prompts[0], NEW, SPEC)[0])
    same_or_near_tie(handles[1].result(), reference(model, prompts[1], NEW))
    same_or_near_tie(handles[2].result(), bounded_reference(model, prompts[2], NEW, specs[2])[0])
    snap = Engine(model, SPEC, block_size=8, blocks=64, max_batch_tokens=512, max_seqs=4)
    assert not snap.submit(prompts[1], max_new_tokens=2, cache="growable")._request.compression


def test_a_window_request_holds_no_prompt_block_and_shares_none(model):
    shared = ids(32, 11)
    prompts = [shared + ids(6, 20 + i) for i in range(2)]
    spec = "window:window=12,sinks=2"
    engine = Engine(model, spec, block_size=8, blocks=16, max_batch_tokens=16, max_seqs=2)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    while engine.step():
        for request in engine.scheduler.running:
            assert request.table == [] and request.cache is not None
            assert len(request.lease) == -(-request.cache.nbytes // engine.pool.block_nbytes)
    assert [h.stats.reused_pool for h in handles] == [0, 0] and engine.pool.owned_count == 0
    for p, h in zip(prompts, handles):
        same_or_near_tie(h.result(), bounded_reference(model, p, NEW, spec)[0])


def test_a_cache_larger_than_the_pool_fails_its_request_alone(model):
    engine = Engine(model, "h2o:budget=200", block_size=8, blocks=12, max_batch_tokens=512, max_seqs=2)
    big = engine.submit(ids(90, 5), max_new_tokens=4, eos_token_id=[])
    engine.run()
    assert big._request.finish_reason == "error" and "more than the pool" in str(big._request.error)
    assert engine.pool.owned_count == 0
    small = Engine(model, "h2o:budget=8", block_size=8, blocks=12, max_batch_tokens=512, max_seqs=2)
    assert len(serve(small, [ids(90, 5)])[0].result()) == NEW


@pytest.mark.parametrize("spec,cache", [("quantized:bits=8", SPEC), ("growable", "quantized:bits=8")])
def test_a_request_cannot_ask_for_what_the_pool_does_not_hold(model, spec, cache):
    engine = Engine(model, spec, block_size=8, blocks=16)
    with pytest.raises(UnsupportedOperation, match="a request may ask for"):
        engine.submit(ids(10, 1), cache=cache)
    assert engine.idle


@pytest.mark.parametrize("spec", [SPEC, "h2o:budget=12,recent=3"])
def test_a_bounded_request_loads_what_the_store_may_give_and_still_matches_generate(model, spec):
    from kvcache import PromptStore

    store = PromptStore("memory", chunk=8)
    prompt = ids(43, 21)
    first = Engine(model, "growable", block_size=8, blocks=32, max_batch_tokens=64, store=store)
    serve(first, [prompt])  # the prompt's chunks go to the store
    engine = Engine(model, spec, block_size=8, blocks=32, max_batch_tokens=64, store=store)
    (handle,) = serve(engine, [prompt])
    # what the compression reads is computed: all but the observation window's 4 (snapkv), all (h2o)
    assert engine.stats.store_tokens == (0 if spec.startswith("h2o") else 43 - 4)
    same_or_near_tie(handle.result(), bounded_reference(model, prompt, NEW, spec)[0])
