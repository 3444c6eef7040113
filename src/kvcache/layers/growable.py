"""The default store: a capacity buffer written at a cursor, doubled when full.

Appending S tokens copies only those S tokens, except when the buffer is full: then a buffer of
twice the capacity (or, for a chunk larger than that, the next multiple of the initial capacity
above it) is allocated and the past copied once. Over T tokens that is at most
ceil(log2(T / initial)) + 1 allocations and amortised O(1) copying per token. ``update`` returns zero-copy views of ``[0, length)``.
"""

from __future__ import annotations

from typing import Any

from ..registry import Option
from .buffer import BufferLayer


class GrowableLayer(BufferLayer):
    """Capacity buffer with geometric growth. ``initial_capacity`` slots on the first append."""

    kind = "growable"
    spec_options = {"initial_capacity": Option(int, least=1), "growth": Option(float, least=1.0, inclusive=False)}
    spec_order = 0
    unbounded = True

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
        self._drop_buffers()

    def options(self) -> dict[str, Any]:
        return {"initial_capacity": self.initial_capacity, "growth": self.growth}
