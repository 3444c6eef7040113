"""The one slot store under every layer: named tensors ``[B, Hkv, C, ...]`` sharing ``C`` slots.

A layer decides what its slots mean (a position in order, a ring slot, a kept token, a block of
codes) and which of them are in use; the store owns the tensors: allocation, growth by a strategy,
writes and views of runs of slots, writes at an index of slots, rebatching, trimming, and the
content as plain tensors with the check a saved state must pass. ``length`` counts the slots in
use, always the run ``[0, length)`` (a ring or an evicting layer fills it and then writes inside).

Growth strategies answer one question, "how many slots for ``need``, given ``current`` slots
(None: nothing allocated yet)?", or refuse:
``Geometric`` (doubling from an initial capacity), ``Fixed`` (one capacity, ``CacheFullError``
past it), ``UpTo`` (doubling up to a maximum), ``Exact`` (what is needed, no more). A layer with
its own sizing rule (eviction budgets, the concatenation baseline) calls ``allocate`` with the
capacity it wants.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CacheFullError, ShapeError
from .checks import Geometry

#: name -> (shape after ``[B, Hkv, C]``, dtype) of each tensor of a store.
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def full_precision(g: Geometry) -> Layout:
    """Keys ``[B, Hkv, C, D]`` and values ``[B, Hkv, C, Dv]`` as they came."""
    return {"keys": ((g.key_dim,), g.dtype), "values": ((g.value_dim,), g.dtype)}


# ---- growth strategies ------------------------------------------------------------------------


class Geometric:
    """``factor`` times the capacity when full; a first allocation, or a chunk larger than that,
    gets the next multiple of ``initial`` above it (a prompt that exactly filled an allocation
    would otherwise force a reallocation on the first decode step)."""

    zeroed = False

    def __init__(self, initial: int, factor: float) -> None:
        self.initial, self.factor = initial, factor

    def capacity(self, need: int, current: int | None, length: int) -> int:
        grown = None if current is None else int(current * self.factor)
        return grown if grown is not None and grown >= need else (need // self.initial + 1) * self.initial


class Fixed:
    """One capacity, allocated zeroed; more than it raises ``CacheFullError``."""

    zeroed = True

    def __init__(self, capacity: int) -> None:
        self.fixed = capacity

    def capacity(self, need: int, current: int | None, length: int) -> int:
        if need > self.fixed:
            raise CacheFullError(
                f"static cache is full: capacity {self.fixed} tokens, {length} stored, "
                f"{need - length} more requested (needs {need}). Nothing was written; "
                f"make the cache with a larger capacity."
            )
        return self.fixed


class Exact:
    """Exactly the slots needed (the concatenation baseline allocates on every append)."""

    zeroed = False

    def capacity(self, need: int, current: int | None, length: int) -> int:
        return need


class UpTo:
    """Doubling from ``initial`` (or what a chunk needs), never above ``maximum``."""

    zeroed = False

    def __init__(self, initial: int, maximum: int) -> None:
        self.initial, self.maximum = initial, maximum

    def capacity(self, need: int, current: int | None, length: int) -> int:
        return min(max(need, self.initial if current is None else 2 * current), self.maximum)


# ---- the store ----------------------------------------------------------------------------------


class SlotStore:
    """Named tensors ``[B, Hkv, C, ...]`` (``layout`` gives each one's trailing shape and dtype
    for a geometry), the run ``[0, length)`` of slots in use, and ``reallocations``: how many
    times they were (re)allocated, the first allocation included."""

    def __init__(self, layout: Callable[[Geometry], Layout] = full_precision, growth=None) -> None:
        self.layout = layout
        self.growth = growth
        self.tensors: dict[str, torch.Tensor] = {}
        self.capacity = 0
        self.length = 0
        self.reallocations = 0

    @property
    def allocated(self) -> bool:
        return bool(self.tensors)

    @property
    def batch(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # ---- allocation -------------------------------------------------------------------------

    def check_room(self, need: int) -> None:
        """Raise (the growth strategy's refusal) unless ``need`` slots can be had; changes nothing."""
        if need > self.capacity:
            self.growth.capacity(need, self.capacity if self.allocated else None, self.length)

    def reserve(self, need: int, geometry: Geometry) -> None:
        """Make room for ``need`` slots by the growth strategy (which may refuse, changing nothing)."""
        if need > self.capacity or not self.allocated:
            capacity = self.growth.capacity(need, self.capacity if self.allocated else None, self.length)
            self.allocate(capacity, geometry, zeroed=self.growth.zeroed)

    def allocate(self, capacity: int, geometry: Geometry, *, keep: bool = True, zeroed: bool = False) -> None:
        """Switch to new tensors of ``capacity`` slots for ``geometry``; the slots in use are copied
        over when ``keep`` and the batch is unchanged, else the store starts empty."""
        g = geometry
        make = torch.zeros if zeroed else torch.empty
        new = {
            name: make(g.batch, g.heads, capacity, *trailing, dtype=dtype, device=g.device)
            for name, (trailing, dtype) in self.layout(g).items()
        }
        if keep and self.allocated and self.length and self.batch == g.batch:
            for name, t in new.items():
                t.narrow(2, 0, self.length).copy_(self.tensors[name].narrow(2, 0, self.length))
        else:
            self.length = 0
        self._switch(new)
        self.reallocations += 1

    def adopt(self, tensors: dict[str, torch.Tensor]) -> None:
        """Use the caller's tensors as the store (empty; not counted as an allocation)."""
        self._switch(dict(tensors))
        self.length = 0

    def drop(self) -> None:
        """Let go of the tensors: capacity 0, nothing in use."""
        self.tensors, self.capacity, self.length = {}, 0, 0

    def _switch(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.capacity = next(iter(tensors.values())).shape[2] if tensors else 0

    # ---- reading and writing slots ------------------------------------------------------------

    def run(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Slots ``start:stop`` of tensor ``name``, a view ``[B, Hkv, stop - start, ...]``."""
        return self.tensors[name].narrow(2, start, stop - start)

    def runs(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        return {name: t.narrow(2, start, stop - start) for name, t in self.tensors.items()}

    def in_use(self) -> dict[str, torch.Tensor]:
        """The slots in use of every tensor, as views: the store's content as plain tensors."""
        return self.runs(0, self.length)

    def write(self, start: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy each ``[B, Hkv, n, ...]`` into slots ``start:start + n`` (``length`` unchanged)."""
        for name, t in tensors.items():
            self.tensors[name].narrow(2, start, t.shape[2]).copy_(t)

    def append(self, tensors: dict[str, torch.Tensor]) -> None:
        """Write after the slots in use (the room must be reserved) and count them in use."""
        n = 0
        for name, t in tensors.items():
            n = t.shape[2]
            self.tensors[name].narrow(2, self.length, n).copy_(t)
        self.length += n

    def put(self, slots: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        """Copy each ``[B, Hkv, len(slots), ...]`` into the slots ``slots`` ``[M]`` (ring, evicted slots)."""
        for name, t in tensors.items():
            self.tensors[name].index_copy_(2, slots, t)

    def trim(self, n: int) -> None:
        """Stop using the last ``n`` slots."""
        self.length -= n

    def shrink(self) -> None:
        """Narrow every tensor to the slots in use (a view: no copy, capacity becomes ``length``)."""
        self._switch(self.in_use())

    # ---- batch work ---------------------------------------------------------------------------

    def rebatch(self, fn, capacity: int | None = None, *, count: bool = True) -> int:
        """Replace the slots in use of every tensor by ``fn(slots)`` (``[B, ...]`` -> ``[B', ...]``).

        The same batch is written back in place, keeping the tensors (and their owner); another
        batch gets new tensors of ``max(capacity, length)`` slots (default: a fixed capacity is
        kept, a growing store gets just its slots in use), counted as a reallocation when
        ``count``. Returns the new batch size."""
        live = {name: fn(t) for name, t in self.in_use().items()}
        batch = next(iter(live.values())).shape[0]
        if batch == self.batch:
            self.write(0, live)
            return batch
        if capacity is None:
            capacity = self.capacity if isinstance(self.growth, Fixed) else self.length
        capacity = max(capacity, self.length)
        old, self.tensors = self.tensors, {}
        new = {}
        for name, t in live.items():
            like = old.pop(name)  # freed before the next tensor is allocated: the lower peak
            new[name] = like.new_empty(batch, like.shape[1], capacity, *like.shape[3:])
            new[name].narrow(2, 0, self.length).copy_(t)
            del like
        self._switch(new)
        self.reallocations += 1 if count else 0
        return batch

    # ---- state --------------------------------------------------------------------------------

    def expected(self, geometry: Geometry, slots: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Full shape and dtype of each tensor holding ``slots`` slots for ``geometry``."""
        g = geometry
        return {name: ((g.batch, g.heads, slots, *trailing), dtype) for name, (trailing, dtype) in self.layout(g).items()}

    def check(self, what: str, tensors: dict[str, torch.Tensor], geometry: Geometry, slots: int) -> None:
        """Raise unless ``tensors`` holds every tensor of this layout, ``slots`` slots of ``geometry``,
        with the right shape and dtype. ``what`` names the owner in the messages."""
        want = self.expected(geometry, slots)
        missing = [name for name in want if name not in tensors]
        if missing:
            raise ValueError(f"{what} state lacks {missing}")
        for name, (shape, dtype) in want.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ShapeError(
                    f"{what} state: {name!r} should be {dtype} of shape {tuple(shape)}, "
                    f"got {t.dtype} of shape {tuple(t.shape)}"
                )

    def load(self, tensors: dict[str, torch.Tensor], geometry: Geometry, capacity: int) -> None:
        """Hold a copy of ``tensors`` (checked) in new tensors of ``capacity`` slots."""
        self.allocate(capacity, geometry, keep=False)
        n = next(iter(tensors.values())).shape[2] if tensors else 0
        self.write(0, {name: tensors[name] for name in self.tensors})
        self.length = n
