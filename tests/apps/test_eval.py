"""The quality harness (``kvcache eval``).

The harness runs in its ``tiny`` mode (seconds; its numbers mean nothing) on a small random model
built and saved the way ``tools/train_tiny.py`` saves the trained one, and must write the
documented schema.
"""

from __future__ import annotations

import json

import pytest
from helpers import load_tool
from kvcache.apps import eval as harness
from kvcache.apps.cli import main
from kvcache.apps.run_options import RunOptions

RUN_KEYS = {"cache", "budget", "task", "accuracy", "kl", "top1", "bytes_per_token"}




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random 2-layer model and the byte-level tokenizer, saved as the training script saves them."""
    train = load_tool("train_tiny")
    folder = tmp_path_factory.mktemp("model")
    args = train.parse_args(["--out", str(folder), "--layers", "2", "--hidden", "64", "--heads", "4",
                             "--kv-heads", "2", "--intermediate", "128"])
    train.build_model(args).save_pretrained(folder)
    train.build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("eval")
    result = harness.run(
        RunOptions(tiny=True, out=out, progress=False), kinds=("h2o", "window", "quantized"), budgets=(0.25,),
        model_dir=model_dir,
    )
    return result, out


def test_tiny_run_writes_the_documented_schema(tiny_result):
    result, out = tiny_result
    for ext in ("json", "md", "png"):
        assert (out / f"eval.{ext}").stat().st_size > 0
    saved = json.loads((out / "eval.json").read_text())
    assert saved["runs"] == result["runs"]
    runs = saved["runs"]
    assert all(RUN_KEYS <= set(r) for r in runs)
    caches = {(r["cache"], r["budget"]) for r in runs}
    assert caches == {("full", "100%"), ("h2o", "25%"), ("window", "25%"), ("quantized", "int8"), ("quantized", "int4"),
                      ("quantized", "int2")}
    tasks_seen = {r["task"] for r in runs}
    assert tasks_seen == {"text"} | {f"{t}-{w}" for t in harness.TASKS for w in harness.DEPTHS}
    for r in runs:
        assert r["bytes_per_token"] > 0
        if r["task"] == "text":
            assert r["accuracy"] is None and r["kl"] >= 0 and 0 <= r["top1"] <= 1
        else:
            assert r["kl"] is None and r["top1"] is None and 0 <= r["accuracy"] <= 1


def test_tiny_run_facts_that_do_not_depend_on_the_weights(tiny_result):
    result, _ = tiny_result
    text = {(r["cache"], r["budget"]): r for r in result["runs"] if r["task"] == "text"}
    full = text[("full", "100%")]
    assert full["kl"] == 0 and full["top1"] == 1
    # Bounded and quantized caches hold fewer bytes per token than the full cache.
    for key, r in text.items():
        if key != ("full", "100%"):
            assert r["bytes_per_token"] < full["bytes_per_token"], key
    bits = [text[("quantized", f"int{b}")]["bytes_per_token"] for b in (2, 4, 8)]
    assert bits == sorted(bits) and len(set(bits)) == 3


def test_specs_cover_budgets_and_bits():
    specs = harness.specs_for(("window", "h2o", "quantized", "h2o-int8"), (0.5, 0.1), 1000)
    assert specs[0] == ("full", "100%", "growable")
    assert ("window", "50%", "window:window=496,sinks=4") in specs
    assert ("h2o", "10%", "h2o:budget=100") in specs
    assert ("h2o-int8", "50%", "h2o:budget=500,storage=int8") in specs
    assert {s for k, _, s in specs if k == "quantized"} == {f"quantized:bits={b}" for b in (8, 4, 2)}
    with pytest.raises(ValueError, match="unknown cache kind"):
        harness.specs_for(("sink",), (0.5,), 100)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--caches", "h2o,bogus"], "bogus"),
        (["--caches", ""], "(none given)"),  # as on a real model: an empty list is no list
        (["--budgets", "0.5,2"], "fraction"),
        (["--budgets", "half"], "fractions"),
        (["--model", "/nonexistent/model"], "no trained model"),
    ],
)
def test_cli_errors_say_what_is_wrong(args, message, capsys, tmp_path, model_dir):
    if "--model" not in args:
        args = [*args, "--model", str(model_dir)]
    assert main(["eval", "--tiny", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_tiny_run(capsys, tmp_path, model_dir):
    code = main(["eval", "--tiny", "--no-progress", "--caches", "lastrec", "--budgets", "0.5", "--out", str(tmp_path),
                 "--model", str(model_dir)])
    assert code == 0
    out = capsys.readouterr().out
    assert "| lastrec | 50% |" in out and "| full | 100% |" in out
    assert json.loads((tmp_path / "eval.json").read_text())["runs"]
