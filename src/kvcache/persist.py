"""Cache files: one safetensors file per cache, checked on load.

Layout: tensors ``layer.{i}.{name}`` (``keys`` ``[B, Hkv, L, D]``, ``values``, ...), and string
metadata: ``format`` = ``kvcache``, ``format_version``, ``spec``, ``dtype``, ``config`` (the model
fields a cache must agree with) and its ``fingerprint``, ``layers`` (per layer: kind, options,
``seen``, ``length``) and ``checksums`` (SHA-256 of each tensor's bytes).

Saving writes a temporary file beside the target, flushes it to disk and renames it into place, so
a failed save leaves the old file intact and raises ``CacheSaveError`` (an ``OSError``) naming the
file. A killed save can leave its temporary folder (``.NAME.HOST~PID~XXXX.tmp/``); loads never read
it and the next save to the same target sweeps it (see ``atomic_write``).

Files are untrusted input. Loading refuses, with a ``CacheFileError`` (a ``ValueError``) naming the
file and the problem, and before changing anything: a file that is truncated, has a changed byte,
is not a kvcache file (or of an unknown version), was saved for a model with another
configuration, or whose metadata was forged with its checksums recomputed but contradicts the rest
of the file (layer layout and options vs the saved spec on this model, tokens seen, lengths, slot
positions, tensor shapes and dtypes vs the model's heads, head dims and dtype). Nothing is
allocated that the file's size and the model's ``max_position_embeddings`` do not bound. A forgery
that is consistent in every respect (other key values with recomputed checksums) is a valid cache:
the checksums catch accidents, not attackers (there is no signature).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from .errors import (
    CacheFileError,
    CacheSaveError,
    CorruptedFileError,
    ForeignFileError,
    ModelMismatchError,
    SpecError,
    TruncatedFileError,
)
from .layers import LAYER_KINDS, KVLayer, LayerState
from .spec import CacheSpec, parse_spec

if TYPE_CHECKING:
    from .cache import KVCache

FORMAT = "kvcache"
FORMAT_VERSION = 1


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # 0-d too


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


# ---- saving -----------------------------------------------------------------------------------
#
# A save writes a temporary file beside the target and renames it into place, so readers see the
# complete old or the complete new file, never a mix. The temporary file sits in a temporary
# folder of its own, ``.{target}.{host}~{pid}~{random}.tmp/``, because the writer may make
# temporary files of its own next to the path it is given (safetensors does: ``.tmpXXXXXX``), and
# a kill would leave those behind under names nobody could tell apart. A failed save removes its
# folder; one left by a killed process (SIGKILL, power loss) is swept by the next save to the same
# target once its process is gone (same host) or it is an hour old (another host's, on a shared
# folder). Loads never look at them.

STALE_TEMP_S = 3600
_HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:64] or "host"


def _temp_pattern(target: Path) -> re.Pattern[str]:
    return re.compile(re.escape(f".{target.name}.") + r"([A-Za-z0-9-]*)~(\d+)~[A-Za-z0-9_]+\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def sweep_temps(target: str | os.PathLike) -> list[str]:
    """Remove temporary files that killed saves to ``target`` left behind; returns their names."""
    target = Path(target)
    pattern = _temp_pattern(target)
    swept = []
    try:
        names = os.listdir(target.parent)
    except OSError:
        return swept
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        path = target.parent / name
        try:
            stale = time.time() - path.lstat().st_mtime > STALE_TEMP_S
            if stale or (match[1] == _HOST and not _alive(int(match[2]))):
                _remove(path)
                swept.append(name)
        except OSError:
            pass  # another save swept it first, or it is not ours to remove
    return swept


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Write a file with ``write(temporary_path)``, flush it to disk and rename it to ``path``.

    Raises ``CacheSaveError`` (an ``OSError``) naming ``path`` if anything fails; the old file at
    ``path`` (if any) is then intact and no temporary file is left.
    """
    target = Path(path)
    sweep_temps(target)
    folder = None
    try:
        folder = tempfile.mkdtemp(prefix=f".{target.name}.{_HOST}~{os.getpid()}~", suffix=".tmp", dir=target.parent)
        tmp = os.path.join(folder, "data")
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
        os.rmdir(folder)
    except BaseException as e:
        if folder is not None:
            _remove(Path(folder))
        if isinstance(e, OSError) and not isinstance(e, CacheSaveError):
            error = CacheSaveError(f"cannot save {target}: {e.strerror or e}")
            error.errno = e.errno
            raise error from e
        raise
    _fsync_dir(target.parent)


