"""The default store: a capacity buffer written at a cursor, doubled when full.

Appending S tokens copies only those S tokens, except when the buffer is full: then a buffer of
twice the capacity (or, for a chunk larger than that, the next multiple of the initial capacity
above it) is allocated and the past copied once. Over T tokens that is at most ceil(log2(T / initial)) + 1 allocations and amortised O(1)
copying per token. ``update`` returns zero-copy views of ``[0, length)``.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Geometry, KVLayer


class BufferLayer(KVLayer):
    """Keys/values in buffers ``[B, Hkv, C, D]`` filled from slot 0 up to a cursor ``length``.

    Subclasses decide what happens when an append does not fit (``_make_room``).
    """

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None  # [B, Hkv, C, D]
        self._vbuf: torch.Tensor | None = None  # [B, Hkv, C, Dv]
        self._len = 0

    def _make_room(self, need: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Make the buffers hold at least ``need`` slots, keeping ``[0, length)``; or raise, changing nothing."""
        raise NotImplementedError

    def _allocate(self, capacity: int, batch: int, like_key: torch.Tensor, like_value: torch.Tensor) -> None:
        """Switch to new buffers of ``capacity`` slots holding the current content."""
        g = self.geometry or Geometry.of(like_key, like_value)
        kbuf = torch.empty(batch, g.heads, capacity, g.key_dim, dtype=g.dtype, device=g.device)
        vbuf = torch.empty(batch, g.heads, capacity, g.value_dim, dtype=g.dtype, device=g.device)
        if self._kbuf is not None and self._len:
            kbuf[:, :, : self._len].copy_(self._kbuf[:, :, : self._len])
            vbuf[:, :, : self._len].copy_(self._vbuf[:, :, : self._len])
        self._kbuf, self._vbuf = kbuf, vbuf
        self.geometry = Geometry(batch, g.heads, g.key_dim, g.value_dim, g.dtype, g.device)
        self.reallocations += 1

    def _append(self, key, value):
        need = self._len + key.shape[-2]
        if self._kbuf is None or need > self.capacity:
            self._make_room(need, key, value)
        self._kbuf[:, :, self._len : need].copy_(key)
        self._vbuf[:, :, self._len : need].copy_(value)
        self._len = need
        self._seen += key.shape[-2]
        return self._kbuf[:, :, :need], self._vbuf[:, :, :need]

    @property
    def length(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[-2]

    @property
    def nbytes(self) -> int:
        if self._kbuf is None:
            return 0
        return self._kbuf.nbytes + self._vbuf.nbytes

    def view(self):
        if self._kbuf is None:
            return None, None
        return self._kbuf[:, :, : self._len], self._vbuf[:, :, : self._len]

    def _trim(self, n: int) -> None:
        self._len -= n

    def _rebatch(self, fn) -> None:
        if self._kbuf is None:
            return
        keys, values = (fn(t) for t in self.view())
        if keys.shape[0] == self.geometry.batch:
            # Same batch (beam reorder): write back in place, keeping the buffers (and their owner).
            self._kbuf[:, :, : self._len].copy_(keys)
            self._vbuf[:, :, : self._len].copy_(values)
            return
        self._kbuf = self._vbuf = None
        self._allocate(max(self._static_capacity(), self._len), keys.shape[0], keys, values)
        self._kbuf[:, :, : self._len].copy_(keys)
        self._vbuf[:, :, : self._len].copy_(values)

    def _static_capacity(self) -> int:
        """Capacity to keep when the batch size changes."""
        return self.capacity


class GrowableLayer(BufferLayer):
    """Capacity buffer with geometric growth. ``initial_capacity`` slots on the first append."""

    kind = "growable"

    def __init__(self, initial_capacity: int = 256, growth: float = 2.0) -> None:
        super().__init__()
        if int(initial_capacity) < 1:
            raise ValueError(f"initial_capacity must be >= 1, got {initial_capacity}")
        if float(growth) <= 1.0:
            raise ValueError(f"growth must be > 1.0, got {growth}")
        self.initial_capacity = int(initial_capacity)
        self.growth = float(growth)

    def _make_room(self, need, key, value):
        if self._kbuf is None:
            capacity, batch = self._fit(need), key.shape[0]
        else:
            grown = int(self.capacity * self.growth)
            capacity = grown if grown >= need else self._fit(need)
            batch = self.geometry.batch
        self._allocate(capacity, batch, key, value)

    def _fit(self, need: int) -> int:
        """Room for ``need`` slots plus headroom: the next multiple of ``initial_capacity`` above it.

        A prompt that exactly fills an allocation would otherwise force a reallocation on the
        first decode step.
        """
        return (need // self.initial_capacity + 1) * self.initial_capacity

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self.geometry = None
        self._len = 0
        self._seen = 0

    def options(self) -> dict[str, Any]:
        return {"initial_capacity": self.initial_capacity, "growth": self.growth}
