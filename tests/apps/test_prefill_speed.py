"""``python -m kvcache.apps.bench.prefill_speed``: every contender runs and is compared with the
model's own SDPA prefill and with ``growable`` (numbers from the shipped tiny model mean nothing)."""

from __future__ import annotations

import pytest

from kvcache.apps.bench import prefill_speed
from kvcache.errors import KVCacheError


def test_rows_compare_each_contender_with_sdpa_and_growable():
    names = list(prefill_speed.CONTENDERS)
    rows = prefill_speed.run([24], [2], names, chunk=8, repeats=1, model_name="tiny", progress=False)
    assert [r["contender"] for r in rows] == names
    for row in rows:
        assert row["seconds"] > 0 and row["cpu_seconds"] > 0 and len(row["seconds_samples"]) == 1
        assert row["seconds_vs_sdpa"] == pytest.approx(row["seconds"] / rows[0]["seconds"])
        assert row["chunk"] == (8 if row["contender"].endswith("chunked") else 24)
    table = prefill_speed.table(rows)
    assert table.count("\n") >= len(names) + 1 and "x growable" in table


def test_unknown_contenders_are_named():
    with pytest.raises(KVCacheError, match="nope"):
        prefill_speed.run([8], [1], ["sdpa", "nope"], model_name="tiny", progress=False)
