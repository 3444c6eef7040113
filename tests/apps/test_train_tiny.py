"""``tools/train_tiny.py``: the schedule, the rows it trains on, and a few real steps end to end
(fresh, resumed, and as a second stage started from another run's weights)."""

from __future__ import annotations

import json
import random

import pytest

from helpers import load_tool
from kvcache.apps.trained import load_trained

SMALL = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--intermediate", "64"]


@pytest.fixture(scope="module")
def train():
    return load_tool("train_tiny")


def test_phases_run_in_order_and_mixed_phases_cycle_their_lengths(train):
    phases = train.parse_phases("128:1:16,256/512:3")
    assert phases == [((128,), 1.0, 16), ((256, 512), 3.0, None)]
    schedule = train.phase_schedule(phases, 8)
    assert schedule == [(0, (128,), 16), (2, (256, 512), None)]
    at = [train.phase_at(schedule, step, tokens_per_step=1024) for step in range(8)]
    assert at[:2] == [(128, 16), (128, 16)]
    assert at[2:] == [(256, 4), (512, 2)] * 3  # batch = tokens per step // length
    with pytest.raises(SystemExit, match="length\\[/length...\\]:share"):
        train.parse_phases("128")


@pytest.mark.parametrize("kind", ["passkey", "assoc", "vartrack", "text", "repeat"])
def test_rows_have_the_exact_length_and_pointers_point_at_the_copied_token(train, kind):
    for i in range(5):
        rng = random.Random(f"test:{kind}:{i}")
        ids, spans, pointers = train.make_row(rng, kind, 512)
        assert len(ids) == 512 and ids[0] == train.BOS_ID
        assert all(0 < a < b <= 512 for a, b in spans)
        # The output at `query` predicts the token at query + 1, a copy of the token at `source`.
        assert all(source <= query and ids[query + 1] == ids[source] for query, source in pointers)
        if kind in ("passkey", "assoc", "repeat"):
            assert pointers and spans


def test_training_saves_a_loadable_folder_resumes_and_chains_stages(train, tmp_path, capsys):
    common = [*SMALL, "--pointer-layer", "0", "--phases", "128/160:1", "--mix", "passkey=1,text=1,repeat=1", "--threads", "1",
              "--eval-every", "100", "--final-eval-lengths", "", "--log-every", "1", "--ckpt-every", "2"]
    first = tmp_path / "first"
    assert train.main(["--out", str(first), "--steps", "3", "--max-minutes", "0", *common]) == 0
    log = [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    assert log[-1] == {"event": "stopped", "step": 1, "reason": "--max-minutes 0.0"}
    assert train.main(["--out", str(first), "--steps", "3", "--resume", "--stop-at", "2", *common]) == 0
    log = [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    assert log[-1] == {"event": "stopped", "step": 2, "reason": "--stop-at 2"}
    assert train.main(["--out", str(first), "--steps", "3", "--resume", *common]) == 0
    log = [json.loads(line) for line in (first / "train_log.jsonl").read_text().splitlines()]
    assert {"event": "resume", "step": 1} in log and {"event": "resume", "step": 2} in log
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3]  # no step twice, none lost
    assert [r["len"] for r in log if "loss" in r] == [128, 160, 128]

    second = tmp_path / "second"
    assert train.main(["--out", str(second), "--init", str(first), "--steps", "2", "--seed", "1", *common]) == 0
    model, tokenizer = load_trained(second)
    assert model.config.hidden_size == 32 and tokenizer.encode("a") == [train.BOS_ID, ord("a")]
    card = (second / "README.md").read_text()
    assert "Commands, in order:" in card
    assert f"1. `python tools/train_tiny.py --out {first} --steps 3 --resume" in card
    assert f"2. `python tools/train_tiny.py --out {second} --init {first}" in card
    # The second stage started from the first one's weights, not from a fresh initialisation.
    start, _ = load_trained(first)
    fresh = train.build_model(train.parse_args(["--out", str(tmp_path / "x"), *SMALL]))
    moved_from_first = (model.lm_head.weight - start.lm_head.weight).abs().max()
    moved_from_fresh = (model.lm_head.weight - fresh.lm_head.weight).abs().max()
    assert moved_from_first < moved_from_fresh
    capsys.readouterr()
