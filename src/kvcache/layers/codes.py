"""The coded storage under a quantized layer: codes by block, and the recent tokens exact.

Keys are kept a slot per block of ``group_size`` tokens: codes ``[B, Hkv, C/G, G, D']``, scale and
minimum ``[B, Hkv, C/G, D]`` (quantized per channel); values a slot per token: codes
``[B, Hkv, C, Dv']``, scale and minimum ``[B, Hkv, C, Dv/G]`` (per token, in groups of channels).
``D'`` is ``D * bits / 8`` (4- and 2-bit codes are packed two and four a byte). The two grow
together. Beside them, the residual: the most recent keys ``[B, Hkv, residual + group_size, D]``
and values ``[B, Hkv, residual + group_size, Dv]`` in full precision.

The codes are the ``formats.Codes`` format with ``key_block = group_size`` (the engine's coded pool
keeps the same format a block of ``block_size`` tokens). Which tokens leave the residual, and how
attention reads the codes, is the layer's business (``quantized.py``); this module owns the
tensors, their growth, their saved form and its check.
"""

from __future__ import annotations

import math

import torch

from ..errors import ShapeError
from ..formats import Codes, FullPrecision
from .checks import Geometry, check_kv
from .store import Layout, SlotStore

#: Tensors of the coded store in a saved state, each ``[B, Hkv, slots, ...]``; keys'
#: scale/minimum have one slot a block.
SAVED = ("kcodes", "kscale", "kmin", "vcodes", "vscale", "vmin")
_VALUE_SAVED = SAVED[3:]