def _remove(path: Path) -> None:
    """Remove a temporary folder and what is in it (or a temporary file of an older version)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (best effort: not every system can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def save_cache(cache: KVCache, path: str | os.PathLike) -> None:
    """Write ``cache`` to ``path`` atomically (temporary file, fsync, rename); see ``atomic_write``."""
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
    atomic_write(path, _write_safetensors(tensors, metadata))


# ---- loading ----------------------------------------------------------------------------------
#
# A file is untrusted input: every field is checked before it is used, and nothing is allocated
# that the file's own size, the spec's checked options and the model's geometry do not bound.

#: Most tokens a layer may claim to have seen (positions stay exact in float64 and int64 far beyond).
MAX_SEEN = 2**40
#: Smallest bound on a spec's sizes (capacity, budget, window, ...): above it, they must not pass
#: the model's ``max_position_embeddings``, so a forged option cannot make a load allocate terabytes.
MIN_SIZE_LIMIT = 2**16
#: Bytes per element of the safetensors dtypes.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_ENTRY_FIELDS = {"kind", "options", "seen", "length", "tensors"}


def _line(e: BaseException | str, limit: int = 300) -> str:
    """The first line of an error message, cut to ``limit`` characters: messages stay one line."""
    text = " ".join(str(e).strip().split("\n", 1)[0].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any) -> str:
    return _line(repr(value), 80)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def _json(text: Any, path: str, what: str) -> Any:
    """``json.loads`` for file content: no NaN/Infinity, no overflowing floats, no recursion crash."""
    if not isinstance(text, (str, bytes)):
        raise CorruptedFileError(f"{path}: {what} is {type(text).__name__}, not JSON text")
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptedFileError(f"{path}: {what} is not valid JSON ({_line(e, 120)}); the file is damaged or foreign") from None


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
    Every tensor entry is checked (dtype, shape, offsets agree and fit in the file) before any
    tensor is read.
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
    header = _json(raw[8 : 8 + header_len], path, "the header")
    if not isinstance(header, dict):
        raise CorruptedFileError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptedFileError(f"{path}: the header's __metadata__ is not a table of strings")
    if meta.get("format") != FORMAT:
        raise ForeignFileError(f"{path}: not a kvcache file (metadata format={_short(meta.get('format'))}, expected {FORMAT!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ForeignFileError(
            f"{path}: kvcache format version {_short(meta.get('format_version'))}; this kvcache reads version {FORMAT_VERSION}"
        )
    if meta.get("meta_checksum") != metadata_checksum(meta):
        raise CorruptedFileError(f"{path}: metadata checksum mismatch: the header changed after saving")
    data_len = file_size - 8 - header_len
    end = 0
    for name, entry in header.items():
        end = max(end, _entry_end(name, entry, path))
    if end > data_len:
        raise TruncatedFileError(f"{path}: tensor data needs {end} bytes but only {data_len} are present (truncated)")
    return header, meta


def _entry_end(name: str, entry: Any, path: str) -> int:
    """Where a header's tensor entry ends in the data; raises unless dtype, shape and offsets agree."""
    if not isinstance(entry, dict):
        raise CorruptedFileError(f"{path}: the header's entry for tensor {_short(name)} is not an object")
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")

    def count(x: Any) -> bool:
        return type(x) is int and x >= 0

    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(count, offsets)) and offsets[0] <= offsets[1]):
        raise CorruptedFileError(f"{path}: tensor {_short(name)} has malformed data offsets {_short(offsets)}")
    if not (isinstance(shape, list) and all(map(count, shape))) or dtype not in _ITEMSIZE:
        raise CorruptedFileError(f"{path}: tensor {_short(name)} has malformed shape {_short(shape)} or dtype {_short(dtype)}")
    if math.prod(shape) * _ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise CorruptedFileError(
            f"{path}: tensor {_short(name)} claims shape {shape} of {dtype} "
            f"({math.prod(shape) * _ITEMSIZE[dtype]} bytes) in {offsets[1] - offsets[0]} bytes of data"
        )
    return offsets[1]


