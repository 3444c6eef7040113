"""Suite ``real`` (decode on a real model against its floor), on a tiny random Llama saved as a
model folder, so nothing is downloaded. No timing is judged: the report's structure, the
identical-tokens comparison against ``DynamicCache``, the floor arithmetic on hand-computed cases,
the prefill the contenders are filled from (against a plain Hugging Face prefill), and that the
compiled rows either decode or say why not."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch
from transformers import DynamicCache

from kvcache import cache_kwargs
from kvcache.apps.bench import SUITES, real, real_decode
from kvcache.apps.bench.floor import Machine, ModelShape, floor_seconds, model_shape, step_flops
from kvcache.apps.bench.workload import make_prompts, prefill, prefill_stored, prompts_pinned, resolve_model
from kvcache.apps.cli import main
from kvcache.apps.run_options import RunOptions
from kvcache.apps.tiny import tiny_model
from kvcache.apps.trained import MODEL_DIR, load_pretrained
from kvcache.errors import KVCacheError

#: Contenders of the end-to-end run: the reference, eager and compiled fixed-capacity caches of
#: both libraries, and ours growable and int8 (Hugging Face's quantized caches need extra packages).
RUN_CONTENDERS = ["dynamic", "hf_static", "hf_static+compile", "growable", "static", "static+compile", "quantized-int8"]


def tiny_llama(**overrides):
    return tiny_model(
        "llama",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=320,
        max_position_embeddings=512,
        **overrides,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama and the shipped byte-level tokenizer, as a ``from_pretrained`` folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def result(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("real-out")
    options = RunOptions(tiny=True, out=out, progress=False)
    return real.run(options, model=str(model_dir), contenders=RUN_CONTENDERS), out


def test_registered():
    assert "real" in SUITES


def test_report_structure(result):
    res, out = result
    assert res["suite"] == "real"
    assert {"torch", "transformers", "kvcache"} <= set(res["machine"])
    assert set(res["config"]["batches"]) == {1, 2} and res["config"]["contexts"] == [32]
    for path in ("real.json", "real.csv", "real.md"):
        assert (out / path).is_file()
    assert json.loads((out / "real.json").read_text())["rows"] == json.loads(json.dumps(res["rows"], default=str))
    assert (out / "real.csv").read_text().splitlines()[0].startswith("batch,context,contender,compiled")
    rows = res["rows"]
    assert [(r["batch"], r["contender"]) for r in rows] == [(b, n) for b in (1, 2) for n in RUN_CONTENDERS]
    rates = res["machine_rates"]
    assert all(m["read_bytes_per_s"] > 0 and m["matmul_flops_per_s"] > 0 for m in rates.values())
    for r in rows:
        if r["tokens_per_s"] is None:
            continue
        assert r["tokens_per_s"] > 0 and r["speedup_vs_dynamic"] > 0 and r["cache_bytes"] > 0
        assert r["step_over_floor"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        assert r["floor_ms"] == pytest.approx(max(r["memory_floor_ms"], r["compute_floor_ms"]))
        assert r["memory_floor_ms"] == pytest.approx(r["weights_floor_ms"] + r["kv_floor_ms"])
        assert r["speedup_vs_hf_static"] > 0
        assert len(r["samples_s"]) == res["config"]["repeats"]
    table = real.table(res)
    assert "| 2 | 32 | growable |" in table and "step / floor" in table


def test_exact_contenders_match_dynamic(result):
    """Full-precision caches keep exactly DynamicCache's keys and values: the same greedy tokens."""
    for r in result[0]["rows"]:
        if r["contender"] in ("dynamic", "hf_static", "growable", "static") and r["tokens_per_s"] is not None:
            assert r["identical_to_dynamic"] is True and r["token_agreement"] == 1.0
    dynamic = [r for r in result[0]["rows"] if r["contender"] == "dynamic"]
    assert all(r["speedup_vs_dynamic"] == 1.0 for r in dynamic)


