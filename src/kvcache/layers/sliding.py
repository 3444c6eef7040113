"""A model's own sliding-window layer (mistral, gemma2 sliding layers), stored in place.

Semantics are Hugging Face's ``DynamicSlidingWindowLayer``: after each update only the last
``window - 1`` tokens are kept, and ``update`` returns the kept tokens followed by the new ones, in
order, so the mask that ``get_mask_sizes`` describes lines up and generation is token-identical.
Storage differs: no concatenation. Tokens are written at a cursor in a buffer of about twice the
window; when the cursor reaches the end, the kept tokens move back to the front (at most
``window - 1`` slots copied every ``window`` or so tokens: amortised O(1) per token). Memory is
bounded by the window, or by the largest chunk appended at once, which a later append shrinks.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedOperation
from .base import Geometry, KVLayer


class SlidingLayer(KVLayer):
    kind = "sliding"
    is_sliding = True

    def __init__(self, window: int) -> None:
        super().__init__()
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.window = int(window)
        self._kbuf: torch.Tensor | None = None  # [B, Hkv, C, D]
        self._vbuf: torch.Tensor | None = None  # [B, Hkv, C, Dv]
        self._start = 0  # first kept slot
        self._len = 0  # kept slots, at most window - 1 between updates

    @property
    def keep(self) -> int:
        """Tokens kept between updates."""
        return self.window - 1

    def _append(self, key, value):
        new = key.shape[-2]
        need = self._len + new
        if self._kbuf is None or self._start + need > self.capacity:
            self._compact(need, key, value)
        end = self._start + need
        self._kbuf[:, :, self._start + self._len : end].copy_(key)
        self._vbuf[:, :, self._start + self._len : end].copy_(value)
        out = self._kbuf[:, :, self._start : end], self._vbuf[:, :, self._start : end]
        drop = max(0, need - self.keep)
        self._start += drop
        self._len = need - drop
        self._seen += new
        return out

    def _compact(self, need: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Move the kept slots to the front, reallocating if the buffer is too small or far too big."""
        target = max(2 * self.window, need)
        cap = self.capacity
        if self._kbuf is None or target > cap or cap > 2 * target:
            self._reallocate(target, key.shape[0] if self._kbuf is None else self.geometry.batch, key, value)
            return
        src = slice(self._start, self._start + self._len)
        for buf in (self._kbuf, self._vbuf):
            kept = buf[:, :, src]
            # Overlapping ranges need a temporary; the usual case (cursor at the end) does not.
            buf[:, :, : self._len].copy_(kept if self._start >= self._len else kept.clone())
        self._start = 0

    def _reallocate(self, capacity: int, batch: int, like_key, like_value) -> None:
        g = self.geometry or Geometry.of(like_key, like_value)
        kbuf = torch.empty(batch, g.heads, capacity, g.key_dim, dtype=g.dtype, device=g.device)
        vbuf = torch.empty(batch, g.heads, capacity, g.value_dim, dtype=g.dtype, device=g.device)
        if self._kbuf is not None and self._len and batch == g.batch:
            keys, values = self.view()
            kbuf[:, :, : self._len].copy_(keys)
            vbuf[:, :, : self._len].copy_(values)
        self._kbuf, self._vbuf, self._start = kbuf, vbuf, 0
        self.geometry = Geometry(batch, g.heads, g.key_dim, g.value_dim, g.dtype, g.device)
        self.reallocations += 1

    @property
    def length(self) -> int:
        return self._len

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[-2]

    @property
    def nbytes(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.nbytes + self._vbuf.nbytes

    @property
    def max_length(self) -> int:
        return self.window

    def view(self):
        if self._kbuf is None:
            return None, None
        s = slice(self._start, self._start + self._len)
        return self._kbuf[:, :, s], self._vbuf[:, :, s]

    def check_trim(self, n: int) -> None:
        # After the trim the next update needs the `keep` tokens before the new end; those must
        # still be stored.
        super().check_trim(n)
        first_needed = max(0, self.seen - int(n) - self.keep)
        first_stored = self.seen - self.length
        if int(n) > 0 and first_stored > first_needed:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a sliding window of {self.window}: tokens before "
                f"position {first_stored} were already dropped, and the window would need them "
                f"from position {first_needed}"
            )

    def _trim(self, n: int) -> None:
        self._len -= n
        surplus = max(0, self._len - self.keep)
        self._start += surplus
        self._len -= surplus

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self.geometry = None
        self._start = self._len = 0
        self._seen = 0

    def _rebatch(self, fn) -> None:
        if self._kbuf is None:
            return
        keys, values = (fn(t) for t in self.view())
        self._reallocate(self.capacity, keys.shape[0], keys, values)
        self._kbuf[:, :, : self._len].copy_(keys)
        self._vbuf[:, :, : self._len].copy_(values)

    def options(self) -> dict[str, Any]:
        return {"window": self.window}
