"""Ada-KV: one budget shared by the KV heads of a layer, split by where the attention goes.

Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference". Slots are scored as SnapKV scores them (the attention of a pass's last
``window`` queries, summed over the query heads of each KV head, max-pooled ``pool`` positions
wide), but instead of the top ``budget`` per head, a batch row keeps the top ``Hkv * budget``
slots across all its KV heads: a head whose attention is spread gets more slots, a focused one
fewer. The paper's safeguard: every head keeps at least ``floor`` (default 0.2, the authors'
``floor_alpha``) of its uniform share of the chosen slots, and at least one. The observation
window (the last ``window`` positions, at most half the budget) is kept in every head, as SnapKV
keeps it; the budget counts it.

Memory is the layer's budget: the kept slots are stored flat, keys/values ``[B, 1, C, D]`` with
``C = Hkv * (budget + 1)`` (one spare slot per head for a decode step), plus each slot's KV head
(int16), absolute position (int32) and score (float32): 10 bytes per slot of bookkeeping, less
than the 12 of a rectangular evicting store of the same budget. A decode step reads the flat store
as ONE KV head with every query head in its group, masked so that a query head sees only its own
KV head's slots (``shared_budget.OwnHeads``): each query scores every slot of the layer, but each
key is read once (decode is bound by reading the keys). ``view()`` and ``positions()`` are
therefore ``[B, 1, L, ...]``; ``heads()`` says whose each slot is, ``head_lengths()`` how many each
head keeps.

A pass of several tokens (a prefill, a chunk) is bound by its scores instead: it reads the slots
laid out per KV head (``by_head.py``), so a query scores only its own head's slots, under the
kernel's end-aligned causal rule with no mask per row. It rescores every slot it attended with its
window's weights (brought back to the flat slots); one that overflows the store is attended as a
temporary concatenation of the kept slots and the new tokens (as the evicting layer does), then
the row keeps its best ``Hkv * budget``. A decode step does not rescore (SnapKV compresses the
prompt): a generated token scores 0, so once it leaves the window it is the first to go, and the
prompt's chosen slots stay. With a budget at least the sequence nothing is evicted and attention
equals the full cache's.

``compressed`` (a keyword, not a spec option): slots the layer holds beside its budget, a context compressed
across a whole cache (KVzip's choice over every layer and head, ``kvcache.hf.kvzip``), where each
layer keeps a different number; the layer keeps ``compressed + Hkv * budget`` slots and a file records it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from ..attention import Reads
from ..errors import ShapeError, UnsupportedOperation
from .options import Option
from .budget import check_budget
from .by_head import ByHead
from .selecting import SELECTION_OPTIONS, SelectingLayer
from .checks import Geometry
from .shared_budget import (
    OwnHeads,
    check_flat_state,
    check_flat_tags,
    flatten_heads,
    gather_slots,
    head_counts,
    keep_across_heads,
    moves_in_place,
    new_slot_tags,
    pooled_by_head,
)
from .slots import get_storage
from .state import LayerState
from .store import Layout, SlotStore


class AdaptiveLayer(SelectingLayer):
    """Ada-KV's shared layer budget over a flat store (see the module docstring)."""

    kind = "adakv"
    spec_options = {
        "budget": SELECTION_OPTIONS["budget"],
        "window": Option(int, least=1),
        "pool": Option(int, least=1),
        "floor": Option(float, least=0.0),
        "storage": SELECTION_OPTIONS["storage"],
        "fine": SELECTION_OPTIONS["fine"],
        "fine_share": SELECTION_OPTIONS["fine_share"],
    }
    keyword_options = {"compressed": Option(int, least=0)}
    required_options = ("budget",)
    spec_order = 5

    def __init__(
        self, budget: int | float, window: int = 32, pool: int = 7, floor: float = 0.2, storage: str = "full", compressed: int = 0,
        fine: str | None = None, fine_share: float | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.storage = get_storage(storage)
        checked = self.check_options(budget=budget, window=window, pool=pool, floor=floor)
        self.compressed = AdaptiveLayer.check_options(compressed=compressed)["compressed"]
        self.budget = check_budget(checked["budget"], "token per head")
        self.window, self.pool, self.floor = checked["window"], checked["pool"], checked["floor"]
        if self.floor > 1:
            raise ValueError(f"floor is a share of each head's uniform budget, in [0, 1], got {floor}")
        self.store = SlotStore(layout=self._layout)
        self._use_tiers(fine, fine_share)
        #: The per-head layout of the pending pass of several tokens, until it settles.
        self._by_head: ByHead | None = None

    # ---- sizes ----------------------------------------------------------------------------

    def budget_now(self, seen: int | None = None) -> int:
        """Slots per head, on average, after ``seen`` tokens: the budget, or its share of ``seen``."""
        seen = self.seen if seen is None else seen
        return self.budget if isinstance(self.budget, int) else max(1, math.ceil(self.budget * seen))

    def recent_now(self, seen: int | None = None) -> int:
        """The observation window every head keeps: ``window``, at most half the budget."""
        return min(self.window, self.budget_now(seen) // 2)

    def floor_now(self, seen: int | None = None) -> int:
        """Slots each head keeps besides the window, whatever the scores: ``floor`` of its share."""
        chosen = self.budget_now(seen) - self.recent_now(seen)
        return max(1, int(self.floor * chosen))

    @property
    def kv_heads(self) -> int:
        return self.geometry.heads if self.geometry is not None else 0

    def _keep_now(self, seen: int | None = None) -> int:
        return self.kv_heads * self.budget_now(seen) + self.compressed

    def _capacity_for(self, seen: int) -> int:
        return self.kv_heads * (self.budget_now(seen) + 1) + self.compressed

    def _layout(self, g: Geometry) -> Layout:
        tags = {"positions": ((), torch.int32), "heads": ((), torch.int16), "scores": ((), torch.float32)}
        return {**self.storage.layout(g), **tags}

    def _flat_geometry(self, batch: int | None = None) -> Geometry:
        g = self.geometry
        return replace(g, heads=1, batch=g.batch if batch is None else batch)

    # ---- reading --------------------------------------------------------------------------

    def view(self):
        """Stored keys ``[B, 1, L, D]`` and values ``[B, 1, L, Dv]``, every head's slots in one run
        (``heads()`` says whose): views for full storage, dequantized copies otherwise."""
        if not self.store.allocated:
            return None, None
        return self.storage.decode(self.store.tensors, self.length, self._flat_geometry())

    def weights_for(self, queries: int) -> str | None:
        return f"window:{self.window}" if queries > 1 else None  # decode steps do not rescore

    def positions(self) -> torch.Tensor:
        """Absolute position of each stored slot, int64 ``[B, 1, L]``."""
        if not self.store.allocated:
            return torch.empty(0, 0, 0, dtype=torch.long)
        return self.store.run("positions", 0, self.length).long()

    def heads(self) -> torch.Tensor:
        """The KV head of each stored slot, int64 ``[B, 1, L]``."""
        if not self.store.allocated:
            return torch.empty(0, 0, 0, dtype=torch.long)
        return self.store.run("heads", 0, self.length).long()

    def scores(self) -> torch.Tensor:
        """Each stored slot's score, float32 ``[B, 1, L]``."""
        if not self.store.allocated:
            return torch.empty(0, 0, 0)
        return self.store.run("scores", 0, self.length)

    def head_lengths(self) -> torch.Tensor:
        """Slots each KV head keeps, int64 ``[B, Hkv]``."""
        if not self.store.allocated:
            return torch.empty(0, 0, dtype=torch.long)
        return head_counts(self.store.run("heads", 0, self.length), self.kv_heads)

    # ---- appending ------------------------------------------------------------------------

    def _new_slots(self, key, value, seen):
        batch, kv_heads, n = key.shape[:3]
        heads, pos = new_slot_tags(batch, kv_heads, seen, n, key.device)
        encoded = {name: flatten_heads(t) for name, t in self.storage.encode(key, value).items()}
        return {**encoded, "positions": pos, "heads": heads, "scores": torch.zeros(pos.shape, dtype=torch.float32, device=key.device)}

    def _as_slots(self, t):
        return flatten_heads(t)

    @property
    def _unit(self) -> int:
        return self.kv_heads

    def _store_geometry(self) -> Geometry:
        return self._flat_geometry()

    def _record(self, keys, values, held, seen, n):
        """A decode step reads every slot in one run ``[B, 1, N, D]``, each query head seeing only
        its own KV head's slots; a pass of several tokens reads them laid out per head
        (``by_head.py``), ``[B, Hkv, W, D]``, and its weights go back to the flat slots on settling."""
        if held is None:
            positions, heads = self.positions(), self.store.run("heads", 0, self.length)
        else:
            positions, heads = held["positions"].long(), held["heads"]
        if n == 1:
            return Reads(keys, values, positions, seen, n, visibility=OwnHeads(heads, self.kv_heads), weights=self.weights_for(n))
        layout = self._by_head = ByHead.of(heads, positions, self.kv_heads, n)
        return Reads(
            layout.rows(keys), layout.rows(values), layout.positions, seen, n, new_at_end=True, padded=layout.padded,
            returned=(keys, values), weights=self.weights_for(n),
        )

    # ---- after attention: score, then keep the best across heads ------------------------

    def _settle(self, weights: torch.Tensor | None) -> None:
        layout, self._by_head = self._by_head, None
        if weights is not None and layout is not None:
            weights = layout.flat(weights)  # [B, Hkv, W] per cell -> [B, 1, N] per flat slot
        super()._settle(weights)

    def _scored(self, weights, slots):
        return self._observe(weights, slots)

    def _settle_in_place(self, weights: torch.Tensor | None) -> None:
        if weights is not None and self.length:
            live = self.store.in_use()
            live["scores"].copy_(self._observe(weights, live))
        extra = self.length - self._keep_now()
        if extra > 0 and not (weights is None and extra <= self.kv_heads and self._drop_weakest(extra)):
            self._keep_best({name: t.clone() for name, t in self.store.in_use().items()}, self._keep_now())

    def _drop_weakest(self, extra: int) -> bool:
        """A decode step's eviction in place (``shared_budget.moves_in_place``); False, changing
        nothing, where that would take a head below its floor (``_keep_best`` then)."""
        live, keep, seen = self.store.in_use(), self._keep_now(), self.seen
        moves = moves_in_place(live, self.kv_heads, keep, seen - self.recent_now(seen), self.floor_now(seen))
        if moves is None:
            return False
        target, source = moves
        for t in live.values():
            src = gather_slots({"t": t}, source)["t"]
            t.scatter_(2, target if t.dim() == 3 else target.unsqueeze(-1).expand(*target.shape, t.shape[-1]), src)
        self.store.length = keep
        return True

    def _observe(self, weights: torch.Tensor, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        """SnapKV's score: the window's weights ``[B, 1, N]`` max-pooled over each head's positions."""
        return pooled_by_head(weights.float(), slots["heads"], slots["positions"], self.kv_heads, self.pool)

    def _rank(self, slots: dict[str, torch.Tensor]) -> torch.Tensor:
        """The window (always kept) first, then by score."""
        return slots["scores"].masked_fill(slots["positions"] >= self.seen - self.recent_now(), math.inf)

    def _keep_best(self, slots: dict[str, torch.Tensor], keep: int) -> None:
        """Store the ``keep`` best of ``slots`` (``[B, 1, N(, X)]``, not views of the store)."""
        if slots["positions"].shape[2] > keep:
            seen = self.seen
            recent_from = seen - self.recent_now(seen)
            index = keep_across_heads(
                slots["scores"], slots["heads"], slots["positions"], keep, self.kv_heads, self.floor_now(seen), recent_from
            )
            slots = gather_slots(slots, index)
        self._store_kept(slots)

    # ---- rollback, reuse, batch work ------------------------------------------------------

    def reset(self) -> None:
        super().reset()
        self._by_head = None
        self.compressed = 0  # an emptied layer holds nothing beside its budget

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        if int(n) > self.seen:
            raise UnsupportedOperation(f"cannot remove {n} tokens from an adakv layer that has seen {self.seen}")
        if int(n) and self.length != self.kv_heads * self.seen:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from an adakv cache that has evicted some of its {self.seen}: "
                f"evicted tokens cannot come back"
            )

    def _trim(self, n: int) -> None:
        # Nothing evicted (check_trim), but the slots are in pass order, head-major within each pass.
        live = self.store.in_use()
        keep = self.kv_heads * (self.seen - n)
        index = (live["positions"] < self.seen - n).to(torch.int8).argsort(dim=-1, descending=True, stable=True)
        kept = gather_slots(live, index[..., :keep].sort(dim=-1).values)
        self.store.write(0, kept)
        self.store.length = keep

    # ---- state ----------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        compressed = {"compressed": self.compressed} if self.compressed else {}
        return {"budget": self.budget, "window": self.window, "pool": self.pool, "floor": self.floor, "storage": self.storage_name,
                **self.tier_options(), **compressed}  # fmt: skip

    @staticmethod
    def spec_options_of(options: Any) -> Any:
        """The options but ``compressed``, which each layer of a compressed context has its own of."""
        return {k: v for k, v in options.items() if k != "compressed"} if isinstance(options, dict) else options

    def state(self) -> LayerState:
        """The kept slots (views), plus ``head_lengths`` ``[B, Hkv]``, which carries the head count."""
        self._check_settled("take its state")
        if not self.store.allocated:
            return LayerState(self.kind, self.options(), self.seen, {})
        tensors = self.store.saved() if self.tiered else self.store.in_use()
        return LayerState(self.kind, self.options(), self.seen, {**tensors, "head_lengths": self.head_lengths()})

    def check_state(self, state: LayerState) -> None:
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        seen = int(state.seen)
        if seen < 0:
            raise ValueError(f"adakv layer state: seen must be >= 0, got {seen}")
        compressed = self._compressed_of(state)
        budget = self.budget if isinstance(self.budget, int) else max(1, math.ceil(self.budget * seen))
        if state.tensors and self.tiered:
            self._check_tiered_state(state.tensors, seen, budget, compressed)
        elif state.tensors:
            check_flat_state(state.tensors, self.storage, self.store, seen, budget, compressed)

    def _check_tiered_state(self, tensors: dict[str, torch.Tensor], seen: int, budget: int, compressed: int) -> Geometry:
        """A mixed layer's saved runs: checked as a flat state of full-precision slots would be,
        against ``budget`` slots per head. Returns the runs' (flat) geometry."""
        lengths = tensors.get("head_lengths")
        runs = self.store.split_saved({name: t for name, t in tensors.items() if name != "head_lengths"})
        g = self.store.geometry_of(runs)
        if g.heads != 1:
            raise ShapeError(f"adakv layer state: a flat store's runs are [B, 1, slots, ...], got {g.heads} heads")
        self.store.check_saved("adakv layer", runs, g)
        if lengths is None:
            raise ValueError("adakv layer state lacks ['head_lengths']")
        check_flat_tags(self.store.joined(runs, "positions"), self.store.joined(runs, "heads"), lengths, seen, budget, compressed)
        return g

    @staticmethod
    def _compressed_of(state: LayerState) -> int:
        """The slots ``state`` holds beside its budget (its own count: the content's, not the spec's)."""
        return AdaptiveLayer.check_options(compressed=state.options.get("compressed", 0) if isinstance(state.options, dict) else 0)["compressed"]

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        self.compressed = self._compressed_of(state)
        self._seen = int(state.seen)
        if state.tensors and self.tiered:
            runs = self.store.split_saved({name: x for name, x in state.tensors.items() if name != "head_lengths"})
            g = self.store.geometry_of(runs)
            self.geometry = replace(g, heads=state.tensors["head_lengths"].shape[1])
            self.store.load_saved(runs, g, self._capacity_for(self.seen))
        elif state.tensors:
            t = {name: x for name, x in state.tensors.items() if name != "head_lengths"}
            g = self.storage.geometry(t)
            self.geometry = replace(g, heads=state.tensors["head_lengths"].shape[1])
            self._keep_best(dict(t), t["positions"].shape[2])

