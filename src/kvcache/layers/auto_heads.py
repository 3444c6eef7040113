"""``auto-heads:bytes=...``: ``auto``'s byte budget and choice of storage over Ada-KV's budget
shared by a layer's KV heads.

``auto`` (``auto.py``) keeps the same number of slots in every KV head of a layer. This kind keeps
the slots as Ada-KV does (``adaptive.py``: one flat store per batch row, the row keeping its best
``Hkv * budget`` slots whatever their head, each head at least ``floor`` of its share and the
observation window), and sizes and codes them as ``auto`` does:

- ``bytes``: below 1 a share of an fp32 cache of every token seen, 1 or more bytes for the whole
  cache, shared equally by its attention layers.
- The slots a layer keeps are the most whose flat store (each slot's codes, position int32, head
  int16, score float32; room to grow and a decode step's spare per head) fits the budget in the
  storage chosen.
- The rule is ``auto``'s (``auto.weigh``), applied whenever a pass overflows the layer: for each
  storage no finer than the present one, the slots it affords, the ones Ada-KV would keep in that
  many, and ``estimate = dropped + coding`` from each candidate's share of its own head's window
  weights; the lowest wins (a tie goes to the finer storage). Here the kept set is chosen across
  heads, so a head whose attention is spread keeps more slots and drops less mass.

Every slot of a layer is in the same storage (the flat store is one run). ``codes=rotated``
chooses among the storages of rotated codes, as ``auto`` does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .adaptive import AdaptiveLayer
from .auto import Choice, Estimate, weigh_storage
from .budget import slots_to_allocate
from .byte_budget import BYTE_BUDGET_OPTIONS, ByteBudget
from .checks import Geometry
from .options import Option
from .shared_budget import check_flat_state, keep_across_heads
from .slots import get_storage
from .state import LayerState
from .tiers import mean_slot_bytes, mixed_parts

#: Bytes of a flat slot's tags: position (int32), head (int16), score (float32).
_TAGS = 4 + 2 + 4


def flat_slot_bytes(storage: str, g: Geometry) -> int:
    """Bytes of one slot of a flat store in ``storage``: its coded key and value and its tags."""
    layout = get_storage(storage).layout(g)
    return _TAGS + sum(int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in layout.values())


def flat_slots_within(allowed: float, per_slot: int, heads: int, growing: bool) -> int:
    """The most slots per head ``n`` a flat store of ``heads`` heads can keep (allocating
    ``slots_to_allocate(heads * (n + 1))``) within ``allowed`` bytes per head; 0 if none."""

    def fits(n: int) -> bool:
        return slots_to_allocate(heads * (n + 1), growing, heads) * per_slot <= allowed * heads

    lo, hi = 0, max(1, int(allowed / per_slot))
    while lo < hi:  # the largest n that fits (fits is monotone)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


class AutoHeadsLayer(ByteBudget, AdaptiveLayer):
    """See the module docstring."""

    kind = "auto-heads"
    spec_order = 6
    spec_options = {"bytes": BYTE_BUDGET_OPTIONS["bytes"], "window": Option(int, least=1), "pool": Option(int, least=1),
                    "floor": Option(float, least=0.0), **BYTE_BUDGET_OPTIONS}  # fmt: skip
    #: ``budget``: the adaptive layer's own argument, which this kind sets itself from ``bytes``.
    keyword_options = {"layer": Option(int, least=0), "layers": Option(int, least=1), "budget": AdaptiveLayer.spec_options["budget"]}
    required_options = ("bytes",)

    def __init__(
        self,
        bytes: int | float,  # noqa: A002 - the spec's word
        window: int = 32,
        pool: int = 7,
        floor: float = 0.2,
        storage: str = "full",
        layer: int | None = None,
        layers: int | None = None,
        rule: str = "mass",
        drop: float | None = None,
        codes: str = "plain",
        tolerance: float | None = None,
        margin: float | None = None,
        fine_share: float | None = None,
    ) -> None:
        size = self.check_options(bytes=bytes)["bytes"]
        if rule == "attention":
            raise ValueError("auto-heads: rule='attention' is auto's only (it measures per KV head); use rule='mass' or 'output'")
        self._init_budget(size, rule, drop, codes, storage, tolerance, margin, fine_share)
        start = "full" if mixed_parts(storage) else storage
        super().__init__(1, window, pool, floor, start)
        if start != storage:  # a saved layer's mixed storage
            self._enter_storage(storage)
        if layers is not None:
            self.at_depth(layer, layers)

    def budget_now(self, seen: int | None = None) -> int:
        """Slots per head, on average, after ``seen`` tokens in the present storage; at least one."""
        if self.geometry is None:
            return 1
        seen = self.seen if seen is None else seen
        return self._budget_in(self.stored_as, seen, self.geometry)

    def _budget_in(self, storage: str, seen: int, g: Geometry) -> int:
        per_slot = mean_slot_bytes(storage, lambda name: flat_slot_bytes(name, g))
        return max(1, flat_slots_within(self.allowed_bytes(seen, g), per_slot, g.heads, self._growing))

    # ---- the decision ---------------------------------------------------------------------------

    def _settle(self, weights: torch.Tensor | None) -> None:
        layout, self._by_head = self._by_head, None
        if weights is not None and layout is not None:
            weights = layout.flat(weights)  # [B, Hkv, W] per cell -> [B, 1, N] per flat slot
        if self._set is not None and weights is not None:
            s, self._set = self._set, None
            self._decide(s, weights)
            return
        super(AdaptiveLayer, self)._settle(weights)

    def choose(self, slots: dict[str, torch.Tensor], weights: torch.Tensor) -> Choice:
        """The storage for candidate ``slots`` (flat, ``[B, 1, N]``) scored by a pass's ``weights``
        ``[B, 1, N]`` (the module docstring's rule)."""
        g, flat = self.geometry, self._flat_geometry()
        n = slots["positions"].shape[2]
        keys, values = self.storage.decode(slots, n, flat)
        heads = slots["heads"].long()  # [B, 1, N]
        mass = weights.float().clamp_min(0)
        per_head = torch.zeros(mass.shape[0], 1, g.heads, device=mass.device).scatter_add_(2, heads, mass)
        mass = mass / per_head.gather(2, heads).clamp_min(torch.finfo(torch.float32).tiny)
        estimates = []
        for name in self.ladder[self.ladder.index(self.stored_as) :]:
            count = self._budget_in(name, self.seen, g)
            keep = min(n, g.heads * count)
            recent = min(self.window, count // 2)
            floor = max(1, int(self.floor * (count - recent)))
            kept = keep_across_heads(slots["scores"], slots["heads"], slots["positions"], keep, g.heads, floor, self.seen - recent)
            estimates.append(weigh_storage(name, count, kept, self._rank(slots), slots["positions"], mass, keys, values, g.heads, flat,
                                           self.rule, slots["heads"]))  # fmt: skip
        best = self._best(estimates) if estimates else Estimate(self.ladder[-1], 1, 1.0, 0.0)
        return Choice(best.storage, best.slots, self.seen, tuple(estimates))

    def _slot_geometry(self) -> Geometry:
        return self._flat_geometry()

    # ---- state ----------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The spec's options and the storage chosen (``storage``); a file's loader compares the
        spec's options only (``spec_options_of``)."""
        return {"bytes": self.byte_budget, "window": self.window, "pool": self.pool, "floor": self.floor,
                "storage": self.stored_as, "layers": self.layer_count, "rule": self.rule, "drop": self.drop, "codes": self.codes,
                "tolerance": self.tolerance, "margin": self.margin, "fine_share": self.fine_share}  # fmt: skip

    def check_state(self, state: LayerState) -> None:
        """The flat store's checks, read in the state's storage (its slots counted against the
        budget that storage affords in the state's geometry)."""
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        seen = int(state.seen)
        if seen < 0:
            raise ValueError(f"auto-heads layer state: seen must be >= 0, got {seen}")
        storage = self._state_storage(state, self.stored_as)
        if not state.tensors:
            return
        t = state.tensors
        with self._in_storage(storage):  # the store's layout is the state's storage's
            if self.tiered:
                g = self._check_tiered_state(t, seen, seen, 0)  # every check but the budget's
            else:
                check_flat_state(t, self.storage, self.store, seen, seen)
                g = self.storage.geometry(dict(t))
        n = sum(x.shape[2] for name, x in t.items() if name in ("positions", "fine.positions", "coarse.positions"))
        kv_heads = t["head_lengths"].shape[1]
        g = replace(g, batch=t["head_lengths"].shape[0], heads=kv_heads)
        budget = self._budget_in(storage, seen, g)
        if n > kv_heads * min(seen, budget + 1):
            raise ValueError(f"auto-heads layer state holds {n} slots for {kv_heads} heads after {seen} tokens, budget {budget} per head")

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self._load_in_storage(state, super().load_state)
