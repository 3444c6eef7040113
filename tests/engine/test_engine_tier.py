"""The prompt store as the engine's tier past the pool (``kvcache/engine/tier.py``): a restart
with a warm store (memory, folder, a real ``redis-server``), prompts stored by ``generate`` and
loaded by the engine and the other way round, preemption through the store, damaged entries and
a store that goes away. Every request's tokens against its own greedy ``generate`` with
``DynamicCache`` (the near-tie rule of ``engine_reference.py``).
"""

from __future__ import annotations

import pytest
import torch

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine, PromptStore, cache_kwargs, make_cache
from kvcache.errors import UnsupportedOperation
from redis_server import RedisServer

NEW, CHUNK = 6, 16


SHARED = ids(3 * CHUNK + 5, 99)
PROMPTS = [SHARED + ids(4 + i, 10 + i) for i in range(4)]


def serve(model, store, prompts=PROMPTS, **kw):
    engine = Engine(model, block_size=8, blocks=kw.pop("blocks", 64), max_batch_tokens=kw.pop("budget", 256), max_seqs=4,
                    store=store, **kw)
    handles = [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0
    return engine, handles


def assert_match(model, prompts, handles, most_ties=0):
    ties = sum(same_or_near_tie(h.result(), reference(model, p, NEW), f"request {i}") for i, (p, h) in enumerate(zip(prompts, handles)))
    assert ties <= most_ties


@pytest.fixture
def redis_store(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("backend", ["memory", "folder", "redis"])
def test_a_restarted_engine_loads_computed_prompts_from_a_warm_store(model, backend, tmp_path, redis_store):
    location = {"memory": "memory", "folder": str(tmp_path / "store"), "redis": redis_store.url()}[backend]
    store = PromptStore(location, chunk=CHUNK)
    first, handles = serve(model, store)
    assert_match(model, PROMPTS, handles)
    assert sum(h.stats.reused_store for h in handles) == 0
    assert store.stats.stored_tokens >= 3 * CHUNK

    again = store if backend == "memory" else PromptStore(location, chunk=CHUNK)  # a new process's store
    second, handles = serve(model, again)
    assert_match(model, PROMPTS, handles)
    # The first request of the restarted engine loads the shared chunks from the store; the others
    # then find them in the pool.
    assert handles[0].stats.reused_store == 3 * CHUNK and handles[0].stats.reused_pool == 0
    assert all(h.stats.reused_pool + h.stats.reused_store >= 3 * CHUNK for h in handles)
    assert second.stats.forward_tokens < first.stats.forward_tokens - 3 * CHUNK + 1


def test_the_engine_and_generate_share_a_store_both_ways(model):
    store = PromptStore("memory", chunk=CHUNK)
    prompt = PROMPTS[0]
    cache = make_cache(model)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), **cache_kwargs(model, cache), max_new_tokens=1, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    assert store.put(cache, out) == 3 * CHUNK
    _, handles = serve(model, store, [prompt])
    assert handles[0].stats.reused_store == 3 * CHUNK
    assert_match(model, [prompt], handles)

    other = PromptStore("memory", chunk=CHUNK)
    serve(model, other, [PROMPTS[1]])
    cache, reused = other.cache_for(model, torch.tensor([PROMPTS[1]]))
    assert reused == 3 * CHUNK
    with torch.inference_mode():
        got = model.generate(torch.tensor([PROMPTS[1]]), **cache_kwargs(model, cache), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0)
    same_or_near_tie(got[0, len(PROMPTS[1]) :].tolist(), reference(model, PROMPTS[1], NEW))


def test_preempted_requests_reload_their_chunks_from_the_store(model):
    prompts = [ids(2 * CHUNK + 3 * i, 40 + i) for i in range(4)]
    longest = max(len(p) for p in prompts) + NEW - 1
    store = PromptStore("memory", chunk=CHUNK)
    # No pool prefix sharing: a preempted request's blocks are not kept in the pool, only in the store.
    engine, handles = serve(model, store, prompts, blocks=-(-longest // 8) + 3, budget=64, share_prefixes=False)
    assert engine.stats.preemptions > 0
    assert engine.stats.store_tokens > 0, "no preempted request reloaded from the store"
    assert_match(model, prompts, handles, most_ties=1)


def test_damaged_entries_are_misses_and_the_request_is_recomputed(model, tmp_path):
    folder = tmp_path / "store"
    store = PromptStore(str(folder), chunk=CHUNK)
    serve(model, store, PROMPTS[:1])
    entries = [p for p in folder.rglob("*") if p.is_file() and p.stat().st_size > 1000]
    assert entries
    for path in entries:
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        path.write_bytes(bytes(raw))
    fresh = PromptStore(str(folder), chunk=CHUNK)
    _, handles = serve(model, fresh, PROMPTS[:1])
    assert handles[0].stats.reused_store < 3 * CHUNK and fresh.stats.bad_entries > 0
    assert_match(model, PROMPTS[:1], handles)


def test_a_store_that_goes_away_leaves_the_engine_serving(model, redis_store):
    store = PromptStore(redis_store.url(), chunk=CHUNK, retry_after=60)
    redis_store.stop()
    with pytest.warns(RuntimeWarning, match="prompt store unavailable") as caught:
        _, handles = serve(model, store, PROMPTS[:2])
    assert len(caught) == 1, "one warning per outage"
    assert_match(model, PROMPTS[:2], handles)
    assert all(h.stats.reused_store == 0 for h in handles)


def test_a_coded_pool_with_a_store_is_refused(model):
    with pytest.raises(UnsupportedOperation, match="store tier holds full-precision"):
        Engine(model, "quantized:bits=8", block_size=8, blocks=8, store=PromptStore("memory"))
    with pytest.raises(TypeError, match="PromptStore"):
        Engine(model, block_size=8, blocks=8, store=42)
