"""``auto:bytes=...``: a byte budget that chooses, per layer, how many tokens to keep and at which
precision.

A layer of this kind is a SnapKV eviction layer (``evicting.py``, the ``snapkv`` policy and its
``window`` and ``pool`` options) whose slot storage (``slots.py``: full, int8, int4, int2; with
``codes=rotated`` full, int8h, int4h, int2h, the codes of rotated keys and values) and number of
kept slots are not given but chosen, from a byte budget:

- ``bytes`` below 1: a share of what an fp32 cache of every token seen would take (``0.125``: an
  eighth of it), so the budget grows with the sequence; 1 or more: bytes for the whole cache,
  shared equally by its attention layers (a fixed budget).
- The slots a layer keeps are the most whose store, as ``budget.py`` allocates it (room to grow
  and a decode step's spare slot included), fits the budget in the storage chosen: what ``nbytes``
  reports, not an estimate, stays within the budget through decode (once the budget affords a
  few slots: ``sinks`` and the recent tokens are always kept).

The rule (``choose``), applied whenever a pass overflows the layer's slots (a prompt, or each
chunk of one) to the candidates (the kept slots and the new tokens) with the weights that pass
reported (the last ``window`` queries' attention, as SnapKV scores by):

1. ``mass``: each candidate's share of those weights, per KV head (sums to 1 over the candidates).
2. For each storage no finer than the layer's present one (a coded slot cannot be made precise
   again): the slots that storage affords, the candidates SnapKV would keep in that many, and
   ``estimate = dropped + coding``, where ``dropped`` is the mass of the candidates left out and
   ``coding`` the mass-weighted relative error of the kept ones' keys and values once coded
   (``(|k - k'| / |k| + |v - v'| / |v|) / 2``; 0 for full storage), averaged over rows and heads.
   Both are first-order estimates of the relative change of the window's attention output:
   dropping a slot of mass ``p`` moves it by about ``p``, coding one with error ``e`` by ``p e``.
   With ``rule=output`` (:func:`weigh`) the two parts are measured on the window's mean attention
   output instead (``o = sum p v`` per head, against the kept candidates' renormalised, then with
   their values coded); keys, which move the weights, keep the first-order term.
3. Tokens first (the default of the ``mass`` rule): of the storages whose kept slots' mean coding
   error (``coding`` over the kept mass; a mixed storage's worse part's) is at most ``tolerance``
   (``byte_budget.TOLERANCE``, 0.3, unless given), the one that drops the least mass wins (the
   finer of equals): the layer keeps every token the bytes afford, in the finest storage that
   affords them, short of a coding error past the tolerance. With ``margin=m``, the finest of
   those that drops at most ``m`` more than the least (a coarser storage must drop clearly less).
   With ``drop=w`` instead, cases are compared by distortion: the lowest ``w * dropped + coding``
   wins (``drop=1``: the estimate itself, the default of the measuring rules; ``w`` above 1
   prefers keeping more tokens, coarser). Exact answers on the task families reward tokens kept
   over precision, the prose KL precision (docs/quality.md). The layer recodes its kept slots into
   the storage chosen and keeps ``Choice`` (``layer.choice``: the storage, the slots, every
   candidate's estimate) for reports (``mix_of(cache)``).

Every head of a layer keeps the same number of slots in the same storage (the store is one
``[B, Hkv, C]`` run); which tokens each head keeps is its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from .auto_measure import measure, window
from .budget import GROWTH_ROOM, MIN_ROOM, slots_to_allocate
from .byte_budget import BYTE_BUDGET_OPTIONS, RULES, ByteBudget
from .checks import Geometry
from .evicting import EvictingLayer
from .options import Option, number
from .slots import get_storage
from .state import LayerState
from .tiers import mean_slot_bytes, mixed_parts, ranked

@dataclass(frozen=True)
class Estimate:
    """One storage's case at a decision: the slots it affords and its estimated error."""

    storage: str
    slots: int
    dropped: float
    coding: float
    #: A mixed storage's worse part's mean coding error (the part's coding over its own mass): what
    #: ``tolerance`` bounds, so a fine part cannot dilute a coarse part's error. None: one storage.
    worst_part: float | None = None

    @property
    def total(self) -> float:
        return self.dropped + self.coding

    @property
    def bounded(self) -> float:
        """What ``tolerance`` compares: the kept slots' mean coding error (``coding`` over the kept
        mass, so dropping more does not make coarse codes pass), or ``worst_part`` for a mix."""
        if self.worst_part is not None:
            return self.worst_part
        return self.coding / max(1 - self.dropped, torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class Choice:
    """A layer's decision: the storage and slots it took, at ``seen`` tokens, and every case weighed."""

    storage: str
    slots: int
    seen: int
    estimates: tuple[Estimate, ...]


def slot_bytes(storage: str, g: Geometry) -> int:
    """Bytes of one slot (one row, one KV head) of an eviction layer in ``storage``: the coded key
    and value and the slot's position and score."""
    layout = {**get_storage(storage).layout(g), "positions": ((), torch.long), "scores": ((), torch.float32)}
    return sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in layout.values())


