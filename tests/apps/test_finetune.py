"""``kvcache finetune`` on the shipped tiny model: a LoRA adapter trained through a bounded cache,
scored under it before and after, saved; bad options refused before anything is loaded."""

from __future__ import annotations

import json
import math

import pytest

from kvcache.apps.cli import main

pytest.importorskip("peft")  # the test extra brings it


def test_finetune_trains_scores_and_saves_the_adapter(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["finetune", "--model", "tiny", "--cache", "h2o:budget=32", "--chunk", "32", "--length", "96", "--steps", "3",
                 "--eval-docs", "1", "--save-every", "2", "--out", str(out), "--no-progress"])  # fmt: skip
    assert code == 0
    record = json.loads((out / "finetune.json").read_text())
    assert record["trained_through"] == "h2o:budget=32" and len(record["train_losses"]) == 3
    for when in ("before", "after"):
        assert all(math.isfinite(v) and v > 0 for v in record[when].values())
    assert record["after"]["loss_under_cache"] != record["before"]["loss_under_cache"]  # the adapter changed the model
    for folder in ("adapter", "adapter-step-2"):
        assert (out / folder / "adapter_config.json").is_file()
    printed = capsys.readouterr().out
    assert "held-out loss under h2o:budget=32:" in printed and str(out / "adapter") in printed


def test_training_through_another_cache_than_the_one_scored(tmp_path):
    out = tmp_path / "full"
    assert main(["finetune", "--model", "tiny", "--cache", "window:window=32", "--train-cache", "growable", "--chunk", "32",
                 "--length", "64", "--steps", "1", "--eval-docs", "1", "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    record = json.loads((out / "finetune.json").read_text())
    assert record["trained_through"] == "growable" and record["run"]["cache"] == "window:window=32"


@pytest.mark.parametrize(("args", "message"), [(["--grad", "all"], "replay, detach or a positive number"), (["--steps", "0"], "--steps must be at least 1")])
def test_bad_options_are_refused(tmp_path, capsys, args, message):
    assert main(["finetune", "--model", "tiny", "--out", str(tmp_path / "x"), *args]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
