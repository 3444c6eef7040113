"""One store shared by threads, processes and machines (Redis): concurrent writers leave complete
entries, an unreachable Redis degrades to no store with one warning, a restarted one works again."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch

import kvcache
import store_worker
from forked import Forked
from helpers import assert_same_tokens, model_for, prompt
from test_prompt_store import greedy

CHUNK = 16
#: Prompts that share their first 32 tokens.
SHARED = prompt(32, seed=41)
PROMPTS = [torch.cat([SHARED, prompt(20 + 3 * i, seed=42 + i)], dim=1) for i in range(4)]


@pytest.fixture(params=["folder", "redis"])
def shared_location(request, tmp_path):
    return str(tmp_path / "store") if request.param == "folder" else request.getfixturevalue("redis_url")


def check_every_prompt_reuses(location):
    model = model_for("llama")
    store = kvcache.PromptStore(location, chunk=CHUNK)
    for ids in PROMPTS:
        cache, reused = store.cache_for(model, ids)
        assert reused == (ids.shape[1] - 1) // CHUNK * CHUNK
        assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), f"reused {reused} at {location}")
    assert store.stats.bad_entries == 0


def test_threads_writing_the_same_prefixes_leave_complete_entries(shared_location):
    model = model_for("llama")
    store = kvcache.PromptStore(shared_location, chunk=CHUNK)
    errors = []

    def work(i):
        try:
            for ids in PROMPTS[i:] + PROMPTS[:i]:
                store.prefill(model, ids)
                store.cache_for(model, ids)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    torch.set_num_threads(1)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.stats.bad_entries == 0
    check_every_prompt_reuses(shared_location)


def test_processes_writing_the_same_prefixes_leave_complete_entries(shared_location):
    workers = [Forked(store_worker.work, shared_location, CHUNK, i, PROMPTS) for i in range(3)]
    for w in workers:
        out, err = w.communicate(timeout=300)
        assert w.returncode == 0, err[-2000:]
        assert "bad entries 0" in out
    check_every_prompt_reuses(shared_location)


def test_a_refused_redis_is_no_store_with_one_warning(refused_url):
    model = model_for("llama")
    store = kvcache.PromptStore(refused_url, chunk=CHUNK)
    ids = PROMPTS[0]
    with pytest.warns(RuntimeWarning, match="prompt store unavailable") as caught:
        cache, reused = store.prefill(model, ids)
        assert store.put(cache, ids[:, :-1]) == 0
        cache, reused = store.cache_for(model, ids)
    assert len([w for w in caught if "unavailable" in str(w.message)]) == 1
    assert reused == 0 and store.stats.unavailable == 1  # then left alone for retry_after seconds
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "no store")


def test_a_restarted_redis_is_used_again(redis_server):
    model = model_for("llama")
    store = kvcache.PromptStore(redis_server.url(), chunk=CHUNK, retry_after=0)
    ids = PROMPTS[1]
    store.prefill(model, ids)
    assert store.cache_for(model, ids)[1] == 48  # 54 tokens prefilled: three chunks
    redis_server.stop()
    with pytest.warns(RuntimeWarning, match="prompt store unavailable"):
        cache, reused = store.cache_for(model, ids)
    assert reused == 0
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "redis down")
    redis_server.start()  # no persistence: it comes back empty
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.cache_for(model, ids)[1] == 0
        store.prefill(model, ids)
        cache, reused = store.cache_for(model, ids)
    assert reused == 48
    assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), "redis restarted")


def test_a_byte_budget_is_kept_and_lookups_stay_exact(shared_location):
    model = model_for("llama")
    probe = kvcache.PromptStore(chunk=CHUNK)
    probe.prefill(model, PROMPTS[0][:, : CHUNK + 1])
    entry = probe.backend.nbytes()  # one chunk entry
    store = kvcache.PromptStore(shared_location, chunk=CHUNK, max_bytes=3 * entry)
    for ids in PROMPTS:
        store.prefill(model, ids)
        assert store.backend.nbytes() <= 3 * entry
    for ids in PROMPTS:  # whatever was evicted, what is reused is right
        cache, reused = store.cache_for(model, ids)
        assert_same_tokens(greedy(model, ids, cache), greedy(model, ids), f"budget, reused {reused}")
    assert store.stats.bad_entries == 0
