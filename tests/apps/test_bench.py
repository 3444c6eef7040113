"""Every benchmark suite runs end to end in its ``tiny`` setting and writes well-formed results.

No timing is judged here. What is checked: the three output files, the JSON's shape (suite,
machine with library versions, config, rows), and each row's measurement fields (types and sane
values), plus the facts a suite reports that do not depend on timing (reallocation counts, bytes
held, bit-exact round trips) against what the schemes are known to do.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers

from helpers import boolean, nonneg_int, nonneg_number, positive_int, positive_list, positive_number, text
from kvcache.apps.bench import SUITES, get_suite
from kvcache.apps.run_options import RunOptions


FIELDS = {
    "update": {
        "contender": text,
        "tokens": positive_int,
        "us_per_token": positive_number,
        "speedup_vs_concat": positive_number,
        "samples_us": positive_list,
        "reallocations": positive_int,
        "peak_bytes": positive_int,
        "final_bytes": positive_int,
    },
    "bounded": {"part": text, "contender": text, "spec": text},  # per-part checks: test_bench_bounded.py
    "gpu": {"part": text, "contender": text},  # per-part checks: test_bench_gpu.py
    "budget": {
        "kind": text,
        "budget_type": text,
        "spec": text,
        "bytes_after_prompt": positive_int,
        "bytes_end": positive_int,
        "bytes_peak": positive_int,
        "kept_slots_end": positive_int,
        "reallocations_decode": nonneg_int,
        "decode_tokens_per_s": positive_number,
        "bytes_vs_count": positive_number,
    },
    "decode": {
        "variant": text,
        "query_heads": positive_int,
        "context": positive_int,
        "contender": text,
        "tokens_per_s": positive_number,
        "speedup_vs_dynamic": positive_number,
        "identical_to_dynamic": boolean,
        "cache_bytes": positive_int,
        "samples_s": positive_list,
    },
    "attention": {
        "dtype": text,
        "variant": text,
        "query_heads": positive_int,
        "tokens": positive_int,
        "contender": text,
        "ms": positive_number,
        "kv_bytes": positive_int,
        "bandwidth_fraction": positive_number,
        "max_abs_diff_vs_sdpa": nonneg_number,
        "samples_ms": positive_list,
    },
    "memory": {
        "contender": text,
        "tokens": positive_int,
        "stepped_tokens": positive_int,
        "peak_rss_bytes": nonneg_int,
        "peak_rss_over_needed": nonneg_number,
        "final_cache_bytes": positive_int,
        "peak_cache_bytes": positive_int,
        "reallocations": positive_int,
        "spikes": positive_int,
        "counts_extrapolated": boolean,
        "seconds": positive_number,
    },
    "prefill": {
        "model": text,
        "tokens": positive_int,
        "contender": text,
        "spec": text,
        "chunk": positive_int,
        "seconds": positive_number,
        "time_vs_full": positive_number,
        "peak_rss_bytes": positive_int,
        "prefill_rss_bytes": nonneg_int,
        "cache_bytes_max": positive_int,
        "full_kv_bytes": positive_int,
        "weight_bytes": positive_int,
        "peak_over_weights": positive_number,
        "cache_over_weights": positive_number,
    },
    "prompt": {"workload": text, "step": positive_int, "contender": text, "backend": text},  # more: test_bench_prompt.py
    "engine": {"contender": text, "arrivals": text},  # more: test_bench_engine.py
    "serve": {"contender": text, "clients": positive_int, "errors": nonneg_int, "requests_done": nonneg_int},  # more: test_bench_serve.py
    "train": {"length": positive_int, "contender": text, "seconds": positive_number, "tokens_per_s": positive_number,
              "saved_peak_bytes": positive_int, "archive_bytes": nonneg_int, "state_bytes": nonneg_int},
    "finetune": {"contender": text, "seed": nonneg_int, "trained_through": text, "before_under_cache": positive_number,
                 "after_under_cache": positive_number, "before_full": positive_number, "after_full": positive_number,
                 "tokens_per_s": positive_number},
    "mixes": {"contender": text, "spec": text, "ms_per_step": positive_number, "vs_growable": positive_number, "nbytes": positive_int,
              "bytes_share": positive_number},
    "capacity": {"contender": text, "sessions_held": positive_int, "session_bytes": positive_int, "questions": positive_int},
    "real": {"batch": positive_int, "context": positive_int, "contender": text, "compiled": boolean},  # more: test_bench_real.py
    "resume": {
        "tokens": positive_int,
        "contender": text,
        "save_ms": positive_number,
        "load_ms": positive_number,
        "file_bytes": positive_int,
        "tensor_bytes": positive_int,
        "save_MBps": positive_number,
        "load_MBps": positive_number,
        "save_x_floor": positive_number,
        "load_x_floor": positive_number,
        "checksum_ms": positive_number,
        "identical": boolean,
    },
}


def test_every_registered_suite_has_field_checks():
    assert set(FIELDS) == set(SUITES)


def test_unknown_suite_is_refused_with_the_list():
    with pytest.raises(ValueError) as err:
        get_suite("nope")
    message = str(err.value)
    assert "nope" in message
    for name in SUITES:
        assert name in message


@pytest.fixture(scope="module")
def tiny_results(tmp_path_factory):
    """Run each suite at most once per test session (some take seconds)."""
    cache = {}

    def get(name):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"bench-{name}")
            returned = get_suite(name).run(RunOptions(tiny=True, out=out, progress=False))
            cache[name] = (out, returned)
        return cache[name]

    return get


#: Suites whose tiny run another file makes anyway, checked there with ``assert_well_formed``
#: instead of running twice: the serve suite's (about 30 s), and the suites the README's command
#: block runs (``--quick --tiny``, without the ``bench`` extra, so there without the PNG).
RUN_ELSEWHERE = {
    "serve": "test_bench_serve.py",
    **{name: "test_readme_commands.py" for name in ("real", "prefill", "prompt", "engine", "capacity")},
}


@pytest.mark.parametrize("name", [n for n in SUITES if n not in RUN_ELSEWHERE])
def test_tiny_run_writes_well_formed_results(name, tiny_results):
    assert_well_formed(name, *tiny_results(name))


def assert_well_formed(name, out, returned, png: bool = True):
    """The JSON, Markdown and (where ``png``) PNG a tiny run of suite ``name`` wrote into ``out``,
    against its rows as returned and the field checks of ``FIELDS``."""
    for ext in ("json", "md", "png") if png else ("json", "md"):
        assert (out / f"{name}.{ext}").is_file(), f"{name}.{ext} not written"
    if png:
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / f"{name}.md").read_text()
    assert md.count("|") > 10  # a markdown table

    result = json.loads((out / f"{name}.json").read_text())
    assert result["suite"] == name == returned["suite"]
    assert result["machine"]["torch"] == torch.__version__
    assert result["machine"]["transformers"] == transformers.__version__
    assert isinstance(result["config"], dict) and result["config"]
    rows = result["rows"]
    assert isinstance(rows, list) and rows
    assert len(rows) == len(returned["rows"])
    module = get_suite(name)
    for row in rows:
        for field, ok in FIELDS[name].items():
            assert field in row, f"{name}: row lacks {field!r}: {sorted(row)}"
            assert ok(row[field]), f"{name}: {field}={row[field]!r} fails {ok.__name__}"
        assert row["contender"] in module.CONTENDERS
    # Every contender is reported.
    assert {r["contender"] for r in rows} == set(module.CONTENDERS)


def test_update_counts(tiny_results):
    _, result = tiny_results("update")
    for r in result["rows"]:
        assert r["final_bytes"] <= r["peak_bytes"]
        if r["contender"] in ("static", "hf_static"):
            assert r["reallocations"] == 1
        if r["contender"] == "concat":
            assert r["reallocations"] == r["tokens"]


def test_attention_outputs_agree(tiny_results):
    _, result = tiny_results("attention")
    for r in result["rows"]:
        if r["dtype"] == "float32":
            assert r["max_abs_diff_vs_sdpa"] < 1e-4


def test_memory_counts_match_the_schemes(tiny_results):
    """Bytes held and reallocations follow from each growth rule; ours report the same themselves."""
    _, result = tiny_results("memory")
    c = result["config"]
    layers, tokens = c["layers"], c["tokens"]
    needed = c["token_bytes_per_layer"] * layers * tokens
    assert c["needed_bytes"] == needed
    rows = {r["contender"]: r for r in result["rows"]}
    assert set(rows) == {"concat", "step256", "growable", "static"}
    assert tokens > 256  # so that every growing scheme grows at least once

    for r in rows.values():
        assert r["tokens"] == tokens
        assert r["final_cache_bytes"] <= r["peak_cache_bytes"]
        assert r["final_cache_bytes"] >= needed
        assert 1 <= r["spikes"] <= tokens
        assert r["reallocations"] >= r["spikes"]
        assert r["samples"] and r["bytes_curve"]

    assert rows["static"]["final_cache_bytes"] == needed
    assert rows["static"]["peak_cache_bytes"] == needed
    assert (rows["static"]["reallocations"], rows["static"]["spikes"]) == (layers, 1)

    assert rows["concat"]["final_cache_bytes"] == needed
    assert rows["concat"]["counts_extrapolated"] is True
    assert rows["concat"]["stepped_tokens"] < tokens
    assert (rows["concat"]["reallocations"], rows["concat"]["spikes"]) == (tokens * layers, tokens)

    step_spikes = math.ceil(tokens / 256)
    assert rows["step256"]["final_cache_bytes"] == c["token_bytes_per_layer"] * layers * 256 * step_spikes
    assert (rows["step256"]["reallocations"], rows["step256"]["spikes"]) == (layers * step_spikes, step_spikes)

    grow_spikes = 1 + math.ceil(math.log2(tokens / 256))
    assert rows["growable"]["final_cache_bytes"] == c["token_bytes_per_layer"] * layers * 256 * 2 ** (grow_spikes - 1)
    assert (rows["growable"]["reallocations"], rows["growable"]["spikes"]) == (layers * grow_spikes, grow_spikes)

    for name in ("step256", "growable", "static"):
        assert rows[name]["stepped_tokens"] == tokens
        assert rows[name]["counts_extrapolated"] is False
    for name in ("growable", "static"):  # the library's own accounting agrees with the storage seen
        assert rows[name]["reported_reallocations"] == rows[name]["reallocations"]
        assert rows[name]["reported_nbytes"] == rows[name]["final_cache_bytes"]


def test_train_holds_the_same_bytes_for_backward_at_every_length(tiny_results):
    """Chunked replay holds one chunk's graph and two states (128 and 256 tokens alike); plain
    training holds more at the longer length; the archive is the sequence's keys and values."""
    _, result = tiny_results("train")
    by = {(r["contender"], r["length"]): r for r in result["rows"]}
    assert result["summary"]["replay_saved_bytes_max_over_min"] <= 1.10
    assert by[("plain", 256)]["saved_peak_bytes"] > 1.5 * by[("plain", 128)]["saved_peak_bytes"]
    assert by[("replay h2o 25%", 256)]["archive_bytes"] > by[("replay h2o 25%", 128)]["archive_bytes"] > 0
    assert by[("detach h2o 25%", 256)]["archive_bytes"] == 0


