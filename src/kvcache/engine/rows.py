"""The rows of one engine step: what each request puts into the packed forward pass, and the step's
rows split by how they attend (``StepRows``). ``step.py`` runs them; ``block_io.py`` reads and
writes their blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Row:
    """One request's part of a step: ``count`` tokens at ``start`` in the packed sequence, after
    ``past`` tokens already in the pool, all of them in blocks ``table`` (in order)."""

    start: int
    count: int
    past: int
    table: tuple[int, ...]
    #: The row's open block in a pool that codes blocks whole (its unfilled last block); else -1.
    tail: int = -1
    #: Attention weights to report for this row (a chunk of a prompt to be compressed): modes of
    #: ``attend_weighted`` (``("window:32",)``), or None.
    weights: tuple[str, ...] | None = None
    #: The row's own bounded cache (a ``KVCache``), which holds its context instead of ``table``.
    cache: Any = None

    @property
    def length(self) -> int:
        """Tokens of the row in the pool once this step has written them."""
        return self.past + self.count


def padded(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """Block ``tables`` as int32 ``[len(tables), longest]`` (at least one column; zeros past each
    table's own entries, which the paged kernels never read; on the CPU)."""
    out = torch.zeros(len(tables), max(1, max((len(t) for t in tables), default=0)), dtype=torch.int32)
    for i, table in enumerate(tables):
        out[i, : len(table)] = torch.tensor(list(table), dtype=torch.int32)
    return out


def slots_of(rows: Sequence[Row], block_size: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Where the rows' new tokens go, one after the other: their blocks and offsets in them, int64
    ``[tokens]`` each, on ``device``."""
    slots = [(r.table[t // block_size], t % block_size) for r in rows for t in range(r.past, r.length)]
    blocks = torch.tensor([b for b, _ in slots], dtype=torch.long, device=device)
    return blocks, torch.tensor([o for _, o in slots], dtype=torch.long, device=device)


def tables_of(rows: list[Row]) -> torch.Tensor:
    """The rows' block tables as int32 ``[rows, longest]`` (``padded``)."""
    return padded([r.table for r in rows])


class StepRows:
    """A step's ``rows`` (one after the other from token 0 of the packed sequence) split by how
    they attend, with the decode rows' packed positions and tables on ``device``."""

    def __init__(self, rows: list[Row], device: torch.device) -> None:
        self.rows = rows
        self.tokens = sum(r.count for r in rows)
        #: Rows whose context lives in a bounded cache of their own (not in the pool).
        self.own_rows = [r for r in rows if r.cache is not None]
        #: Rows whose context lives in the pool's blocks.
        self.pooled_rows = [r for r in rows if r.cache is None]
        # One new token after a past is a decode row, unless it must report weights (a prompt's last
        # chunk of one token, to be compressed): that goes the way of a chunk.
        self.decode_rows = [r for r in self.pooled_rows if r.count == 1 and r.past > 0 and r.weights is None]
        self.chunk_rows = [r for r in self.pooled_rows if not (r.count == 1 and r.past > 0 and r.weights is None)]
        #: Chunk rows that report no weights (the pool's prefill kernel may take them all at once),
        #: and those that do (each through ``attend_weighted``).
        self.plain_chunk_rows = [r for r in self.chunk_rows if r.weights is None]
        self.reporting_rows = [r for r in self.chunk_rows if r.weights is not None]
        self.decode_tokens = torch.tensor([r.start for r in self.decode_rows], dtype=torch.long, device=device)
        self.decode_tables = tables_of(self.decode_rows).to(device)  # one copy to a GPU, not one a row
