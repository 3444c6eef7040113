"""Storage in preallocated buffers: what the growable, static and sliding layers share.

Keys and values live in buffers ``[B, Hkv, C, D]`` / ``[B, Hkv, C, Dv]``; the stored slots are the
contiguous run ``[start, start + length)`` (``start`` is 0 except for the sliding layer, which
drops from the front). Subclasses decide what happens when an append does not fit.
"""

from __future__ import annotations

import torch

from .base import Geometry, KVLayer


class BufferLayer(KVLayer):
    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None  # [B, Hkv, C, D]
        self._vbuf: torch.Tensor | None = None  # [B, Hkv, C, Dv]
        self._start = 0  # first stored slot
        self._len = 0  # stored slots

    def _make_room(self, need: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Make room for ``need`` slots from ``start``, keeping the content; or raise, changing nothing."""
        raise NotImplementedError

    def _allocate(self, capacity: int, batch: int, like_key: torch.Tensor, like_value: torch.Tensor) -> None:
        """Switch to new buffers of ``capacity`` slots, the content (if the batch is unchanged) moved to slot 0."""
        g = self.geometry or Geometry.of(like_key, like_value)
        kbuf = torch.empty(batch, g.heads, capacity, g.key_dim, dtype=g.dtype, device=g.device)
        vbuf = torch.empty(batch, g.heads, capacity, g.value_dim, dtype=g.dtype, device=g.device)
        if self._kbuf is not None and self._len and batch == g.batch:
            keys, values = self.view()
            kbuf.narrow(2, 0, self._len).copy_(keys)
            vbuf.narrow(2, 0, self._len).copy_(values)
        self._kbuf, self._vbuf, self._start = kbuf, vbuf, 0
        self.geometry = Geometry(batch, g.heads, g.key_dim, g.value_dim, g.dtype, g.device)
        self.reallocations += 1

    def _append(self, key, value):
        new = key.shape[2]
        need = self._len + new
        if self._kbuf is None or self._start + need > self._kbuf.shape[2]:
            self._make_room(need, key, value)
        kbuf, vbuf, start = self._kbuf, self._vbuf, self._start
        kbuf.narrow(2, start + self._len, new).copy_(key)
        vbuf.narrow(2, start + self._len, new).copy_(value)
        self._len = need
        self._seen += new
        return kbuf.narrow(2, start, need), vbuf.narrow(2, start, need)

    @property
    def length(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[2]

    @property
    def nbytes(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.nbytes + self._vbuf.nbytes

    def view(self):
        if self._kbuf is None:
            return None, None
        return self._kbuf.narrow(2, self._start, self._len), self._vbuf.narrow(2, self._start, self._len)

    def _trim(self, n: int) -> None:
        self._len -= n

    def _drop_buffers(self) -> None:
        self._kbuf = self._vbuf = None
        self.geometry = None
        self._start = self._len = 0
        self._seen = 0

    def _rebatch(self, fn) -> None:
        if self._kbuf is None:
            return
        keys, values = (fn(t) for t in self.view())
        if keys.shape[0] == self.geometry.batch:
            # Same batch (beam reorder): write back in place, keeping the buffers (and their owner).
            stored_k, stored_v = self.view()
            stored_k.copy_(keys)
            stored_v.copy_(values)
            return
        self._kbuf = self._vbuf = None
        self._allocate(max(self._rebatch_capacity(), self._len), keys.shape[0], keys, values)
        self._kbuf.narrow(2, 0, self._len).copy_(keys)
        self._vbuf.narrow(2, 0, self._len).copy_(values)

    def _rebatch_capacity(self) -> int:
        """Capacity of the new buffers when the batch size changes."""
        return self.capacity
