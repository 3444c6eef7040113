"""A flat store's slots laid out per KV head, for a pass of several queries.

A flat store (``shared_budget.py``) keeps every KV head's slots in one run ``[B, 1, N]``. Read as
one KV head, every query head scores every slot of the layer and a mask per query head hides the
other heads' slots: ``Hkv`` times the work of a per-head layout, and a mask per query row. That
suits a decode step, which is bound by reading the keys once; a prefill is bound by the scores.

So a pass of several queries reads the slots laid out per head, ``[B, Hkv, W, ...]``: each head's
older slots in store order, then empty cells, then the pass's new tokens in position order (always
the last ``Hkv * n`` slots of the flat set, head-major). Every older slot is visible to every new
query and the new tokens sit at the end of each row, so causal visibility is the kernel's
end-aligned ``causal``; empty cells (position -1) are hidden by one key mask. ``W`` is the widest
head's older slots plus ``n``.

The weights that pass reports, per cell ``[B, Hkv, W]``, go back to the flat slots with ``flat``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ByHead:
    """Where each flat slot sits in the per-head layout (see the module docstring).

    ``positions`` ``[B, Hkv, W]``: each cell's absolute position, -1 for an empty one;
    ``source`` ``[B, Hkv * W]``: the flat slot each cell reads (0 for an empty one), None when the
    flat run is already the layout (head-major, as wide as every head: a first pass);
    ``cells`` ``[B, N]``: each flat slot's cell (``head * W + column``), None likewise;
    ``padded``: some cell is empty."""

    positions: torch.Tensor
    source: torch.Tensor | None
    cells: torch.Tensor | None
    padded: bool

    @classmethod
    def of(cls, heads: torch.Tensor, positions: torch.Tensor, kv_heads: int, new: int) -> ByHead:
        """The layout of a flat set whose last ``kv_heads * new`` slots are a pass's new tokens,
        head-major: ``heads`` (KV head of each slot) and ``positions`` ``[B, 1, N]``."""
        batch, n_slots = positions.shape[0], positions.shape[2]
        older = n_slots - kv_heads * new
        if older == 0:
            return cls(positions.reshape(batch, kv_heads, new).long(), None, None, False)
        head = heads[:, 0, :older].long()  # [B, older]
        one_hot = torch.nn.functional.one_hot(head, kv_heads)  # [B, older, Hkv]
        column = (one_hot.cumsum(dim=1) - 1).gather(2, head.unsqueeze(-1)).squeeze(-1)  # rank within its head
        counts = one_hot.sum(dim=1)  # [B, Hkv]
        widest = int(counts.max())
        width = widest + new
        device = positions.device
        new_cells = (torch.arange(kv_heads, device=device) * width + widest).repeat_interleave(new) + torch.arange(
            new, device=device
        ).repeat(kv_heads)
        cells = torch.cat([head * width + column, new_cells.expand(batch, -1)], dim=1)  # [B, N]
        slots = torch.arange(n_slots, device=device).expand(batch, -1)
        source = torch.zeros(batch, kv_heads * width, dtype=torch.long, device=device).scatter_(1, cells, slots)
        cell_positions = torch.full((batch, kv_heads * width), -1, dtype=torch.long, device=device)
        cell_positions.scatter_(1, cells, positions[:, 0].long())
        padded = bool((counts < widest).any())
        return cls(cell_positions.view(batch, kv_heads, width), source, cells, padded)

    @property
    def width(self) -> int:
        return self.positions.shape[2]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """Flat slots ``[B, 1, N, X]`` laid out per head: ``[B, Hkv, W, X]`` (a view for a first pass)."""
        batch, kv_heads, width = self.positions.shape
        if self.source is None:
            return t.reshape(batch, kv_heads, width, t.shape[-1])
        index = self.source.unsqueeze(-1).expand(batch, kv_heads * width, t.shape[-1])
        return t[:, 0].gather(1, index).view(batch, kv_heads, width, t.shape[-1])

    def flat(self, cells: torch.Tensor) -> torch.Tensor:
        """Per-cell values ``[B, Hkv, W]`` (a pass's weights) back on the flat slots: ``[B, 1, N]``."""
        batch = cells.shape[0]
        if self.cells is None:
            return cells.reshape(batch, 1, -1)
        return cells.reshape(batch, -1).gather(1, self.cells).unsqueeze(1)
