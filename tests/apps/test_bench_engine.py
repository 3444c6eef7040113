"""Suite ``engine`` (the paged engine against sequential requests and ``transformers``' continuous
batching) in its ``tiny`` setting: the rows and summary, that every exact contender generates the
sequential contender's tokens, the prompt tokens each computes, the arrival schedules, a contender
the engine cannot build, and the errors for bad options. No timing is judged."""

from __future__ import annotations

import json

import pytest

import kvcache
from kvcache.apps.bench import SUITES, engine
from kvcache.apps.bench.engine_report import compare_tokens, percentile
from kvcache.apps.bench.engine_workload import Run, Served, arrival_times
from kvcache.apps.run_options import RunOptions
from kvcache.errors import KVCacheError, UnsupportedOperation

#: Contenders whose tokens must equal sequential's exactly (int8 blocks round the keys and values).
EXACT = ("sequential", "sequential+store", "hf_generate_batch", "engine", "engine+sharing")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine-out")
    return engine.run(RunOptions(tiny=True, out=out, progress=False), eager=True), out  # compiled: see below


def test_registered():
    assert "engine" in SUITES


def test_outputs_written(result):
    res, out = result
    assert json.loads((out / "engine.json").read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    md = (out / "engine.md").read_text()
    for heading in ("## Targets", "## Results", "## How each contender runs"):
        assert heading in md
    for name in engine.CONTENDERS:
        assert f"`{name}`:" in md


def test_a_row_per_contender_and_pattern(result):
    res, _ = result
    got = [(r["contender"], r["arrivals"]) for r in res["rows"]]
    assert sorted(got) == sorted((n, p) for n in engine.CONTENDERS for p in engine.ARRIVALS)
    s = engine.sizes(RunOptions(tiny=True))
    for r in res["rows"]:
        if r["reason"]:
            assert r["contender"] == "engine+int8" and r["reason"].startswith("not available"), r
            continue
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["cache_bytes"] > 0
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] < r["wall_s"]
        assert r["tpot_s"] > 0
        assert r["compared"] == s.sessions * s.repeats and len(r["samples"]) == s.repeats
        assert r["tokens_per_s"] == pytest.approx(s.sessions * s.new_tokens / r["wall_s"])


def test_exact_contenders_generate_sequentials_tokens(result):
    res, _ = result
    for r in res["rows"]:
        if r["contender"] in EXACT:
            assert r["identical"] == r["compared"] and r["divergences"] == [], r
        elif not r["reason"]:
            assert all(0 <= d["position"] < engine.sizes(RunOptions(tiny=True)).new_tokens for d in r["divergences"])
            assert r["identical"] + len(r["divergences"]) == r["compared"]


def test_prompt_tokens_computed(result):
    """Without sharing every prompt is computed whole; with the pool's sharing or the store's, the
    system prompt once (the tiny sizes put it on block and chunk boundaries)."""
    res, _ = result
    s = engine.sizes(RunOptions(tiny=True))
    whole, once = s.sessions * (s.shared + s.user), s.shared + s.sessions * s.user
    by = {(r["contender"], r["arrivals"]): r for r in res["rows"]}
    for pattern in engine.ARRIVALS:
        assert by[("sequential", pattern)]["prompt_tokens_computed"] == whole
        assert by[("engine", pattern)]["prompt_tokens_computed"] == whole
        assert by[("engine+sharing", pattern)]["prompt_tokens_computed"] == once
        assert by[("sequential+store", pattern)]["prompt_tokens_computed"] == once
        assert by[("engine+sharing", pattern)]["facts"]["reused_pool"] == (s.sessions - 1) * s.shared
        for name in ("engine", "engine+sharing"):
            row = by[(name, pattern)]
            assert row["forward_tokens"] == row["facts"]["engine_forward_tokens"]  # the hook counts what the engine ran
            assert row["facts"]["preemptions"] == 0
        summary = res["summary"][pattern]
        assert summary["prompt_tokens_least"] == once and summary["shared_once"] is True


def test_summary_ratios_and_no_verdicts_at_tiny_size(result):
    res, _ = result
    assert res["config"]["judged"] is False
    speed = {(r["contender"], r["arrivals"]): r["tokens_per_s"] for r in res["rows"]}
    for pattern, s in res["summary"].items():
        assert s["ratios"]["over_hf"] == pytest.approx(speed[("engine+sharing", pattern)] / speed[("hf_generate_batch", pattern)])
        assert s["ratios"]["over_sequential"] == pytest.approx(speed[("engine+sharing", pattern)] / speed[("sequential", pattern)])
        assert s["ratios"]["ttft_p95_of_hf"] > 0
        assert set(s["met"].values()) == {None}


def test_arrival_schedule_in_config(result):
    res, _ = result
    c = res["config"]
    s = engine.sizes(RunOptions(tiny=True))
    assert c["arrival_s"]["burst"] == [0.0] * s.sessions
    poisson = c["arrival_s"]["poisson"]
    assert poisson == arrival_times("poisson", s.sessions, c["mean_gap_s"], s.seed)
    assert c["mean_gap_s"] == pytest.approx(s.gap_share * c["sequential_request_s"])