def test_run_options_pick_the_value_for_the_run_size():
    assert RunOptions().pick("tiny", "quick", "full") == "full"
    assert RunOptions(quick=True).pick("tiny", "quick", "full") == "quick"
    assert RunOptions(tiny=True, quick=True).pick("tiny", "quick", "full") == "tiny"


def test_memory_refuses_gpu():
    with pytest.raises(ValueError, match="CPU"):
        get_suite("memory").run(RunOptions(tiny=True, device="cuda", progress=False))


def test_resume_round_trips_and_floor(tiny_results):
    _, result = tiny_results("resume")
    c = result["config"]
    token_bytes = 2 * c["kv_heads"] * c["head_dim"] * 4 * c["layers"]  # fp32 keys and values
    for r in result["rows"]:
        assert r["identical"] is True, f"{r['contender']} at {r['tokens']} tokens did not round-trip"
        assert r["tensor_bytes"] == token_bytes * r["tokens"]
        assert r["file_bytes"] > r["tensor_bytes"]  # a header at least
        if r["contender"] == "safetensors":
            assert r["save_x_floor"] == r["load_x_floor"] == 1.0
    lengths = sorted({r["tokens"] for r in result["rows"]})
    assert lengths == sorted(c["lengths"]) and len(lengths) == 2
    ours = {r["tokens"]: r for r in result["rows"] if r["contender"] == "kvcache"}
    floor = {r["tokens"]: r for r in result["rows"] if r["contender"] == "safetensors"}
    for t in lengths:  # our metadata and checksums cost bytes, never fewer than the plain file
        assert ours[t]["file_bytes"] > floor[t]["file_bytes"]


