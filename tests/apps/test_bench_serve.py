"""Suite ``serve`` (``kvcache serve`` under concurrent streaming clients, against ``transformers
serve``, and replicas sharing prompts through Redis) in its ``tiny`` setting: real server processes
on loopback ports, the rows, the replicas' cached tokens, zero errors; and the client's timing and
stream reading on hand-made events. No timing is judged."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvcache.apps.bench import SUITES, serve
from kvcache.apps.bench.serve_report import load_row
from kvcache.apps.bench.serve_workload import Load, Sample, read_event, stream_chat
from kvcache.apps.run_options import RunOptions
from kvcache.errors import KVCacheError


#: The tiny run starts six server processes (about 45 s): the slow lane's (``tests/apps/test_serve.py``
#: checks the server itself on every run).
SLOW = pytest.mark.slow


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-out")
    return serve.run(RunOptions(tiny=True, out=out, progress=False)), out


def test_registered():
    assert "serve" in SUITES


@SLOW
def test_the_tiny_run_is_well_formed(result):
    """The checks every suite's tiny run gets in test_bench.py (run here, where the run is made)."""
    from test_bench import assert_well_formed

    returned, out = result
    assert_well_formed("serve", out, returned)


@SLOW
def test_outputs_written(result):
    res, out = result
    assert json.loads((out / "serve.json").read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    md = (out / "serve.md").read_text()
    for heading in ("## Targets at 16 clients", "## Concurrent clients", "## A second replica warmed only through Redis",
                    "## How each server runs"):  # fmt: skip
        assert heading in md
    for name in serve.CONTENDERS:
        assert f"`{name}`:" in md


@SLOW
def test_a_row_per_server_and_client_count_without_errors(result):
    """kvcache's servers always run (the test extra installs its serve extra); transformers' runs
    where its serving extra is installed, else its row says how to install it."""
    res, _ = result
    s = serve.sizes(RunOptions(tiny=True))
    assert [(r["clients"], r["contender"]) for r in res["rows"]] == [(c, n) for c in s.clients for n in serve.CONTENDERS]
    for r in res["rows"]:
        if r["reason"]:
            assert r["contender"] == "transformers" and r["reason"].startswith("not available: pip install"), r
            continue
        assert r["errors"] == 0, r["error_samples"]
        assert r["requests_done"] >= r["clients"] and len(r["samples"]) == r["requests_done"]
        assert r["requests_per_s"] > 0 and r["output_tokens_per_s"] > 0 and r["wall_s"] >= s.window_s
        assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] < r["wall_s"]
        assert 0 <= r["itl_p50_s"] <= r["itl_p99_s"]
        assert 1 <= r["tokens_per_request"] <= s.new_tokens
        assert r["output_tokens_per_s"] == pytest.approx(r["requests_per_s"] * r["tokens_per_request"])
    assert res["summary"]["errors"] == 0 and res["summary"]["met"] == {"tokens_over_peer": None, "ttft_p99_of_peer": None}


@SLOW
def test_second_replica_takes_the_system_prompt_from_redis(result):
    """A and the cold C compute every prompt token; B, fresh but on A's Redis database, reuses at
    least the system turn's whole chunks."""
    res, _ = result
    rep = res["replicas"]
    if rep["reason"]:
        pytest.skip(rep["reason"])  # no redis-server binary here
    by = {r["replica"]: r for r in rep["rows"]}
    assert [r["errors"] for r in rep["rows"]] == [0, 0, 0]
    assert by["A"]["cached_tokens"] == [0] and by["C"]["cached_tokens"] == [0]
    assert by["B"]["cached_tokens"][0] >= rep["least_cached_tokens"] > 0
    assert all(r["ttft_s"] > 0 for r in rep["rows"])
    assert rep["cold_over_redis_ttft"] == pytest.approx(by["C"]["ttft_s"] / by["B"]["ttft_s"])


def test_tokens_in_one_event_count_as_zero_apart():
    sample = Sample(sent=10.0, texts=[11.0, 11.5, 12.5], end=13.0, tokens=5, finish="length")
    assert sample.ttft_s == 1.0
    assert sample.gaps_s() == [0.5, 1.0, 0.0, 0.0]  # 5 tokens, 4 gaps: 2 between events, 2 inside them


def _events(lines: list[str]) -> Sample:
    sample = Sample(sent=0.0)
    for i, line in enumerate(lines):
        if read_event(sample, line, float(i)):
            break
    return sample


def test_read_events_of_either_server():
    role = '{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}'
    text = '{"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}'
    # kvcache serve: the role, text, a finish chunk, then usage in a chunk of its own and [DONE]
    ours = _events([role, text, text, '{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
                    '{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}',
                    "[DONE]"])  # fmt: skip
    assert (ours.texts, ours.tokens, ours.prompt_tokens, ours.cached_tokens, ours.finish) == ([1.0, 2.0], 3, 9, 4, "length")
    # transformers serve: usage with the finish, no [DONE]
    theirs = _events([role, text, '{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":{"completion_tokens":1,"prompt_tokens":9}}'])
    assert (theirs.texts, theirs.tokens, theirs.cached_tokens, theirs.finish, theirs.error) == ([1.0], 1, None, "stop", "")
    failed = _events([role, '{"error": "CB worker died"}', text])
    assert failed.error.startswith("error event") and failed.texts == []


def _streamed(status: int, body: str) -> Sample:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))

    async def go() -> Sample:
        async with httpx.AsyncClient(transport=transport) as client:
            return await stream_chat(client, "http://127.0.0.1:1/v1/chat/completions", {"model": "m"})

    return asyncio.run(go())


def test_refusals_and_broken_streams_are_errors():
    assert _streamed(503, '{"error": {"message": "full"}}').error.startswith("HTTP 503")
    cut = _streamed(200, 'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n')
    assert cut.error == "broken stream: it ended without a finish_reason" and cut.tokens == 1
    assert _streamed(200, "data: {not json\n\n").error.startswith("broken stream: JSONDecodeError")
    whole = _streamed(200, 'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    assert whole.error == "" and whole.tokens == 1


def test_a_row_counts_only_requests_done():
    good = Sample(sent=0.0, texts=[0.5, 0.6, 0.7], end=1.0, tokens=3, finish="length")
    bad = Sample(sent=0.2, end=0.3, error="HTTP 503: full")
    row = load_row("kvcache", Load(2, start=0.0, window_s=0.5, samples=[good, bad]))
    assert (row["requests_done"], row["errors"], row["error_samples"]) == (1, 1, ["HTTP 503: full"])
    assert row["output_tokens_per_s"] == 3.0 and row["requests_per_s"] == 1.0 and row["ttft_p50_s"] == 0.5
    unavailable = load_row("transformers", Load(2, reason="not available: pip install x"))
    assert unavailable["output_tokens_per_s"] is None and unavailable["reason"].startswith("not available")


def test_a_missing_extra_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    assert serve.unavailable("transformers") == "not available: pip install 'transformers[serving]' (missing: fastapi)"
    assert serve.unavailable("kvcache") == ""


def test_bad_options_are_refused_before_any_server_starts(capsys):
    from kvcache.apps.cli import main

    with pytest.raises(KVCacheError, match="unknown contender"):
        serve.run(RunOptions(tiny=True, progress=False), contenders=["vllm"])
    with pytest.raises(KVCacheError, match="client counts"):
        serve.run(RunOptions(tiny=True, progress=False), clients=[0])
    assert main(["bench", "update", "--clients", "4"]) != 0
    assert "suite 'serve'" in capsys.readouterr().err
