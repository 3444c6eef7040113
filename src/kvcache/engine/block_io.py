"""How a step reads and writes the pool's blocks, by what their format allows.

``PagedStep`` (``step.py``) is one step over any pool: it packs the rows, runs rows with a cache of
their own, and attends every prefill chunk over its past and itself. What depends on the format
is here, behind four calls per layer:

- ``before``: store what must be in the blocks before attention;
- ``decode``: attend the decode rows (one new token after a past) together;
- ``chunks``: attend the prefill chunks that report no weights together, or None (then each chunk
  attends its ``past`` and itself in the step);
- ``past``: a row's first ``past`` tokens as keys and values ``[Hkv, past, D]``;
- ``after``: store what attention had to read exact first.

``SlotIO`` serves formats that take single slots (full precision): every new token is written into
its slot before attention, and decode rows read the blocks through the paged kernel, rows sharing
a prefix reading it once; prompt chunks read their past and themselves from the blocks through
the paged prefill kernel, all chunks of the step in one call. ``OpenBlockIO`` serves formats that code a block whole (int8/int4/int2):
a decode row's token goes into its open block first; decode rows read the codes through the coded
library (``fused_paged``) or, where it cannot run, SDPA over their dequantized blocks; after
attention the blocks that filled are coded and a chunk's remainder becomes its open block. So a
token is attended exactly until the step after its block fills, and coded from then on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import device_kernels
from ..formats.blocks import as_blocks, flat
from . import shared_prefix
from .paged import paged_decode
from .pool import BlockPool
from .rows import Row, StepRows, slots_of, tables_of


def block_io(pool: BlockPool, step: StepRows) -> SlotIO | OpenBlockIO:
    """The reads and writes of ``step`` over ``pool``, by its format."""
    return OpenBlockIO(pool, step) if pool.open_blocks else SlotIO(pool, step)


class SlotIO:
    def __init__(self, pool: BlockPool, step: StepRows) -> None:
        self.pool, self.step = pool, step
        bs, device = pool.block_size, pool.device
        rows = step.pooled_rows
        self.slot_blocks, self.slot_offsets = slots_of(rows, bs, device)
        #: The packed positions of the pool's rows' tokens, when other rows have a cache of their own.
        self.pooled = (
            torch.tensor([t for r in rows for t in range(r.start, r.start + r.count)], dtype=torch.long, device=device)
            if step.own_rows else None
        )
        self.decode_lengths = torch.tensor([r.length for r in step.decode_rows], dtype=torch.int64, device=device)
        plain = step.plain_chunk_rows
        #: The packed positions of the chunks ``chunks`` attends (made only where there are some).
        self.chunk_tokens = torch.tensor([t for r in plain for t in range(r.start, r.start + r.count)], dtype=torch.long, device=device)
        if plain:  # their starts among those positions, pasts and tables
            self.chunk_starts = torch.tensor([0] + [r.count for r in plain], dtype=torch.int64).cumsum(0)
            self.chunk_pasts = torch.tensor([r.past for r in plain], dtype=torch.int64)
            self.chunk_tables = tables_of(plain)
        #: Decode rows that read a shared prefix in one pass with other rows.
        self.shared_rows = 0
        #: How the decode rows read shared prefixes (``shared_prefix.plan``), made at the first
        #: layer (it needs the query heads per KV head); False until then, None for none.
        self._sharing: shared_prefix.Plan | None | bool = False

    def before(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        new_keys, new_values = key[0], value[0]
        if self.pooled is not None:
            new_keys, new_values = new_keys[:, self.pooled], new_values[:, self.pooled]
        self.pool.storage.write_slots(
            layer, self.slot_blocks, self.slot_offsets, new_keys.transpose(0, 1), new_values.transpose(0, 1)
        )

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode rows' attention ``[S, Hq, Dv]``, query ``[S, Hq, D]``."""
        pool, step = self.pool, self.step
        seqs, q_heads, dim = q.shape
        packed = q.reshape(seqs, pool.kv_heads, q_heads // pool.kv_heads, dim)
        blocks = pool.storage.layer(layer)
        if self._sharing is False:
            tables, lengths = [r.table for r in step.decode_rows], [r.length for r in step.decode_rows]
            self._sharing = shared_prefix.plan(tables, lengths, pool.block_size, q_heads // pool.kv_heads)
        if self._sharing is not None:
            got = shared_prefix.attend(self._sharing, packed, blocks["keys"], blocks["values"], scale)
            if got is not None:
                self.shared_rows = sum(len(p.rows) for p in self._sharing.passes)
                return got.reshape(seqs, q_heads, -1)
        got = device_kernels.paged_decode(packed, blocks["keys"], blocks["values"], step.decode_tables, self.decode_lengths, scale)
        if got is not None:
            return got.reshape(seqs, q_heads, -1)
        tables, lengths = [r.table for r in step.decode_rows], [r.length for r in step.decode_rows]
        return paged_decode(pool, layer, q[:, :, None], tables, lengths, scale)[:, :, 0]

    def chunks(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """The attention ``[N, Hq, Dv]`` (float32) of the chunk rows that report no weights, their
        tokens in step order (``chunk_tokens``), query ``[1, Hq, T, D]``; None where the paged
        prefill kernel cannot take them (the step then attends each chunk over its gathered past)."""
        if not len(self.chunk_tokens):
            return None
        pool = self.pool
        q_heads, dim = query.shape[1], query.shape[3]
        q = query[0][:, self.chunk_tokens].reshape(pool.kv_heads, q_heads // pool.kv_heads, -1, dim).transpose(1, 2)
        blocks = pool.storage.layer(layer)
        got = device_kernels.paged_prefill(
            q, blocks["keys"], blocks["values"], self.chunk_tables, self.chunk_starts, self.chunk_pasts, scale
        )
        if got is None:
            return None
        return got.transpose(1, 2).reshape(q_heads, -1, got.shape[-1]).transpose(0, 1)

    def past(self, layer: int, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.pool.gather(layer, row.table[: -(-row.past // self.pool.block_size)])
        return keys[:, : row.past], values[:, : row.past]

    def after(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        return None


class OpenBlockIO:
    #: Coded pools read no prefix once for several rows.
    shared_rows = 0

    def __init__(self, pool: BlockPool, step: StepRows) -> None:
        self.pool, self.step = pool, step
        bs, device = pool.block_size, pool.device
        missing = next((r for r in step.pooled_rows if not 0 <= r.tail < pool.tail_count), None)
        if missing is not None:
            raise ValueError(f"a row of a coded pool needs an open block, got tail {missing.tail}")
        dec = step.decode_rows
        self.decode_tails = torch.tensor([r.tail for r in dec], dtype=torch.long, device=device)
        self.decode_offsets = torch.tensor([r.past % bs for r in dec], dtype=torch.long, device=device)
        self.decode_coded = torch.tensor([r.past // bs * bs for r in dec], dtype=torch.int64, device=device)
        self.decode_open = torch.tensor([r.past % bs + 1 for r in dec], dtype=torch.int64, device=device)
        filled = [r for r in dec if r.length % bs == 0]
        self.filled_tails = torch.tensor([r.tail for r in filled], dtype=torch.long, device=device)
        self.filled_blocks = torch.tensor([r.table[r.past // bs] for r in filled], dtype=torch.long, device=device)

    def before(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if not self.step.decode_rows:
            return
        tail = self.pool.open.layer(layer)
        new = self.step.decode_tokens
        tail["keys"][self.decode_tails, :, self.decode_offsets] = key[0, :, new].transpose(0, 1).float()
        tail["values"][self.decode_tails, :, self.decode_offsets] = value[0, :, new].transpose(0, 1).float()

    def decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode rows' attention ``[S, Hq, Dv]`` (float32), query ``[S, Hq, D]``."""
        pool, step = self.pool, self.step
        seqs, q_heads, dim = q.shape
        packed = q.reshape(seqs, pool.kv_heads, q_heads // pool.kv_heads, dim)
        coded, tail = pool.storage.layer(layer), pool.open.layer(layer)
        got = device_kernels.paged_coded_decode(
            packed,
            (coded["kcodes"], coded["kscale"], coded["kmin"]),
            (coded["vcodes"], coded["vscale"], coded["vmin"]),
            pool.format.bits, pool.format.group_of(pool.value_dim), step.decode_tables, self.decode_coded,
            tail["keys"], tail["values"], self.decode_tails.to(torch.int32), self.decode_open, scale,
            fp8=pool.format.fp8,
        )  # fmt: skip
        if got is not None:
            return got.reshape(seqs, q_heads, -1)
        rows = []
        for s, r in enumerate(step.decode_rows):
            k, v = self._read(layer, r, r.past // pool.block_size, r.past % pool.block_size + 1)
            qs = q[s : s + 1, :, None].float()  # [1, Hq, 1, D]
            rows.append(F.scaled_dot_product_attention(qs, k[None], v[None], scale=scale, enable_gqa=True)[0, :, 0])
        return torch.stack(rows)

    def chunks(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor | None:
        """None: a chunk attends its past dequantized and itself exact, in the step."""
        return None

    def past(self, layer: int, row: Row) -> tuple[torch.Tensor, torch.Tensor]:
        return self._read(layer, row, *divmod(row.past, self.pool.block_size))

    def _read(self, layer: int, row: Row, full: int, open_: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, full * bs + open_, D]`` keys and values (float32) of ``row``: its first ``full``
        coded blocks dequantized, then the first ``open_`` tokens of its open block."""
        k, v = self.pool.storage.read_blocks(layer, torch.tensor(row.table[:full], dtype=torch.long, device=self.pool.device))
        tail = self.pool.open.layer(layer)
        tk, tv = tail["keys"][row.tail, :, :open_], tail["values"][row.tail, :, :open_]
        return torch.cat([flat(k), tk], dim=1), torch.cat([flat(v), tv], dim=1)

    def after(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Code the blocks that filled, then keep each chunk (its full blocks coded, the rest open)."""
        pool = self.pool
        tail = pool.open.layer(layer)
        if len(self.filled_tails):
            filled_k, filled_v = tail["keys"][self.filled_tails], tail["values"][self.filled_tails]
            pool.storage.write_blocks(layer, self.filled_blocks, filled_k, filled_v)
        for r in self.step.chunk_rows:
            span = slice(r.start, r.start + r.count)
            self._store_chunk(layer, r, key[0, :, span], value[0, :, span])

    def _store_chunk(self, layer: int, row: Row, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keys ``[Hkv, n, D]`` and values of a chunk after the row's open tokens: the blocks they
        fill are coded, the rest becomes the open block."""
        pool, bs = self.pool, self.pool.block_size
        first, open_ = divmod(row.past, bs)
        tail = pool.open.layer(layer)
        tail_k, tail_v = tail["keys"][row.tail], tail["values"][row.tail]
        k = torch.cat([tail_k[:, :open_], key.float()], dim=1)
        v = torch.cat([tail_v[:, :open_], value.float()], dim=1)
        full = k.shape[1] // bs
        if full:
            blocks = torch.tensor(row.table[first : first + full], dtype=torch.long, device=pool.device)
            pool.storage.write_blocks(layer, blocks, as_blocks(k[:, : full * bs], bs), as_blocks(v[:, : full * bs], bs))
        rest = k.shape[1] - full * bs
        tail_k[:, :rest] = k[:, full * bs :]
        tail_v[:, :rest] = v[:, full * bs :]