def test_attention_quantized_rows(tiny_results):
    """The quantized part: every contender at every (batch, T), bytes read as the layouts say
    (int8 and fp8 a quarter of fp32 plus scales and the residual, int4 less again), outputs near fp32's."""
    _, result = tiny_results("attention")
    rows = result["quantized_rows"]
    cases = {(r["batch"], r["tokens"]) for r in rows}
    assert len(rows) == 7 * len(cases)
    for batch, tokens in cases:
        by = {r["contender"]: r for r in rows if (r["batch"], r["tokens"]) == (batch, tokens)}
        assert set(by) == {"fp32", "int8", "int4", "fp8", "int8-pytorch", "int4-pytorch", "fp8-pytorch"}
        assert by["fp32"]["bytes_read"] == 2 * batch * 3 * tokens * 64 * 4
        assert by["int4"]["bytes_read"] < by["int8"]["bytes_read"] == by["fp8"]["bytes_read"] < by["fp32"]["bytes_read"] / 2
        assert by["int8"]["bytes_read"] == by["int8-pytorch"]["bytes_read"]
        assert by["int8"]["max_abs_diff_vs_fp32"] < 0.05 and by["int4"]["max_abs_diff_vs_fp32"] < 0.5
        assert by["fp8"]["max_abs_diff_vs_fp32"] < 0.1  # 3 mantissa bits: coarser than int8's 256 levels a group
        for r in by.values():
            assert r["ms"] > 0 and r["bandwidth_fraction"] > 0 and len(r["samples_ms"]) > 0


