"""The cache file: layer states and metadata <-> one safetensors file, with every check the file
alone allows (what it must agree with in a model is ``cachefile.py``'s business).

Tensors: ``layer.{i}.{name}`` (``keys`` ``[B, Hkv, L, D]``, ``values``, or a kind's own). String
metadata: ``format`` = ``kvcache``, ``format_version``, ``spec``, ``config`` (the model fields a
cache must agree with) and its ``fingerprint``, ``layers`` (per layer: kind, options, ``seen``,
tensor names; null for a layer without a cache), ``checksums`` (SHA-256 of each tensor's bytes),
``token_ids`` (only for a conversation: a JSON list of ints) and ``meta_checksum`` over the rest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_bytes

from ..errors import CorruptedFileError, ForeignFileError
from .fingerprint import fingerprint_of
from ..layers.base import LayerState
from .atomic import atomic_write
from .header import FORMAT, FORMAT_VERSION, head_bytes, metadata_checksum, one_line, parse_json, read_header, short

#: Most tokens a layer may claim to have seen (positions stay exact in float64 and int64 far beyond).
MAX_SEEN = 2**40
_ENTRY_FIELDS = {"kind", "options", "seen", "tensors"}


@dataclass
class SavedCache:
    """What one cache file holds: ``layers[i]`` is layer i's state (None: no cache there)."""

    spec: str
    config: dict[str, Any] | None
    layers: list[LayerState | None]
    #: The conversation's tokens, for a file saved with them; else None.
    token_ids: list[int] | None = None


def checksum(t: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes."""
    return hashlib.sha256(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())).hexdigest()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage: a cache view copied once, never twice."""
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


# ---- writing ----------------------------------------------------------------------------------


def write_cache_file(path: str | os.PathLike, saved: SavedCache) -> None:
    """Write ``saved`` to ``path`` atomically (see ``atomic.atomic_write``)."""
    atomic_write(path, _write_safetensors(*_tensors_and_metadata(saved)))


def encode_cache(saved: SavedCache) -> bytes:
    """The bytes of the cache file for ``saved`` (what ``write_cache_file`` would write)."""
    return safetensors_bytes(*_tensors_and_metadata(saved))


def _tensors_and_metadata(saved: SavedCache) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors: dict[str, torch.Tensor] = {}
    table: list[dict[str, Any] | None] = []
    for i, state in enumerate(saved.layers):
        if state is None:
            table.append(None)
            continue
        for name, t in state.tensors.items():
            tensors[f"layer.{i}.{name}"] = _owned(t)
        table.append({"kind": state.kind, "options": state.options, "seen": state.seen, "tensors": list(state.tensors)})
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "spec": saved.spec,
        "config": json.dumps(saved.config, sort_keys=True),
        "fingerprint": "" if saved.config is None else fingerprint_of(saved.config),
        "layers": json.dumps(table),
        "checksums": json.dumps({name: checksum(t) for name, t in tensors.items()}, sort_keys=True),
    }
    if saved.token_ids is not None:
        metadata["token_ids"] = json.dumps(list(saved.token_ids))
    metadata["meta_checksum"] = metadata_checksum(metadata)
    return tensors, metadata


def _write_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> Callable[[str], None]:
    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as e:  # safetensors wraps I/O errors (ENOSPC, EFBIG, ...) in its own type
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1]))) from e

    return write


# ---- reading ----------------------------------------------------------------------------------


def read_cache_file(path: str | os.PathLike) -> SavedCache:
    """The states and metadata of the cache file at ``path`` (tensors on the CPU).

    Raises a ``CacheFileError`` naming the file for anything the file contradicts on its own:
    truncation, changed bytes (checksums), a foreign format or version, malformed fields, a layer
    table that disagrees with the tensors. Nothing is allocated that the file's size does not bound.
    """
    path = str(path)
    if os.path.isdir(path):
        raise ForeignFileError(f"{path}: is a directory, not a cache file")
    _, meta = read_header(head_bytes(path), path, os.path.getsize(path))
    return _saved_cache(meta, path, lambda: load_file(path))


