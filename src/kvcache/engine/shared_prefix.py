"""Decode rows that share prefix blocks read them once per step (cascade attention).

When many requests continue one system prompt, their block tables start with the same blocks (the
pool shares them, ``scheduler.py``). Attending row by row reads those keys and values once per
row; here the rows of a group are stacked as the query rows of one pass over the shared blocks
(the paged kernel scores a tile of keys against every row while it sits in cache), each row's
own remaining blocks are read in a second pass, and the two are merged by their log-sum-exps:

    out = (out_1 * exp(lse_1 - m) + out_2 * exp(lse_2 - m)) / (exp(lse_1 - m) + exp(lse_2 - m)),
    m = max(lse_1, lse_2)

which is softmax attention over the union of the keys, exactly up to float rounding (FlashInfer's
cascade and Hydragen do the same on GPUs).

``plan`` finds the groups from the tables alone: rows whose tables start with the same blocks,
``MIN_TOKENS`` worth of them, form a group, which shares its rows' longest common run of leading
blocks, minus any block a row is still writing. A group needs at least ``MIN_ROWS`` rows, else
its rows are read the plain way. A group larger than the kernel's rows per pass is split into
passes of up to ``native.PAGED_MAX_ROWS // R`` rows (``R`` query heads per KV head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention import native
from .rows import padded

#: Rows a group needs before its prefix is read once for all of them.
MIN_ROWS = 2
#: Shared tokens a group needs (below this, a second pass and a merge cost more than they save).
MIN_TOKENS = 64


@dataclass(frozen=True)
class Pass:
    """One read of shared blocks: ``rows`` (indices into the step's decode rows) attend the first
    ``length`` tokens of blocks ``table`` (int32 ``[1, blocks]``)."""

    rows: torch.Tensor  # int64 [n]
    table: torch.Tensor  # int32 [1, blocks]
    length: torch.Tensor  # int64 [1]


@dataclass(frozen=True)
class Plan:
    """How a step's decode rows read the pool: ``passes`` over shared prefixes, then every row over
    its own blocks ``tables`` (int32 ``[S, width]``) for ``lengths`` (int64 ``[S]``) tokens: the
    blocks after its shared prefix, or all of them for a row in no group."""

    passes: tuple[Pass, ...]
    tables: torch.Tensor
    lengths: torch.Tensor


def groups(tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int) -> list[tuple[list[int], int]]:
    """The groups of decode rows (block ``tables``, ``lengths`` tokens each, the new token included)
    that share enough leading blocks to read them once: each as (its rows, the full blocks they
    share that none writes this step), in the order of their first row."""
    lead = -(-MIN_TOKENS // block_size)  # blocks a group must at least share
    found: dict[tuple[int, ...], list[int]] = {}
    for i, (table, n) in enumerate(zip(tables, lengths)):
        if (n - 1) // block_size >= lead:
            found.setdefault(tuple(table[:lead]), []).append(i)
    out = []
    for rows in found.values():
        if len(rows) < MIN_ROWS:
            continue
        # full blocks every row reads and none writes this step (its new token lies past them)
        shared = min((lengths[i] - 1) // block_size for i in rows)
        first = tables[rows[0]]
        for i in rows[1:]:
            table = tables[i]
            common = 0
            while common < shared and table[common] == first[common]:
                common += 1
            shared = common
        out.append((rows, shared))
    return out


def plan(tables: Sequence[Sequence[int]], lengths: Sequence[int], block_size: int, group_heads: int) -> Plan | None:
    """The passes for decode rows with block ``tables`` and ``lengths`` (tokens each row attends,
    its new token included), or None when no group shares enough to be worth a pass."""
    per_pass = max(1, native.PAGED_MAX_ROWS // group_heads)
    passes, skip = [], [0] * len(tables)
    for rows, shared in groups(tables, lengths, block_size):
        table = torch.tensor([list(tables[rows[0]][:shared])], dtype=torch.int32)
        length = torch.tensor([shared * block_size], dtype=torch.int64)
        for start in range(0, len(rows), per_pass):
            passes.append(Pass(torch.tensor(rows[start : start + per_pass], dtype=torch.int64), table, length))
        for i in rows:
            skip[i] = shared
    if not passes:
        return None
    own = padded([table[s:] for table, s in zip(tables, skip)])
    own_lengths = torch.tensor([n - s * block_size for n, s in zip(lengths, skip)], dtype=torch.int64)
    return Plan(tuple(passes), own, own_lengths)


def attend(p: Plan, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Decode attention float32 ``[S, Hkv, R, Dv]`` of query rows ``q`` ``[S, Hkv, R, D]`` over pool
    blocks ``keys``/``values`` ``[blocks, Hkv, block_size, D]`` read as ``p`` says; None where the
    paged kernel cannot run (the caller then reads row by row)."""
    got = native.paged_decode(q, keys, values, p.tables, p.lengths, scale, lse=True)
    if got is None:
        return None
    out, lse = got
    seqs, heads, rows, dim = q.shape
    for shared in p.passes:
        n = len(shared.rows)
        stacked = q[shared.rows].transpose(0, 1).reshape(1, heads, n * rows, dim)
        part = native.paged_decode(stacked, keys, values, shared.table, shared.length, scale, lse=True)
        if part is None:
            return None
        o1 = part[0].reshape(heads, n, rows, -1).transpose(0, 1)
        l1 = part[1].reshape(heads, n, rows).transpose(0, 1)
        out[shared.rows] = merge(o1, l1, out[shared.rows], lse[shared.rows])
    return out


def merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Attention ``[..., Dv]`` over the union of two sets of keys, from each set's attention
    ``o1``/``o2`` ``[..., Dv]`` and log-sum-exp ``l1``/``l2`` ``[...]`` (the module docstring's
    formula). Either log-sum-exp may be -inf (no keys in that set: its weight is 0), not both."""
    top = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
    return (o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]
