"""How many slots an evicting layer keeps after some number of tokens: its budget (a count, or
below 1 a share of the tokens seen), the protected sinks and recent tokens, and the policy's
sizing by the layer's depth (PyramidKV: ``Policy.layer_budget``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..policies import Policy


def check_budget(size: int | float, unit: str = "token") -> int | float:
    """A budget as kept: a whole count of ``unit`` >= 1 (int), or a share of the tokens seen in (0, 1)."""
    if isinstance(size, float) and not size.is_integer():
        if not 0 < size < 1:
            raise ValueError(f"a fractional budget must be in (0, 1) (a share of the tokens seen), got {size}")
        return size
    if int(size) < 1:
        raise ValueError(f"budget must be >= 1 {unit} (or a fraction in (0, 1)), got {size}")
    return int(size)


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
