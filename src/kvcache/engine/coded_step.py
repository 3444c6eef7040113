"""One step's attention over a ``CodedBlockPool``: the float step (``step.py``) with coded blocks.

A row's past is its coded blocks (every full block, in table order) followed by its open block's
exact tokens. Per layer the step:

1. writes each decode row's new key and value into its open block (it always has room: a block
   that fills is coded at the end of the step that filled it);
2. attends the decode rows in one call of the coded library (``fused_paged.paged_decode_attention``:
   scores from the key codes, online softmax, values decoded from their codes, then the open
   block's exact tokens), or, where the library cannot run, through SDPA over each row's
   dequantized blocks;
3. attends each prefill chunk exactly over itself, after its past dequantized (as the quantized
   layer does: a chunk attends its own tokens in full precision);
4. codes every block that filled in this step (``CodedBlockPool.code_blocks``) and moves a chunk's
   unfilled remainder into its open block.

So a token is attended exactly until the step after its block fills, and coded from then on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import attend, fused_paged
from .coded_pool import CodedBlockPool, flat
from .step import PagedStep, Row


class CodedStep(PagedStep):
    """``PagedStep`` over a ``CodedBlockPool``; every row must hold an open block (``Row.tail``)."""

    pool: CodedBlockPool

    def __init__(self, pool: CodedBlockPool, rows: list[Row]):
        super().__init__(pool, rows)
        bs = pool.block_size
        missing = next((r for r in rows if not 0 <= r.tail < pool.tail_count), None)
        if missing is not None:
            raise ValueError(f"a row of a coded pool needs an open block, got tail {missing.tail}")
        dec = self.decode_rows
        self.decode_tails = torch.tensor([r.tail for r in dec], dtype=torch.long)
        self.decode_offsets = torch.tensor([r.past % bs for r in dec], dtype=torch.long)
        self.decode_coded = torch.tensor([r.past // bs * bs for r in dec], dtype=torch.int64)
        self.decode_open = torch.tensor([r.past % bs + 1 for r in dec], dtype=torch.int64)
        filled = [r for r in dec if r.length % bs == 0]
        self.filled_tails = torch.tensor([r.tail for r in filled], dtype=torch.long)
        self.filled_blocks = torch.tensor([r.table[r.past // bs] for r in filled], dtype=torch.long)

    def _attend_layer(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        pool = self.pool
        tail_k, tail_v = pool.tail_keys[layer], pool.tail_values[layer]
        out = query.new_empty(1, self.tokens, query.shape[1], value.shape[-1])
        if self.decode_rows:
            new = self.decode_tokens
            tail_k[self.decode_tails, :, self.decode_offsets] = key[0, :, new].transpose(0, 1).float()
            tail_v[self.decode_tails, :, self.decode_offsets] = value[0, :, new].transpose(0, 1).float()
            q = query[0, :, new].transpose(0, 1)  # [S, Hq, D]
            out[0, new] = self._decode(layer, q, scale).to(out.dtype)
        for r in self.chunk_rows:
            span = slice(r.start, r.start + r.count)
            q, k, v = query[:, :, span], key[:, :, span], value[:, :, span]
            if r.past == 0:
                got = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                past_k, past_v = self._past(layer, r, *divmod(r.past, self.pool.block_size))
                k = torch.cat([past_k[None].to(q.dtype), k], dim=2)
                v = torch.cat([past_v[None].to(q.dtype), v], dim=2)
                got = attend(q, k, v, scale=scale, causal=True)
            out[0, span] = got[0].transpose(0, 1)
        if len(self.filled_tails):
            pool.code_blocks(layer, self.filled_blocks, tail_k[self.filled_tails], tail_v[self.filled_tails])
        for r in self.chunk_rows:
            span = slice(r.start, r.start + r.count)
            self._store_chunk(layer, r, key[0, :, span], value[0, :, span])
        return out

    def _past(self, layer: int, row: Row, full: int, open_: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[Hkv, full * bs + open_, D]`` keys and values (float32) of ``row``: its first ``full``
        coded blocks dequantized, then the first ``open_`` tokens of its open block."""
        k, v = self.pool.decoded(layer, torch.tensor(row.table[:full], dtype=torch.long))
        tk = self.pool.tail_keys[layer, row.tail, :, :open_]
        tv = self.pool.tail_values[layer, row.tail, :, :open_]
        return torch.cat([flat(k), tk], dim=1), torch.cat([flat(v), tv], dim=1)

    def _store_chunk(self, layer: int, row: Row, key: torch.Tensor, value: torch.Tensor) -> None:
        """Keys ``[Hkv, n, D]`` and values of a chunk after the row's open tokens: the blocks they
        fill are coded, the rest becomes the open block."""
        pool, bs = self.pool, self.pool.block_size
        first, open_ = divmod(row.past, bs)
        tail_k, tail_v = pool.tail_keys[layer, row.tail], pool.tail_values[layer, row.tail]
        k = torch.cat([tail_k[:, :open_], key.float()], dim=1)
        v = torch.cat([tail_v[:, :open_], value.float()], dim=1)
        full = k.shape[1] // bs
        if full:
            blocks = torch.tensor(row.table[first : first + full], dtype=torch.long)
            pool.code_blocks(layer, blocks, _blocks(k[:, : full * bs], bs), _blocks(v[:, : full * bs], bs))
        rest = k.shape[1] - full * bs
        tail_k[:, :rest] = k[:, full * bs :]
        tail_v[:, :rest] = v[:, full * bs :]

    def _decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode rows' attention ``[S, Hq, Dv]`` (float32), query ``[S, Hq, D]``."""
        pool = self.pool
        seqs, q_heads, dim = q.shape
        packed = q.reshape(seqs, pool.kv_heads, q_heads // pool.kv_heads, dim)
        got = fused_paged.paged_decode_attention(
            packed,
            (pool.key_codes[layer], pool.key_scale[layer], pool.key_min[layer]),
            (pool.value_codes[layer], pool.value_scale[layer], pool.value_min[layer]),
            pool.bits, pool.value_group, self.decode_tables, self.decode_coded,
            pool.tail_keys[layer], pool.tail_values[layer], self.decode_tails.to(torch.int32), self.decode_open, scale,
        )  # fmt: skip
        if got is not None:
            return got.reshape(seqs, q_heads, -1)
        rows = []
        for s, r in enumerate(self.decode_rows):
            k, v = self._past(layer, r, r.past // pool.block_size, r.past % pool.block_size + 1)
            qs = q[s : s + 1, :, None].float()  # [1, Hq, 1, D]
            rows.append(F.scaled_dot_product_attention(qs, k[None], v[None], scale=scale, enable_gqa=True)[0, :, 0])
        return torch.stack(rows)


def _blocks(tokens: torch.Tensor, bs: int) -> torch.Tensor:
    """A run of tokens ``[Hkv, n * bs, D]`` as blocks ``[n, Hkv, bs, D]``."""
    heads, length, dim = tokens.shape
    return tokens.reshape(heads, length // bs, bs, dim).transpose(0, 1)
