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

from ..errors import UnsupportedOperation
from .buffer import BufferLayer


class SlidingLayer(BufferLayer):
    kind = "sliding"
    is_sliding = True

    def __init__(self, window: int) -> None:
        super().__init__()
        if int(window) < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        self.window = int(window)

    @property
    def keep(self) -> int:
        """Tokens kept between updates."""
        return self.window - 1

    @property
    def max_length(self) -> int:
        return self.window

    def _append(self, key, value):
        out = super()._append(key, value)
        surplus = max(0, self._len - self.keep)
        self._start += surplus
        self._len -= surplus
        return out

    def _make_room(self, need, key, value) -> None:
        """Move the kept slots to the front, reallocating if the buffer is too small or far too big."""
        target = max(2 * self.window, need)
        cap = self.capacity
        if self._kbuf is None or target > cap or cap > 2 * target:
            batch = key.shape[0] if self._kbuf is None else self.geometry.batch
            self._allocate(target, batch, key, value)
            return
        for buf in (self._kbuf, self._vbuf):
            kept = buf.narrow(2, self._start, self._len)
            # Overlapping ranges need a temporary; the usual case (cursor at the end) does not.
            buf.narrow(2, 0, self._len).copy_(kept if self._start >= self._len else kept.clone())
        self._start = 0

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
        self._drop_buffers()

    def options(self) -> dict[str, Any]:
        return {"window": self.window}