def test_arrival_times():
    assert arrival_times("burst", 3, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_times("poisson", 200, 0.5, 7)
    assert times[0] == 0.0 and times == sorted(times) and times == arrival_times("poisson", 200, 0.5, 7)
    assert 0.35 < times[-1] / 199 < 0.65  # the mean gap
    assert times != arrival_times("poisson", 200, 0.5, 8)
    with pytest.raises(KVCacheError, match="unknown arrival pattern"):
        arrival_times("uniform", 3, 1.0, 0)


def test_a_spec_the_engine_refuses_is_a_row_not_a_crash(monkeypatch):
    real = kvcache.Engine

    def refusing(model, spec="growable", **kwargs):
        if spec != "growable":
            raise UnsupportedOperation(f"{spec!r} blocks are not built yet")
        return real(model, spec, **kwargs)

    monkeypatch.setattr(kvcache, "Engine", refusing)
    res = engine.run(RunOptions(tiny=True, progress=False), contenders=["engine+int8"], arrivals=["burst"])
    assert [(r["contender"], r["arrivals"]) for r in res["rows"]] == [("sequential", "burst"), ("engine+int8", "burst")]
    row = res["rows"][1]
    assert row["reason"] == "not available: 'quantized:bits=8' blocks are not built yet" and row["tokens_per_s"] is None
    assert "not available: 'quantized:bits=8'" in engine.table(res)
    assert res["summary"]["burst"]["ratios"] == {"over_hf": None, "over_sequential": None, "ttft_p95_of_hf": None}


def test_by_default_each_engine_asks_to_compile_and_is_made_once_for_every_run(monkeypatch):
    """Each engine contender's one engine serves the warm-up and the runs, its prefix cache
    forgotten and its counts reset before each (a run computes the system prompt once and counts
    only its own tokens); int8's coded blocks, which the compiled step refuses, step eagerly. The
    float engines here step eagerly too: compiling costs minutes (tests/engine checks compiled steps)."""
    real, made = kvcache.Engine, []

    def recording(model, spec="growable", *, compile=False, **kwargs):
        made.append((spec, compile))
        return real(model, spec, compile=compile and spec != "growable", **kwargs)  # int8: the real refusal

    monkeypatch.setattr(kvcache, "Engine", recording)
    res = engine.run(RunOptions(tiny=True, progress=False), contenders=["engine+sharing", "engine+int8"], arrivals=["burst"])
    assert made == [("growable", True), ("quantized:bits=8", True), ("quantized:bits=8", False)]
    assert res["config"]["engine_compile"] is True and "compile=True" in res["config"]["configured"]["engine+sharing"]
    s = engine.sizes(RunOptions(tiny=True))
    for r in res["rows"]:
        if r["contender"] != "sequential":
            assert r["prompt_tokens_computed"] == s.shared + s.sessions * s.user, r
            assert r["forward_tokens"] == r["facts"]["engine_forward_tokens"] and r["facts"]["compiled"] is False


def test_bad_options_are_refused_before_loading_anything():
    with pytest.raises(KVCacheError, match=r"unknown contender\(s\) engin; valid: sequential, sequential\+store"):
        engine.run(RunOptions(tiny=True, progress=False), contenders=["engin"])
    with pytest.raises(KVCacheError, match=r"unknown arrival pattern\(s\) uniform; valid: burst, poisson"):
        engine.run(RunOptions(tiny=True, progress=False), arrivals=["uniform"])
    with pytest.raises(KVCacheError, match="none given"):
        engine.run(RunOptions(tiny=True, progress=False), arrivals=[])


def test_cli_options_belong_to_their_suites(capsys):
    from kvcache.apps.cli import main

    assert main(["bench", "update", "--arrivals", "burst"]) != 0
    assert "--arrivals (suite 'engine')" in capsys.readouterr().err
    assert main(["bench", "prompt", "--contenders", "engine"]) != 0
    assert "--contenders (suites 'real', 'engine', 'serve')" in capsys.readouterr().err
    assert main(["bench", "engine", "--tiny", "--contenders", "nope", "--no-progress"]) != 0
    assert "unknown contender(s) nope" in capsys.readouterr().err


def test_percentile_is_linear_between_order_statistics():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile([5.0], 95) == 5.0


def test_divergences_and_near_ties():
    ref = Run([Served(0, 1, 2, [1, 2, 3], gaps=[0.5, 5e-5, 0.2]), Served(0, 1, 2, [4, 5, 6], gaps=[0.3, 0.3, 0.3])])
    mine = Run([Served(0, 1, 2, [1, 9, 9]), Served(0, 1, 2, [4, 5, 7])])
    assert compare_tokens(mine, ref) == [
        {"request": 0, "position": 1, "gap": 5e-5, "near_tie": True},
        {"request": 1, "position": 2, "gap": 0.3, "near_tie": False},
    ]
    assert compare_tokens(ref, ref) == []
