"""Decode attention over a block pool's tables (the read side of PagedAttention).

Each sequence of a decode step attends its own first ``length`` tokens, which lie in the pool's
blocks in the order of its block table (``pool.py``). ``paged_decode`` runs the float decode
library's paged entry (``attention.native.paged_decode``: one pass over each block, the query heads
of a group packed per KV head, ragged lengths, blocks spread over the threads); where the library
cannot run it gathers each sequence's blocks and calls torch's SDPA, one sequence at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..attention import device_kernels
from .pool import BlockPool, PoolError


def paged_decode(
    pool: BlockPool,
    layer: int,
    query: torch.Tensor,
    tables: Sequence[Sequence[int]],
    lengths: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention ``[S, Hq, 1, Dv]`` (the query's dtype) of one query token per sequence, ``query``
    ``[S, Hq, 1, D]`` (``Hq`` a multiple of the pool's KV heads), over layer ``layer`` of ``pool``:
    sequence ``s`` reads its first ``lengths[s]`` tokens from blocks ``tables[s]``, which must be
    owned and cover them. ``scale`` defaults to ``1 / sqrt(D)``. Raises ``PoolError`` on a table or
    length that does not fit, changing nothing."""
    seqs, q_heads, q_len, dim = _check(pool, layer, query, tables, lengths)
    blocks = pool.storage.layer(layer)
    keys, values = blocks["keys"], blocks["values"]
    scale = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    kv_heads = pool.kv_heads
    width = max((len(t) for t in tables), default=0) or 1
    table = torch.zeros(seqs, width, dtype=torch.int32)
    for s, t in enumerate(tables):
        table[s, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
    packed = query.reshape(seqs, kv_heads, q_heads // kv_heads, dim)
    out = device_kernels.paged_decode(packed, keys, values, table, torch.tensor(list(lengths), dtype=torch.int64), scale)
    if out is not None:
        return out.reshape(seqs, q_heads, 1, -1).to(query.dtype)
    return _gathered(pool, layer, query, tables, lengths, scale)


def _gathered(pool, layer, query, tables, lengths, scale) -> torch.Tensor:
    """The same through torch: each sequence's blocks gathered, then SDPA (grouped heads)."""
    rows = []
    for s, (table, length) in enumerate(zip(tables, lengths)):
        if length == 0:
            rows.append(query.new_zeros(1, query.shape[1], 1, pool.value_dim))
            continue
        keys, values = pool.gather(layer, table)
        k, v = keys[None, :, :length].to(query.dtype), values[None, :, :length].to(query.dtype)
        rows.append(F.scaled_dot_product_attention(query[s : s + 1], k, v, scale=scale, enable_gqa=True))
    return torch.cat(rows, dim=0)


def _check(pool, layer, query, tables, lengths) -> tuple[int, int, int, int]:
    if not isinstance(query, torch.Tensor) or query.dim() != 4 or query.shape[2] != 1:
        raise PoolError(f"query must be [S, Hq, 1, D], got {getattr(query, 'shape', type(query).__name__)}")
    seqs, q_heads, q_len, dim = query.shape
    if not pool.exact:
        raise PoolError(f"paged_decode reads full-precision blocks; this pool's are {pool.format.name} (its step reads them)")
    if q_heads % pool.kv_heads or dim != pool.head_dim:
        raise PoolError(f"query has {q_heads} heads of {dim}; the pool has {pool.kv_heads} KV heads of {pool.head_dim}")
    if not 0 <= int(layer) < pool.layers:
        raise PoolError(f"layer {layer} is not one of the pool's {pool.layers}")
    if len(tables) != seqs or len(lengths) != seqs:
        raise PoolError(f"{seqs} queries need {seqs} tables and lengths, got {len(tables)} and {len(lengths)}")
    for s, (table, length) in enumerate(zip(tables, lengths)):
        if length < 0 or -(-length // pool.block_size) > len(table):
            raise PoolError(f"sequence {s}: {len(table)} blocks of {pool.block_size} cannot hold {length} tokens")
        for block in table[: -(-length // pool.block_size)]:
            if not 0 <= block < pool.total or pool.refcount(block) == 0:
                raise PoolError(f"sequence {s}: block {block} is not an owned block of the pool")
    return seqs, q_heads, q_len, dim
