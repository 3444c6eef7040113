"""A chunk entry's header, held to what the store writes there before any tensor byte is used.

A chunk entry's payload is a kvcache file of a one-row growable cache holding one chunk's keys and
values (``chunks.chunk_payload``). ``open_chunk`` reads its header with ``persist.read_header``
(bounded parsing; the format, its version and the metadata checksum; every tensor entry's dtype,
shape and offsets inside the file) and then requires what the store writes for the cache it
fills (``ChunkLayout``): the model's configuration, spec ``growable``, the layer table of a
``chunk``-token piece of this model, the chunk's token ids, and for each layer with a cache
``keys`` ``[1, Hkv, chunk, D]`` and ``values`` ``[1, Hkv, chunk, Dv]`` of the model's dtype, with
the heads and head dims the model's configuration gives. The file's per-tensor checksums are not
read: the entry's digest covers every byte, and is checked as the bytes are copied
(``chunk_fill``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import StoreEntryError
from ..hf.build import make_cache
from ..hf.cache import KVCache
from ..hf.cachefile import kv_dims
from ..persist.fingerprint import fingerprint_of
from ..persist.header import one_line, parse_json, read_header, short
from .chunks import CHUNK_SPEC
from .entry import split

#: safetensors' names of the dtypes a model computes in.
DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_SIDES = ("keys", "values")


@dataclass(frozen=True)
class ChunkLayout:
    """What every chunk entry for caches of one model, dtype and chunk size holds: ``table`` the
    layer table (JSON values), ``names`` its tensors (``layer.{i}.keys``, ``layer.{i}.values`` for
    each layer with a cache, in layer order), ``dims`` (heads, head dim, value head dim) as the
    configuration gives them (``cachefile.kv_dims``)."""

    fingerprint: str
    chunk: int
    dtype: torch.dtype
    table: list[dict[str, Any] | None]
    names: tuple[str, ...]
    dims: tuple[Any, Any, Any]
    #: The configuration and layer table as ``persist`` writes them: text equal to these needs no parsing.
    texts: dict[str, str]

    @classmethod
    def of(cls, cache: KVCache, dtype: torch.dtype, chunk: int) -> ChunkLayout:
        piece = make_cache(cache.attention_config, CHUNK_SPEC)  # what chunk_payload saves
        table = [
            None if layer is None else {"kind": layer.kind, "options": json.loads(json.dumps(layer.options())), "seen": chunk, "tensors": list(_SIDES)}
            for layer in piece.kv_layers
        ]
        names = tuple(f"layer.{i}.{side}" for i, row in enumerate(table) if row is not None for side in _SIDES)
        texts = {"config": json.dumps(piece.config_summary, sort_keys=True), "layers": json.dumps(table)}
        return cls(piece.fingerprint or "", chunk, dtype, table, names, kv_dims(cache.attention_config), texts)


@dataclass(frozen=True)
class OpenedChunk:
    """A chunk entry whose header passed: the digest it states, its payload (a view of the entry),
    where each of ``layout.names``' bytes start in the payload (``offsets``, int64) and their
    shapes ``[1, Hkv, chunk, D]``."""

    key: str
    stated: bytes
    payload: memoryview
    offsets: np.ndarray
    shapes: tuple[tuple[int, ...], ...]


def open_chunk(layout: ChunkLayout, key: str, raw: object, tokens: list[int]) -> OpenedChunk:
    """The chunk entry ``raw`` stored under ``key`` for ``tokens``, its header checked (see the
    module docstring); raises a ``CacheFileError`` (``StoreEntryError`` for an entry that is well
    formed but not this chunk) naming the problem. Its digest is not checked here."""
    stated, payload = split(key, raw)
    name = f"entry {key[:16]}"
    size = len(payload)
    header_len = struct.unpack("<Q", payload[:8])[0] if size >= 8 else 0
    tensors, meta = read_header(bytes(payload[: 8 + min(header_len, max(0, size - 8))]), name, size)
    wrong = _problem(layout, tensors, meta, tokens, name)
    if wrong is not None:
        raise StoreEntryError(f"{name}: {wrong}")
    start = 8 + header_len
    offsets = np.array([start + tensors[n]["data_offsets"][0] for n in layout.names], dtype=np.int64)
    return OpenedChunk(key, stated, payload, offsets, tuple(tuple(tensors[n]["shape"]) for n in layout.names))


def _problem(layout: ChunkLayout, tensors: dict[str, Any], meta: dict[str, str], tokens: list[int], name: str) -> str | None:
    """What the header says that a chunk entry of ``layout`` for ``tokens`` cannot, or None."""
    if meta.get("spec") != CHUNK_SPEC:
        return f"a {short(meta.get('spec'))} cache, not a {CHUNK_SPEC} chunk"
    if meta.get("fingerprint") != layout.fingerprint or not _same_config(meta.get("config"), layout, name):
        return "saved for another model configuration"
    if meta.get("layers") != layout.texts["layers"] and parse_json(meta.get("layers"), name, "the layer table") != layout.table:
        return f"its layer table is not that of a {layout.chunk}-token chunk of this model"
    if "token_ids" not in meta or parse_json(meta["token_ids"], name, "the token ids") != tokens:
        return "holds other tokens than the chunk it is stored for"
    if set(tensors) != set(layout.names):
        return f"holds the tensors {short(sorted(tensors))}, not a chunk's keys and values"
    code = DTYPE_CODES.get(layout.dtype)
    for keys_name, values_name in zip(layout.names[0::2], layout.names[1::2]):
        keys, values = tensors[keys_name], tensors[values_name]
        if keys["dtype"] != code or values["dtype"] != code:
            return f"holds {keys['dtype']}/{values['dtype']} keys and values; the model computes in {layout.dtype}"
        wrong = _shape_problem(keys["shape"], values["shape"], layout)
        if wrong is not None:
            return f"{keys_name.rsplit('.', 1)[0]}: {one_line(wrong)}"
    return None


def _same_config(text: Any, layout: ChunkLayout, name: str) -> bool:
    if text == layout.texts["config"]:
        return True
    config = parse_json(text, name, "the model configuration")
    return isinstance(config, dict) and fingerprint_of(config) == layout.fingerprint


def _shape_problem(keys: list[int], values: list[int], layout: ChunkLayout) -> str | None:
    heads, key_dim, value_dim = layout.dims
    if len(keys) != 4 or len(values) != 4 or keys[:3] != values[:3] or keys[:1] != [1] or keys[2] != layout.chunk or 0 in keys + values:
        return f"keys {keys} and values {values} are not one row of {layout.chunk} tokens"
    for what, came, want in (("key/value heads", keys[1], heads), ("key head dim", keys[3], key_dim), ("value head dim", values[3], value_dim)):
        if type(want) is int and came != want:
            return f"{came} {what}, this model has {want}"
    return None
