"""How many slots an evicting layer keeps after some number of tokens: its budget (a count, or
below 1 a share of the tokens seen), the protected sinks and recent tokens, and the policy's
sizing by the layer's depth (PyramidKV: ``Policy.layer_budget``); and how many it allocates.

A count is allocated once, at its size. A share grows with the sequence, a slot every few tokens:
its store is allocated with room to grow of :data:`GROWTH_ROOM` of what it keeps (at least
:data:`MIN_ROOM` steps' worth), so its bytes stay within a few percent of what a count of the same
size would hold, and a sequence of n tokens reallocates O(log n) times, not once per slot.
Doubling would keep up to twice the bytes the budget promises."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .policies import Policy


def check_budget(size: int | float, unit: str = "token") -> int | float:
    """A budget as kept: a whole count of ``unit`` >= 1 (int), or a share of the tokens seen in (0, 1)."""
    if isinstance(size, float) and not size.is_integer():
        if not 0 < size < 1:
            raise ValueError(f"a fractional budget must be in (0, 1) (a share of the tokens seen), got {size}")
        return size
    if int(size) < 1:
        raise ValueError(f"budget must be >= 1 {unit} (or a fraction in (0, 1)), got {size}")
    return int(size)


#: Room a growing budget allocates beyond what it needs, as a share of that (1/16: ~6% of bytes).
GROWTH_ROOM = 1 / 16
#: ... and at least this many steps of slots, so small stores do not reallocate every step.
MIN_ROOM = 8


def slots_to_allocate(need: int, growing: bool, step: int = 1) -> int:
    """Capacity for a store that must hold ``need`` slots: exactly that for a fixed budget; with
    room to grow for a budget that ``growing`` with the sequence, ``step`` slots per token."""
    if not growing:
        return need
    return need + max(MIN_ROOM * step, math.ceil(need * GROWTH_ROOM))


def holds_wrong_size(capacity: int, need: int, growing: bool, step: int = 1) -> bool:
    """Whether a store of ``capacity`` slots should be reallocated to hold ``need``: too small, or
    larger than ``slots_to_allocate`` would make it (after a trim, a load or a batch change)."""
    return capacity < need or capacity > slots_to_allocate(need, growing, step)


@dataclass
class Budget:
    """``size``: tokens (int) or a share of the tokens seen (float in (0, 1)); ``recent`` None
    means the policy's default; ``depth``: (layer index, layer count) when the policy sizes by it."""

    size: int | float
    sinks: int
    recent: int | None
    policy: Policy
    depth: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.size = check_budget(self.size)
        if isinstance(self.size, int) and self.sinks + (self.recent or 0) >= self.size:
            raise ValueError(
                f"sinks ({self.sinks}) + recent ({self.recent}) must be less than the budget "
                f"({self.size}), or nothing is left for the policy to choose"
            )

    def place(self, index: int, count: int) -> None:
        """Record layer ``index`` of ``count`` (checked) if the policy sizes its budget by depth."""
        if index >= count:
            raise ValueError(f"layer must be below layers ({count}), got {index}")
        if self.policy.by_depth:
            self.depth = (index, count)

    def uniform(self, seen: int) -> int:
        """The same for every layer: the budget, or its share of ``seen``."""
        if isinstance(self.size, int):
            return self.size
        return max(1, math.ceil(self.size * seen))

    def recent_now(self, seen: int) -> int:
        """Recent tokens protected after ``seen`` tokens."""
        return self.recent if self.recent is not None else self.policy.recent_for(self.uniform(seen))

    def now(self, seen: int) -> int:
        """Slots this layer keeps after ``seen`` tokens."""
        uniform = self.uniform(seen)
        if self.depth is None:
            return uniform
        return self.policy.layer_budget(uniform, self.sinks + self.recent_now(seen), self.depth)
