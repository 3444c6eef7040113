"""Cache files: one safetensors file per cache, checked on load.

Layout: tensors ``layer.{i}.{name}`` (``keys`` ``[B, Hkv, L, D]``, ``values``, ...), and string
metadata: ``format`` = ``kvcache``, ``format_version``, ``spec``, ``dtype``, ``config`` (the model
fields a cache must agree with) and its ``fingerprint``, ``layers`` (per layer: kind, options,
``seen``, ``length``) and ``checksums`` (SHA-256 of each tensor's bytes).

Saving writes a temporary file beside the target, flushes it to disk and renames it into place, so
a failed save leaves the old file intact. Loading refuses, with an error naming the problem, a
file that is truncated, has a changed byte, is not a kvcache file (or of an unknown version), or
was saved for a model with another configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from .errors import CacheFileError, CorruptedFileError, ForeignFileError, ModelMismatchError, TruncatedFileError
from .layers import LAYER_KINDS, LayerState

if TYPE_CHECKING:
    from .cache import KVCache

FORMAT = "kvcache"
FORMAT_VERSION = 1


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())


def checksum(t: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes."""
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor owning its storage: a cache view copied once, never twice."""
    t = t.detach().to("cpu").contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def metadata_checksum(meta: dict[str, str]) -> str:
    """SHA-256 of every metadata field but itself, so no header byte can change unnoticed."""
    fields = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def save_cache(cache: KVCache, path: str | os.PathLike) -> None:
    """Write ``cache`` to ``path`` atomically (temporary file, fsync, rename)."""
    from .foreign import refuse

    refuse(
        "save",
        getattr(cache, "other_kinds", {}),
        "saving works for caches whose layers are all attention (or dummy); keep an in-memory copy with "
        "cache.snapshot() or cache.fork() instead",
    )
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any] | None] = []
    dtype = None
    for i, store in enumerate(cache.stores):
        if store is None:
            layers.append(None)
            continue
        state = store.state()
        names = []
        for name, t in state.tensors.items():
            tensors[f"layer.{i}.{name}"] = _owned(t)
            names.append(name)
            dtype = dtype or str(t.dtype).removeprefix("torch.")
        length = state.tensors["keys"].shape[2] if "keys" in state.tensors else 0
        layers.append({"kind": state.kind, "options": state.options, "seen": state.seen, "length": length, "tensors": names})
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "spec": str(cache.spec),
        "dtype": dtype or "none",
        "config": json.dumps(cache.config_summary, sort_keys=True),
        "fingerprint": cache.fingerprint or "",
        "layers": json.dumps(layers),
        "checksums": json.dumps({name: checksum(t) for name, t in tensors.items()}, sort_keys=True),
    }
    metadata["meta_checksum"] = metadata_checksum(metadata)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or Path("."))
    try:
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _head_bytes(path: str) -> bytes:
    """The length prefix and JSON header of a safetensors file (not its tensor data)."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return prefix
        (header_len,) = struct.unpack("<Q", prefix)
        return prefix + f.read(min(header_len, 100 * 2**20))


def read_header(raw: bytes, path: str, file_size: int | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Parse and check a safetensors header from the file's first bytes ``raw``.

    ``file_size`` is the whole file's size (default ``len(raw)``). Returns (tensor entries, metadata).
    """
    file_size = len(raw) if file_size is None else file_size
    if len(raw) < 8:
        raise TruncatedFileError(f"{path}: {len(raw)} bytes is too short for a cache file (a header needs 8)")
    (header_len,) = struct.unpack("<Q", raw[:8])
    if header_len > file_size - 8:
        if raw[8:9] not in (b"{", b""):
            raise ForeignFileError(f"{path}: not a safetensors file (no JSON header)")
        raise TruncatedFileError(
            f"{path}: header announces {header_len} bytes but the file has only {file_size - 8} after the length"
        )
    try:
        header = json.loads(raw[8 : 8 + header_len])
        meta = header.pop("__metadata__", None) or {}
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise CorruptedFileError(f"{path}: the header is not valid JSON ({e}); the file is damaged or foreign") from None
    if meta.get("format") != FORMAT:
        raise ForeignFileError(f"{path}: not a kvcache file (metadata format={meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ForeignFileError(
            f"{path}: kvcache format version {meta.get('format_version')!r}; this kvcache reads version {FORMAT_VERSION}"
        )
    if meta.get("meta_checksum") != metadata_checksum(meta):
        raise CorruptedFileError(f"{path}: metadata checksum mismatch: the header changed after saving")
    data_len = file_size - 8 - header_len
    try:
        end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise CorruptedFileError(f"{path}: the tensor table in the header is malformed") from None
    if end > data_len:
        raise TruncatedFileError(f"{path}: tensor data needs {end} bytes but only {data_len} are present (truncated)")
    return header, meta


def load_cache(path: str | os.PathLike, model: Any, *, device: str | torch.device | None = None) -> KVCache:
    """Load a cache saved by ``KVCache.save`` for ``model`` (a model or its config).

    Tensors go to ``device`` (default: the model's device, else CPU). ``model`` is not changed: a
    cache with bounded layers needs ``kvcache.use_kvcache_attention(model)``, as from ``make_cache``. Raises a ``CacheFileError``
    subclass naming the problem for truncated, corrupted, foreign or other-model files.
    """
    from .cache import config_summary, text_config

    config = text_config(model)
    summary = config_summary(config)  # a wrong `model` is the caller's error, not the file's
    path = str(path)
    _, meta = read_header(_head_bytes(path), path, os.path.getsize(path))
    if device is None:
        device = next((p.device for p in getattr(model, "parameters", lambda: iter(()))()), torch.device("cpu"))
    try:
        cache = _build(meta, path, summary, device, config)
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        # The header checksum passed, so this is a file written by another tool or version.
        raise CorruptedFileError(f"{path}: the cache metadata cannot be used ({type(e).__name__}: {e})") from None
    return cache


def _build(meta: dict[str, str], path: str, summary: dict[str, Any], device, config) -> KVCache:
    from .cache import KVCache, fingerprint_of
    from .spec import parse_spec

    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise CorruptedFileError(f"{path}: tensor data cannot be read ({e})") from None
    for name, want in json.loads(meta["checksums"]).items():
        if name not in tensors:
            raise CorruptedFileError(f"{path}: tensor {name!r} listed in the checksums is missing")
        if checksum(tensors[name]) != want:
            raise CorruptedFileError(f"{path}: checksum mismatch in tensor {name!r}: its bytes changed after saving")

    saved = json.loads(meta["config"])
    if saved is not None and fingerprint_of(saved) != fingerprint_of(summary):
        diffs = [f"{k}: file {saved.get(k)!r}, model {summary.get(k)!r}" for k in summary if saved.get(k) != summary.get(k)]
        raise ModelMismatchError(f"{path}: saved for another model configuration ({'; '.join(diffs)})")

    stores = []
    for i, entry in enumerate(json.loads(meta["layers"])):
        if entry is None:
            stores.append(None)
            continue
        kind = entry["kind"]
        if kind not in LAYER_KINDS:
            raise ForeignFileError(f"{path}: layer {i} has unknown kind {kind!r}")
        layer_tensors = {n: tensors[f"layer.{i}.{n}"].to(device) for n in entry["tensors"]}
        state = LayerState(kind, entry["options"], int(entry["seen"]), layer_tensors)
        stores.append(LAYER_KINDS[kind].from_state(state))
    return KVCache(stores, parse_spec(meta["spec"]), summary, config)