def test_attention_paged_rows(tiny_results):
    """The engine's paged decode: every contender at every block size, bytes read as the layouts say
    (bfloat16 blocks half of float32's, int8 less), outputs near the dense reference's."""
    _, result = tiny_results("attention")
    rows = result["paged_rows"]
    sizes = {r["block_size"] for r in rows}
    assert len(rows) == 5 * len(sizes)
    for bs in sizes:
        by = {r["contender"]: r for r in rows if r["block_size"] == bs}
        assert set(by) == {"paged", "paged-bf16", "paged-int8", "paged-fp8", "dense"}
        assert by["paged-bf16"]["bytes_read"] * 2 == by["paged"]["bytes_read"] == 2 * by["paged"]["tokens"] * 3 * 64 * 4
        assert by["paged-int8"]["bytes_read"] == by["paged-fp8"]["bytes_read"] < by["paged-bf16"]["bytes_read"]
        near = {"paged": 1e-4, "paged-bf16": 2e-2, "paged-int8": 0.05, "paged-fp8": 0.1, "dense": 0.0}
        for name, r in by.items():
            assert r["max_abs_diff_vs_dense"] <= near[name], (name, r["max_abs_diff_vs_dense"])
            assert r["ms"] > 0 and r["bandwidth_fraction"] > 0 and len(r["samples_ms"]) > 0