def decode_cache(raw: bytes, name: str, *, digest_checked: bool = False) -> SavedCache:
    """``read_cache_file`` for the bytes of a cache file (``name`` is used in error messages).

    ``digest_checked``: the caller has checked a digest over all of ``raw`` (a prompt store entry),
    so the per-tensor checksums, which could only repeat that check, are skipped.
    """
    _, meta = read_header(raw, name)
    return _saved_cache(meta, name, lambda: safetensors_load(bytes(raw)), check_tensors=not digest_checked)


def _saved_cache(
    meta: dict[str, str], path: str, load_tensors: Callable[[], dict[str, torch.Tensor]], *, check_tensors: bool = True
) -> SavedCache:
    """The checks after the header's: fields, layer table, checksums, then the tensors."""
    config = parse_json(meta.get("config"), path, "the model configuration")
    if not isinstance(config, dict):
        raise CorruptedFileError(f"{path}: the file records no model configuration (got {short(config)})")
    if meta.get("fingerprint") != fingerprint_of(config):
        raise CorruptedFileError(f"{path}: the configuration fingerprint does not match the configuration saved with it")
    spec = meta.get("spec")
    if not isinstance(spec, str):
        raise CorruptedFileError(f"{path}: the cache spec is missing")
    table = parse_json(meta.get("layers"), path, "the layer table")
    if not isinstance(table, list):
        raise CorruptedFileError(f"{path}: the layer table is {short(table)}, not a list of layers")
    for i, entry in enumerate(table):
        _check_entry(i, entry, path)
    checksums = parse_json(meta.get("checksums"), path, "the checksums")
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise CorruptedFileError(f"{path}: the checksums are not a table of strings")
    token_ids = None
    if "token_ids" in meta:
        token_ids = parse_json(meta["token_ids"], path, "the token ids")
        if not isinstance(token_ids, list):  # its items are the cache's to check, against its tokens seen
            raise CorruptedFileError(f"{path}: the token ids are {short(token_ids)}, not a list")

    try:
        tensors = load_tensors()
    except Exception as e:  # safetensors raises its own error types
        raise CorruptedFileError(f"{path}: tensor data cannot be read ({one_line(e)})") from None
    listed = {f"layer.{i}.{n}" for i, e in enumerate(table) if e is not None for n in e["tensors"]}
    if not set(tensors) == set(checksums) == listed:
        odd = sorted(set(tensors) ^ listed | set(tensors) ^ set(checksums))
        raise CorruptedFileError(f"{path}: the tensors in the file, the checksums and the layer table disagree on {short(odd)}")
    for name, want in checksums.items() if check_tensors else ():
        if checksum(tensors[name]) != want:
            raise CorruptedFileError(f"{path}: checksum mismatch in tensor {name!r}: its bytes changed after saving")
    layers = [
        None if e is None else LayerState(e["kind"], e["options"], e["seen"], {n: tensors[f"layer.{i}.{n}"] for n in e["tensors"]})
        for i, e in enumerate(table)
    ]
    return SavedCache(spec, config, layers, token_ids)


def _check_entry(i: int, entry: Any, path: str) -> None:
    """Layer ``i``'s row of the layer table: null, or its kind, options, tokens seen and tensor names."""
    if entry is None:
        return
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise CorruptedFileError(f"{path}: layer {i}'s entry {short(entry)} does not have the fields {sorted(_ENTRY_FIELDS)}")
    if not isinstance(entry["kind"], str) or not isinstance(entry["options"], dict):
        raise CorruptedFileError(f"{path}: layer {i} has kind {short(entry['kind'])} and options {short(entry['options'])}")
    seen = entry["seen"]
    if type(seen) is not int or not 0 <= seen <= MAX_SEEN:
        raise CorruptedFileError(f"{path}: layer {i} claims {short(seen)} tokens seen (expected an integer in [0, 2**40])")
    names = entry["tensors"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise CorruptedFileError(f"{path}: layer {i}'s tensor list {short(names)} is not a list of distinct names")
