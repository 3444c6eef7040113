"""The mutation engine of the reliability suite: damaged, forged and hostile cache files.

A *mutation* is a ``Mutation(category, name, data)``: the bytes of a whole file made from the
bytes of a real saved cache. Categories:

- ``flip``: one bit flipped anywhere in the file;
- ``truncate``: the file cut at some length;
- ``append``: random bytes added after the end;
- ``crafted``: the metadata or tensors rewritten *with every checksum recomputed*, so only the
  loader's semantic checks can refuse them (lying seen/positions, shapes, dtypes, layer counts,
  kinds, options, spec, config, token ids);
- ``raw``: hand-written headers the checksum layer never gets to see (header-size lies, non-UTF-8,
  non-JSON, deeply nested JSON, absurd shape claims, bad offsets).

Everything random takes a ``random.Random``: a failure names its seed and mutation, and
reproduces. ``crafted`` mutations lie about one thing at a time, and always in a way the rest of
the file contradicts: a self-consistent forgery (other key values, with their checksum
recomputed) is a valid cache, and no loader can tell it from the real one.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvcache.persist import checksum, metadata_checksum

#: Every cache kind the library saves, as make_cache specs, sized for a ~35-token conversation on
#: the tiny gemma2 (hybrid: sliding layers 0 and 2 keep a window of 16, full layers 1 and 3 the spec).
SPECS = (
    "growable:initial_capacity=16",
    "static:capacity=64",
    "concat",
    "window:window=12,sinks=2",
    "h2o:budget=20,storage=full",
    "h2o:budget=20,storage=int8",
    "h2o:budget=20,storage=int4",
    "tova:budget=0.5,storage=full",
    "lastrec:budget=16,recent=4,storage=int4",
    "quantized:bits=8,group_size=8,residual=8",
    "quantized:bits=4,group_size=8,residual=8",
    "quantized:bits=2,group_size=8,residual=8",
)

FULL_LAYER = 1  # a full-attention layer of the tiny gemma2: it has the spec's kind
SLIDING_LAYER = 0  # a sliding one: always a window layer


@dataclass(frozen=True)
class Mutation:
    category: str
    name: str
    data: bytes


# ---- reading and writing files ---------------------------------------------------------------


def split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """(header JSON as a dict, the tensor data after it) of a safetensors file."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: Any, data: bytes, *, header_len: int | None = None) -> bytes:
    """A file from a header (any JSON value) and data; ``header_len`` overrides the length prefix."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text) if header_len is None else header_len) + text + data


def join_text(text: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(text)) + text + data


class Parts:
    """A saved file opened for forging: its metadata (layers, checksums, ... parsed) and tensors."""

    def __init__(self, raw: bytes) -> None:
        header, _ = split(raw)
        self.meta: dict[str, Any] = dict(header["__metadata__"])
        self.layers: list[Any] = json.loads(self.meta["layers"])
        self.tensors: dict[str, torch.Tensor] = dict(st_load(raw))

    def build(self, *, recompute: bool = True) -> bytes:
        """The file again: tensor checksums and the metadata checksum recomputed (unless told not)."""
        meta = dict(self.meta)
        meta["layers"] = self.layers if isinstance(self.layers, str) else json.dumps(self.layers)
        if recompute:
            sums = {name: checksum(t) for name, t in self.tensors.items()}
            meta["checksums"] = json.dumps(sums, sort_keys=True)
            meta["meta_checksum"] = metadata_checksum(meta)
        return st_save(self.tensors, metadata=meta)

    def live(self) -> list[int]:
        """Indices of layers that hold tensors."""
        return [i for i, e in enumerate(self.layers) if e is not None and e["tensors"]]


# ---- byte-level damage -----------------------------------------------------------------------


def flips(raw: bytes, rng: random.Random, count: int) -> Iterator[Mutation]:
    """``count`` single-bit flips; half of them in the header, where the structure is."""
    (n,) = struct.unpack("<Q", raw[:8])
    for k in range(count):
        pos = rng.randrange(8 + n) if k % 2 == 0 else rng.randrange(len(raw))
        bit = rng.randrange(8)
        out = bytearray(raw)
        out[pos] ^= 1 << bit
        yield Mutation("flip", f"byte {pos} bit {bit}", bytes(out))


def truncations(raw: bytes, rng: random.Random, count: int) -> Iterator[Mutation]:
    (n,) = struct.unpack("<Q", raw[:8])
    fixed = [0, 7, 8, 8 + n - 1, 8 + n, len(raw) - 1]
    cuts = fixed[:count] + [rng.randrange(len(raw)) for _ in range(max(0, count - len(fixed)))]
    for cut in cuts:
        yield Mutation("truncate", f"cut at {cut} of {len(raw)}", raw[:cut])


def appends(raw: bytes, rng: random.Random, count: int) -> Iterator[Mutation]:
    for _ in range(count):
        size = rng.choice([1, 7, 8, rng.randrange(1, 5000)])
        junk = bytes(rng.randrange(256) for _ in range(size))
        yield Mutation("append", f"{size} random bytes appended", raw + junk)


# ---- crafted: checksums recomputed -----------------------------------------------------------

Forge = Callable[[Parts], None]  # edits Parts in place; may raise Skip when it does not apply


class Skip(Exception):
    """The forgery does not apply to this file (e.g. positions lies on a file without positions)."""


def _entry(p: Parts, layer: int) -> dict[str, Any]:
    entry = p.layers[layer]
    if entry is None or not entry["tensors"]:
        raise Skip
    return entry


def _set_layer(layer: int, field: str, value: Any) -> Forge:
    def forge(p: Parts) -> None:
        _entry(p, layer)[field] = value

    return forge


def _shift_layer(layer: int, field: str, by: int) -> Forge:
    def forge(p: Parts) -> None:
        entry = _entry(p, layer)
        entry[field] = entry[field] + by

    return forge


def _option(layer: int, value: Any, which: int = 0) -> Forge:
    """Set the ``which``-th option (in sorted order) of a layer to ``value``."""

    def forge(p: Parts) -> None:
        options = _entry(p, layer)["options"]
        if not options:
            raise Skip
        names = sorted(options)
        options[names[which % len(names)]] = value

    return forge


def _spec_and_options(value: Any) -> Forge:
    """A consistent lie: the first option of the spec and of every full layer set to ``value``."""

    def forge(p: Parts) -> None:
        kind, _, rest = p.meta["spec"].partition(":")
        if not rest:
            raise Skip
        name = rest.split(",")[0].split("=")[0]
        opts = [x for x in rest.split(",") if not x.startswith(name + "=")]
        p.meta["spec"] = f"{kind}:" + ",".join([f"{name}={value}", *opts])
        changed = False
        for e in p.layers:
            if e is not None and name in e["options"]:
                e["options"][name] = value
                changed = True
        if not changed:
            raise Skip

    return forge


def _tensor(layer: int, name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Forge:
    def forge(p: Parts) -> None:
        key = f"layer.{layer}.{name}"
        if key not in p.tensors:
            raise Skip
        p.tensors[key] = fn(p.tensors[key]).contiguous()

    return forge


def _all_tensors(layer: int, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Forge:
    """Rewrite every tensor of a layer (a consistent shape change)."""

    def forge(p: Parts) -> None:
        entry = _entry(p, layer)
        for name in entry["tensors"]:
            key = f"layer.{layer}.{name}"
            p.tensors[key] = fn(name, p.tensors[key]).contiguous()

    return forge


def _positions(layer: int, fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Forge:
    def forge(p: Parts) -> None:
        entry = _entry(p, layer)
        key = f"layer.{layer}.positions"
        if key not in p.tensors:
            raise Skip
        p.tensors[key] = fn(p.tensors[key].clone(), entry["seen"]).contiguous()

    return forge


def _duplicate_position(t: torch.Tensor, seen: int) -> torch.Tensor:
    t[..., 1] = t[..., 0]
    return t


def _meta(field: str, value: Any) -> Forge:
    def forge(p: Parts) -> None:
        p.meta[field] = value

    return forge


def _token_ids(fn: Callable[[list], Any]) -> Forge:
    """Rewrite the conversation's token ids: ``fn`` gets the list and returns the new field's text
    (a string), or a value to write as JSON."""

    def forge(p: Parts) -> None:
        if "token_ids" not in p.meta:
            raise Skip
        value = fn(json.loads(p.meta["token_ids"]))
        p.meta["token_ids"] = value if isinstance(value, str) else json.dumps(value)

    return forge


def _drop_token_ids(p: Parts) -> None:
    if p.meta.pop("token_ids", None) is None:
        raise Skip


def _config(fn: Callable[[dict], Any]) -> Forge:
    def forge(p: Parts) -> None:
        p.meta["config"] = json.dumps(fn(json.loads(p.meta["config"])))

    return forge


def _layers(fn: Callable[[list], Any]) -> Forge:
    def forge(p: Parts) -> None:
        p.layers = fn(p.layers)

    return forge


def _drop_checksum(p: Parts) -> None:
    """List a tensor in no checksum (the tensor then goes unverified unless the loader notices)."""
    name = f"layer.{FULL_LAYER}.{_entry(p, FULL_LAYER)['tensors'][0]}"
    sums = {k: checksum(t) for k, t in p.tensors.items() if k != name}
    p.meta["checksums"] = json.dumps(sums, sort_keys=True)
    p.meta["meta_checksum"] = metadata_checksum({**p.meta, "layers": json.dumps(p.layers)})
    raise _Built(p.build(recompute=False))


def _extra_tensor(p: Parts) -> None:
    p.tensors["layer.9.keys"] = torch.zeros(1, 2, 3, 16)


def _swap_layers(p: Parts) -> None:
    """Full layer's entry and tensors moved to the sliding layer's index and back."""
    a, b = SLIDING_LAYER, FULL_LAYER
    p.layers[a], p.layers[b] = p.layers[b], p.layers[a]
    renamed = {}
    for key, t in p.tensors.items():
        _, i, name = key.split(".", 2)
        i = {str(a): str(b), str(b): str(a)}.get(i, i)
        renamed[f"layer.{i}.{name}"] = t
    p.tensors = renamed


class _Built(Exception):
    """A forgery that built its own bytes (it needed checksums that are not all recomputed)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