def load_cache(path: str | os.PathLike, model: Any, *, device: str | torch.device | None = None) -> KVCache:
    """Load a cache saved by ``KVCache.save`` for ``model`` (a model or its config).

    Tensors go to ``device`` (default: the model's device, else CPU). ``model`` is not changed: a
    cache with bounded layers needs ``kvcache.use_kvcache_attention(model)``, as from ``make_cache``. Raises a
    ``CacheFileError`` subclass naming the file and the problem for truncated, corrupted, forged,
    foreign or other-model files, before changing anything.
    """
    from .cache import text_config

    config = text_config(model)  # a wrong `model` is the caller's error, not the file's
    path = str(path)
    if os.path.isdir(path):
        raise ForeignFileError(f"{path}: is a directory, not a cache file")
    _, meta = read_header(_head_bytes(path), path, os.path.getsize(path))
    if device is None:
        device = next((p.device for p in getattr(model, "parameters", lambda: iter(()))()), torch.device("cpu"))
    try:
        cache = _build(meta, path, config, _model_dtype(model), device)
    except CacheFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RecursionError) as e:
        # The checksums passed: a file written by another tool or version, or forged.
        raise CorruptedFileError(f"{path}: the cache metadata cannot be used ({type(e).__name__}: {_line(e)})") from None
    return cache


def _model_dtype(model: Any) -> torch.dtype | None:
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    return next((p.dtype for p in params() if p.is_floating_point()), None)


def _build(meta: dict[str, str], path: str, config: Any, model_dtype: torch.dtype | None, device) -> KVCache:
    from .cache import KVCache, config_summary, fingerprint_of

    summary = config_summary(config)
    saved = _json(meta.get("config"), path, "the model configuration")
    if not isinstance(saved, dict):
        raise CorruptedFileError(f"{path}: the file records no model configuration (got {_short(saved)})")
    if meta.get("fingerprint") != fingerprint_of(saved):
        raise CorruptedFileError(f"{path}: the configuration fingerprint does not match the configuration saved with it")
    if fingerprint_of(saved) != fingerprint_of(summary):
        diffs = [f"{k}: file {saved.get(k)!r}, model {summary.get(k)!r}" for k in summary if saved.get(k) != summary.get(k)]
        raise ModelMismatchError(f"{path}: saved for another model configuration ({_line('; '.join(diffs) or 'extra fields')})")

    spec, expected = _layout(meta.get("spec"), config, summary, path)
    entries = _json(meta.get("layers"), path, "the layer table")
    if not isinstance(entries, list) or len(entries) != len(expected):
        count = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise CorruptedFileError(f"{path}: the layer table has {count} layers, this model {len(expected)}")
    checksums = _json(meta.get("checksums"), path, "the checksums")
    if not isinstance(checksums, dict) or not all(isinstance(v, str) for v in checksums.values()):
        raise CorruptedFileError(f"{path}: the checksums are not a table of strings")
    for i, (entry, want) in enumerate(zip(entries, expected)):
        _check_entry(i, entry, want, spec, path)

    try:
        tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types
        raise CorruptedFileError(f"{path}: tensor data cannot be read ({_line(e)})") from None
    listed = {f"layer.{i}.{n}" for i, e in enumerate(entries) if e is not None for n in e["tensors"]}
    if not set(tensors) == set(checksums) == listed:
        odd = sorted(set(tensors) ^ listed | set(tensors) ^ set(checksums))
        raise CorruptedFileError(f"{path}: the tensors in the file, the checksums and the layer table disagree on {_short(odd)}")
    for name, want in checksums.items():
        if checksum(tensors[name]) != want:
            raise CorruptedFileError(f"{path}: checksum mismatch in tensor {name!r}: its bytes changed after saving")

    first = next((f"layer.{i}.{e['tensors'][0]}" for i, e in enumerate(entries) if e is not None and e["tensors"]), None)
    written = "none" if first is None else str(tensors[first].dtype).removeprefix("torch.")
    if meta.get("dtype") != written:
        raise CorruptedFileError(f"{path}: the file says its dtype is {_short(meta.get('dtype'))}, its tensors are {written}")

    stores = []
    for i, (entry, want) in enumerate(zip(entries, expected)):
        if entry is None:
            stores.append(None)
            continue
        state = LayerState(entry["kind"], entry["options"], entry["seen"], {n: tensors[f"layer.{i}.{n}"] for n in entry["tensors"]})
        keys = state.tensors.get("keys")
        stored = keys.shape[2] if keys is not None and keys.dim() == 4 else 0
        if entry["length"] != stored:
            raise CorruptedFileError(f"{path}: layer {i} claims length {_short(entry['length'])}, its keys hold {stored} slots")
        try:
            want.check_state(state)
        except (ValueError, TypeError) as e:  # shapes (ShapeError), dtypes (DTypeError), counts
            raise CorruptedFileError(f"{path}: layer {i}: {_line(e)}") from None
        state.tensors = {n: t.to(device) for n, t in state.tensors.items()}
        stores.append(LAYER_KINDS[state.kind].from_state(state))
    _check_agreement(stores, config, model_dtype, path)
    return KVCache(stores, spec, summary, config)


