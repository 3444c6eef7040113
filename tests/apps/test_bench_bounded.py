"""The ``bounded`` benchmark suite in its ``tiny`` setting: well-formed results and the facts it
reports that do not depend on timing (bytes each bound allows, identical tokens when nothing is
evicted, bytes a decode attention call reads).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from helpers import boolean, nonneg_number, positive_int, positive_list, positive_number, text
from kvcache.apps.bench import SUITES, get_suite
from kvcache.apps.bench import bounded
from kvcache.apps.run_options import RunOptions

FP32, FP16 = 4, 2
POSITION_AND_SCORE = 8 + 4  # int64 position and float32 score per slot and KV head


FIELDS = {
    "decode": {
        "variant": text,
        "query_heads": positive_int,
        "context": positive_int,
        "contender": text,
        "spec": text,
        "tokens_per_s": positive_number,
        "speedup_vs_growable": positive_number,
        "identical_to_growable": boolean,
        "cache_bytes": positive_int,
        "samples_s": positive_list,
    },
    "bytes": {
        "contender": text,
        "spec": text,
        "tokens": positive_int,
        "cache_bytes": positive_int,
        "bytes_per_token": positive_number,
        "ratio_to_fp16": positive_number,
    },
    "bandwidth": {
        "variant": text,
        "query_heads": positive_int,
        "tokens": positive_int,
        "contender": text,
        "spec": text,
        "ms": positive_number,
        "bytes_read": positive_int,
        "GBps": positive_number,
        "bandwidth_fraction": positive_number,
        "max_abs_diff_vs_growable": nonneg_number,
        "samples_ms": positive_list,
    },
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-bounded")
    return out, get_suite("bounded").run(RunOptions(tiny=True, out=out, progress=False))


def rows_of(result, part):
    return [r for r in result["rows"] if r["part"] == part]


def slot_bytes(dtype_bytes: int, heads: int = bounded.KV_HEADS, dim: int = bounded.HEAD_DIM) -> int:
    """Keys and values of one slot (one token) in one layer, full precision."""
    return 2 * heads * dim * dtype_bytes


def int8_slot_bytes(dtype_bytes: int, heads: int = bounded.KV_HEADS, dim: int = bounded.HEAD_DIM) -> int:
    """One evicting slot with storage=int8: codes, then scale and minimum per 64 channels, for keys
    and values; position and score."""
    groups = dim // 64
    return heads * (2 * dim + 2 * 2 * groups * dtype_bytes + POSITION_AND_SCORE)


def test_registered():
    assert "bounded" in SUITES
    assert get_suite("bounded") is bounded


def test_writes_well_formed_results(tiny):
    out, returned = tiny
    for ext in ("json", "md", "png"):
        assert (out / f"bounded.{ext}").is_file()
    assert (out / "bounded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bounded.md").read_text()
    assert md.count("| variant | context | contender |") == 1
    assert md.count("\n| T | contender |") == 1
    assert md.count("| variant | T | contender |") == 1

    result = json.loads((out / "bounded.json").read_text())
    assert result["suite"] == "bounded" == returned["suite"]
    assert result["machine"]["torch"] == torch.__version__
    assert result["machine"]["transformers"] == transformers.__version__
    assert positive_number(result["read_bandwidth_bytes_per_s"])
    c = result["config"]
    assert c["tiny"] is True and c["quick"] is False and c["parts"] == list(bounded.PARTS)
    assert len(result["rows"]) == len(returned["rows"])
    for row in result["rows"]:
        assert row["part"] in FIELDS, row
        for field, ok in FIELDS[row["part"]].items():
            assert field in row, f"{row['part']}: row lacks {field!r}: {sorted(row)}"
            assert ok(row[field]), f"{row['part']}: {field}={row[field]!r} fails {ok.__name__}"
        assert row["contender"] in bounded.CONTENDERS
    # Every contender is reported (the keep-all check is tiny-only), each part with its own.
    assert {r["contender"] for r in result["rows"]} == set(bounded.CONTENDERS)
    decode = rows_of(result, "decode")
    assert {r["contender"] for r in decode} == {*bounded.DECODE_CONTENDERS, bounded.KEEP_ALL}
    assert {r["contender"] for r in rows_of(result, "bytes")} == set(bounded.BYTES_CONTENDERS)
    assert {r["contender"] for r in rows_of(result, "bandwidth")} == set(bounded.BANDWIDTH_CONTENDERS)
    for part in ("decode", "bandwidth"):
        assert {(r["variant"], r["query_heads"]) for r in rows_of(result, part)} == set(bounded.VARIANTS.items())


def test_decode_cache_bytes_follow_the_bounds(tiny):
    _, result = tiny
    c = result["config"]["decode"]
    layers, budget, sinks = c["layers"], c["budget"], c["sinks"]
    assert c["contexts"] == [128] and budget < 128  # the bounds bind, and the quantized layers code tokens
    for r in rows_of(result, "decode"):
        name, nbytes = r["contender"], r["cache_bytes"]
        assert r["samples_s"] and len(r["samples_s"]) == c["repeats"]
        if name == "growable":
            assert r["speedup_vs_growable"] == 1.0 and r["identical_to_growable"] is True
            # Full precision, at least every token of the sequence (capacity rounds up).
            assert nbytes >= layers * (r["context"] + 1 + c["new_tokens"]) * slot_bytes(FP32)
        elif name == "window":
            assert r["spec"] == f"window:window={budget},sinks={sinks}"
            assert nbytes == layers * (budget + sinks) * slot_bytes(FP32)
        elif name in ("lastrec", "h2o", "tova"):
            assert r["spec"] == f"{name}:budget={budget}"
            per_slot = slot_bytes(FP32) + bounded.KV_HEADS * POSITION_AND_SCORE
            assert nbytes == layers * (budget + 1) * per_slot
        elif name == "h2o-int8":
            assert nbytes == layers * (budget + 1) * int8_slot_bytes(FP32)
        elif name.startswith("quantized"):
            assert r["spec"] == f"quantized:bits={name[-1]}"
    for variant in bounded.VARIANTS:
        rows = {r["contender"]: r for r in rows_of(result, "decode") if r["variant"] == variant}
        growable = rows["growable"]["cache_bytes"]
        assert rows["quantized-int4"]["cache_bytes"] < rows["quantized-int8"]["cache_bytes"] < growable
        assert rows["h2o-int8"]["cache_bytes"] < rows["h2o"]["cache_bytes"]
        # A budget covering the whole sequence evicts nothing: the bounded attention path then
        # produces exactly the full cache's tokens.
        assert rows[bounded.KEEP_ALL]["identical_to_growable"] is True


def test_bytes_per_token(tiny):
    _, result = tiny
    c = result["config"]["bytes"]
    budget, layers = c["budget"], c["layers"]
    rows = rows_of(result, "bytes")
    assert sorted({r["tokens"] for r in rows}) == c["lengths"]
    for r in rows:
        t = r["tokens"]
        fp16 = bounded.fp16_bytes(t)
        assert fp16 == t * layers * slot_bytes(FP16)
        assert r["bytes_per_token"] == pytest.approx(r["cache_bytes"] / t)
        assert r["ratio_to_fp16"] == pytest.approx(r["cache_bytes"] / fp16)
        name = r["contender"]
        if name == "static":
            assert r["cache_bytes"] == fp16
        elif name == "growable":
            assert r["cache_bytes"] >= fp16
        elif name == "window":
            assert r["cache_bytes"] == layers * min(t, budget + bounded.SINKS) * slot_bytes(FP16)
        elif name in ("lastrec", "h2o", "tova"):
            per_slot = slot_bytes(FP16) + bounded.KV_HEADS * POSITION_AND_SCORE
            assert r["cache_bytes"] == layers * (min(t, budget) + 1) * per_slot
        elif name == "h2o-int8":
            assert r["cache_bytes"] == layers * (min(t, budget) + 1) * int8_slot_bytes(FP16)
    for t in c["lengths"]:
        by = {r["contender"]: r["cache_bytes"] for r in rows if r["tokens"] == t}
        assert by["quantized-int4"] < by["quantized-int8"]


def test_bandwidth_bytes_read(tiny):
    _, result = tiny
    bw = result["read_bandwidth_bytes_per_s"]
    for r in rows_of(result, "bandwidth"):
        assert r["GBps"] * 1e9 == pytest.approx(r["bytes_read"] / (r["ms"] / 1e3))
        assert r["bandwidth_fraction"] == pytest.approx(r["GBps"] * 1e9 / bw)
        assert len(r["samples_ms"]) == result["config"]["bandwidth"]["repeats"]
        if r["contender"] == "growable":  # fp32 K and V of T + 1 tokens
            assert r["bytes_read"] == (r["tokens"] + 1) * slot_bytes(FP32)
            assert r["max_abs_diff_vs_growable"] == 0.0
    for variant in bounded.VARIANTS:
        rows = {r["contender"]: r for r in rows_of(result, "bandwidth") if r["variant"] == variant}
        read = {name: r["bytes_read"] for name, r in rows.items()}
        assert read["quantized-int4"] < read["quantized-int8"] < read["growable"]
        # Quantization error is small but real; int4's larger than int8's.
        error = {name: r["max_abs_diff_vs_growable"] for name, r in rows.items()}
        assert 0 < error["quantized-int8"] < error["quantized-int4"] < 0.5


def test_bytes_read_counts_the_used_part_of_the_quantized_store():
    layer = bounded.make_layer("quantized-int8")
    k, v = torch.randn(1, 8, 200, 128), torch.randn(1, 8, 200, 128)
    layer.update(k, v)
    layer.settle()
    used = bounded.bytes_read(layer)
    assert used == sum(t.nbytes for t in layer.state().tensors.values())
    assert used <= layer.nbytes  # allocated may exceed used, never the other way
    full = bounded.make_layer("growable")
    full.update(k, v)
    assert bounded.bytes_read(full) == 200 * slot_bytes(FP32)


def test_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown contender 'nope'"):
        bounded.spec_for("nope", 16)
    with pytest.raises(ValueError, match="unknown part"):
        bounded.run(RunOptions(tiny=True, progress=False), parts=["nope"])
