"""Chunk entries of the prompt store: a cache's slots cut into one-chunk payloads, and stored
chunks put back together as the first columns of a (batched, left-padded) cache.

A chunk's payload is a kvcache file of a one-row ``growable`` cache holding that chunk's keys and
values for every layer, with the chunk's token ids; the target cache's spec is in the key's salt,
not here, since growable, static and concat hold the same keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..build import make_cache
from ..cache import KVCache
from .keys import Row

#: What a chunk entry is saved as.
CHUNK_SPEC = "growable"


def chunks_needed(tokens: int, chunk: int) -> int:
    return 0 if tokens <= 0 else -(-tokens // chunk)


def chunk_tokens(found: list[Row], keys: list[list[str]], key: str, chunk: int) -> list[int]:
    """The token ids of the chunk stored under ``key`` (any row that keys it)."""
    for row, row_keys in zip(found, keys):
        if key in row_keys:
            j = row_keys.index(key)
            return row.tokens[j * chunk : (j + 1) * chunk]
    raise KeyError(key)


def assemble(cache: KVCache, found: list[Row], keys: list[list[str]], loaded: dict, columns: int, chunk: int) -> list:
    """Per layer ``(keys [B, Hkv, columns, D], values)``: each row's stored tokens after zeros for
    its padding (masked out by the attention mask, as ``generate``'s own pad slots are). Each
    chunk's slots are copied once, into place."""
    past = []
    for i, store in enumerate(cache.kv_layers):
        if store is None:
            past.append(None)
            continue
        like = next(v[i] for v in loaded.values() if v is not None)  # any chunk's (keys, values) of this layer
        sides = []
        for side in (0, 1):
            heads, dim = like[side].shape[1], like[side].shape[3]
            out = like[side].new_empty(len(found), heads, columns, dim)
            for r, row in enumerate(found):
                real = max(0, columns - row.pad)
                out[r, :, : columns - real].zero_()
                at = columns - real
                for k in keys[r][: chunks_needed(real, chunk)]:
                    take = min(chunk, columns - at)
                    out[r, :, at : at + take].copy_(loaded[k][i][side][0, :, :take])
                    at += take
            sides.append(out)
        past.append(tuple(sides))
    return past


def chunk_payload(cache: KVCache, row: int, start: int, chunk: int, tokens: Sequence[int]) -> bytes:
    """A chunk entry's payload: a one-row growable cache file of slots ``[start, start + chunk)``."""
    piece = make_cache(cache.attention_config, CHUNK_SPEC)
    past = []
    for store in cache.kv_layers:
        if store is None:
            past.append(None)
            continue
        keys, values = store.view()
        past.append((keys[row : row + 1, :, start : start + chunk], values[row : row + 1, :, start : start + chunk]))
    piece.extend(past)  # copies the slices into the piece's own buffers
    return piece.to_bytes(token_ids=list(tokens))
