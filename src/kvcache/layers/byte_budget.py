"""What ``auto`` and ``auto-heads`` share: a budget in bytes (a share of an fp32 cache, or bytes
for the whole cache split equally by its layers), the rule a storage is chosen by, and the move of
a layer's candidate slots into the storage chosen.

``ByteBudget`` is a mixin for an evicting layer (``EvictingLayer`` or ``AdaptiveLayer``) whose
``choose(slots, weights)`` returns a ``Choice`` and whose slots are laid out in
``_slot_geometry()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .checks import Geometry
from .options import Option, number
from .slots import ROTATED, STORAGES
from .state import LayerState
from .tiers import SOURCE, mixed_name

#: How a case's error is scored: ``mass``, the first-order estimate (dropped mass plus the
#: mass-weighted relative coding error); ``output``, the change of the window's mean attention output
#: measured for dropping and for coding the values (keys still first-order); ``attention``, the
#: change of the window's attention outputs, measured with its queries (``auto_measure.py``; ``auto`` only).
RULES = ("mass", "output", "attention")
#: The storages a layer chooses among, finest first, per ``codes=``: plain codes, or codes of
#: rotated keys and values (``formats/rotated.py``).
LADDERS = {"plain": STORAGES, "rotated": ROTATED}
#: The options both kinds take (each adds its policy's own, after ``bytes``): the budget, where the
#: layer starts, how a case is scored and how cases compare, and the ladder.
BYTE_BUDGET_OPTIONS = {
    "bytes": Option(number, least=0, inclusive=False),
    "storage": Option(str),
    "rule": Option(str),
    "drop": Option(float, least=0, inclusive=False),
    "tolerance": Option(float, least=0),
    "margin": Option(float, least=0),
    "codes": Option(str),
    "fine_share": Option(float, least=0, inclusive=False),
}
#: The coding part a case may carry, by default, and still be compared by what it drops alone:
#: between what int4 codes weigh on SmolLM2 (about 0.12) and what int2 codes weigh (about 0.6). Set
#: before any answer was run (docs/quality.md, "Tokens first"), on the ``mass`` rule's scale, the
#: only rule it is the default of; ``drop=w`` compares by distortion.
TOLERANCE = 0.3
#: Dropped parts closer than this are equal under ``tolerance`` (the finer storage wins): a mass
#: summed in float32 over every candidate is 1 only to about this.
SAME_DROP = 1e-5


def mixed_ladder(ladder: tuple[str, ...], share: float) -> tuple[str, ...]:
    """``ladder`` with, between each storage and the next coarser one, the mixed storage of the two
    (``share`` of the kept slots in the finer): finest first, each no finer than the one before."""
    out = [ladder[0]]
    for finer, coarser in zip(ladder, ladder[1:]):
        out += [mixed_name(finer, share, coarser), coarser]
    return tuple(out)


def fp32_bytes(g: Geometry) -> int:
    """Bytes of one token's key and value per row and KV head in an fp32 cache."""
    return 4 * (g.key_dim + g.value_dim)


