"""One scheduler step as one forward pass: the rows of every running request packed into one
sequence, and the attention that writes their keys and values into the pool and reads each row's
own blocks.

The model sees a batch of one sequence of ``T`` tokens (every row's tokens one after the other)
with each token's own position id, so its linear layers run once over all rows. Its attention
calls (the ``"kvcache"`` implementation, which hands them to ``PagedStep.attend`` when the forward
carries a step under ``hf.FORWARD_STEP``) take the packed query ``[1, Hq, T, D]`` and the new keys
and values ``[1, Hkv, T, D]``. For each layer the step:

1. writes every new key and value into its row's block and slot (one indexed copy);
2. runs the rows that compute one token (decode) together through the paged decode kernel
   (``native.paged_decode``: ragged lengths, each row's block table), rows that share prefix
   blocks reading those once for all of them (``shared_prefix.py``);
3. runs each row of several tokens (a prefill chunk) through attention over its blocks, causal
   aligned to the end (the chunk follows the row's past), or over the chunk itself when the row
   has no past;
4. runs each row whose context lives in a bounded cache of its own (``compression.py``) through
   that cache's layer: ``update`` with its new key and value, then ``attend``, as under ``generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..attention import attend, attend_weighted, native
from ..attention_kwargs import AttentionExtras
from ..errors import UnsupportedOperation
from ..hf import ForwardStep
from . import shared_prefix
from .paged import paged_decode
from .pool import BlockPool


@dataclass(frozen=True)
class Row:
    """One request's part of a step: ``count`` tokens at ``start`` in the packed sequence, after
    ``past`` tokens already in the pool, all of them in blocks ``table`` (in order)."""

    start: int
    count: int
    past: int
    table: tuple[int, ...]
    #: The row's open block in a ``CodedBlockPool`` (its unfilled last block); -1 in a float pool.
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


class PagedStep(ForwardStep):
    """The attention of one packed forward pass over ``pool`` (see the module docstring).

    ``rows`` lie one after the other from token 0 of the packed sequence. Every block a row writes
    must be writable (``BlockPool.claim`` checks and notes them; the engine claims before the
    forward). ``layers_run`` counts the attention calls, so the engine can tell a model that did not
    pass the step down to its attention."""

    def __init__(self, pool: BlockPool, rows: list[Row]):
        self.pool, self.rows = pool, rows
        self.tokens = sum(r.count for r in rows)
        bs = pool.block_size
        self.own_rows = [r for r in rows if r.cache is not None]
        rows = [r for r in rows if r.cache is None]
        self.pooled = (
            torch.tensor([t for r in rows for t in range(r.start, r.start + r.count)], dtype=torch.long, device=pool.device)
            if self.own_rows else None
        )
        slots = [(r.table[t // bs], t % bs) for r in rows for t in range(r.past, r.length)]
        self.slot_blocks = torch.tensor([b for b, _ in slots], dtype=torch.long, device=pool.device)
        self.slot_offsets = torch.tensor([o for _, o in slots], dtype=torch.long, device=pool.device)
        # One new token after a past is a decode row, unless it must report weights (a prompt's last
        # chunk of one token, to be compressed): that goes the way of a chunk.
        self.decode_rows = [r for r in rows if r.count == 1 and r.past > 0 and r.weights is None]
        self.chunk_rows = [r for r in rows if not (r.count == 1 and r.past > 0 and r.weights is None)]
        self.decode_tokens = torch.tensor([r.start for r in self.decode_rows], dtype=torch.long)
        width = max((len(r.table) for r in self.decode_rows), default=1)
        self.decode_tables = torch.zeros(len(self.decode_rows), width, dtype=torch.int32)
        for i, r in enumerate(self.decode_rows):
            self.decode_tables[i, : len(r.table)] = torch.tensor(r.table, dtype=torch.int32)
        self.decode_lengths = torch.tensor([r.length for r in self.decode_rows], dtype=torch.int64)
        #: How the decode rows read shared prefixes (``shared_prefix.plan``), made at the first
        #: layer (it needs the query heads per KV head); False until then, None for none.
        self._sharing: shared_prefix.Plan | None | bool = False
        #: Decode rows that read a shared prefix in one pass with other rows, in this step.
        self.shared_rows = 0
        self.layers_run = 0
        #: For each row that reports weights (by its index in ``rows``): per layer the row's keys and
        #: values ``[1, Hkv, length, D]`` and its weights, mode -> float32 ``[1, Hkv, length]``.
        self.reported: dict[int, list[tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]] = {}

    def attend(
        self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        scaling: float | None, kwargs: dict,
    ) -> torch.Tensor:
        """Write ``key``/``value`` ``[1, Hkv, T, D]`` into the pool and attend; ``[1, T, Hq, Dv]``."""
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise UnsupportedOperation(
                f"the engine needs each attention module's layer_idx; {type(module).__name__} has none"
            )
        extras = AttentionExtras.from_kwargs(kwargs)
        if extras.softcap is not None or extras.sinks is not None or extras.bias is not None or extras.indices is not None:
            raise UnsupportedOperation(
                "the engine's paged attention does not apply logit caps, attention sinks, position biases or "
                "sparse indices yet; serve this model with generate and make_cache"
            )
        if query.shape[0] != 1 or query.shape[2] != self.tokens:
            raise UnsupportedOperation(
                f"the engine packs {self.tokens} tokens as one sequence, but the attention got a query of shape "
                f"{list(query.shape)}; this model does not pass the packed batch through unchanged"
            )
        pool = self.pool
        if key.shape[1] != pool.kv_heads or key.shape[-1] != pool.head_dim or value.shape[-1] != pool.value_dim:
            raise UnsupportedOperation(
                f"layer {layer}'s attention got keys {list(key.shape)} and values {list(value.shape)}; the engine's pool "
                f"holds {pool.kv_heads} heads of {pool.head_dim} (values {pool.value_dim}) as the config says"
            )
        dim = query.shape[-1]
        scale = 1.0 / math.sqrt(dim) if scaling is None else float(scaling)
        out = self._attend_layer(layer, query, key, value, scale)
        self.layers_run += 1
        return out

    def _attend_layer(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Store the layer's new keys and values and attend every row: ``[1, T, Hq, Dv]``."""
        pool = self.pool
        keys, values = pool.key_blocks[layer], pool.value_blocks[layer]
        out = query.new_empty(1, self.tokens, query.shape[1], value.shape[-1])
        for r in self.own_rows:
            span = slice(r.start, r.start + r.count)
            own = r.cache.kv_layers[layer]
            own.update(key[:, :, span], value[:, :, span])
            out[0, span] = own.attend(query[:, :, span], scale=scale)[0].transpose(0, 1)
        new_keys, new_values = key[0], value[0]
        if self.pooled is not None:  # the tokens of rows in the pool, when others have their own cache
            new_keys, new_values = new_keys[:, self.pooled], new_values[:, self.pooled]
        # keys[block, :, offset] is [T, Hkv, D]: every new token's slot in one indexed copy.
        keys[self.slot_blocks, :, self.slot_offsets] = new_keys.transpose(0, 1).to(pool.dtype)
        values[self.slot_blocks, :, self.slot_offsets] = new_values.transpose(0, 1).to(pool.dtype)

        if self.decode_rows:
            q = query[0, :, self.decode_tokens].transpose(0, 1).unsqueeze(2)  # [S, Hq, 1, D]
            got = self._decode(layer, q, scale)
            out[0, self.decode_tokens] = got[:, :, 0].to(out.dtype)
        for r in self.chunk_rows:
            q = query[:, :, r.start : r.start + r.count]
            if r.weights is not None:
                got = self._reporting(layer, r, q, key, value, scale)
            elif r.past == 0:
                k, v = key[:, :, r.start : r.start + r.count], value[:, :, r.start : r.start + r.count]
                got = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                k, v = pool.gather(layer, r.table[: -(-r.length // pool.block_size)])
                k, v = k[None, :, : r.length].to(q.dtype), v[None, :, : r.length].to(q.dtype)
                got = attend(q, k, v, scale=scale, causal=True)
            out[0, r.start : r.start + r.count] = got[0].transpose(0, 1)
        return out

    def _reporting(self, layer, row, q, key, value, scale) -> torch.Tensor:
        """A chunk row's attention ``[1, Hq, n, Dv]`` over its past and itself, keeping its keys,
        values and reduced weights in ``reported``."""
        span = slice(row.start, row.start + row.count)
        k, v = key[:, :, span], value[:, :, span]
        if row.past:
            pk, pv = self.pool.gather(layer, row.table[: -(-row.past // self.pool.block_size)])
            k = torch.cat([pk[None, :, : row.past].to(k.dtype), k], dim=2)
            v = torch.cat([pv[None, :, : row.past].to(v.dtype), v], dim=2)
        if row.weights:
            got, weights = attend_weighted(q, k, v, scale=scale, causal=True, weights=row.weights)
        else:  # keys and values only (a compression that reads no weights)
            got, weights = attend(q, k, v, scale=scale, causal=True), {}
        self.reported.setdefault(self.rows.index(row), []).append((k, v, weights))
        return got

    def _decode(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """The decode rows' attention ``[S, Hq, 1, Dv]`` through the paged kernel."""
        pool = self.pool
        seqs, q_heads, _, dim = q.shape
        packed = q.reshape(seqs, pool.kv_heads, q_heads // pool.kv_heads, dim)
        if self._sharing is False:
            tables, lengths = [r.table for r in self.decode_rows], [r.length for r in self.decode_rows]
            self._sharing = shared_prefix.plan(tables, lengths, pool.block_size, q_heads // pool.kv_heads)
        if self._sharing is not None:
            got = shared_prefix.attend(self._sharing, packed, pool.key_blocks[layer], pool.value_blocks[layer], scale)
            if got is not None:
                self.shared_rows = sum(len(p.rows) for p in self._sharing.passes)
                return got.reshape(seqs, q_heads, 1, -1)
        got = native.paged_decode(
            packed, pool.key_blocks[layer], pool.value_blocks[layer], self.decode_tables, self.decode_lengths, scale
        )
        if got is not None:
            return got.reshape(seqs, q_heads, 1, -1)
        tables = [r.table for r in self.decode_rows]
        return paged_decode(pool, layer, q, tables, [r.length for r in self.decode_rows], scale)