HUGE = 2**40  # elements: 4 TiB of float32, which nothing may try to allocate


def crafted_forgeries() -> list[tuple[str, Forge]]:
    """Every crafted lie, by name. Each applies to some or all cache kinds (else ``Skip``)."""
    L, S = FULL_LAYER, SLIDING_LAYER
    out: list[tuple[str, Forge]] = []
    for layer, where in ((L, "full"), (S, "sliding")):
        for by in (1, -1, 7, -7):
            out.append((f"{where} layer seen {by:+d}", _shift_layer(layer, "seen", by)))
        for value in (0, -1, 2**62, 2**64, 1e300, math.inf, math.nan, 3.5, "12", True, None, [3]):
            out.append((f"{where} layer seen = {value!r}", _set_layer(layer, "seen", value)))
        # Format 1's per-layer "length" (redundant with the tensors): a row that carries it is refused.
        for value in (1, -1, HUGE):
            out.append((f"{where} layer + a format-1 length = {value}", _set_layer(layer, "length", value)))
        for kind in ("growable", "static", "concat", "window", "evicting", "quantized", "bogus", None, 3):
            out.append((f"{where} layer kind = {kind!r}", _set_layer(layer, "kind", kind)))
        out.append((f"{where} layer options = []", _set_layer(layer, "options", [])))
        out.append((f"{where} layer options = null", _set_layer(layer, "options", None)))
        out.append((f"{where} layer options + evil", lambda p, i=layer: _entry(p, i)["options"].update(evil=1)))
        out.append((f"{where} layer options emptied", lambda p, i=layer: _entry(p, i)["options"].clear()))
        for which in range(5):
            for value in (0, -1, 1, 2, 3, HUGE, 1e300, math.inf, math.nan, 0.5, "x", None, True, [1], {"a": 1}):
                out.append((f"{where} layer option #{which} = {value!r}", _option(layer, value, which)))
        out.append((f"{where} layer tensors list drops one", lambda p, i=layer: _entry(p, i)["tensors"].pop()))
        out.append((f"{where} layer tensors list + ghost", lambda p, i=layer: _entry(p, i)["tensors"].append("ghost")))
        out.append((f"{where} layer tensors list = 'keys'", _set_layer(layer, "tensors", "keys")))
        out.append((f"{where} layer entry = null", _layers(lambda ls, i=layer: [None if j == i else e for j, e in enumerate(ls)])))
        out.append((f"{where} layer entry = 5", _layers(lambda ls, i=layer: [5 if j == i else e for j, e in enumerate(ls)])))
        out.append((f"{where} layer entry = {{}}", _layers(lambda ls, i=layer: [{} if j == i else e for j, e in enumerate(ls)])))
        # Shapes of one layer's tensors: heads, head dim, batch, slots, rank, dtype.
        out.append((f"{where} layer drops a head", _all_tensors(layer, lambda n, t: t[:, :1])))
        out.append((f"{where} layer adds a head", _all_tensors(layer, lambda n, t: torch.cat([t, t[:, :1]], 1))))
        out.append((f"{where} layer adds a batch row", _all_tensors(layer, lambda n, t: torch.cat([t, t], 0))))
        out.append((f"{where} layer drops a slot", _all_tensors(layer, lambda n, t: t[:, :, :-1])))
        out.append((f"{where} layer adds a slot", _all_tensors(layer, lambda n, t: torch.cat([t, t[:, :, -1:]], 2))))
        out.append((f"{where} layer keeps no slot", _all_tensors(layer, lambda n, t: t[:, :, :0])))
        for name in ("keys", "values", "kcodes", "kscale", "vcodes", "vmin", "residual_keys", "residual_values", "scores"):
            out.append((f"{where} {name} halves its last dim", _tensor(layer, name, lambda t: t[..., : max(1, t.shape[-1] // 2)])))
            out.append((f"{where} {name} loses a slot", _tensor(layer, name, lambda t: t[:, :, :-1] if t.dim() > 2 else t[:-1])))
            out.append((f"{where} {name} rank 3", _tensor(layer, name, lambda t: t.reshape(t.shape[0], -1, t.shape[-1]))))
            out.append((f"{where} {name} rank 5", _tensor(layer, name, lambda t: t.unsqueeze(0))))
            out.append((f"{where} {name} as float16", _tensor(layer, name, lambda t: t.to(torch.float16))))
            out.append((f"{where} {name} as float64", _tensor(layer, name, lambda t: t.to(torch.float64))))
            out.append((f"{where} {name} as int32", _tensor(layer, name, lambda t: t.to(torch.int32))))
            out.append((f"{where} {name} as bool", _tensor(layer, name, lambda t: t != 0)))
            out.append((f"{where} {name} as a scalar", _tensor(layer, name, lambda t: t.reshape(-1)[:1].reshape(()))))
        out.append((f"{where} all float tensors as bfloat16", _all_tensors(layer, lambda n, t: t.to(torch.bfloat16) if t.is_floating_point() else t)))
    # Positions of an evicting layer: out of range, negative, duplicated, not integers.
    out.append(("positions >= seen", _positions(L, lambda t, seen: t.fill_(seen))))
    out.append(("positions far beyond seen", _positions(L, lambda t, seen: t.fill_(2**40))))
    out.append(("a position = seen", _positions(L, lambda t, seen: t.index_fill_(2, torch.tensor([t.shape[2] - 1]), seen))))
    out.append(("positions negative", _positions(L, lambda t, seen: t.fill_(-1))))
    out.append(("a position -5", _positions(L, lambda t, seen: t.index_fill_(2, torch.tensor([0]), -5))))
    out.append(("positions duplicated", _positions(L, _duplicate_position)))
    out.append(("positions as float", _positions(L, lambda t, seen: t.float())))
    out.append(("positions as int32", _positions(L, lambda t, seen: t.int())))
    out.append(("scores NaN", _tensor(L, "scores", lambda t: torch.full_like(t, math.nan))))
    # The whole cache: layer counts, kinds, spec, dtype, config.
    out += [
        ("layers: last dropped", _layers(lambda ls: ls[:-1])),
        ("layers: first dropped", _layers(lambda ls: ls[1:])),
        ("layers: one more (copy of the last)", _layers(lambda ls: ls + [ls[-1]])),
        ("layers: one more null", _layers(lambda ls: ls + [None])),
        ("layers: reversed", _layers(lambda ls: ls[::-1])),
        ("layers: empty", _layers(lambda ls: [])),
        ("layers: all null", _layers(lambda ls: [None] * len(ls))),
        ("layers: a dict", _layers(lambda ls: {"0": ls[0]})),
        ("layers: a string", _layers(lambda ls: "x")),
        ("layers: JSON text of a number", _layers(lambda ls: "5")),
        ("layers: not JSON", _layers(lambda ls: "[{")),
        ("layers: nested 100000 deep", _layers(lambda ls: _deep(100_000))),
        ("layers: a sliding and a full layer swapped", _swap_layers),
        ("checksums: one tensor unlisted", _drop_checksum),
        ("an extra tensor nobody lists", _extra_tensor),
        ("checksums nested 100000 deep", lambda p: (_ for _ in ()).throw(_Built(_deep_checksums(p)))),
        ("config nested 100000 deep", _meta("config", _deep(100_000))),
        ("config = null", _meta("config", "null")),
        ("config = []", _meta("config", "[]")),
        ("config: other layer count", _config(lambda c: {**c, "num_hidden_layers": 6})),
        ("config: other kv heads", _config(lambda c: {**c, "num_key_value_heads": 4})),
        ("config: missing field", _config(lambda c: {k: v for k, v in c.items() if k != "vocab_size"})),
        ("fingerprint changed", _meta("fingerprint", "0123456789abcdef")),
        ("fingerprint empty", _meta("fingerprint", "")),
        ("dtype = float16", _meta("dtype", "float16")),
        ("dtype = bfloat16", _meta("dtype", "bfloat16")),
        ("dtype = int8", _meta("dtype", "int8")),
        ("dtype = bogus", _meta("dtype", "bogus")),
        ("dtype = none", _meta("dtype", "none")),
        ("format_version = 1", _meta("format_version", "1")),
        ("format_version = 3", _meta("format_version", "3")),
        ("format = other", _meta("format", "other")),
        ("spec = bogus", _meta("spec", "bogus")),
        ("spec = empty", _meta("spec", "")),
        ("spec = growable", _meta("spec", "growable")),
        ("spec = concat", _meta("spec", "concat")),
        ("spec = static:capacity=2", _meta("spec", "static:capacity=2")),
        ("spec = window:window=3", _meta("spec", "window:window=3")),
        ("spec = h2o:budget=20", _meta("spec", "h2o:budget=20")),
        ("spec = quantized:bits=4", _meta("spec", "quantized:bits=4")),
        ("spec = growable:growth=nan", _meta("spec", "growable:growth=nan")),
        ("spec option nested text", _meta("spec", "static:capacity=" + _deep(1000))),
    ]
    # The conversation's token ids: as many as the tokens seen, or one more; each in the vocabulary.
    out += [
        ("token ids: not JSON", _token_ids(lambda ids: "[1, 2")),
        ("token ids: empty text", _token_ids(lambda ids: "")),
        ("token ids: null", _token_ids(lambda ids: None)),
        ("token ids: a JSON object", _token_ids(lambda ids: {"0": ids[0]})),
        ("token ids: a JSON string", _token_ids(lambda ids: "\"ids\"")),
        ("token ids: nested 100000 deep", _token_ids(lambda ids: _deep(100_000))),
        ("token ids: NaN", _token_ids(lambda ids: "[NaN]")),
        ("token ids: a 5000-digit id", _token_ids(lambda ids: "[" + "9" * 5000 + "]")),
        ("token ids: a string id", _token_ids(lambda ids: ["a"] + ids[1:])),
        ("token ids: a float id", _token_ids(lambda ids: [float(ids[0])] + ids[1:])),
        ("token ids: a negative id", _token_ids(lambda ids: [-1] + ids[1:])),
        ("token ids: a boolean id", _token_ids(lambda ids: [True] + ids[1:])),
        ("token ids: a null id", _token_ids(lambda ids: [None] + ids[1:])),
        ("token ids: an id past the vocabulary", _token_ids(lambda ids: [10**9] + ids[1:])),
        ("token ids: an id of 2**64", _token_ids(lambda ids: ids[:-1] + [2**64])),
        ("token ids: one more", _token_ids(lambda ids: ids + [ids[-1]])),
        ("token ids: one fewer", _token_ids(lambda ids: ids[:-1])),
        ("token ids: two fewer", _token_ids(lambda ids: ids[:-2])),
        ("token ids: empty list", _token_ids(lambda ids: [])),
        ("token ids: doubled", _token_ids(lambda ids: ids + ids)),
        ("token ids: a million", _token_ids(lambda ids: [1] * 10**6)),
        ("token ids: field dropped", _drop_token_ids),
    ]
    for value in (HUGE, 2**62, 2**40 + 1, 10**6, 0, -1, "nan", "inf", "1e400"):
        out.append((f"spec and every layer: first option = {value!r}", _spec_and_options(value)))
    return out


def _deep_checksums(p: Parts) -> bytes:
    meta = dict(p.meta, layers=json.dumps(p.layers), checksums=_deep(100_000))
    meta["meta_checksum"] = metadata_checksum(meta)
    return st_save(p.tensors, metadata=meta)


def crafted(raw: bytes, forgeries: list[tuple[str, Forge]] | None = None) -> Iterator[Mutation]:
    for name, forge in forgeries or crafted_forgeries():
        parts = Parts(raw)
        try:
            forge(parts)
            data = parts.build()
        except Skip:
            continue
        except _Built as built:
            data = built.data
        yield Mutation("crafted", name, data)


# ---- raw headers -----------------------------------------------------------------------------


def raw_headers(raw: bytes) -> Iterator[Mutation]:
    """Headers the checksum layer never sees: lies about sizes, broken text, absurd shapes."""
    header, data = split(raw)
    (n,) = struct.unpack("<Q", raw[:8])
    body = raw[8:]
    for value in (0, 1, 7, n - 1, n + 1, len(body), len(body) + 1, 2**32, 2**63, 2**64 - 1):
        yield Mutation("raw", f"header length = {value}", struct.pack("<Q", value) + body)
    yield Mutation("raw", "header not UTF-8", join_text(b"\xff\xfe" + raw[10 : 8 + n], data))
    yield Mutation("raw", "header latin-1 text", join_text(b'{"\xe9": 1}', data))
    yield Mutation("raw", "header not JSON", join_text(b"hello, world" + b" " * 20, data))
    yield Mutation("raw", "header empty", join_text(b"", data))
    for value in ([], 5, "s", None, True, 1e300):
        yield Mutation("raw", f"header = {value!r}", join(value, data))
    yield Mutation("raw", "header nested 100000 deep", join_text(_deep(100_000).encode(), data))
    yield Mutation("raw", "header object nested 100000 deep", join_text(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, data))
    yield Mutation("raw", "header NaN/Infinity literals", join_text(b'{"a": NaN, "b": -Infinity}', data))
    meta = header["__metadata__"]
    for value in ([], "x", 5, None, {"format": 5}):
        yield Mutation("raw", f"__metadata__ = {value!r}", join({**header, "__metadata__": value}, data))
    yield Mutation("raw", "__metadata__ values not strings", join({**header, "__metadata__": {**meta, "layers": [1]}}, data))
    name = next(k for k in header if k != "__metadata__")
    entry = header[name]
    shape = list(entry["shape"])
    huge_shape = shape[:2] + [HUGE] + shape[3:]
    nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
    lies = {
        "shape 2**40 slots, offsets kept": {**entry, "shape": huge_shape},
        "shape 2**40 slots, offsets to match": {
            **entry,
            "shape": huge_shape,
            "data_offsets": [entry["data_offsets"][0], entry["data_offsets"][0] + nbytes // shape[2] * HUGE],
        },
        "shape of 2**64 elements": {**entry, "shape": [2**32, 2**32]},
        "shape negative": {**entry, "shape": [-1] + shape[1:]},
        "shape a string": {**entry, "shape": "big"},
        "shape floats": {**entry, "shape": [float(s) for s in shape]},
        "dtype F64": {**entry, "dtype": "F64"},
        "dtype BOGUS": {**entry, "dtype": "BOGUS"},
        "offsets reversed": {**entry, "data_offsets": entry["data_offsets"][::-1]},
        "offsets negative": {**entry, "data_offsets": [-8, entry["data_offsets"][1]]},
        "offsets 1e400": {**entry, "data_offsets": [0, 1e400]},
        "offsets huge": {**entry, "data_offsets": [0, 2**64 + 5]},
        "offsets strings": {**entry, "data_offsets": ["0", "8"]},
        "offsets missing": {k: v for k, v in entry.items() if k != "data_offsets"},
        "offsets one number": {**entry, "data_offsets": [0]},
        "offsets overlap the previous tensor": {**entry, "data_offsets": [0, nbytes]},
        "entry a list": [1, 2],
        "entry null": None,
    }
    for what, lie in lies.items():
        yield Mutation("raw", f"{name}: {what}", join({**header, name: lie}, data))
    yield Mutation("raw", "a tensor entry removed", join({k: v for k, v in header.items() if k != name}, data))
    # Duplicate keys: Python's json and safetensors' parser must agree on which one counts.
    text = json.dumps(header)
    dup = text[:-1] + ", " + json.dumps(name) + ": " + json.dumps({**entry, "shape": [1]}) + "}"
    yield Mutation("raw", "a tensor entry duplicated with another shape", join_text(dup.encode(), data))
    dup_meta = text[:-1] + ', "__metadata__": {"format": "kvcache"}}'
    yield Mutation("raw", "__metadata__ duplicated", join_text(dup_meta.encode(), data))
    yield Mutation("raw", "huge header announced, tiny file", struct.pack("<Q", 100 * 2**20) + b"{" + b" " * 64)
    yield Mutation("raw", "empty file", b"")
    yield Mutation("raw", "only a length", struct.pack("<Q", 2))


# ---- all of them -----------------------------------------------------------------------------


def mutations(raw: bytes, rng: random.Random, *, flips_n: int, cuts_n: int, appends_n: int,
              forgeries: list[tuple[str, Forge]] | None = None, raw_too: bool = True) -> Iterator[Mutation]:
    yield from flips(raw, rng, flips_n)
    yield from truncations(raw, rng, cuts_n)
    yield from appends(raw, rng, appends_n)
    yield from crafted(raw, forgeries)
    if raw_too:
        yield from raw_headers(raw)