class ByteBudget:
    """See the module docstring. Attributes: ``byte_budget`` (float below 1: a share; int: bytes),
    ``layer_count``, ``rule``, ``drop``, ``tolerance``, ``margin``, ``codes`` and its ``ladder`` (the storages
    chosen among, finest first), ``choice`` (the last ``Choice``, None before one)."""

    def _init_budget(self, size: int | float, rule: str, drop: float | None = None, codes: str = "plain", storage: str = "full",
                     tolerance: float | None = None, margin: float | None = None, fine_share: float | None = None) -> None:  # fmt: skip
        """``size`` as the constructor's ``check_options`` reads it; ``drop``, ``tolerance`` and
        ``margin`` as given, read here: with neither ``drop`` nor ``tolerance`` cases are compared
        by what they drop within :data:`TOLERANCE` (on the ``mass`` rule's scale; the measuring
        rules, whose coding parts are smaller, compare by distortion); ``drop`` alone compares by
        distortion (``drop=1`` with a tolerance, as a layer's ``options()`` record it, is the
        tolerance's); ``margin`` (None: 0) widens a tolerance. ``storage``: where the layer starts,
        which must be on the ladder ``codes`` names; ``fine_share``: the ladder holds mixed
        storages too (``mixed_ladder``), weighed by ``mass``."""
        if drop is not None:
            drop = self.check_options(drop=drop)["drop"]
        if tolerance is not None:
            tolerance = self.check_options(tolerance=tolerance)["tolerance"]
        if margin is not None:
            margin = self.check_options(margin=margin)["margin"]
        if tolerance is not None and drop not in (None, 1.0):
            raise ValueError(f"drop={drop:g} and tolerance={tolerance:g} are two ways to compare cases; give one")
        if margin is not None and tolerance is None and drop is not None:
            raise ValueError(f"margin={margin:g} widens a tolerance's comparison of dropped mass; drop={drop:g} compares by distortion")
        if tolerance is None and drop is None and rule == "mass":
            tolerance = TOLERANCE
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        if codes not in LADDERS:
            raise ValueError(f"codes must be one of {tuple(LADDERS)}, got {codes!r}")
        self.codes, self.ladder = codes, LADDERS[codes]
        self.fine_share = None
        if fine_share is not None:
            self.fine_share = self.check_options(fine_share=fine_share)["fine_share"]
            if not self.fine_share < 1:
                raise ValueError(f"fine_share is the share of kept slots a mixed storage keeps finer, in (0, 1), got {fine_share}")
            if rule != "mass":
                raise ValueError(f"fine_share weighs mixed storages by the mass rule (its parts add up); rule={rule!r} does not")
            self.ladder = mixed_ladder(self.ladder, self.fine_share)
        if storage not in self.ladder:
            raise ValueError(f"storage must be one of {self.ladder} (codes={codes}), got {storage!r}")
        self.rule = rule
        self.drop = 1.0 if drop is None else float(drop)
        self.tolerance = tolerance
        self.margin = margin
        self.byte_budget = size
        self.layer_count = 1
        self.choice = None

    def at_depth(self, index: int | None, count: int | None) -> None:
        """Record the layer's place: a budget in bytes is shared equally by ``count`` layers."""
        if count is not None:  # (a saved layer's options give the count alone)
            self.layer_count = self.check_options(layers=count)["layers"]

    @property
    def _growing(self) -> bool:
        return isinstance(self.byte_budget, float)

    def allowed_bytes(self, seen: int, g: Geometry | None = None) -> float:
        """Bytes one (row, KV head) of this layer may take after ``seen`` tokens."""
        g = g or self.geometry
        if isinstance(self.byte_budget, float):
            return self.byte_budget * seen * fp32_bytes(g)
        return self.byte_budget / self.layer_count / (g.batch * g.heads)

    def _best(self, estimates: list[Any]) -> Any:
        """The case with the lowest ``drop * dropped + coding`` (the first, the finer storage, of
        equals). With ``tolerance``: of the cases whose ``bounded`` coding (a mixed storage's worse
        part's) is at most ``tolerance``, the finest that drops at most ``margin`` more than the
        least any of them drops (so with no margin, the one that drops the least, the finer of
        equals); if none is, the lowest ``coding``. ``estimates`` come finest first."""
        if self.tolerance is None:
            return min(estimates, key=lambda e: self.drop * e.dropped + e.coding)
        within = [e for e in estimates if e.bounded <= self.tolerance]
        if not within:
            return min(estimates, key=lambda e: e.coding)
        least = min(e.dropped for e in within)
        return next(e for e in within if e.dropped <= least + max(self.margin or 0.0, SAME_DROP))

    def _slot_geometry(self) -> Geometry:
        """The geometry the layer's slots are encoded in."""
        return self.geometry

    def _decide(self, slots: dict[str, torch.Tensor], weights: torch.Tensor, queries: torch.Tensor | None = None) -> None:
        """Score candidate ``slots`` by a pass's ``weights`` (and its window's ``queries``, for a
        rule that measures), choose their storage, move them into it and keep the best."""
        slots["scores"] = self._scored(weights, slots)
        choice = self.choose(slots, weights) if queries is None else self.choose(slots, weights, queries)
        if choice.storage != self.stored_as:
            self._recode(slots, choice.storage)
        self.choice = choice
        self._keep_best(slots, self._keep_now())

    def _recode(self, slots: dict[str, torch.Tensor], storage: str) -> None:
        """Rewrite candidate ``slots`` in place into ``storage`` (one, or a mixed one), which the
        layer then stores, in a new store."""
        n = slots["positions"].shape[2]
        keys, values = self.storage.decode(slots, n, self._slot_geometry())
        for name in (*self.storage.names, SOURCE):
            slots.pop(name, None)
        self._enter_storage(storage)
        slots.update(self.storage.encode(keys, values))

    @staticmethod
    def spec_options_of(options: Any) -> Any:
        """What of a layer's ``options()`` its spec fixes: all but the storage, the layer's own
        choice (a file saved before ``rule``, ``drop``, ``codes``, ``tolerance`` or ``margin`` existed scored
        by ``mass``, ``drop=1``, over plain codes, with no tolerance and no margin)."""
        defaults = {"rule": "mass", "drop": 1.0, "codes": "plain", "tolerance": None, "margin": None, "fine_share": None}
        return {**defaults, **{k: v for k, v in options.items() if k != "storage"}} if isinstance(options, Mapping) else options

    def _state_storage(self, state: LayerState, default: str) -> str:
        """The storage a state's options name (``default`` where they name none), checked."""
        storage = state.options.get("storage", default) if isinstance(state.options, Mapping) else default
        if storage not in self.ladder:
            raise ValueError(f"{self.kind} layer state: unknown storage {storage!r}; one of {self.ladder} (codes={self.codes})")
        return storage

    def _load_in_storage(self, state: LayerState, load: Callable[[LayerState], None]) -> None:
        """``load(state)`` with the layer in the state's storage; on failure the layer is as before."""
        self.check_state(state)
        previous = self.storage, self.store
        self._enter_storage(self._state_storage(state, "full"))
        try:
            load(state)
        except Exception:
            self.storage, self.store = previous
            raise
        self.choice = None

    def _in_storage(self, name: str):
        """A context in which the layer holds storage ``name`` in a new store, then what it held."""
        from contextlib import contextmanager

        @contextmanager
        def entered():
            previous = self.storage, self.store, self.geometry
            self._enter_storage(name)
            try:
                yield
            finally:
                self.storage, self.store, self.geometry = previous

        return entered()
