"""How an evicting layer stores the keys and values of its slots: the "storage" half of
storage x policy composition.

``Slots`` lays a storage format (``kvcache.formats``, shared with the engine's pool) out a slot per
token: named tensors with the slot on dim 2 (``[B, Hkv, n, ...]``), so that the layer can move,
gather and evict slots without knowing what is in them, and turns a run of slots back into
full-precision keys and values for attention.

- ``full``: the keys and values themselves; reading them back is a view.
- ``int8`` / ``int4`` / ``int2``: every slot coded on its own, keys and values per token in groups of
  channels (a slot can then be overwritten alone, which per-channel key blocks would not allow);
  reading back (``decode``) dequantizes the slots (a temporary of the budget's size). Attention
  reads them through a ``SlotCodesReader`` instead (``reader``): a decode step straight from the
  codes with the coded C++ library (``attention/fused.py``), else a block of slots dequantized at a time.
- ``int8h`` / ``int4h`` / ``int2h``: the same codes of the keys and values turned by a Hadamard
  rotation (``formats/rotated.py``). A decode step from the codes turns the query the same way and
  the output back.
- ``fp8``: e4m3 codes (``formats/fp8.py``) per token in groups of channels, as ``int8`` lays them out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import torch

from ..attention import BlockReader, device_kernels, fused
from ..formats import ROTATED, SLOT_STORAGES, STORAGES, CodedFormat, Format, format_named
from .checks import Geometry
from .store import Layout

__all__ = ["ROTATED", "SLOT_STORAGES", "STORAGES", "SlotCodesReader", "Slots", "get_storage"]


class Slots:
    """``format`` a slot per token (its keys coded per token: ``format.key_block`` is 1)."""

    def __init__(self, format: Format) -> None:
        if format.key_block != 1:
            raise ValueError(f"slots hold a token each; {format!r} codes keys over blocks of {format.key_block}")
        self.format = format
        self.name = format.name
        probe = torch.float32  # names do not depend on dims or dtype
        self.key_names = tuple(format.key_layout(8, probe))
        self.value_names = tuple(format.value_layout(8, probe))
        self.names = self.key_names + self.value_names

    def layout(self, g: Geometry) -> Layout:
        """Each tensor's shape after ``[B, Hkv, slots]`` and its dtype."""
        return {**self.format.key_layout(g.key_dim, g.dtype), **self.format.value_layout(g.value_dim, g.dtype)}

    def encode(self, key: torch.Tensor, value: torch.Tensor) -> dict[str, torch.Tensor]:
        return {**self.format.encode_keys(key), **self.format.encode_values(value)}

    def decode(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, Hkv, length, D]`` and values of the first ``length`` slots in the geometry's
        dtype: views for full precision, dequantized copies for codes."""
        return self.decode_run(slots, "k", 0, length, g), self.decode_run(slots, "v", 0, length, g)

    def decode_run(self, slots: dict[str, torch.Tensor], prefix: str, start: int, stop: int, g: Geometry) -> torch.Tensor:
        """The keys (``prefix`` "k") or values ("v") of slots ``[start, stop)``:
        ``[B, Hkv, stop - start, D or Dv]`` in the geometry's dtype."""
        if prefix == "k":
            return self.format.decode_keys({name: slots[name][:, :, start:stop] for name in self.key_names}, g.dtype)
        return self.format.decode_values({name: slots[name][:, :, start:stop] for name in self.value_names}, g.dtype)

    def reader(self, slots: dict[str, torch.Tensor], length: int, g: Geometry) -> SlotCodesReader | None:
        """The first ``length`` of ``slots`` (a store's whole tensors) as attention reads them; None
        for full precision: attention reads the views ``decode`` gives, in place."""
        return None if self.format.exact else SlotCodesReader(slots, length, g, self)

    def geometry(self, tensors: dict[str, torch.Tensor]) -> Geometry:
        """The geometry of stored slots (a saved state's)."""
        if self.format.exact:
            return Geometry.of(tensors["keys"], tensors["values"])
        k, v, bits = tensors["kcodes"], tensors["vcodes"], cast(CodedFormat, self.format).bits
        b, h = k.shape[:2]
        return Geometry(b, h, k.shape[-1] * 8 // bits, v.shape[-1] * 8 // bits, tensors["kscale"].dtype, k.device)


class SlotCodesReader(BlockReader):
    """The first ``length`` coded slots of a store (``Slots`` of ``Codes``: tensors ``[B, Hkv, C, ...]``,
    whole: no view of them is taken) as the attention kernel reads them: keys and values ``[B, Hkv,
    length, D / Dv]`` in the geometry's dtype.

    A decode step reads the codes themselves with the coded library (``attention.fused``): its scores
    (``decode_scores``), its weighted values (``decode_values``), or the whole step in one pass
    (``decode_attention``). Where the library declines (off, unbuilt, a shape beyond it, gradients
    asked for), the kernel reads ``key_blocks``/``value_blocks``: ``block`` slots dequantized at a time.
    Every slot is coded: unlike a quantized layer's store, there is no exact tail."""

    def __init__(
        self, slots: dict[str, torch.Tensor], length: int, geometry: Geometry, codec: Slots, block: int = 512
    ) -> None:
        self.slots, self.length, self.geometry, self.codec, self.block = slots, length, geometry, codec, block
        self.format = cast(CodedFormat, codec.format)  # a reader is made for codes only (``Slots.reader``)
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
        return self.format.group_of(self.geometry.key_dim if prefix == "k" else self.geometry.value_dim)

    def decode_scores(self, query: torch.Tensor) -> torch.Tensor | None:
        """Scores float32 ``[B, Hkv, R, length]`` of scaled query rows ``[B, Hkv, R, D]`` straight
        from the key codes, or None when the library cannot run."""
        turned = self.format.rotate(query)
        return fused.token_key_scores(
            turned, *self._codes("k"), self.format.bits, self._group("k"), self.length, fp8=self.format.fp8
        )

    def decode_values(self, weights: torch.Tensor) -> torch.Tensor | None:
        """``weights @ values`` ``[B, Hkv, R, Dv]`` in the weights' dtype for weights ``[B, Hkv, R,
        length]`` straight from the value codes, or None when the library cannot run."""
        if torch.is_grad_enabled() and weights.requires_grad:  # the library computes no gradients
            return None
        out = fused.weighted_values(weights, *self._codes("v"), self.format.bits, self._group("v"), fp8=self.format.fp8)
        return None if out is None else self.format.unrotate(out).to(weights.dtype)

    def decode_attention(
        self, query: torch.Tensor, scale: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step with no mask or weights (the kernel's ``route`` checks) of query rows
        ``[B, Hkv, R, D]`` in one pass over the codes: ``(out, lse)`` as ``BlockReader.decode_attention``
        (the rotation keeps every score, so the log-sum-exp is the unrotated one), or None to decline
        (the library cannot run, or no slots)."""
        keys, values, groups = self._codes("k"), self._codes("v"), (self._group("k"), self._group("v"))
        turned = self.format.rotate(query)
        done = device_kernels.token_coded_decode(
            turned, keys, values, self.format.bits, self.length, *groups, scale, softcap, fp8=self.format.fp8
        )
        return None if done is None else (self.format.unrotate(done[0]).to(query.dtype), done[1])


def get_storage(name: str) -> Slots:
    """The slots a ``storage=`` option names (``full``, ``int8``, ``int4``, ``int2``,
    ``int8h``, ``int4h``, ``int2h`` over rotated keys and values, and ``fp8``)."""
    return Slots(format_named(name))