def _layout(text: Any, config: Any, summary: dict[str, Any], path: str) -> tuple[CacheSpec, list[KVLayer | None]]:
    """The spec saved in the file, and the empty layers ``make_cache`` builds with it for this model."""
    from .cache import make_cache

    if not isinstance(text, str):
        raise CorruptedFileError(f"{path}: the cache spec is missing")
    try:
        spec = parse_spec(text)
    except SpecError as e:
        raise CorruptedFileError(f"{path}: the saved cache spec is not valid: {_line(e)}") from None
    positions = summary.get("max_position_embeddings")
    limit = max(positions if type(positions) is int else 0, MIN_SIZE_LIMIT)
    for name, value in spec.options.items():
        if isinstance(value, (int, float)) and not (-limit <= value <= limit):
            raise CorruptedFileError(
                f"{path}: the saved spec {_short(text)} asks for {name}={value}; a cache for this model "
                f"(max_position_embeddings {positions}) needs at most {limit}"
            )
    try:
        layout = make_cache(config, spec)
    except ValueError as e:  # SpecError, or a layer's own check of its options
        raise CorruptedFileError(f"{path}: the saved cache spec {_short(text)} does not fit this model: {_line(e)}") from None
    return spec, layout.stores


def _check_entry(i: int, entry: Any, want: KVLayer | None, spec: CacheSpec, path: str) -> None:
    """Layer ``i``'s row of the layer table against the layer the spec makes for this model."""
    if want is None or entry is None:
        if want is not None or entry is not None:
            made = "no cache" if want is None else f"a {want.kind} layer"
            raise CorruptedFileError(f"{path}: layer {i} is {_short(entry)} in the file; this model and spec make {made}")
        return
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise CorruptedFileError(f"{path}: layer {i}'s entry {_short(entry)} does not have the fields {sorted(_ENTRY_FIELDS)}")
    options = json.loads(json.dumps(want.options()))
    if entry["kind"] != want.kind or entry["options"] != options:
        raise CorruptedFileError(
            f"{path}: layer {i} is {_short(entry['kind'])} with options {_short(entry['options'])} in the file; "
            f"spec {str(spec)!r} on this model makes {want.kind!r} with {_short(options)}"
        )
    seen = entry["seen"]
    if type(seen) is not int or not 0 <= seen <= MAX_SEEN:
        raise CorruptedFileError(f"{path}: layer {i} claims {_short(seen)} tokens seen (expected an integer in [0, 2**40])")
    names = entry["tensors"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise CorruptedFileError(f"{path}: layer {i}'s tensor list {_short(names)} is not a list of distinct names")


def _check_agreement(stores: list[KVLayer | None], config: Any, model_dtype, path: str) -> None:
    """Layers must agree with each other (tokens seen, batch, dtype) and with the model (heads, head dim, dtype)."""
    live = [(i, s) for i, s in enumerate(stores) if s is not None]
    seen = {s.seen for _, s in live}
    if len(seen) > 1:
        raise CorruptedFileError(f"{path}: the layers disagree on the tokens seen: {', '.join(f'layer {i} {s.seen}' for i, s in live)}")
    shaped = [(i, s.geometry) for i, s in live if s.geometry is not None]
    if not shaped:
        return
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "hidden_size", None) and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    value_dim = getattr(config, "v_head_dim", None) or head_dim
    batch = shaped[0][1].batch
    for i, g in shaped:
        found = str(g.dtype).removeprefix("torch.")
        if type(heads) is int and g.heads != heads:
            raise CorruptedFileError(f"{path}: layer {i} holds {g.heads} key/value heads, this model has {heads}")
        if type(head_dim) is int and g.key_dim != head_dim:
            raise CorruptedFileError(f"{path}: layer {i} holds keys of head dim {g.key_dim}, this model's is {head_dim}")
        if type(value_dim) is int and g.value_dim != value_dim:
            raise CorruptedFileError(f"{path}: layer {i} holds values of head dim {g.value_dim}, this model's is {value_dim}")
        if g.batch != batch:
            raise CorruptedFileError(f"{path}: layer {i} holds a batch of {g.batch}, layer {shaped[0][0]} of {batch}")
        if g.dtype != shaped[0][1].dtype:
            raise CorruptedFileError(f"{path}: layer {i} holds {found} keys and values, layer {shaped[0][0]} {shaped[0][1].dtype}")
        if model_dtype is not None and g.dtype != model_dtype:
            raise ModelMismatchError(f"{path}: the cache holds {found} keys and values, the model computes in {model_dtype}")
