"""The ``window`` kind with fixed shapes, for ``torch.compile`` (see ``fixed.py``).

The ring of ``sinks + window`` slots is allocated whole on the first update. A decode step (one
token) writes its token at the slot ``sinks + (seen - sinks) % window`` (or ``seen`` among the
sinks) computed from the ``seen`` tensor, records the slot's absolute position in ``slot_positions``
``[sinks + window]`` (-1: empty), and attends the whole ring with a mask made from those positions
by the window's ``Visibility``: no Python number and no data-dependent branch in the step.

Longer updates (a prefill) and rollback take the eager window's paths, which read the counts as
ints; ``slot_positions`` is then recomputed from them. The attention ignores the model's mask: it
covers absolute positions, which a fixed shape cannot, so a batch whose rows are padded differently
(left-padded prompts of several lengths) is refused at its prefill.
"""

from __future__ import annotations

import torch

from ..attention import Reads
from ..errors import UnsupportedOperation
from .fixed import Counter, CountedStore, FixedDecodeAttention, mark_static
from .store import Fixed
from .window import WindowLayer


class FixedWindowLayer(FixedDecodeAttention, WindowLayer):
    """``window`` whose decode steps keep fixed shapes (see the module docstring). Same kind,
    options and saved state as ``WindowLayer``."""

    def __init__(self, window: int, sinks: int = 0, initial_capacity: int = 256) -> None:
        self.seen_counter = Counter()
        super().__init__(window, sinks, initial_capacity)
        self.store = CountedStore(growth=Fixed(self.max_length))
        #: Absolute position held by each ring slot ``[sinks + window]``, -1 for an empty slot.
        self.slot_positions = torch.full((self.max_length,), -1, dtype=torch.long)
        mark_static(self.slot_positions)

    @classmethod
    def like(cls, layer: WindowLayer, tokens: int | None = None) -> FixedWindowLayer:
        """An empty twin of the empty ``layer`` (its ring is its size: ``tokens`` is ignored)."""
        return cls(**layer.options())

    def _append(self, key, value):
        if key.shape[2] != 1 or self.journal is not None:
            reads = super()._append(key, value)
            self._place(key.device)
            self._recount_positions()
            return reads
        self._ensure_full_buffers(key, value)
        keys, values = self._ring()
        seen = self.seen_counter.value
        query_at = seen.clone()  # the new token's position: seen before this update
        slot = torch.where(seen < self.sinks, seen, self.sinks + (seen - self.sinks).remainder(self.window)).view(1)
        keys.index_copy_(2, slot, key)
        values.index_copy_(2, slot, value)
        self.slot_positions.index_copy_(0, slot, seen.view(1))
        count = self.store.count.value
        count.copy_(torch.clamp(count + 1, max=self.max_length))
        seen.add_(1)
        return Reads(keys, values, self.slot_positions, query_at, 1, visibility=self.visibility)

    def _ensure_full_buffers(self, key, value) -> None:
        super()._ensure_full_buffers(key, value)
        self._place(key.device)

    def _place(self, device: torch.device) -> None:
        """Move the counters to the ring's device (once: eager code only)."""
        if self.slot_positions.device != device:
            self.seen_counter.to(device)
            self.slot_positions = self.slot_positions.to(device)
            mark_static(self.slot_positions)

    def _recount_positions(self) -> None:
        """``slot_positions`` from the int counts, after an eager update, trim or load."""
        if self.store.allocated:
            n = self.length
            self.slot_positions.fill_(-1)
            self.slot_positions[:n] = self._slot_positions(self.seen, n, self.slot_positions.device)

    def _eager_mask(self, mask):
        """None: the model's mask covers absolute positions only up to the ring's size (module
        docstring). Rows padded differently would need it: refused (checked on a prefill)."""
        if mask is not None and mask.shape[0] > 1 and not torch.equal(mask, mask[:1].expand_as(mask)):
            raise UnsupportedOperation(
                "a window layer made with compile=True attends without the model's mask, so it cannot serve "
                "a batch whose rows are padded differently; make the cache without compile=True for it"
            )
        return None

    def _decode_mask(self, query_at, mask):
        return self.visibility(query_at.view(1, 1), self.slot_positions.view(1, -1))  # [1, sinks + window]

    def trim(self, n: int) -> None:
        super().trim(n)
        self._recount_positions()

    def load_state(self, state) -> None:
        super().load_state(state)
        self._recount_positions()

    def reset(self) -> None:
        super().reset()
        self.slot_positions.fill_(-1)
