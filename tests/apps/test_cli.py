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
BOUNDED = ["window 25%", "h2o 25%", "tova 12.5%", "quantized int4"]
FIELDS = {
    "cache",
    "spec",
    "bounded",
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
        "family": "llama", "prompt_tokens": 32, "new_tokens": 8, "depth": demo.DEPTH, "repeats": 1, "threads": None
    }

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
    argv = ["demo", "--prompt-tokens", "512", "--new-tokens", "8", "--depth", "0.5", "--repeats", "1", "--threads", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    data = json.loads(path.read_text())
    assert out[0] == data["header"]
    assert "trained" in out[0] and "pass-key prompt 512 (key at depth 0.5" in out[0]
    assert data["settings"]["prompt_tokens"] == 512 and data["settings"]["family"] is None
    results = {r["cache"]: r for r in data["results"]}
    assert list(results) == CONTENDERS + BOUNDED
    key = tasks.passkey(0, length=511, depth=0.5).answer.strip()
    # The demo's prompt is seed 0's instance; the full caches answer exactly as DynamicCache does.
    assert results["DynamicCache"]["answer"].strip() == key and results["DynamicCache"]["correct"] is True
    for name in CONTENDERS[1:]:
        assert results[name]["identical"] is True and results[name]["answer"] == results["DynamicCache"]["answer"]
    for name in BOUNDED:
        r = results[name]
        assert r["bounded"] is True and set(r) == FIELDS
        assert isinstance(r["correct"], bool) and r["correct"] == (r["answer"].strip() == key)
        assert r["cache_bytes"] == r["reported_nbytes"] > 0
        assert any(line.startswith(name + " ") for line in out), name
    # Bounded caches hold less than the full cache.
    assert results["window 25%"]["cache_bytes"] < results["growable"]["cache_bytes"] / 2
    assert results["quantized int4"]["cache_bytes"] < results["growable"]["cache_bytes"] / 2


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