def slots_within(allowed: float, per_slot: int, growing: bool) -> int:
    """The most slots ``n`` an eviction store can keep (allocating ``slots_to_allocate(n + 1)``: a
    decode step's spare and, for a ``growing`` budget, room) within ``allowed`` bytes; 0 if none."""

    def fits(n: int) -> bool:
        return slots_to_allocate(n + 1, growing) * per_slot <= allowed

    n = max(0, int(allowed / per_slot / (1 + GROWTH_ROOM)) - MIN_ROOM - 2)
    while fits(n + 1):
        n += 1
    while n > 0 and not fits(n):
        n -= 1
    return n


def relative_error(x: torch.Tensor, coded: torch.Tensor) -> torch.Tensor:
    """``|x - coded| / |x|`` per token ``[B, H, N]`` (0 where ``x`` is 0)."""
    x, coded = x.float(), coded.float()
    return (x - coded).norm(dim=-1) / x.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)


def weigh(storage: str, count: int, kept: torch.Tensor, mass: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          heads: int, g: Geometry, rule: str = "mass", head_of: torch.Tensor | None = None) -> Estimate:  # fmt: skip
    """The case of keeping candidates ``kept`` (an index ``[B, H', K]`` into dim 2) in ``storage``:
    ``mass`` ``[B, H', N]`` is each candidate's share of its KV head's window weights (each head's
    shares sum to 1), ``keys``/``values`` ``[B, H', N, D]`` the candidates in the geometry ``g``
    they are laid out in (``H'``: the KV heads, or 1 for a flat store of ``heads`` heads whose
    candidates' heads are ``head_of`` ``[B, 1, N]``). Both parts are means over rows and KV heads.

    ``rule`` ``"mass"``: ``dropped`` is the mass left out, ``coding`` the kept mass times the mean of
    the keys' and values' relative coding errors. ``"output"``: the window's mean output ``o = sum p
    v`` per head (the mean of its queries' outputs: ``mass`` is their mean weight) against ``o_keep``,
    the kept candidates' renormalised, ``dropped = |o_keep - o| / sum p |v|``; ``coding`` the mean of
    ``|o_code - o_keep| / sum p |v|`` (the kept values coded: independent rounding errors partly
    cancel, which the first-order sum ignores) and the keys' first-order error (keys move the
    weights, which cannot be measured without the queries)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    kept_mass = mass.gather(2, kept)
    coded = None
    if storage != "full":
        codec = get_storage(storage)
        coded = codec.decode(codec.encode(keys, values), keys.shape[2], g)
    if rule == "mass":
        dropped = float((1 - kept_mass.sum(dim=(1, 2)) / heads).clamp_min(0).mean())
        coding = 0.0
        if coded is not None:
            error = (relative_error(keys, coded[0]) + relative_error(values, coded[1])) / 2  # [B, H', N]
            coding = float(((kept_mass * error.gather(2, kept)).sum(dim=(1, 2)) / heads).mean())
        return Estimate(storage, count, dropped, coding)
    per_head = _per_head(head_of, heads)
    p = mass.float()
    v = values.float()
    scale = per_head(p * v.norm(dim=-1)).clamp_min(torch.finfo(torch.float32).tiny)  # [B, heads]
    whole = per_head(p.unsqueeze(-1) * v)  # [B, heads, D]
    p_kept = torch.zeros_like(p).scatter_(2, kept, kept_mass)
    share = per_head(p_kept).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    o_keep = per_head(p_kept.unsqueeze(-1) * v) / share
    dropped = float(((o_keep - whole).norm(dim=-1) / scale).mean())
    coding = 0.0
    if coded is not None:
        o_code = per_head(p_kept.unsqueeze(-1) * coded[1].float()) / share
        value_part = (o_code - o_keep).norm(dim=-1) / scale
        key_part = per_head(p_kept * relative_error(keys, coded[0]))
        coding = float(((value_part + key_part) / 2).mean())
    return Estimate(storage, count, dropped, coding)


def weigh_storage(name: str, count: int, kept: torch.Tensor, rank: torch.Tensor, positions: torch.Tensor, mass: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, heads: int, g: Geometry, rule: str = "mass",
                  head_of: torch.Tensor | None = None) -> Estimate:  # fmt: skip
    """``weigh``'s case of keeping ``kept`` in storage ``name``; a mixed storage's (``tiers.py``)
    kept slots split as its store splits them (``tiers.ranked`` by ``rank`` and ``positions``
    ``[B, H', N]``), each part weighed in its storage: the ``mass`` rule's parts add up (coding),
    and what both leave out is dropped; ``worst_part`` is the larger of the two parts' mean errors
    (each part's coding over its own mass)."""
    parts = mixed_parts(name)
    if parts is None:
        return weigh(name, count, kept, mass, keys, values, heads, g, rule, head_of)
    fine, share, coarse = parts
    k = kept.shape[2]
    order = ranked(rank.gather(2, kept), positions.gather(2, kept))
    top = kept.gather(2, order[..., : min(k, round(share * k))])
    rest = kept.gather(2, order[..., top.shape[2] :])
    a, b = (weigh(s, count, part, mass, keys, values, heads, g, rule, head_of) for s, part in ((fine, top), (coarse, rest)))
    dropped = max(0.0, a.dropped + b.dropped - 1)
    return Estimate(name, count, dropped, a.coding + b.coding, max(a.bounded, b.bounded))


def _per_head(head_of: torch.Tensor | None, heads: int):
    """Sum over each KV head's candidates: ``[B, H, N, ...]`` -> ``[B, H, ...]`` laid out per head,
    or ``[B, 1, N, ...]`` -> ``[B, heads, ...]`` by ``head_of`` for a flat store."""

    def total(x: torch.Tensor) -> torch.Tensor:
        if head_of is None:
            return x.sum(dim=2)
        index = head_of[:, 0].long()  # [B, N]
        index = index.view(*index.shape, *([1] * (x.dim() - 3))).expand(*x[:, 0].shape)
        return torch.zeros(x.shape[0], heads, *x.shape[3:], dtype=x.dtype, device=x.device).scatter_add_(1, index, x[:, 0])

    return total


class AutoLayer(ByteBudget, EvictingLayer):
    """See the module docstring."""

    kind = "auto"
    spec_order = 5
    spec_options = {"bytes": BYTE_BUDGET_OPTIONS["bytes"], "recent": Option(int, least=0), "sinks": Option(int, least=0),
                    **BYTE_BUDGET_OPTIONS}  # fmt: skip
    #: ``budget``: the eviction layer's own argument, which this kind sets itself from ``bytes``.
    keyword_options = {**EvictingLayer.keyword_options, "budget": Option(number, least=0, inclusive=False)}
    required_options = ("bytes",)

    @classmethod
    def spec_kinds(cls) -> dict[str, dict[str, Any]]:
        return {"auto": {}}

    @classmethod
    def kind_options(cls, fixed: Mapping[str, Any]) -> dict[str, Option]:
        from .policies import POLICIES

        return {**cls.spec_options, **POLICIES["snapkv"].spec_options}

    def __init__(
        self,
        bytes: int | float,  # noqa: A002 - the spec's word
        recent: int | None = None,
        sinks: int = 0,
        storage: str = "full",
        layer: int | None = None,
        layers: int | None = None,
        rule: str = "mass",
        drop: float | None = None,
        codes: str = "plain",
        tolerance: float | None = None,
        margin: float | None = None,
        fine_share: float | None = None,
        **policy_options: Any,
    ) -> None:
        """``bytes``: a share (below 1) or bytes of the whole cache; ``storage``: where the layer
        starts (a saved layer's choice; a new one starts in full precision and chooses); ``rule``:
        how a case is scored (:data:`RULES`, :func:`weigh`); ``tolerance``: cases are compared by
        what they drop, among those whose kept slots' mean coding error (``Estimate.bounded``) is
        at most it (default ``byte_budget.TOLERANCE`` under the ``mass`` rule unless ``drop`` is
        given); ``drop``: compare by distortion instead, the lowest ``drop * dropped + coding``
        winning; ``margin``: with a tolerance, the finest case within it of the least dropped
        wins; ``codes``: ``plain``
        chooses among full, int8, int4 and int2, ``rotated`` among full, int8h, int4h and int2h
        (``formats/rotated.py``); ``fine_share``: also among the mixed storage of each two next
        storages (``byte_budget.mixed_ladder``, ``tiers.py``)."""
        size = self.check_options(bytes=bytes)["bytes"]
        self._init_budget(size, rule, drop, codes, storage, tolerance, margin, fine_share)
        start = "full" if mixed_parts(storage) else storage
        super().__init__(size if isinstance(size, float) else 1 << 62, "snapkv", recent, sinks, start, layer, layers, **policy_options)
        if start != storage:  # a saved layer's mixed storage
            self._enter_storage(storage)
        self.byte_budget = size

    def budget_now(self, seen: int | None = None) -> int:
        """Slots kept after ``seen`` tokens (default: now) in the present storage; at least one."""
        if self.geometry is None:
            return 1
        seen = self.seen if seen is None else seen
        return max(1, slots_within(self.allowed_bytes(seen), self._slot_bytes(self.stored_as), self._growing))

    def _slot_bytes(self, storage: str) -> float:
        """Bytes of one slot in ``storage`` (a mixed one's mean) in the layer's geometry."""
        return mean_slot_bytes(storage, lambda name: slot_bytes(name, self.geometry))

    def recent_now(self, seen: int | None = None) -> int:
        return self.recent if self.recent is not None else self.policy.recent_for(self.budget_now(seen))

    # ---- the decision ---------------------------------------------------------------------------

    def weights_for(self, queries: int) -> str | tuple[str, ...] | None:
        """The policy's weights; under ``rule=attention`` a prompt pass also reports its window's
        queries (``"queries:N"``, N the policy's window), which ``choose`` measures with."""
        asked = super().weights_for(queries)
        return (asked, f"queries:{self.policy.window}") if self.rule == "attention" and asked is not None else asked

    def _settle(self, weights: torch.Tensor | dict[str, torch.Tensor] | None) -> None:
        queries = None
        if isinstance(weights, dict):
            queries = weights[f"queries:{self.policy.window}"]
            weights = weights[self.policy.weights]
        if self._set is not None and weights is not None:
            s, self._set = self._set, None
            self._decide(s, weights, queries)
            return
        super()._settle(weights)

    def choose(self, slots: dict[str, torch.Tensor], weights: torch.Tensor, queries: torch.Tensor | None = None) -> Choice:
        """The storage for candidate ``slots`` scored by a pass's ``weights`` ``[B, Hkv, N]`` (the
        module docstring's rule); ``rule=attention`` measures with the window's ``queries``
        ``[B, Hkv, group, W, D]`` (``auto_measure.py``)."""
        g = self.geometry
        n = slots["positions"].shape[2]
        keys, values = self.storage.decode(slots, n, g)
        mass = weights.float().clamp_min(0)
        mass = mass / mass.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        allowed = self.allowed_bytes(self.seen)
        reference = None
        if self.rule == "attention":
            if queries is None:
                raise ValueError(f"auto layer with rule=attention: a decision needs the window's queries ('queries:{self.policy.window}')")
            reference = window(queries, keys, values, slots["positions"], self.seen)
        estimates = []
        for name in self.ladder[self.ladder.index(self.stored_as) :]:
            count = min(n, slots_within(allowed, self._slot_bytes(name), self._growing))
            if count < 1:
                continue
            recent = self.recent if self.recent is not None else self.policy.recent_for(count)
            protected = (slots["positions"] < self.sinks) | (slots["positions"] >= self.seen - recent)
            kept = slots["scores"].masked_fill(protected, math.inf).topk(count, dim=-1).indices  # [B, H, count]
            if reference is not None:
                estimates.append(Estimate(name, count, *measure(name, kept, reference, g)))
            else:
                estimates.append(weigh_storage(name, count, kept, self._rank(slots), slots["positions"], mass, keys, values, g.heads, g, self.rule))
        if not estimates:  # not even one slot is affordable: the coarsest storage, one slot
            estimates.append(Estimate(self.ladder[-1], 1, 1.0, 0.0))
        best = self._best(estimates)
        return Choice(best.storage, best.slots, self.seen, tuple(estimates))

    # ---- state ----------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The spec's options and the storage chosen (``storage``); a file's loader compares the
        spec's options only (``spec_options_of``)."""
        return {"bytes": self.byte_budget, "recent": self.recent, "sinks": self.sinks, "storage": self.stored_as,
                **self.policy.options(), "layers": self.layer_count, "rule": self.rule, "drop": self.drop, "codes": self.codes,
                "tolerance": self.tolerance, "margin": self.margin, "fine_share": self.fine_share}  # fmt: skip

    def load_state(self, state: LayerState) -> None:
        self._load_in_storage(state, super().load_state)

    def check_state(self, state: LayerState) -> None:
        """The eviction layer's checks, read in the state's storage and geometry (its slots are
        counted against the budget that storage affords)."""
        storage = self._state_storage(state, self.stored_as)
        with self._in_storage(storage):
            if state.tensors and self.geometry is None and self.tiered:
                self.geometry = self.store.geometry_of(self.store.split_saved(dict(state.tensors)))
            elif state.tensors and self.geometry is None and all(n in state.tensors for n in (*self.storage.names, "positions")):
                batch = state.tensors["positions"].shape[0]
                self.geometry = replace(self.storage.geometry(dict(state.tensors)), batch=batch)
            super().check_state(state)
