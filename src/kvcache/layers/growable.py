"""The default store: a capacity buffer written at a cursor, doubled when full.

Appending S tokens copies only those S tokens, except when the buffer is full: then a buffer of
twice the capacity (or, for a chunk larger than that, the next multiple of the initial capacity
above it) is allocated and the past copied once. Over T tokens that is at most
ceil(log2(T / initial)) + 1 allocations and amortised O(1) copying per token. ``update`` returns zero-copy views of ``[0, length)``.
"""

from __future__ import annotations

from typing import Any

from .base import KVLayer
from .options import Option
from .store import Geometric, SlotStore


class GrowableLayer(KVLayer):
    """Capacity buffer with geometric growth. ``initial_capacity`` slots on the first append."""

    kind = "growable"
    spec_options = {"initial_capacity": Option(int, least=1), "growth": Option(float, least=1.0, inclusive=False)}
    spec_order = 0
    unbounded = True

    def __init__(self, initial_capacity: int = 256, growth: float = 2.0) -> None:
        super().__init__()
        checked = self.check_options(initial_capacity=initial_capacity, growth=growth)
        self.initial_capacity, self.growth = checked["initial_capacity"], checked["growth"]
        self.store = SlotStore(growth=Geometric(self.initial_capacity, self.growth))

    _append = KVLayer._record_in_order  # slot j holds position j (so update skips the record)

    def reset(self) -> None:
        self.store.drop()
        self.geometry = None
        self._seen = 0

    def options(self) -> dict[str, Any]:
        return {"initial_capacity": self.initial_capacity, "growth": self.growth}

