"""An undo log for ring buffers: what speculative decoding needs to take back rejected tokens.

Assisted generation and prompt-lookup decoding append a few candidate tokens in one update, then
remove the rejected ones with ``crop(-n)``. A ring buffer has by then written those candidates over
the oldest slots of the window, which the shorter sequence still needs. While recording, each
update leaves an ``Entry``: the slots it overwrote with their old content, and a copy of the
tokens it appended. Undoing an entry puts the old slots back (the ring is exactly as before the
update); a partial rollback then re-appends the update's first tokens.

Memory: an entry holds ``2 * n`` slots of keys and values for an update of ``n`` tokens (at most
``n`` overwritten, ``n`` appended). ``Hugging Face``'s ``crop`` closes a step, so the log is
emptied at each trim; without trims it keeps the newest entries up to ``limit`` tokens (always the
newest entry, whatever its size).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    """One update: ``first`` position, ``length_before`` slots stored before it, the ``slots`` it
    overwrote ``[M]`` with their old ``keys``/``values`` ``[B, Hkv, M, D]``, and the appended tokens
    ``new_keys``/``new_values`` ``[B, Hkv, n, D]``."""

    first: int
    length_before: int
    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.new_keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.keys, self.values, self.new_keys, self.new_values))


class Journal:
    """The entries of the updates since the last trim, newest last."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.entries: deque[Entry] = deque()

    @property
    def tokens(self) -> int:
        """How many of the newest tokens can be taken back."""
        return sum(e.tokens for e in self.entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def record(
        self, first: int, length_before: int, slots: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, key, value
    ) -> None:
        """Log an update about to write ``key``/``value`` into ``slots`` of ``kbuf``/``vbuf`` (call before writing)."""
        old_k, old_v = kbuf.index_select(2, slots), vbuf.index_select(2, slots)
        self.entries.append(Entry(first, length_before, slots, old_k, old_v, key.clone(), value.clone()))
        total = self.tokens
        while len(self.entries) > 1 and total > self.limit:
            total -= self.entries.popleft().tokens

    def clear(self) -> None:
        self.entries.clear()

    def rebatch(self, fn) -> None:
        for e in self.entries:
            e.keys, e.values, e.new_keys, e.new_values = (fn(t) for t in (e.keys, e.values, e.new_keys, e.new_values))
