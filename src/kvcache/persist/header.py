"""The safetensors header of a cache file, read as untrusted bytes.

``read_header`` checks the length prefix, the JSON, the kvcache format and version, the metadata
checksum and every tensor entry (dtype, shape and offsets agree and fit in the file) before any
tensor is read, so a lying header cannot make a load allocate more than the file holds.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from typing import Any

from ..errors import CorruptedFileError, ForeignFileError, TruncatedFileError

FORMAT = "kvcache"
#: 2: token ids of a conversation in the file; no ``dtype`` and per-layer ``length`` fields.
FORMAT_VERSION = 2


def metadata_checksum(meta: dict[str, str]) -> str:
    """SHA-256 of every metadata field but itself, so no header byte can change unnoticed."""
    fields = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


#: Bytes per element of the safetensors dtypes.
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def one_line(e: BaseException | str, limit: int = 300) -> str:
    """The first line of an error message, cut to ``limit`` characters: messages stay one line."""
    text = " ".join(str(e).strip().split("\n", 1)[0].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any) -> str:
    return one_line(repr(value), 80)


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows a float")
    return value


def parse_json(text: Any, path: str, what: str) -> Any:
    """``json.loads`` for file content: no NaN/Infinity, no overflowing floats, no recursion crash."""
    if not isinstance(text, (str, bytes)):
        raise CorruptedFileError(f"{path}: {what} is {type(text).__name__}, not JSON text")
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CorruptedFileError(f"{path}: {what} is not valid JSON ({one_line(e, 120)}); the file is damaged or foreign") from None


def head_bytes(path: str) -> bytes:
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
    header = parse_json(raw[8 : 8 + header_len], path, "the header")
    if not isinstance(header, dict):
        raise CorruptedFileError(f"{path}: the header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptedFileError(f"{path}: the header's __metadata__ is not a table of strings")
    if meta.get("format") != FORMAT:
        raise ForeignFileError(f"{path}: not a kvcache file (metadata format={short(meta.get('format'))}, expected {FORMAT!r})")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise ForeignFileError(
            f"{path}: kvcache format version {short(meta.get('format_version'))}; this kvcache reads version {FORMAT_VERSION}"
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
        raise CorruptedFileError(f"{path}: the header's entry for tensor {short(name)} is not an object")
    offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")

    def count(x: Any) -> bool:
        return type(x) is int and x >= 0

    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(count, offsets)) and offsets[0] <= offsets[1]):
        raise CorruptedFileError(f"{path}: tensor {short(name)} has malformed data offsets {short(offsets)}")
    if not (isinstance(shape, list) and all(map(count, shape))) or dtype not in _ITEMSIZE:
        raise CorruptedFileError(f"{path}: tensor {short(name)} has malformed shape {short(shape)} or dtype {short(dtype)}")
    if math.prod(shape) * _ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise CorruptedFileError(
            f"{path}: tensor {short(name)} claims shape {shape} of {dtype} "
            f"({math.prod(shape) * _ITEMSIZE[dtype]} bytes) in {offsets[1] - offsets[0]} bytes of data"
        )
    return offsets[1]


