"""A fixed budget of slots per batch row and KV head, the rest evicted by a scoring policy.

Each (row, KV head) keeps its own ``budget`` slots: which positions survive differs per head,
and memory really is ``budget`` slots (plus one for the incoming token), not a mask over a full
cache. Bookkeeping per slot: its absolute position (for masks and the protected ranges) and its
score (``policies.py``). The first ``sinks`` positions and the last ``recent`` are never evicted.

One decode step: the new token goes into the spare slot, attention runs over ``budget + 1``
slots and reports its weights, the policy updates the scores, and the lowest-scoring unprotected
slot of each head is overwritten by the spare one (O(1) copying). A chunk of several tokens that
does not fit (a prefill) is attended as a temporary concatenation of the kept slots and the new
tokens, masked causally by position; then the best ``budget`` of them are kept.

With a budget at least the sequence length nothing is evicted and attention sees exactly the full
cache. Trimming works only while nothing has been evicted: evicted tokens cannot come back.

A policy may bring options of its own (SnapKV's ``window`` and ``pool``: ``"snapkv:budget=0.25,
window=32"``), keep one set of positions for all the heads of a row (``shared_heads``), or size its
budget by the layer's depth (PyramidKV: ``make_cache`` tells each layer its place, ``at_depth``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import DTypeError, ShapeError, UnsupportedOperation
from .policies import POLICIES, Policy, get_policy
from .options import Option
from ..attention import Reads
from .checks import Geometry
from .state import LayerState
from .selecting import SELECTION_OPTIONS, SelectingLayer
from .budget import Budget
from .slots import get_storage
from .store import Layout, SlotStore

class EvictingLayer(SelectingLayer):
    kind = "evicting"
    spec_options = {
        "budget": SELECTION_OPTIONS["budget"],
        "recent": Option(int, least=0),
        "sinks": Option(int, least=0),
        "storage": SELECTION_OPTIONS["storage"],
        "fine": SELECTION_OPTIONS["fine"],
        "fine_share": SELECTION_OPTIONS["fine_share"],
    }
    #: The layer's place among the cache's layers, for policies whose budget depends on it.
    keyword_options = {"layer": Option(int, least=0), "layers": Option(int, least=1)}
    required_options = ("budget",)
    spec_order = 4

    @classmethod
    def spec_kinds(cls) -> dict[str, dict[str, Any]]:
        """One spec kind per eviction policy (``"h2o:budget=1024"``), each fixing ``policy``."""
        return {name: {"policy": name} for name in POLICIES}

    @classmethod
    def kind_options(cls, fixed: Mapping[str, Any]) -> dict[str, Option]:
        """The layer's options and the policy's own (``"snapkv"``: ``window``, ``pool``)."""
        return {**cls.spec_options, **POLICIES[fixed["policy"]].spec_options}

    def __init__(
        self,
        budget: int | float,
        policy: str | Policy = "h2o",
        recent: int | None = None,
        sinks: int = 0,
        storage: str = "full",
        layer: int | None = None,
        layers: int | None = None,
        fine: str | None = None,
        fine_share: float | None = None,
        **policy_options: Any,
    ) -> None:
        """``policy_options``: the policy's own (``window=32`` for SnapKV); ``layer`` of ``layers``:
        the layer's place, as ``at_depth`` records it (saved files pass it back)."""
        super().__init__()
        if not isinstance(policy, str) and policy_options:
            raise ValueError(f"options {sorted(policy_options)} go with a policy name, not a {type(policy).__name__} instance")
        self.policy = get_policy(policy, **policy_options) if isinstance(policy, str) else policy
        self.storage = get_storage(storage)
        checked = self.check_options(budget=budget, sinks=sinks, **({} if recent is None else {"recent": recent}))
        self.sizing = Budget(checked["budget"], checked["sinks"], checked.get("recent"), self.policy)
        if layer is not None or layers is not None:
            self.at_depth(layer, layers)
        #: The codec's tensors, each slot's position and score: name -> [B, Hkv, C(, D)]. Sized
        #: by the budget (``_capacity_for``), not by a growth strategy.
        self.store = SlotStore(layout=self._layout)
        self._use_tiers(fine, fine_share)

    # ---- sizes ----------------------------------------------------------------------------

    # budget, sinks, recent: as given (``budget.py`` sizes the layer from them).
    budget = property(lambda self: self.sizing.size)
    sinks = property(lambda self: self.sizing.sinks)
    recent = property(lambda self: self.sizing.recent)
    depth = property(lambda self: self.sizing.depth)

    def at_depth(self, index: int, count: int) -> None:
        """Record the layer's place (layer ``index`` of ``count``) when the policy's budget depends on it."""
        checked = self.check_options(layer=index, layers=count)
        self.sizing.place(checked["layer"], checked["layers"])

    def budget_now(self, seen: int | None = None) -> int:
        """Slots kept after ``seen`` tokens (default: now): the budget, or its fraction of ``seen``,
        as the policy sizes it for this layer's depth."""
        return self.sizing.now(self.seen if seen is None else seen)

    def recent_now(self, seen: int | None = None) -> int:
        return self.sizing.recent_now(self.seen if seen is None else seen)

    # nbytes (the store's): keys and values as stored (codes and scales for int8/int4) and each
    # slot's position and score.

    @property
    def _slots(self) -> dict[str, torch.Tensor]:
        """Every tensor of the store, all its slots ``[B, Hkv, C(, D)]`` (what ``_attended`` reads)."""
        return self.store.tensors

    @property
    def _len(self) -> int:
        return self.store.length

    def _layout(self, g: Geometry) -> Layout:
        return {**self.storage.layout(g), "positions": ((), torch.long), "scores": ((), torch.float32)}

    def view(self):
        """Stored keys and values in slot order: views for full storage, dequantized copies otherwise."""
        if not self.store.allocated:
            return None, None
        return self.storage.decode(self.store.tensors, self.length, self.geometry)

    def positions(self) -> torch.Tensor:
        if not self.store.allocated:
            return torch.empty(0, 0, 0, dtype=torch.long)
        return self.store.run("positions", 0, self.length)

    def scores(self) -> torch.Tensor:
        """The policy's score of each stored slot, float32 ``[B, Hkv, length]``."""
        if not self.store.allocated:
            return torch.empty(0, 0, 0)
        return self.store.run("scores", 0, self.length)

    # ---- appending ------------------------------------------------------------------------

    def _keep_now(self, seen: int | None = None) -> int:
        return self.budget_now(seen)

    def _new_slots(self, key, value, seen):
        batch, heads, n = key.shape[:3]
        pos = torch.arange(seen, seen + n, device=key.device).expand(batch, heads, n)
        return {**self.storage.encode(key, value), "positions": pos, "scores": self.policy.initial(pos)}

    def _fitted_view(self, key, value):
        # Coded slots are attended through their reader (``_record``): nothing to dequantize here.
        return self.view() if self.storage.format.exact else (key, value)

    def _record(self, keys, values, held, seen, n):
        # The new tokens are the last slots, after every survivor: causal is end-aligned.
        fits = held is None
        positions = self.positions() if fits else held["positions"]
        # An update that fitted is attended over the store itself: coded slots through their reader
        # (a decode step reads the codes; slots.py), while the model gets ``keys``/``values`` as ever.
        reader = self.storage.reader(self.store.tensors, self.length, self.geometry) if fits else None
        read = (keys, values) if reader is None else (reader, None)
        return Reads(
            *read, positions, seen, n, all_visible=fits and n == 1, new_at_end=True, returned=(keys, values),
            weights=self.weights_for(n),
        )

    def weights_for(self, queries: int) -> str | None:
        return self.policy.weights_for(queries)

    def _capacity_for(self, seen: int) -> int:
        """Slots needed for ``seen`` tokens: the budget then and one spare for a decode step."""
        return self.budget_now(seen) + 1

    # ---- after attention: score, then evict ------------------------------------------------

    def _scored(self, weights, slots):
        return self._observed(slots["scores"], weights, slots["positions"])

    def _settle_in_place(self, weights: torch.Tensor | None) -> None:
        if weights is not None:
            live = self._slots["scores"][:, :, : self._len]
            live.copy_(self._observed(live, weights, self._slots["positions"][:, :, : self._len]))
        if self._len > self.budget_now():
            self._evict(self._len - self.budget_now())

    def _observed(self, scores: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The policy's scores after a pass ``[B, Hkv, N]``; with ``shared_heads``, their mean over
        the row's heads, so every head evicts the same positions (its slots hold the same ones)."""
        out = self.policy.observe(scores, weights, positions)
        if self.policy.shared_heads:
            out = out.mean(dim=1, keepdim=True).expand_as(out).contiguous()
        return out

    def _eviction_key(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Scores with the protected slots (sinks, recent tokens) raised above everything."""
        protected = (positions < self.sinks) | (positions >= self.seen - self.recent_now())
        return scores.masked_fill(protected, math.inf)

    def _rank(self, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._eviction_key(slots["scores"], slots["positions"])

    def _evict(self, count: int) -> None:
        live = self.store.in_use()
        if count != 1:
            self._keep_best({name: t.clone() for name, t in live.items()}, self.length - count)
            return
        # One too many (a decode step): the last slot overwrites each head's weakest one.
        weakest = self._eviction_key(live["scores"], live["positions"]).argmin(dim=-1, keepdim=True)  # [B, H, 1]
        last = self.length - 1
        for name, t in live.items():
            index = weakest if t.dim() == 3 else weakest.unsqueeze(-1).expand(*weakest.shape, t.shape[-1])
            t.scatter_(2, index, t[:, :, last : last + 1].clone())  # the source must not alias the target
        self.store.length = last

    def _keep_best(self, slots: dict[str, torch.Tensor], keep: int) -> None:
        """Store the ``keep`` best of ``slots`` (tensors ``[B, H, N(, D)]``, not views of the store)."""
        n = slots["positions"].shape[2]
        if n > keep:
            key = self._eviction_key(slots["scores"], slots["positions"])
            index = key.topk(keep, dim=-1).indices.sort(dim=-1).values  # [B, H, keep], in slot order
            slots = {
                name: t.gather(2, index if t.dim() == 3 else index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))
                for name, t in slots.items()
            }
        self._store_kept(slots)

    # ---- rollback, reuse, batch work ------------------------------------------------------

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        if int(n) and self.length != self.seen:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a {self.policy.name} cache that has evicted "
                f"{self.seen - self.length} of its {self.seen}: evicted tokens cannot come back"
            )

    # _trim (the store's): nothing evicted (check_trim), so slots are positions 0..len-1 in order.

    # ---- state ----------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        depth = {} if self.depth is None else {"layer": self.depth[0], "layers": self.depth[1]}
        return {
            "budget": self.budget,
            "policy": self.policy.name,
            "recent": self.recent,
            "sinks": self.sinks,
            "storage": self.storage_name,
            **self.tier_options(),
            **self.policy.options(),
            **depth,
        }

    @property
    def selection_name(self) -> str:
        return self.policy.name

    def state(self) -> LayerState:
        self._check_settled("take its state")
        tensors = self.store.saved() if self.tiered else self.store.in_use()
        return LayerState(self.kind, self.options(), self.seen, tensors)

    def check_state(self, state: LayerState) -> None:
        super().check_state(state)
        t = state.tensors
        if not t:
            return
        if self.tiered:
            runs = self.store.split_saved(t)
            g = self.store.geometry_of(runs)
            self.store.check_saved("evicting layer", runs, g)
            t = {"positions": self.store.joined(runs, "positions")}
            self._check_positions(t["positions"], int(state.seen))
            return
        missing = [name for name in (*self.storage.names, "positions", "scores") if name not in t]
        if missing:
            raise ValueError(f"evicting layer state lacks {missing}")
        pos = t["positions"]
        if pos.dim() != 3 or any(t[name].dim() != 4 for name in self.storage.names):
            raise ShapeError(
                f"evicting layer state needs positions [B, Hkv, slots] and {self.storage.names} [B, Hkv, slots, ...], got "
                + ", ".join(f"{name} {tuple(t[name].shape)}" for name in ("positions", *self.storage.names))
            )
        batch, _, n = pos.shape
        g = self.storage.geometry(t)
        if not g.dtype.is_floating_point:
            raise DTypeError(f"evicting layer state: keys or scales must be floating-point, got {g.dtype}")
        self.store.check("evicting layer", t, replace(g, batch=batch), n)
        self._check_positions(pos, int(state.seen))

    def _check_positions(self, pos: torch.Tensor, seen: int) -> None:
        """Raise unless saved slots at positions ``pos`` ``[B, Hkv, n]`` fit the budget after ``seen``, once each."""
        n = pos.shape[2]
        if n > min(seen, self._capacity_for(seen)):
            raise ValueError(f"evicting layer state holds {n} slots after {seen} tokens, budget {self.budget_now(seen)}")
        if n and (int(pos.min()) < 0 or int(pos.max()) >= seen):
            raise ValueError(f"evicting layer state has positions outside [0, {seen}): {int(pos.min())}..{int(pos.max())}")
        if n > 1 and not bool((pos.sort(dim=-1).values.diff(dim=-1) > 0).all()):
            raise ValueError("evicting layer state holds a position twice in one head")

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        if state.tensors and self.tiered:
            runs = self.store.split_saved(state.tensors)
            self.geometry = self.store.geometry_of(runs)
            self.store.load_saved(runs, self.geometry, self._capacity_for(int(state.seen)))
        elif state.tensors:
            t = dict(state.tensors)
            self.geometry = self.storage.geometry(t)
            t["positions"], t["scores"] = t["positions"].long(), t["scores"].float()
            self._seen = int(state.seen)
            self._keep_best(t, t["positions"].shape[2])
        self._seen = int(state.seen)
