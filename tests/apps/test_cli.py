"""The ``kvcache`` command line and the demo behind ``kvcache demo``.

The demo's figures are checked against arithmetic from the model config and against Hugging Face's
``DynamicCache`` behaviour (one new storage per layer per forward pass), and the library's own
counters against the demo's pointer measurements. With the shipped trained model, the answers are
checked against the pass key of the prompt the demo builds.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import subprocess
import sys

import pytest
import torch

import kvcache
from kvcache.apps import demo, demo_table, tasks
from kvcache.apps.cli import main

CONTENDERS = ["DynamicCache", "concat", "growable", "static"]
#: The trained model's unbounded contenders, then its bounded ones: those the demo says keep the key, those that lose it.
TRAINED = ["DynamicCache", "growable"]
KEEP = ["snapkv 12.5%", "adakv 12.5%", "auto 12.5% bytes", "quantized int4"]
LOSE = ["window 25%", "h2o 25%"]
BOUNDED = KEEP + LOSE
FIELDS = {
    "cache",
    "spec",
    "bounded",
    "why",
    "answer",
    "correct",
    "tokens_per_s",
    "tokens_per_s_runs",
    "prefill_s",
    "speedup",
    "cache_bytes",
    "reallocations",
    "reported_nbytes",
    "reported_reallocations",
    "identical",
    "new_tokens",
}


def kv_bytes_per_slot(model) -> int:
    """Bytes of keys + values for one token in one layer, from the config."""
    c = model.config
    return 2 * c.num_key_value_heads * c.head_dim * torch.finfo(torch.float32).bits // 8


def test_demo_writes_json_and_prints_table(tmp_path, capsys):
    path = tmp_path / "demo.json"
    argv = ["demo", "--family", "llama", "--prompt-tokens", "32", "--new-tokens", "8", "--repeats", "1"]
    rc = main([*argv, "--json", str(path)])
    assert rc == 0

    out = capsys.readouterr().out.splitlines()
    data = json.loads(path.read_text())
    assert out[0] == data["header"]
    assert "tiny llama" in out[0]
    assert f"torch {torch.__version__}" in out[0]
    assert "transformers " in out[0] and "prompt 32 + 8 new tokens" in out[0]
    assert data["settings"] == {
        "family": "llama", "prompt_tokens": 32, "new_tokens": 8, "depth": demo.DEPTH, "repeats": 1, "threads": None,
        "sessions": 16,
    }
    assert data["sessions"] is None  # a random model has no pass keys: no sessions part

    results = {r["cache"]: r for r in data["results"]}
    assert [r["cache"] for r in data["results"]] == CONTENDERS
    for name in CONTENDERS:
        assert set(results[name]) == FIELDS
        assert any(line.startswith(name + " ") for line in out), f"no table row for {name}"
    for name in CONTENDERS[1:]:
        assert results[name]["identical"] is True, name
    assert all(r["answer"] is None and r["correct"] is None for r in results.values())

    model = demo.build_model("llama")
    layers, slot = model.config.num_hidden_layers, kv_bytes_per_slot(model)
    stored = 32 + 8 - 1  # the last generated token is never fed back
    for name, r in results.items():
        assert r["new_tokens"] == 8
        assert len(r["tokens_per_s_runs"]) == 1
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
    # Concatenation (Hugging Face's and ours) holds exactly what is stored, and moves every forward.
    for name in ("DynamicCache", "concat"):
        assert results[name]["cache_bytes"] == layers * stored * slot
        assert results[name]["reallocations"] == layers * 8
    # Static holds its capacity (prompt + new tokens) and allocates once per layer.
    assert results["static"]["spec"] == "static:capacity=40"
    assert results["static"]["cache_bytes"] == layers * 40 * slot
    assert results["static"]["reallocations"] == layers
    # Growable: whole slots, room for what is stored; 39 tokens fit in the first allocation
    # (default initial capacity 256), so one allocation per layer.
    assert results["growable"]["cache_bytes"] % (layers * slot) == 0
    assert results["growable"]["cache_bytes"] >= layers * stored * slot
    assert results["growable"]["reallocations"] == layers
    # The library's counters agree with the demo's measurements.
    for name in CONTENDERS[1:]:
        assert results[name]["reported_nbytes"] == results[name]["cache_bytes"], name
        assert results[name]["reported_reallocations"] == results[name]["reallocations"], name
    assert results["DynamicCache"]["reported_nbytes"] is None


def test_demo_flags_differing_tokens_and_restores_threads(monkeypatch):
    real = demo.measured_generate

    def sabotaged(model, prompt, cache, new_tokens):
        run = real(model, prompt, cache, new_tokens)
        if isinstance(cache, kvcache.KVCache) and cache.spec.kind == "concat":
            run["tokens"] = run["tokens"][:-1] + [(run["tokens"][-1] + 1) % model.config.vocab_size]
        return run

    monkeypatch.setattr(demo, "measured_generate", sabotaged)
    before = torch.get_num_threads()
    results = demo.run_demo("llama", prompt_tokens=8, new_tokens=2, repeats=1, progress=False, threads=1)
    assert torch.get_num_threads() == before
    identical = {r["cache"]: r["identical"] for r in results}
    assert identical == {"DynamicCache": True, "concat": False, "growable": True, "static": True}
    table = demo_table.format_table(results).splitlines()
    assert next(line for line in table if line.startswith("concat ")).endswith(" NO")
    assert next(line for line in table if line.startswith("growable ")).endswith(" yes")


def test_demo_on_the_trained_model_finds_the_pass_key(tmp_path, capsys):
    path = tmp_path / "demo.json"
    argv = ["demo", "--new-tokens", "8", "--repeats", "1", "--threads", "1", "--sessions", "3"]  # the default prompt
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    data = json.loads(path.read_text())
    assert out[0] == data["header"]
    assert "trained" in out[0] and f"pass-key prompt 1024 (key at depth {demo.DEPTH:g}" in out[0]
    assert data["settings"]["prompt_tokens"] == 1024 and data["settings"]["family"] is None
    results = {r["cache"]: r for r in data["results"]}
    assert list(results) == TRAINED + BOUNDED
    key = tasks.passkey(0, length=1023, depth=demo.DEPTH).answer.strip()
    # The demo's prompt is seed 0's instance; the full cache answers exactly as DynamicCache does.
    assert results["DynamicCache"]["answer"].strip() == key and results["DynamicCache"]["correct"] is True
    assert results["growable"]["identical"] is True and results["growable"]["answer"] == results["DynamicCache"]["answer"]
    for name in BOUNDED:
        r = results[name]
        assert r["bounded"] is True and set(r) == FIELDS and r["why"]
        assert isinstance(r["correct"], bool) and r["correct"] == (r["answer"].strip() == key)
        assert r["cache_bytes"] == r["reported_nbytes"] > 0
        row = next(line for line in out if line.startswith(name + " "))
        assert r["why"] in row and ("right: " if r["correct"] else "WRONG: ") in row
    # What the demo shows at its own settings: the query-aware kinds, auto and int4 keep the key in
    # a fraction of the bytes; a window and H2O of a quarter lose it (the reasons printed beside them).
    assert [name for name in BOUNDED if results[name]["correct"]] == KEEP
    full = results["DynamicCache"]["cache_bytes"]
    for name in ("snapkv 12.5%", "adakv 12.5%", "auto 12.5% bytes"):
        assert results[name]["cache_bytes"] < full / 4, name
    assert results["quantized int4"]["cache_bytes"] < full / 2
    # The sessions: the engine's tokens are generate's, the keys counted from the answers.
    sessions = data["sessions"]
    assert sessions["sessions"] == 3 and sessions["identical"] is True
    assert 0 <= sessions["right"] == sessions["right_engine"] <= 3
    assert sessions["engine_tokens_per_s"] > 0 and sessions["generate_tokens_per_s"] > 0
    assert any(line.startswith("3 sessions at once") for line in out)


def test_the_sessions_count_a_wrong_key_and_differing_tokens(monkeypatch):
    """The second part's checks can fail: an engine that answers otherwise is reported so."""
    from kvcache.apps import demo_sessions
    from kvcache.apps.trained import load_trained

    model, tokenizer = load_trained()
    real = kvcache.Engine.generate_batch

    def off_by_one(self, inputs, **kwargs):
        return [[(t + 1) % model.config.vocab_size for t in row] for row in real(self, inputs, **kwargs)]

    monkeypatch.setattr(kvcache.Engine, "generate_batch", off_by_one)
    got = demo_sessions.run_sessions(model, tokenizer, sessions=2, new_tokens=6)
    assert got["identical"] is False and got["right_engine"] < got["right"] == 2
    assert "identical to generate's: NO" in demo_sessions.sessions_lines(got)