def test_attention_prefill_rows(tiny_results):
    """The prompt part: both contenders in both dtypes at every case, the same attention (in
    bfloat16 the SDPA contender's queries and outputs are rounded to bfloat16)."""
    _, result = tiny_results("attention")
    rows = result["prefill_rows"]
    cases = {(r["case"], r["dtype"]) for r in rows}
    assert {d for _, d in cases} == {"float32", "bfloat16"} and len(rows) == 2 * len(cases)
    for case in cases:
        by = {r["contender"]: r for r in rows if (r["case"], r["dtype"]) == case}
        assert set(by) == {"paged-prefill", "gather+sdpa"}
        near = 1e-4 if case[1] == "float32" else 2e-2
        for r in by.values():
            assert r["ms"] > 0 and r["gflops"] > 0 and r["max_abs_diff"] < near and len(r["samples_ms"]) > 0


def test_budget_share_holds_the_bytes_it_keeps_and_a_count_never_moves(tiny_results):
    """Both keep the same slots at the end; the share's bytes grew in steps (room of 1/16, at
    least 8 slots: on the tiny run's small stores the minimum room is up to ~12%), the count's
    store was allocated once, before the decode, at its size."""
    _, result = tiny_results("budget")
    rows = {(r["kind"], r["budget_type"]): r for r in result["rows"]}
    assert {kind for kind, _ in rows} == set(get_suite("budget").KINDS)
    for kind in get_suite("budget").KINDS:
        share, count = rows[(kind, "share")], rows[(kind, "count")]
        assert share["kept_slots_end"] == count["kept_slots_end"], kind
        assert count["reallocations_decode"] == 0 and count["bytes_peak"] == count["bytes_end"], kind
        assert share["bytes_after_prompt"] < share["bytes_end"] == share["bytes_peak"], kind
        assert 1.0 <= share["bytes_vs_count"] <= 1.15, (kind, share["bytes_vs_count"])
        assert share["reallocations_decode"] >= 1, kind


def test_attention_shapes_run_only_the_calls_named(tmp_path):
    from kvcache.apps.bench import attention

    shapes = attention.parse_shapes("9/3x64@2x40, 4/4x32@1x16")
    assert shapes == [attention.Shape(9, 3, 64, 2, 40), attention.Shape(4, 4, 32, 1, 16)]
    result = attention.run(RunOptions(tiny=True, out=tmp_path, progress=False), shapes=shapes, repeats=1)
    assert [(r["variant"], r["batch"], r["tokens"], r["contender"]) for r in result["rows"]] == [
        ("9/3x64", 2, 40, "sdpa"), ("9/3x64", 2, 40, "attend"), ("4/4x32", 1, 16, "sdpa"), ("4/4x32", 1, 16, "attend"),
    ]  # fmt: skip
    assert result["quantized_rows"] == [] and all(r["max_abs_diff_vs_sdpa"] < 1e-5 for r in result["rows"])
    assert "| 9/3x64 (9q/3kv x 64) | 2 | 40 | attend |" in attention.table(result)


@pytest.mark.parametrize("text", ["9/3x64", "9/4x64@1x10", "a/3x64@1x10", "9/3x64@1x0"])
def test_attention_shapes_refuse_malformed_text(text):
    from kvcache.apps.bench import attention
    from kvcache.errors import KVCacheError

    with pytest.raises(KVCacheError, match="Hq/HkvxD@BxT|positive"):
        attention.parse_shapes(text)


def test_bench_refuses_an_option_of_another_suite(capsys):
    from kvcache.apps.cli import main

    assert main(["bench", "update", "--shapes", "9/3x64@1x10"]) != 0
    assert "suite 'attention'" in capsys.readouterr().err
