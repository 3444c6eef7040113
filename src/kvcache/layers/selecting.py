"""What eviction layers share: keep a selection of slots within a budget, chosen after attention.

An evicting layer (one policy's scores per KV head, ``evicting.py``) and an Ada-KV layer (one
budget shared by a layer's heads over a flat store, ``adaptive.py``) store the same way:

- an update that fits the store's spare room is appended and attended where it lies;
- one that does not is attended as a temporary concatenation of the kept slots and the new
  tokens (the new ones in full precision), held as a candidate set (``_set``) until its
  attention settles it, and nothing that reads or reshapes the store may come in between;
- settling scores the slots with the weights the pass reported, then keeps the best ``keep``
  (``_keep_best``, each kind's own choice) in a store sized by ``budget.py``'s one rule.

A kind supplies its slots (``_new_slots``: the codec's tensors plus tags, ``[B, H, N, ...]``),
its record (``_record``), its scores (``_scored``) and its choice (``_keep_best``); ``_unit`` is
how many slots one token takes (1 per head's row, or ``Hkv`` in a flat store).

Design: docs/architecture.md, "Kinds that run their own attention".
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace

import torch

from ..attention import Reads
from ..errors import UnsupportedOperation
from .options import Option, number
from .own_attention import OwnAttentionLayer
from .budget import holds_wrong_size, slots_to_allocate
from .checks import Geometry
from .slots import Slots, get_storage
from .store import SlotStore
from .tiers import SOURCE, TieredStore, mixed_name, mixed_parts, precision


#: The options every selecting kind takes: a budget (a count, or a share of the tokens seen, in
#: ``budget.py``'s unit), the codec of the kept slots (``slots.py``: full, int8, int4, int2) and,
#: for mixed precision (``tiers.py``), a finer codec for the ``fine_share`` of them ranked highest.
SELECTION_OPTIONS = {
    "budget": Option(number, least=0, inclusive=False), "storage": Option(str), "fine": Option(str),
    "fine_share": Option(float, least=0.0, inclusive=False),
}  # fmt: skip
#: The share of kept slots in the ``fine`` storage when it is given without ``fine_share``.
FINE_SHARE = 0.25


class SelectingLayer(OwnAttentionLayer):
    """A bounded layer that keeps a selection of slots (see the module docstring)."""

    _set: dict[str, torch.Tensor] | None = None
    #: How the slots keep keys and values (set by each kind from its ``storage=`` option).
    storage: Slots

    @property
    def exact(self) -> bool:
        return self.storage.format.exact and not self.tiered

    # ---- mixed precision (``tiers.py``) -----------------------------------------------------

    @property
    def tiered(self) -> bool:
        """Whether the kept slots are in two storages (``fine=``)."""
        return isinstance(self.store, TieredStore)

    def _use_tiers(self, fine: str | None, share: float | None) -> None:
        """With ``fine``: keep the ``share`` (default ``FINE_SHARE``) of the kept slots that
        ``_rank`` puts first in storage ``fine``, the rest in ``storage``; the layer's candidates
        are then full precision (``self.storage`` is ``full``). Call after ``storage`` and ``store`` are set."""
        if fine is None:
            if share is not None:
                raise ValueError("fine_share is the share of slots kept in the fine storage: give fine= with it")
            return
        share = FINE_SHARE if share is None else self.check_options(fine_share=share)["fine_share"]
        if not 0 < share < 1:
            raise ValueError(f"fine_share is the share of kept slots in the fine storage, in (0, 1), got {share}")
        coarse, finer = self.storage, get_storage(fine)
        if precision(finer) <= precision(coarse):
            raise ValueError(f"fine={fine!r} must be finer than storage={coarse.name!r} (fine keeps the highest-ranked slots)")
        self.storage = get_storage("full")
        full = self.storage.names
        self.store = TieredStore(finer, coarse, share, lambda g: {k: v for k, v in self._layout(g).items() if k not in full}, self._rank)

    def _rank(self, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        """How the kept ``slots`` rank for the fine run (higher first) ``[B, H, N]``: their scores."""
        return slots["scores"]

    @property
    def storage_name(self) -> str:
        """The storage of the kept slots (the coarse one of a mixed layer), as its options name it."""
        return self.store.coarse.name if isinstance(self.store, TieredStore) else self.storage.name

    @property
    def stored_as(self) -> str:
        """The kept slots' storage by name: one storage's, or a mixed one's ``fine@share+coarse``."""
        if isinstance(self.store, TieredStore):
            return mixed_name(self.store.fine.name, self.store.share, self.store.coarse.name)
        return self.storage.name

    def _enter_storage(self, name: str) -> None:
        """Hold the kept slots in storage ``name`` (one storage, or ``fine@share+coarse``) from now
        on, in a new empty store (the old one is left as it was, for a caller that restores it)."""
        parts = mixed_parts(name)
        self.storage = get_storage(name if parts is None else parts[2])
        self.store = SlotStore(layout=self._layout)
        if parts is not None:
            self._use_tiers(parts[0], parts[1])

    def tier_options(self) -> dict[str, object]:
        """``fine`` and ``fine_share`` of a mixed layer, else nothing."""
        if not isinstance(self.store, TieredStore):
            return {}
        return {"fine": self.store.fine.name, "fine_share": self.store.share}

    # ---- what a kind supplies -------------------------------------------------------------

    @abstractmethod
    def _new_slots(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> dict[str, torch.Tensor]:
        """The store's tensors for the new tokens at positions ``seen...``: name -> ``[B, H, N(, X)]``."""

    def _as_slots(self, t: torch.Tensor) -> torch.Tensor:
        """New keys or values ``[B, Hkv, n, D]`` laid out as the store's slots (full precision)."""
        return t

    @abstractmethod
    def _record(self, keys: torch.Tensor, values: torch.Tensor, held: dict[str, torch.Tensor] | None, seen: int, n: int) -> Reads:
        """The read record of an update of ``n`` tokens from position ``seen``: ``keys``/``values``
        attended; their tags (positions, ...) are ``held``'s, the candidate set of an update that
        overflowed, or the store's slots in use when ``held`` is None (the update fitted)."""

    @abstractmethod
    def _scored(self, weights: torch.Tensor, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        """``slots``' scores after a pass that reported ``weights`` over them."""

    @abstractmethod
    def _keep_best(self, slots: dict[str, torch.Tensor], keep: int) -> None:
        """Store the ``keep`` best of ``slots`` (not views of the store): choose, then ``_store_kept``."""

    @abstractmethod
    def _settle_in_place(self, weights: torch.Tensor | None) -> None:
        """Settle an update that fitted the store: rescore with ``weights``, evict what is over."""

    @abstractmethod
    def _keep_now(self, seen: int | None = None) -> int:
        """Slots kept after ``seen`` tokens (default: now)."""

    @abstractmethod
    def _capacity_for(self, seen: int) -> int:
        """Slots the store needs after ``seen`` tokens: the budget then, and a decode step's spare."""

    @property
    def _unit(self) -> int:
        """Slots one token takes: 1 (a row per head), or ``Hkv`` in a flat store."""
        return 1

    def _store_geometry(self) -> Geometry:
        """The geometry the store is allocated with."""
        return self.geometry

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def _growing(self) -> bool:
        """The budget is a share of the sequence: its store is allocated with room to grow
        (``budget.slots_to_allocate``)."""
        return isinstance(self.budget, float)

    @property
    def selection_name(self) -> str:
        """How error messages name the layer (its policy, for eviction)."""
        return self.kind

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> Reads:
        if self.tiered:
            return self._append_to_candidates(key, value)
        if self._set is not None or self.length > self._keep_now():
            self._settle(None)  # a store loaded with its spare slots in use: choose now
        n, seen = key.shape[2], self.seen
        new = self._new_slots(key, value, seen)  # encodes (may raise): nothing changed yet
        self.geometry = self.geometry or Geometry.of(key, value)
        added = new["positions"].shape[2]
        if self.length + added <= max(self.capacity, self._capacity_for(seen + n)):
            self._ensure_capacity(self.length + added, seen + n)
            self.store.append(new)
            self._seen = seen + n
            keys, values = self._fitted_view(key, value)
            return self._record(keys, values, None, seen, n)
        # Too many new tokens for the spare room: attend a temporary concatenation (the new tokens
        # in full precision), then keep the best when it settles.
        new_keys, new_values = self._as_slots(key), self._as_slots(value)
        if self.store.allocated and self.length:
            old_k, old_v = self.view()
            keys, values = torch.cat([old_k, new_keys], dim=2), torch.cat([old_v, new_values], dim=2)
            stored = self.store.in_use()
            self._set = {name: torch.cat([stored[name], t], dim=2) for name, t in new.items()}
        else:
            keys, values, self._set = new_keys, new_values, new
        self._seen = seen + n
        return self._record(keys, values, self._set, seen, n)

    def _append_to_candidates(self, key: torch.Tensor, value: torch.Tensor) -> Reads:
        """A mixed layer's update: the kept slots decoded and the new tokens, one candidate set."""
        if self._set is not None:
            self._settle(None)
        n, seen = key.shape[2], self.seen
        new = self._new_slots(key, value, seen)
        self.geometry = self.geometry or Geometry.of(key, value)
        new[SOURCE] = torch.full(new["positions"].shape, -1, dtype=torch.long, device=key.device)
        if self.store.allocated and self.length:
            stored = self.store.in_use()
            self._set = {name: torch.cat([stored[name], t], dim=2) for name, t in new.items()}
        else:
            self._set = new
        self._seen = seen + n
        return self._record(self._set["keys"], self._set["values"], self._set, seen, n)

    def _fitted_view(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What an update that fitted hands the model (``Reads.returned``): the stored slots as
        views. A kind whose attention reads its slots otherwise (coded slots, through a reader)
        hands back the update's own ``key``/``value`` instead of dequantizing every slot."""
        return self.view()

    def _ensure_capacity(self, need: int, seen: int) -> None:
        if self.store.allocated and self.capacity >= need:
            return
        need = max(need, self._capacity_for(seen))
        self.store.allocate(slots_to_allocate(need, self._growing, self._unit), self._store_geometry())  # the stored slots kept

    # ---- after attention --------------------------------------------------------------------

    def _settle(self, weights: torch.Tensor | None) -> None:
        if self._set is not None:
            s, self._set = self._set, None
            if weights is not None:
                s["scores"] = self._scored(weights, s)
            self._keep_best(s, self._keep_now())
            return
        if self.tiered:  # nothing pending: keep the budget (a mixed layer's slots are not rewritten in place)
            if self.length > self._keep_now():
                self._keep_best(self.store.in_use(), self._keep_now())
            return
        self._settle_in_place(weights)

    def _store_kept(self, slots: dict[str, torch.Tensor]) -> None:
        """Write the chosen ``slots`` (``[B, H, kept(, X)]``) from slot 0, reallocating the store when
        its size (``budget.holds_wrong_size``) or batch is not what they need."""
        kept, batch = slots["positions"].shape[2], slots["positions"].shape[0]
        need = max(self._capacity_for(self.seen), kept)
        wrong_size = not self.store.allocated or holds_wrong_size(self.capacity, need, self._growing, self._unit)
        if wrong_size or self.store.batch != batch:
            self.geometry = replace(self.geometry, batch=batch)
            self.store.allocate(slots_to_allocate(need, self._growing, self._unit), self._store_geometry(), keep=False)
        self.store.write(0, slots)
        self.store.length = kept

    # ---- rollback, reuse, batch work ------------------------------------------------------

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        if int(n) and self.tiered:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a {self.selection_name} layer with fine={self.store.fine.name}: "
                f"its slots are re-split between two storages after every update, so none can be taken back"
            )

    def _check_settled(self, what: str) -> None:
        if self._set is not None:
            raise UnsupportedOperation(
                f"{self.selection_name} layer: cannot {what} between an update that overflowed the budget "
                f"and its attention (call attend() or settle() first)"
            )

    def _rebatch(self, fn) -> None:
        self._check_settled("change the batch")
        if self.store.allocated:  # another batch: the budget's capacity
            batch = self.store.rebatch(fn, capacity=self._capacity_for(self.seen))
            self.geometry = replace(self.geometry, batch=batch)

    def reset(self) -> None:
        super().reset()
        self.store.drop()
        self._set = None
        self._seen = 0
        self.geometry = None