class CodedStore:
    """Codes of ``bits`` bits (e4m3 with ``fp8``) by blocks of ``group_size`` tokens, and
    ``residual`` exact tokens."""

    def __init__(self, bits: int, group_size: int, residual: int, fp8: bool = False) -> None:
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.format = Codes(bits, group_size, key_block=group_size, fp8=fp8)
        self.keys = SlotStore(layout=self._key_layout)
        self.values = SlotStore(layout=self._value_layout)
        #: Slots in use: ``seen - quantized_keys`` and ``seen - quantized_values``.
        exact = FullPrecision()
        self.residual_keys = SlotStore(layout=lambda g: exact.key_layout(g.key_dim, g.dtype))
        self.residual_values = SlotStore(layout=lambda g: exact.value_layout(g.value_dim, g.dtype))
        #: Bumped by every call that changes the content (drop, write, trim_exact, rebatch, load):
        #: equal versions, equal content (what a cached dequantized view is checked against).
        self.version = 0

    @property
    def stores(self) -> tuple[SlotStore, ...]:
        return (self.keys, self.values, self.residual_keys, self.residual_values)

    def drop(self) -> None:
        self.version += 1
        for store in self.stores:
            store.drop()

    def _key_layout(self, g: Geometry) -> Layout:
        return self.format.key_layout(g.key_dim, g.dtype)

    def _value_layout(self, g: Geometry) -> Layout:
        return self.format.value_layout(g.value_dim, g.dtype)

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return self.values.allocated

    @property
    def quantized_keys(self) -> int:
        """Quantized keys (a multiple of group_size)."""
        return self.keys.length * self.group_size

    @property
    def quantized_values(self) -> int:
        return self.values.length

    @property
    def exact_keys(self) -> torch.Tensor | None:
        """The residual keys buffer ``[B, Hkv, residual + group_size, D]`` (None before the first append)."""
        return self.residual_keys.tensors.get("keys")

    @property
    def exact_values(self) -> torch.Tensor | None:
        return self.residual_values.tensors.get("values")

    @property
    def capacity(self) -> int:
        return self.keys.capacity * self.group_size + self.residual_keys.capacity

    @property
    def nbytes(self) -> int:
        """Codes, scales and minimums as allocated, plus the full-precision residual buffers."""
        return sum(store.nbytes for store in self.stores)

    def value_group(self, g: Geometry | None) -> int:
        return self.format.group_of(g.value_dim) if g else self.group_size

    def check_dims(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Raise unless head dims ``D`` and ``Dv`` pack into bytes and ``Dv`` splits into groups."""
        self.format.check_dims(key.shape[3], value.shape[3])

    # ---- reading --------------------------------------------------------------------------

    def keys_block(self, g: Geometry, start: int, stop: int) -> torch.Tensor:
        """Dequantized keys of positions ``start:stop`` (block-aligned), ``[B, Hkv, stop - start, D]``."""
        G = self.group_size
        out = self.format.decode_keys(self.keys.runs(start // G, stop // G), g.dtype)
        return out.reshape(g.batch, g.heads, stop - start, g.key_dim)

    def values_block(self, g: Geometry, start: int, stop: int) -> torch.Tensor:
        """Dequantized values of positions ``start:stop``, ``[B, Hkv, stop - start, Dv]``."""
        return self.format.decode_values(self.values.runs(start, stop), g.dtype)

    def dequantized(self, g: Geometry, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All ``seen`` keys ``[B, Hkv, seen, D]`` and values ``[B, Hkv, seen, Dv]`` in full precision (a copy)."""
        tk, tv = self.quantized_keys, self.quantized_values
        keys = torch.cat([self.keys_block(g, 0, tk), self.exact_keys[:, :, : seen - tk]], dim=2)
        values = torch.cat([self.values_block(g, 0, tv), self.exact_values[:, :, : seen - tv]], dim=2)
        return keys, values

    # ---- writing --------------------------------------------------------------------------

    def write(self, g: Geometry, keys: dict | None, values: dict | None, exact_keys, exact_values) -> None:
        """Append coded key blocks (``format.encode_keys`` of ``[B, Hkv, n/G, G, D]``) and coded
        values (of ``[B, Hkv, m, Dv]``), then make ``exact_keys``/``exact_values`` ``[B, Hkv, r, D]``
        the whole residual."""
        self.version += 1
        self._first(g)
        qk = 0 if keys is None else keys["kcodes"].shape[2] * self.group_size
        qv = 0 if values is None else values["vcodes"].shape[2]
        self._ensure(self.quantized_keys + qk, self.quantized_values + qv, g)
        if keys is not None:
            self.keys.append(keys)
        if values is not None:
            self.values.append(values)
        self.residual_keys.write(0, {"keys": exact_keys})
        self.residual_values.write(0, {"values": exact_values})
        self.residual_keys.length, self.residual_values.length = exact_keys.shape[2], exact_values.shape[2]

    def extend(self, g: Geometry, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys ``[B, Hkv, n, D]`` and values ``[B, Hkv, n, Dv]`` after the residual's tokens,
        in place (the caller checked that they fit: no block leaves)."""
        self.version += 1
        self._first(g)
        self.residual_keys.append({"keys": keys})
        self.residual_values.append({"values": values})

    def _first(self, g: Geometry) -> None:
        """Allocate empty codes and the residual buffers, unless done."""
        if not self.allocated:
            self._allocate(0, g)
            self.residual_keys.allocate(self.residual + self.group_size, g)
            self.residual_values.allocate(self.residual + self.group_size, g)

    def _allocate(self, tokens: int, g: Geometry) -> None:
        """(Re)allocate the codes for ``tokens`` (a multiple of group_size), keeping their content."""
        self.keys.allocate(tokens // self.group_size, g)
        self.values.allocate(tokens, g)

    def _ensure(self, tk: int, tv: int, g: Geometry) -> None:
        have = self.values.capacity
        need = max(tk, tv)
        if need <= have:
            return
        grown = max(need, have + have // 4)  # a quarter more: the codes are the bulk of the memory
        self._allocate(math.ceil(grown / self.group_size) * self.group_size, g)

    def trim_exact(self, n: int) -> None:
        """Drop the last ``n`` residual tokens (the caller checked they are all still exact)."""
        self.version += 1
        self.residual_keys.trim(n)
        self.residual_values.trim(n)

    def rebatch(self, fn) -> int:
        """Replace every stored row by ``fn(rows)``; returns the new batch size."""
        self.version += 1
        for store in (self.keys, self.values, self.residual_keys):
            store.rebatch(fn, store.capacity, count=False)
        return self.residual_values.rebatch(fn, self.residual_values.capacity, count=False)

    # ---- saved form -------------------------------------------------------------------------

    def saved(self) -> dict[str, torch.Tensor]:
        """The content as a saved state's tensors (views), each a slot per token; empty if nothing is stored."""
        if not self.values.tensors:
            return {}
        tensors = {**self.keys.in_use(), **self.values.in_use()}
        tensors["kcodes"] = tensors["kcodes"].flatten(2, 3)
        tensors["residual_keys"] = self.residual_keys.in_use()["keys"]
        tensors["residual_values"] = self.residual_values.in_use()["values"]
        return tensors

    def check(self, t: dict[str, torch.Tensor], seen: int) -> None:
        """Raise ``ValueError``/``ShapeError`` unless ``load(t)`` would hold ``seen`` tokens consistently."""
        missing = [name for name in (*SAVED, "residual_keys", "residual_values") if name not in t]
        if missing:
            raise ValueError(f"quantized layer state lacks {missing}")
        rk, rv = t["residual_keys"], t["residual_values"]
        # Residual keys and values differ in length (keys leave it a block at a time): only
        # [batch, heads] and the dtype must agree.
        check_kv(rk[:, :, :0], rv[:, :, :0], None) if rk.dim() == rv.dim() == 4 else check_kv(rk, rv, None)
        self.check_dims(rk, rv)
        if any(t[name].dim() != 4 for name in SAVED):
            raise ShapeError(f"quantized layer state: {', '.join(f'{n} {tuple(t[n].shape)}' for n in SAVED)} must be 4-D")
        tk, tv = t["kcodes"].shape[2], t["vcodes"].shape[2]
        if tk % self.group_size or tk + rk.shape[2] != seen or tv + rv.shape[2] != seen:
            raise ValueError(
                f"quantized layer state is inconsistent: {tk} quantized + {rk.shape[2]} "
                f"residual keys, {tv} + {rv.shape[2]} values, {seen} tokens seen"
            )
        most = self.residual + self.group_size - 1
        if max(rk.shape[2], rv.shape[2]) > most:
            raise ValueError(
                f"quantized layer state keeps {rk.shape[2]} keys and {rv.shape[2]} values in full precision; "
                f"residual {self.residual} with group size {self.group_size} keeps at most {most} of each"
            )
        g = Geometry.of(rk, rv)
        self.values.check("quantized layer", t, g, tv)
        self.keys.check("quantized layer (keys by blocks of group_size tokens)", _key_blocks(t, self.group_size), g, tk // self.group_size)

    def load(self, t: dict[str, torch.Tensor]) -> Geometry:
        """Hold ``t``'s content (copied; ``check`` passed, the store is empty); returns its geometry."""
        g = Geometry.of(t["residual_keys"], t["residual_values"])
        tk, tv, G = t["kcodes"].shape[2], t["vcodes"].shape[2], self.group_size
        self._allocate(math.ceil(max(tk, tv) / G) * G, g)
        self.residual_keys.allocate(self.residual + G, g)
        self.residual_values.allocate(self.residual + G, g)
        self.fill(t)
        return g

    def fill(self, t: dict[str, torch.Tensor]) -> None:
        """Copy ``t``'s content (``check`` passed) into the allocated, empty store, which has room for it."""
        self.version += 1
        self.keys.append(_key_blocks(t, self.group_size))
        self.values.append({name: t[name] for name in _VALUE_SAVED})
        self.residual_keys.append({"keys": t["residual_keys"]})
        self.residual_values.append({"values": t["residual_values"]})


def _key_blocks(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A saved state's key codes ``[B, Hkv, T, D']`` as the store keeps them, ``[B, Hkv, T/G, G, D']``
    (``T`` a multiple of G and the tensors 4-D: checked before), with the keys' scale and minimum."""
    codes = tensors["kcodes"]
    return {
        "kcodes": codes.unflatten(2, (codes.shape[2] // group_size, group_size)),
        "kscale": tensors["kscale"],
        "kmin": tensors["kmin"],
    }
