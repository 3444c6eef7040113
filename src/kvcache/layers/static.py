"""A fixed capacity, allocated once (or buffers the caller owns). Never reallocates on append.

Appending past the capacity raises ``CacheFullError`` and writes nothing. With caller-owned
buffers ``[B, Hkv, C, D]`` the cache writes into them and returns views of them, so their
identity is kept (a batch-size change, e.g. ``repeat`` for beams, needs new buffers).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CacheFullError, DTypeError, ShapeError
from .base import Geometry, KVLayer
from .options import Option
from .store import Fixed, SlotStore


class StaticLayer(KVLayer):
    kind = "static"
    spec_options = {"capacity": Option(int, least=1), "buffers": Option(object)}
    required_options = ("capacity|buffers",)
    spec_order = 1

    @classmethod
    def from_options(cls, options: dict[str, Any], buffers: tuple[torch.Tensor, torch.Tensor] | None = None) -> StaticLayer:
        """From a spec's options, over a caller-owned ``(keys, values)`` pair ``[B, Hkv, C, D]`` if given."""
        if buffers is None:
            return cls(**options)
        keys, values = buffers
        return cls(options.get("capacity"), keys=keys, values=values)

    def __init__(
        self,
        capacity: int | None = None,
        *,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if (keys is None) != (values is None):
            raise ValueError("pass both keys and values buffers, or neither")
        if keys is not None:
            _check_buffers(keys, values, capacity)
            capacity = keys.shape[2]
        if capacity is None:
            raise ValueError("a static layer needs a capacity (tokens) or a keys/values buffer pair, got neither")
        self._capacity = self.check_options(capacity=capacity)["capacity"]
        self.store = SlotStore(growth=Fixed(self._capacity))
        if keys is not None:
            self.store.adopt({"keys": keys, "values": values})
            self.geometry = Geometry.of(keys, values)

    def check_append(self, n: int) -> None:
        self.store.check_room(self.length + int(n))

    _append = KVLayer._record_in_order  # slot j holds position j (so update skips the record)

    @property
    def max_length(self) -> int:
        return self._capacity

    def check_state(self, state) -> None:
        super().check_state(state)
        stored = state.tensors["keys"].shape[2] if "keys" in state.tensors else 0
        if stored > self._capacity:
            raise CacheFullError(f"state holds {stored} tokens, more than this static layer's capacity {self._capacity}")

    def load_state(self, state) -> None:
        self.check_state(state)
        keys = state.tensors.get("keys")
        if keys is not None and self.geometry is not None and self.geometry != Geometry.of(keys, state.tensors["values"]):
            self.store.drop()  # another batch size or dtype: new buffers
            self.geometry = None
        super().load_state(state)

    def reset(self) -> None:
        # Keeps the buffers (they may be the caller's) and so the geometry.
        self.store.length = 0
        self._seen = 0

    def options(self) -> dict[str, Any]:
        return {"capacity": self._capacity}


def _check_buffers(keys: torch.Tensor, values: torch.Tensor, capacity: int | None) -> None:
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ShapeError(f"{name} buffer must be a 4-D tensor [batch, kv_heads, capacity, head_dim]")
    if keys.shape[:3] != values.shape[:3]:
        raise ShapeError(
            f"keys and values buffers must agree on [batch, kv_heads, capacity]: "
            f"{tuple(keys.shape)} vs {tuple(values.shape)}"
        )
    if keys.dtype != values.dtype or keys.device != values.device:
        raise DTypeError("keys and values buffers must share dtype and device")
    if capacity is not None and int(capacity) != keys.shape[2]:
        raise ShapeError(f"capacity {capacity} does not match the buffers' capacity {keys.shape[2]}")
