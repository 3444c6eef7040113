"""int8/int4/int2 storage with a full-precision residual of recent tokens (KIVI, Liu et al., 2024).

Keys are quantized per channel over blocks of ``group_size`` tokens (keys have outlier channels,
so each channel gets its own range); values per token, in groups of ``group_size`` channels. Codes
of 4 and 2 bits are packed two and four per byte. The most recent ``residual`` tokens stay in full precision:
values leave the residual one token at a time, keys a whole block of ``group_size`` once
``residual + group_size`` have gathered (so between ``residual`` and ``residual + group_size - 1``
recent keys are exact). A prompt's tail stays exact the same way.

Decode attention reads the store block by block (``block`` tokens at a time): the attention
kernel gets a ``BlockReader`` (``StoreReader``) that dequantizes one block into a small temporary
for the kernel to take its scores or its share of the output, so no full-precision copy of the
cache is ever built on a decode step. A chunk longer than the
residual (a prefill) attends its own tokens in full precision, as Hugging Face's quantized cache
does, with the quantized past dequantized for that one pass.

Positions are in order (token ``p`` is column ``p``), so masks need no remapping. Trimming works
for tokens still in the residual; quantized tokens cannot be un-quantized into a rollback.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch

from ..attention import BlockReader, Reads
from ..errors import ShapeError, UnsupportedOperation
from ..quant import BITS, Quantized, dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
from ..registry import Option
from .checks import Geometry, check_kv
from .state import LayerState
from .bounded import BoundedLayer
from .store import Layout, SlotStore

#: Tensors of the quantized store in a saved state, each ``[B, Hkv, slots, ...]``; keys'
#: scale/minimum have one slot a block.
_STORE = ("kcodes", "kscale", "kmin", "vcodes", "vscale", "vmin")
_KEY_STORE, _VALUE_STORE = _STORE[:3], _STORE[3:]


class QuantizedLayer(BoundedLayer):
    kind = "quantized"
    spec_options = {"bits": Option(int), "group_size": Option(int, least=1), "residual": Option(int, least=0)}
    keyword_options = {"block": Option(int, least=1)}
    spec_order = 3

    def __init__(self, bits: int = 4, group_size: int = 64, residual: int = 32, block: int = 512) -> None:
        super().__init__()
        if int(bits) not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits}")
        checked = self.check_options(bits=bits, group_size=group_size, residual=residual, block=block)
        self.bits, self.group_size, self.residual = checked["bits"], checked["group_size"], checked["residual"]
        self.block = max(self.group_size, checked["block"] // self.group_size * self.group_size)
        #: Quantized keys, a slot per block of ``group_size`` tokens: codes ``[B, Hkv, C/G, G, D']``,
        #: scale and minimum ``[B, Hkv, C/G, D]``; values a slot per token. They grow together.
        self._keys = SlotStore(layout=self._key_layout)
        self._values = SlotStore(layout=self._value_layout)
        #: The recent tokens in full precision: ``[B, Hkv, residual + group_size, D]`` and
        #: ``[B, Hkv, max(residual, 1), Dv]``, slots in use ``seen - _tk`` and ``seen - _tv``.
        self._residual_keys = SlotStore(layout=_residual_key_layout)
        self._residual_values = SlotStore(layout=_residual_value_layout)
        self._reset_storage()

    def _reset_storage(self) -> None:
        for store in (self._keys, self._values, self._residual_keys, self._residual_values):
            store.drop()
        self.geometry = None
        self._seen = 0

    # ---- sizes ----------------------------------------------------------------------------

    def _key_layout(self, g: Geometry) -> Layout:
        return {
            "kcodes": ((self.group_size, g.key_dim * self.bits // 8), torch.uint8),
            "kscale": ((g.key_dim,), g.dtype),
            "kmin": ((g.key_dim,), g.dtype),
        }

    def _value_layout(self, g: Geometry) -> Layout:
        groups = g.value_dim // min(self.group_size, g.value_dim)
        return {
            "vcodes": ((g.value_dim * self.bits // 8,), torch.uint8),
            "vscale": ((groups,), g.dtype),
            "vmin": ((groups,), g.dtype),
        }

    @property
    def _tk(self) -> int:
        """Quantized keys (a multiple of group_size)."""
        return self._keys.length * self.group_size

    @property
    def _tv(self) -> int:
        """Quantized values."""
        return self._values.length

    @property
    def _rk(self) -> torch.Tensor | None:
        return self._residual_keys.tensors.get("keys")

    @property
    def _rv(self) -> torch.Tensor | None:
        return self._residual_values.tensors.get("values")

    @property
    def reallocations(self) -> int:
        """Allocations of the quantized store (keys and values grow together: one count)."""
        return self._values.reallocations

    @property
    def value_group(self) -> int:
        return min(self.group_size, self.geometry.value_dim) if self.geometry else self.group_size

    @property
    def length(self) -> int:
        return self.seen

    @property
    def capacity(self) -> int:
        return self._keys.capacity * self.group_size + self._residual_keys.capacity

    @property
    def nbytes(self) -> int:
        """Codes, scales and minimums as allocated, plus the full-precision residual buffers."""
        return sum(s.nbytes for s in (self._keys, self._values, self._residual_keys, self._residual_values))

    def view(self):
        """The keys and values, dequantized: a full-precision copy (for inspection and tests)."""
        if self.geometry is None:
            return None, None
        return self._dequantized()

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self._keys_block(0, self._tk), self._rk[:, :, : self.seen - self._tk]], dim=2)
        values = torch.cat([self._values_block(0, self._tv), self._rv[:, :, : self.seen - self._tv]], dim=2)
        return keys, values

    # ---- reading blocks of the store -------------------------------------------------------

    def _keys_block(self, start: int, stop: int) -> torch.Tensor:
        """Dequantized keys of positions ``start:stop`` (block-aligned), ``[B, Hkv, stop - start, D]``."""
        g, G = self.geometry, self.group_size
        blocks = self._keys.runs(start // G, stop // G)
        codes, scale, minimum = blocks["kcodes"], blocks["kscale"].unsqueeze(3), blocks["kmin"].unsqueeze(3)
        out = dequantize_per_channel(Quantized(codes, scale, minimum, self.bits), g.dtype)
        return out.reshape(g.batch, g.heads, stop - start, g.key_dim)

    def _values_block(self, start: int, stop: int) -> torch.Tensor:
        q = self._values.runs(start, stop)
        part = Quantized(q["vcodes"], q["vscale"], q["vmin"], self.bits)
        return dequantize_per_token(part, self.value_group, self.geometry.dtype)

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key, value):
        n, seen = key.shape[2], self.seen
        if self.geometry is None:
            self._check_dims(key, value)
        copy = None
        if n > max(self.residual, 1):  # a chunk that attends itself in full precision, and the past as it is
            if seen:
                past_k, past_v = self._dequantized()
                copy = (torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2))
            else:
                copy = (key, value)
        plan = self._plan(key, value)  # quantizes (may raise); nothing stored yet
        self._commit(plan, key, value)
        self._seen = seen + n
        if copy is not None:
            return Reads(copy[0], copy[1], None, seen, n)
        # The model gets the residual buffers (it only hands them back to the attention).
        return Reads(StoreReader(self), None, None, seen, n, all_visible=n == 1, returned=(self._rk, self._rv))

    def _check_dims(self, key, value) -> None:
        d, dv, G = key.shape[3], value.shape[3], self.group_size
        per_byte = 8 // self.bits
        if d % per_byte or dv % per_byte:
            raise ShapeError(
                f"{self.bits}-bit storage packs {per_byte} codes a byte: head dims must be multiples of "
                f"{per_byte}, got {d} and {dv}"
            )
        if dv % min(G, dv):
            raise ShapeError(f"value head dim {dv} is not a multiple of group_size {G}")

    def _plan(self, key, value) -> dict[str, Any]:
        """Which tokens leave the residual for the store, quantized: computed before anything changes."""
        G, R = self.group_size, self.residual
        ck, cv = self.seen - self._tk, self.seen - self._tv
        n = key.shape[2]
        qk = max(0, (ck + n - R) // G * G)
        qv = max(0, cv + n - R)
        src_k = key if not ck else torch.cat([self._rk[:, :, :ck], key], dim=2)
        src_v = value if not cv else torch.cat([self._rv[:, :, :cv], value], dim=2)
        plan: dict[str, Any] = {"qk": qk, "qv": qv, "src_k": src_k, "src_v": src_v}
        if qk:
            b, h, _, d = src_k.shape
            blocks = src_k[:, :, :qk].reshape(b, h, qk // G, G, d)
            plan["k"] = quantize_per_channel(blocks, self.bits)
        if qv:
            plan["v"] = quantize_per_token(src_v[:, :, :qv], self.bits, min(G, value.shape[3]))
        return plan

    def _commit(self, plan: dict[str, Any], key, value) -> None:
        if not self._values.allocated:
            self.geometry = Geometry.of(key, value)
            self._allocate_store(0)
            self._residual_keys.allocate(self.residual + self.group_size, self.geometry)
            self._residual_values.allocate(max(self.residual, 1), self.geometry)
        qk, qv = plan["qk"], plan["qv"]
        self._ensure_store(self._tk + qk, self._tv + qv)
        if qk:
            k = plan["k"]
            self._keys.append({"kcodes": k.codes, "kscale": k.scale.squeeze(3), "kmin": k.minimum.squeeze(3)})
        if qv:
            v = plan["v"]
            self._values.append({"vcodes": v.codes, "vscale": v.scale, "vmin": v.minimum})
        rest_k, rest_v = plan["src_k"][:, :, qk:], plan["src_v"][:, :, qv:]
        self._residual_keys.write(0, {"keys": rest_k})
        self._residual_values.write(0, {"values": rest_v})
        self._residual_keys.length, self._residual_values.length = rest_k.shape[2], rest_v.shape[2]

    def _allocate_store(self, tokens: int) -> None:
        """(Re)allocate the quantized store for ``tokens`` (a multiple of group_size), keeping its content."""
        self._keys.allocate(tokens // self.group_size, self.geometry)
        self._values.allocate(tokens, self.geometry)

    def _ensure_store(self, tk: int, tv: int) -> None:
        have = self._values.capacity
        need = max(tk, tv)
        if need <= have:
            return
        G = self.group_size
        grown = max(need, have + have // 4)  # a quarter more: the store is the bulk of the memory
        self._allocate_store(math.ceil(grown / G) * G)

    # ---- rollback and state ---------------------------------------------------------------

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        exact = self.seen - max(self._tk, self._tv)
        if int(n) > exact:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a quantized layer: only the last {exact} are still in "
                f"full precision, and quantized tokens cannot be rolled back"
            )

    def _trim(self, n: int) -> None:
        # Only residual tokens (check_trim): the caller lowers seen.
        self._residual_keys.trim(n)
        self._residual_values.trim(n)

    def reset(self) -> None:
        super().reset()
        self._reset_storage()

    def _rebatch(self, fn) -> None:
        if not self._values.allocated:
            return
        for store in (self._keys, self._values, self._residual_keys):
            store.rebatch(fn, store.capacity, count=False)
        batch = self._residual_values.rebatch(fn, self._residual_values.capacity, count=False)
        self.geometry = replace(self.geometry, batch=batch)

    def options(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "residual": self.residual, "block": self.block}

    def state(self) -> LayerState:
        tensors: dict[str, torch.Tensor] = {}
        if self._values.tensors:
            tensors = {**self._keys.in_use(), **self._values.in_use()}
            tensors["kcodes"] = tensors["kcodes"].flatten(2, 3)  # a slot per token, as saved
            tensors["residual_keys"] = self._residual_keys.in_use()["keys"]
            tensors["residual_values"] = self._residual_values.in_use()["values"]
        return LayerState(self.kind, self.options(), self.seen, tensors)

    def check_state(self, state: LayerState) -> None:
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        t = state.tensors
        if not t:
            if int(state.seen):
                raise ValueError(f"quantized layer state holds no tokens but {state.seen} seen")
            return
        missing = [name for name in (*_STORE, "residual_keys", "residual_values") if name not in t]
        if missing:
            raise ValueError(f"quantized layer state lacks {missing}")
        rk, rv = t["residual_keys"], t["residual_values"]
        # Residual keys and values differ in length (keys leave it a block at a time): only
        # [batch, heads] and the dtype must agree.
        check_kv(rk[:, :, :0], rv[:, :, :0], None) if rk.dim() == rv.dim() == 4 else check_kv(rk, rv, None)
        self._check_dims(rk, rv)
        if any(t[name].dim() != 4 for name in _STORE):
            raise ShapeError(f"quantized layer state: {', '.join(f'{n} {tuple(t[n].shape)}' for n in _STORE)} must be 4-D")
        tk, tv = t["kcodes"].shape[2], t["vcodes"].shape[2]
        seen = int(state.seen)
        if tk % self.group_size or tk + rk.shape[2] != seen or tv + rv.shape[2] != seen:
            raise ValueError(
                f"quantized layer state is inconsistent: {tk} quantized + {rk.shape[2]} "
                f"residual keys, {tv} + {rv.shape[2]} values, {seen} tokens seen"
            )
        if rk.shape[2] >= self.residual + self.group_size or rv.shape[2] > self.residual:
            raise ValueError(
                f"quantized layer state keeps {rk.shape[2]} keys and {rv.shape[2]} values in full precision; "
                f"residual {self.residual} with group size {self.group_size} keeps at most "
                f"{self.residual + self.group_size - 1} and {self.residual}"
            )
        g = Geometry.of(rk, rv)
        self._values.check("quantized layer", t, g, tv)
        self._keys.check("quantized layer (keys by blocks of group_size tokens)", _key_blocks(t, self.group_size), g, tk // self.group_size)

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        t = state.tensors
        if t:
            rk, rv = t["residual_keys"], t["residual_values"]
            self.geometry = g = Geometry.of(rk, rv)
            tk, tv, G = t["kcodes"].shape[2], t["vcodes"].shape[2], self.group_size
            self._allocate_store(math.ceil(max(tk, tv) / G) * G)
            self._keys.append(_key_blocks(t, G))
            self._values.append({name: t[name] for name in _VALUE_STORE})
            self._residual_keys.load({"keys": rk}, g, self.residual + G)
            self._residual_values.load({"values": rv}, g, max(self.residual, 1))
        self._seen = int(state.seen)


def _residual_key_layout(g: Geometry) -> Layout:
    return {"keys": ((g.key_dim,), g.dtype)}


def _residual_value_layout(g: Geometry) -> Layout:
    return {"values": ((g.value_dim,), g.dtype)}


def _key_blocks(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """A saved state's key codes ``[B, Hkv, T, D']`` as the store keeps them, ``[B, Hkv, T/G, G, D']``
    (``T`` a multiple of G and the tensors 4-D: checked before), with the keys' scale and minimum."""
    codes = tensors["kcodes"]
    return {
        "kcodes": codes.unflatten(2, (codes.shape[2] // group_size, group_size)),
        "kscale": tensors["kscale"],
        "kmin": tensors["kmin"],
    }


class StoreReader(BlockReader):
    """A quantized layer's store as the attention kernel reads it: ``block`` tokens of codes
    dequantized at a time, then the full-precision residual (see the module docstring)."""

    def __init__(self, layer: QuantizedLayer) -> None:
        self.layer = layer
        g, seen = layer.geometry, layer.seen
        self._shape = torch.Size((g.batch, g.heads, seen, g.key_dim))
        self._value_shape = torch.Size((g.batch, g.heads, seen, g.value_dim))

    @property
    def shape(self) -> torch.Size:
        return self._shape

    @property
    def value_shape(self) -> torch.Size:
        return self._value_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.geometry.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.geometry.device

    def key_blocks(self) -> Iterator[torch.Tensor]:
        layer, tk = self.layer, self.layer._tk
        for start in range(0, tk, layer.block):
            yield layer._keys_block(start, min(start + layer.block, tk))
        yield layer._rk[:, :, : layer.seen - tk]

    def value_blocks(self) -> Iterator[torch.Tensor]:
        layer, tv = self.layer, self.layer._tv
        for start in range(0, tv, layer.block):
            yield layer._values_block(start, min(start + layer.block, tv))
        yield layer._rv[:, :, : layer.seen - tv]
