"""What a layer's queries read, and the one function that attends it.

Every layer's append returns a ``Reads`` record: the keys and values its new queries attend
(views of the store, a temporary concatenation for a chunk that overflows the store, or a
``BlockReader`` over codes), where each slot sits in the sequence, where the queries sit, and what
the pass must do for this update (its ``Visibility`` rule, the attention weights its policy asks
for). Unbounded layers hand the model ``returned`` and forget the record; a bounded layer keeps it
as ``pending`` until its attention settles it. ``attend_reads`` builds the mask from the positions
and the visibility rule (``masks.py``), runs the kernel once and returns the weights asked for.

Design: docs/architecture.md, "The read record".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernel import attend_weighted
from .masks import CAUSAL, VisibilityRule, bias_at_slots, filled_slots, position_rows
from .readers import TensorLike


@dataclass(slots=True)  # one per layer per step: slots make it cheap to build
class Reads:
    """The read record of one update.

    ``keys`` ``[B, Hkv, N, D]`` and ``values`` ``[B, Hkv, N, Dv]`` (or ``keys`` a ``BlockReader``
    and ``values`` None); ``positions``: the absolute position of each slot ``[B|1, Hkv|1, N]``
    (-1 for an empty slot), a callable giving them when only a masked step needs them, or None
    when slot ``j`` holds position ``j``; ``first_query``: the position of the update's first
    token; ``queries``: how many tokens it appended; ``all_visible``: every slot is visible to
    every query (no mask needed); ``new_at_end``: see the field; ``returned``: the (keys, values) ``update`` handed the model
    (default: ``keys``, ``values``), by which the attention of a forward pass recognises the record;
    ``visibility``: which slot each query may see (a rule of ``masks.py``; None: ``CAUSAL``); ``weights``: the
    attention weights this update's pass must report (``attend_weighted``'s modes; None for none).
    """

    keys: TensorLike
    values: torch.Tensor | None
    positions: torch.Tensor | Callable[[], torch.Tensor] | None
    first_query: int
    queries: int
    all_visible: bool = False
    #: The last ``queries`` slots are the update's tokens in order and every earlier slot is older
    #: than the first of them (an eviction store's survivors, then the new tokens): causal
    #: visibility is then the kernel's end-aligned ``causal``, which skips the keys in every row's future.
    new_at_end: bool = False
    #: Some slots are empty (position -1: the padding of a per-head layout, ``layers/by_head.py``).
    #: With ``new_at_end`` they are hidden by one key mask, so the pass stays on the kernel's ``causal``.
    padded: bool = False
    returned: tuple[torch.Tensor, torch.Tensor] | None = None
    visibility: VisibilityRule | None = None
    weights: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.returned is None:
            self.returned = (self.keys, self.values)

    def slot_positions(self) -> torch.Tensor:
        """``positions`` as a tensor (``[N]`` when slots are positions in order)."""
        if self.positions is None:
            return torch.arange(self.keys.shape[2], device=self.keys.device)
        return self.positions() if callable(self.positions) else self.positions


def attend_reads(
    query: torch.Tensor,
    reads: Reads,
    visible: VisibilityRule | None = None,
    *,
    first_query: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    weights: str | tuple[str, ...] | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor] | None]:
    """Attention of ``query`` ``[B, Hq, Sq, D]`` at positions ``first_query...`` (default: the
    record's) over what ``reads`` holds, masked by ``visible`` (default: the record's rule) and ``mask`` (boolean over absolute
    positions, see ``position_rows``), plus ``bias``: additive logits over absolute positions
    ``[B|1, Hq|1, Sq, P]`` (``bias_at_slots``). Returns ``[B, Hq, Sq, Dv]`` and the weights asked
    for (``attend_weighted``'s modes, float32 ``[B, Hkv, N]``, a dict for a tuple of modes) or None."""
    rows, causal, filled = None, False, None
    visible = (reads.visibility or CAUSAL) if visible is None else visible
    if visible == CAUSAL and mask is None and not reads.all_visible and _end_aligned(reads, first_query):
        causal = True  # the same rule, with no mask to build (see ``Reads.new_at_end``)
        if reads.padded:
            filled = filled_slots(reads.slot_positions(), query.shape[1])  # [B|1, Hq|1, 1, N]
    elif mask is not None or not reads.all_visible:
        first = reads.first_query if first_query is None else first_query
        rows = position_rows(first, reads.slot_positions(), visible, mask, reads.keys.shape[1])
    slot_mask = None if bias is None else bias_at_slots(bias, reads.slot_positions(), query.shape[1])
    if filled is not None:
        slot_mask = filled if slot_mask is None else slot_mask.masked_fill(~filled, float("-inf"))
    return attend_weighted(
        query, reads.keys, reads.values, scale=scale, softcap=softcap, mask=slot_mask, mask_rows=rows, causal=causal,
        weights=weights, sinks=sinks,
    )


def _end_aligned(reads: Reads, first_query: int | None) -> bool:
    """Whether causal visibility by position is the kernel's end-aligned ``causal`` for these queries."""
    if first_query is not None and first_query != reads.first_query:
        return False
    if reads.new_at_end:
        return True
    return reads.positions is None and reads.keys.shape[2] == reads.first_query + reads.queries
