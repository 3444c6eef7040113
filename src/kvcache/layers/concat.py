"""The baseline: concatenate on every append, as Hugging Face ``DynamicLayer`` does.

Step t copies the whole past, so T tokens cost O(T^2) bytes copied and hold two copies of the
cache for a moment at every step. Kept as the reference for tests and benchmarks: its store is
reallocated to exactly the tokens held on every append (``torch.cat``'s cost, done by the store).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..attention import Reads
from .base import Geometry, KVLayer
from .store import Exact, SlotStore


class ConcatLayer(KVLayer):
    kind = "concat"
    spec_order = 5
    unbounded = True

    def __init__(self) -> None:
        super().__init__()
        self.store = SlotStore(growth=Exact())

    def _append(self, key, value):
        geometry = self.geometry or Geometry.of(key, value)
        self.store.allocate(self.length + key.shape[-2], geometry)  # the past copied, every time
        self.store.append({"keys": key, "values": value})
        self.geometry = geometry
        seen, n = self._seen, key.shape[-2]
        self._seen = seen + n
        keys, values = self.view()
        return Reads(keys, values, None, seen, n, all_visible=n == 1)

    def _trim(self, n: int) -> None:
        self.store.trim(n)
        self.store.shrink()  # capacity is always the length

    def reset(self) -> None:
        self.store.drop()
        self.geometry = None
        self._seen = 0

    def _rebatch(self, fn) -> None:
        if self.store.allocated:  # not counted: concatenation allocates on every append anyway
            self.geometry = replace(self.geometry, batch=self.store.rebatch(fn, count=False))

    def options(self) -> dict[str, Any]:
        return {}
