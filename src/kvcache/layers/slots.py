"""How an evicting layer stores the keys and values of its slots: the "storage" half of
storage x policy composition.

A codec turns new keys/values into named tensors with the slot on dim 2 (``[B, Hkv, n, ...]``),
so that the layer can move, gather and evict slots without knowing what is in them, and turns a
run of slots back into full-precision keys and values for attention.

- ``full``: the keys and values themselves; reading them back is a view.
- ``int8`` / ``int4`` / ``int2``: every slot quantized on its own, keys and values per token in groups of
  channels (a slot can then be overwritten alone, which per-channel key blocks would not allow);
  reading back (``decode``) dequantizes the slots (a temporary of the budget's size). Attention
  reads them through a ``SlotCodesReader`` instead (``reader``): a decode step straight from the
  codes with the coded C++ library (``attention/fused.py``), else a block of slots dequantized at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..attention import BlockReader, fused
from ..quant import Quantized, dequantize_per_token, quantize_per_token
from .checks import Geometry
from .store import Layout

STORAGES = ("full", "int8", "int4", "int2")


class FullSlots:
    name = "full"
    names = ("keys", "values")

    def layout(self, g: Geometry) -> Layout:
        """Each tensor's shape after ``[B, Hkv, slots]`` and its dtype."""
        return {"keys": ((g.key_dim,), g.dtype), "values": ((g.value_dim,), g.dtype)}

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": key, "values": value}

    def decode(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        return slots["keys"][:, :, :length], slots["values"][:, :, :length]

    def reader(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> None:
        """None: attention reads full slots as the views ``decode`` gives, in place."""
        return None

    def geometry(self, tensors: dict[str, torch.Tensor]) -> Geometry:
        """The geometry of stored slots (a saved state's)."""
        return Geometry.of(tensors["keys"], tensors["values"])


class QuantSlots:
    names = ("kcodes", "kscale", "kmin", "vcodes", "vscale", "vmin")

    def __init__(self, bits: int, group_size: int = 64) -> None:
        self.bits = bits
        self.group_size = group_size
        self.name = f"int{bits}"

    def group(self, dim: int) -> int:
        """Channels per (scale, minimum) pair of a key or value of ``dim`` channels."""
        return min(self.group_size, dim)

    def layout(self, g: Geometry) -> Layout:
        out: Layout = {}
        for prefix, dim in (("k", g.key_dim), ("v", g.value_dim)):
            groups = dim // self.group(dim)
            out[prefix + "codes"] = ((dim * self.bits // 8,), torch.uint8)
            out[prefix + "scale"] = ((groups,), g.dtype)
            out[prefix + "min"] = ((groups,), g.dtype)
        return out

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, x in (("k", key), ("v", value)):
            q = quantize_per_token(x, self.bits, self.group(x.shape[-1]))
            out.update({prefix + "codes": q.codes, prefix + "scale": q.scale, prefix + "min": q.minimum})
        return out

    def decode(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_run(slots, "k", 0, length, g), self.decode_run(slots, "v", 0, length, g)

    def decode_run(self, slots: dict[str, torch.Tensor], prefix: str, start: int, stop: int, g: Geometry) -> torch.Tensor:
        """The keys (``prefix`` "k") or values ("v") of slots ``[start, stop)`` dequantized:
        ``[B, Hkv, stop - start, D or Dv]`` in the geometry's dtype."""
        dim = g.key_dim if prefix == "k" else g.value_dim
        q = Quantized(*(slots[prefix + part][:, :, start:stop] for part in ("codes", "scale", "min")), self.bits)
        return dequantize_per_token(q, self.group(dim), g.dtype)

    def reader(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> SlotCodesReader:
        """The first ``length`` of ``slots`` (a store's whole tensors) as attention reads them."""
        return SlotCodesReader(slots, length, g, self)

    def geometry(self, tensors: dict[str, torch.Tensor]) -> Geometry:
        k, v = tensors["kcodes"], tensors["vcodes"]
        b, h = k.shape[:2]
        dtype = tensors["kscale"].dtype
        return Geometry(b, h, k.shape[-1] * 8 // self.bits, v.shape[-1] * 8 // self.bits, dtype, k.device)


class SlotCodesReader(BlockReader):
    """The first ``length`` coded slots of a store (``QuantSlots``'s tensors ``[B, Hkv, C, ...]``,
    whole: no view of them is taken) as the attention kernel reads them: keys and values ``[B, Hkv,
    length, D / Dv]`` in the geometry's dtype.

    A decode step reads the codes themselves with the coded library (``attention.fused``): its scores
    (``decode_scores``), its weighted values (``decode_values``), or the whole step in one pass
    (``decode_attention``). Where the library declines (off, unbuilt, a shape beyond it, gradients
    asked for), the kernel reads ``key_blocks``/``value_blocks``: ``block`` slots dequantized at a time.
    Every slot is coded: unlike a quantized layer's store, there is no exact tail."""

    def __init__(
        self, slots: dict[str, torch.Tensor], length: int, geometry: Geometry, codec: QuantSlots, block: int = 512
    ) -> None:
        self.slots, self.length, self.geometry, self.codec, self.block = slots, length, geometry, codec, block
        batch, heads = slots["kcodes"].shape[:2]
        self._shape = torch.Size((batch, heads, length, geometry.key_dim))
        self._value_shape = torch.Size((batch, heads, length, geometry.value_dim))

    shape = property(lambda self: self._shape)
    value_shape = property(lambda self: self._value_shape)
    dtype = property(lambda self: self.geometry.dtype)
    device = property(lambda self: self.geometry.device)

    def key_blocks(self) -> Iterator[torch.Tensor]:
        return self._blocks("k")

    def value_blocks(self) -> Iterator[torch.Tensor]:
        return self._blocks("v")

    def _blocks(self, prefix: str) -> Iterator[torch.Tensor]:
        # max(..., 1): no slots still make one (empty) block, so that the kernel has something to join.
        for start in range(0, max(self.length, 1), self.block):
            yield self.codec.decode_run(self.slots, prefix, start, min(start + self.block, self.length), self.geometry)

    def _codes(self, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.slots[prefix + part] for part in ("codes", "scale", "min"))

    def _group(self, prefix: str) -> int:
        return self.codec.group(self.geometry.key_dim if prefix == "k" else self.geometry.value_dim)

    def decode_scores(self, query: torch.Tensor) -> torch.Tensor | None:
        """Scores float32 ``[B, Hkv, R, length]`` of scaled query rows ``[B, Hkv, R, D]`` straight
        from the key codes, or None when the library cannot run."""
        return fused.token_key_scores(query, *self._codes("k"), self.codec.bits, self._group("k"), self.length)

    def decode_values(self, weights: torch.Tensor) -> torch.Tensor | None:
        """``weights @ values`` ``[B, Hkv, R, Dv]`` in the weights' dtype for weights ``[B, Hkv, R,
        length]`` straight from the value codes, or None when the library cannot run."""
        if torch.is_grad_enabled() and weights.requires_grad:  # the library computes no gradients
            return None
        out = fused.weighted_values(weights, *self._codes("v"), self.codec.bits, self._group("v"))
        return None if out is None else out.to(weights.dtype)

    def decode_attention(self, query: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor | None:
        """A plain decode step (no mask, sinks or weights: the kernel's ``route`` checks) of query rows
        ``[B, Hkv, R, D]`` in one pass over the codes: ``[B, Hkv, R, Dv]`` in the query's dtype, or None
        to decline (the library cannot run, or no slots)."""
        keys, values, groups = self._codes("k"), self._codes("v"), (self._group("k"), self._group("v"))
        done = fused.token_decode_attention(query, keys, values, self.codec.bits, self.length, *groups, scale, softcap)
        return None if done is None else done[0].to(query.dtype)


def get_storage(name: str) -> FullSlots | QuantSlots:
    if name == "full":
        return FullSlots()
    if name in STORAGES[1:]:
        return QuantSlots(int(name[3:]))
    raise ValueError(f"unknown slot storage {name!r}; choose one of {STORAGES}")