def test_compiled_rows_decode_or_say_why(result):
    for r in result[0]["rows"]:
        if not r["compiled"]:
            continue
        if r["tokens_per_s"] is None:
            assert r["reason"].startswith(("compile failed:", "recompiled after warm-up:")), r["reason"]
        else:
            assert r["compile_s"] > 0 and r["identical_to_dynamic"] is True
    # Hugging Face's StaticCache compiles with fullgraph and no recompilation: it must decode.
    assert all(r["tokens_per_s"] for r in result[0]["rows"] if r["contender"] == "hf_static+compile")


def test_compare_reports_differing_tokens():
    """identical/agreement come from the last round's tokens against DynamicCache's."""
    shape = ModelShape(layers=1, query_heads=2, kv_heads=1, head_dim=4, hidden=8, vocab=16, body_params=10, weight_bytes=100)
    machine = Machine(read_bytes_per_s=1e3, matmul_flops_per_s=1e3, gemv_flops_per_s=1e3)

    def decoded(tokens):
        return {"seconds": 1.0, "tokens": torch.tensor(tokens), "cache_bytes": 64, "kv_bytes_at_context": 32, "compile_s": None}

    runs = {
        "dynamic": [decoded([[1, 2, 3, 4]])],
        "growable": [decoded([[1, 2, 3, 4]])],
        "quantized-int8": [decoded([[1, 2, 9, 9]])],
        "static+compile": [{"reason": "compile failed: Unsupported: graph break"}],
    }
    rows = {r["contender"]: r for r in real.compare(runs, shape, machine, batch=1, context=4, steps=4)}
    assert rows["growable"]["identical_to_dynamic"] is True
    assert rows["quantized-int8"]["identical_to_dynamic"] is False
    assert rows["quantized-int8"]["token_agreement"] == 0.5
    assert rows["static+compile"]["tokens_per_s"] is None and "graph break" in rows["static+compile"]["reason"]
    # quantized: the floor counts the bytes held at the context (32), fp32 ones the keys and values.
    assert rows["quantized-int8"]["kv_bytes_read"] == 32
    assert rows["growable"]["kv_bytes_read"] == 2 * 1 * 1 * 4 * 4 * 4


def test_targets_judge_ours_against_static_and_coded_against_growable():
    def row(batch, context, name, speed):
        return {"batch": batch, "context": context, "contender": name, "tokens_per_s": speed}

    rows = [
        row(1, 1024, "hf_static", 10.0), row(1, 1024, "growable", 10.4), row(1, 1024, "static", 10.6),
        row(1, 1024, "quantized-int8", 9.0),  # batch 1 at 1K: no coded target covers it
        row(4, 4096, "hf_static", 10.0), row(4, 4096, "growable", 10.0), row(4, 4096, "static", None),
        row(4, 4096, "quantized-int8", 10.9), row(4, 4096, "quantized-int4", 9.0),  # int4: from 8K
        row(8, 8192, "growable", 10.0), row(8, 8192, "quantized-int8", 11.0), row(8, 8192, "quantized-int4", 12.0),
    ]  # fmt: skip
    assert real.targets(rows) == [
        "batch 1 x 1024: ours (static) / StaticCache = 1.06 (target >= 1.05: met)",
        "batch 4 x 4096: ours (growable) / StaticCache = 1.00 (target >= 1.05: not met)",
        "batch 4 x 4096: quantized-int8 / growable = 1.09 (target >= 1.1: not met)",
        "batch 8 x 8192: quantized-int8 / growable = 1.10 (target >= 1.1: met)",
        "batch 8 x 8192: quantized-int4 / growable = 1.20 (target >= 1.2: met)",
    ]


def test_floor_hand_computed():
    shape = ModelShape(layers=2, query_heads=4, kv_heads=2, head_dim=8, hidden=32, vocab=100, body_params=1000, weight_bytes=20000)
    # 2*1000*2 weights + 2*32*100*2 LM head + 4*2*4*8*10*2 attention
    assert step_flops(shape, batch=2, context=10) == 4000 + 12800 + 5120
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4
    kv = shape.kv_bytes_per_token * 10 * 2  # 5120
    memory_bound = floor_seconds(shape, Machine(1000.0, 1000.0, 1.0), 2, 10, kv)
    assert memory_bound == pytest.approx({"memory_s": 25.12, "weights_s": 20.0, "kv_s": 5.12, "compute_s": 21.92, "floor_s": 25.12})
    compute_bound = floor_seconds(shape, Machine(1e6, 100.0, 1.0), 2, 10, kv)
    assert compute_bound["floor_s"] == compute_bound["compute_s"] == pytest.approx(219.2)