def test_demo_leaves_the_models_attention_as_it_found_it():
    from kvcache.apps.trained import load_trained

    model, tokenizer = load_trained()
    before = model.config._attn_implementation
    results = demo.run_demo(prompt_tokens=256, new_tokens=2, repeats=1, model=model, tokenizer=tokenizer, progress=False)
    assert any(r["bounded"] for r in results)  # they switch the model to the "kvcache" attention
    assert model.config._attn_implementation == before


def test_demo_refuses_a_prompt_too_short_for_the_pass_key(capsys):
    assert main(["demo", "--prompt-tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache: error: --prompt-tokens 20: passkey: length 19 is too short")


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"kvcache {kvcache.__version__}\n"
    assert kvcache.__version__ == importlib.metadata.version("kvcache")


def test_console_script_points_at_main():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "kvcache"] == ["kvcache.apps.cli:main"]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nosuch"],
        ["demo", "--new-tokens", "1"],
        ["demo", "--prompt-tokens", "0"],
        ["demo", "--repeats", "two"],
        ["demo", "--family", "gpt2"],
        ["demo", "--json", "/nonexistent-dir/out.json"],
        ["demo", "--depth", "1.5"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err


def test_kvcache_error_is_one_line_exit_2(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise kvcache.SpecError("no such cache kind 'x'")

    monkeypatch.setattr(demo, "build_model", fail)
    assert main(["demo", "--family", "llama"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "kvcache: error: no such cache kind 'x'\n"
    assert captured.out == ""


def test_python_dash_m(tmp_path):
    path = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "kvcache", "demo", "--family", "llama", "--prompt-tokens", "16", "--new-tokens", "4"]
    cmd += ["--repeats", "1"]
    done = subprocess.run([*cmd, "--json", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("kvcache demo: tiny llama")
    for name in CONTENDERS:
        assert any(line.startswith(name + " ") for line in lines), name
    assert [r["cache"] for r in json.loads(path.read_text())["results"]] == CONTENDERS
    assert "Traceback" not in done.stderr

