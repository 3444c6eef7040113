"""How an evicting layer stores the keys and values of its slots: the "storage" half of
storage x policy composition.

A codec turns new keys/values into named tensors with the slot on dim 2 (``[B, Hkv, n, ...]``),
so that the layer can move, gather and evict slots without knowing what is in them, and turns a
run of slots back into full-precision keys and values for attention.

- ``full``: the keys and values themselves; reading them back is a view.
- ``int8`` / ``int4`` / ``int2``: every slot quantized on its own, keys and values per token in groups of
  channels (a slot can then be overwritten alone, which per-channel key blocks would not allow);
  reading back dequantizes the slots (a temporary of the budget's size, once per step).
"""

from __future__ import annotations

import torch

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

    def geometry(self, tensors: dict[str, torch.Tensor]) -> Geometry:
        """The geometry of stored slots (a saved state's)."""
        return Geometry.of(tensors["keys"], tensors["values"])


class QuantSlots:
    names = ("kcodes", "kscale", "kmin", "vcodes", "vscale", "vmin")

    def __init__(self, bits: int, group_size: int = 64) -> None:
        self.bits = bits
        self.group_size = group_size
        self.name = f"int{bits}"

    def _group(self, dim: int) -> int:
        return min(self.group_size, dim)

    def layout(self, g: Geometry) -> Layout:
        out: Layout = {}
        for prefix, dim in (("k", g.key_dim), ("v", g.value_dim)):
            groups = dim // self._group(dim)
            out[prefix + "codes"] = ((dim * self.bits // 8,), torch.uint8)
            out[prefix + "scale"] = ((groups,), g.dtype)
            out[prefix + "min"] = ((groups,), g.dtype)
        return out

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for prefix, x in (("k", key), ("v", value)):
            q = quantize_per_token(x, self.bits, self._group(x.shape[-1]))
            out.update({prefix + "codes": q.codes, prefix + "scale": q.scale, prefix + "min": q.minimum})
        return out

    def decode(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for prefix, dim in (("k", g.key_dim), ("v", g.value_dim)):
            q = Quantized(*(slots[prefix + part][:, :, :length] for part in ("codes", "scale", "min")), self.bits)
            out.append(dequantize_per_token(q, self._group(dim), g.dtype))
        return out[0], out[1]

    def geometry(self, tensors: dict[str, torch.Tensor]) -> Geometry:
        k, v = tensors["kcodes"], tensors["vcodes"]
        b, h = k.shape[:2]
        dtype = tensors["kscale"].dtype
        return Geometry(b, h, k.shape[-1] * 8 // self.bits, v.shape[-1] * 8 // self.bits, dtype, k.device)


def get_storage(name: str) -> FullSlots | QuantSlots:
    if name == "full":
        return FullSlots()
    if name in STORAGES[1:]:
        return QuantSlots(int(name[3:]))
    raise ValueError(f"unknown slot storage {name!r}; choose one of {STORAGES}")