@pytest.mark.parametrize("tied", [False, True])
def test_model_shape_counts(tied):
    model = tiny_llama(tie_word_embeddings=tied)
    shape = model_shape(model)
    embedding = model.model.embed_tokens.weight.numel()
    body = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert shape.body_params == body
    head_bytes = model.lm_head.weight.numel() * 4
    assert shape.weight_bytes == (body * 4 + head_bytes)  # an untied input embedding is not read whole
    assert embedding == 320 * 64 and (shape.layers, shape.query_heads, shape.kv_heads, shape.head_dim) == (2, 4, 2, 16)


def test_prefill_is_a_plain_prefill(model_dir, tmp_path):
    """Chunked, row by row, the first C positions equal a plain C-token prefill of each row."""
    model, tokenizer = load_pretrained(model_dir)
    prompts = make_prompts(tokenizer, 2, 40, model.config.vocab_size)
    assert not torch.equal(prompts[0], prompts[1])
    past = prefill(model, prompts, chunk=16)
    for row in range(2):
        reference = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(prompts[row : row + 1, :24], **cache_kwargs(model, reference))
        for (keys, values), layer in zip(past, reference.layers):
            torch.testing.assert_close(keys[row : row + 1, :, :24], layer.keys)
            torch.testing.assert_close(values[row : row + 1, :, :24], layer.values)
    stored = prefill_stored(model, prompts, tmp_path, chunk=16)
    again = prefill_stored(model, prompts, tmp_path, chunk=16)  # from the file
    assert len(list(tmp_path.glob("prefill-*.pt"))) == 1
    for (k1, v1), (k2, v2) in zip(stored, again):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_pinned_prompts_survive_a_changed_corpus(model_dir, tmp_path, monkeypatch):
    """Kept prompts are read back even when the source text would now tokenize differently; a kept
    file of the wrong shape or range is refused, not used."""
    from kvcache.apps.bench import workload

    _, tokenizer = load_pretrained(model_dir)
    first = prompts_pinned(tokenizer, 2, 30, 320, tmp_path)
    assert torch.equal(first, make_prompts(tokenizer, 2, 30, 320))
    monkeypatch.setattr(workload, "corpus", lambda: "a different text entirely " * 40)
    assert not torch.equal(make_prompts(tokenizer, 2, 30, 320), first)
    assert torch.equal(prompts_pinned(tokenizer, 2, 30, 320, tmp_path), first)
    torch.save(torch.full((2, 30), 999, dtype=torch.long), tmp_path / "prompts-2x30.pt")
    with pytest.raises(KVCacheError, match="token ids below 320"):
        prompts_pinned(tokenizer, 2, 30, 320, tmp_path)
    (tmp_path / "prompts-2x30.pt").write_bytes(b"not a tensor")
    with pytest.raises(KVCacheError, match="not a prompts file"):
        prompts_pinned(tokenizer, 2, 30, 320, tmp_path)


def test_missing_backend_is_a_reason(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert "not installed" in real_decode.unavailable("hf_quanto-int4")
    assert real_decode.unavailable("growable") is None


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(KVCacheError, match="smollm2"):
        resolve_model("no-such-model")


def test_cli(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(real, "CONTENDERS", {n: real_decode.CONTENDERS[n] for n in ("dynamic", "growable")})
    code = main(["bench", "real", "--tiny", "--no-progress", "--model", str(model_dir), "--batches", "1", "--out", str(tmp_path)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| 1 | 32 | growable |" in text and f"wrote {tmp_path / 'real.csv'}" in text
    assert main(["bench", "decode", "--tiny", "--model", str(model_dir), "--out", str(tmp_path)]) == 2
    assert main(["bench", "real", "--contexts", "0,4"]) == 2
