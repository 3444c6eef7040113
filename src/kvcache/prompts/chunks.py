"""Chunk entries of the prompt store: a cache's slots cut into one-chunk payloads, and where stored
chunks go among the first columns of a (batched, left-padded) cache (``chunk_fill`` puts them there).

A chunk's payload is a kvcache file of a one-row ``growable`` cache holding that chunk's keys and
values for every layer, with the chunk's token ids; the target cache's spec is in the key's salt,
not here, since growable, static and concat hold the same keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..hf.build import make_cache
from ..hf.cache import KVCache
from .keys import PromptRow

#: What a chunk entry is saved as.
CHUNK_SPEC = "growable"


def chunks_needed(tokens: int, chunk: int) -> int:
    return 0 if tokens <= 0 else -(-tokens // chunk)


def chunk_tokens(found: list[PromptRow], keys: list[list[str]], key: str, chunk: int) -> list[int]:
    """The token ids of the chunk stored under ``key`` (any row that keys it)."""
    for row, row_keys in zip(found, keys):
        if key in row_keys:
            j = row_keys.index(key)
            return row.tokens[j * chunk : (j + 1) * chunk]
    raise KeyError(key)


@dataclass(frozen=True)
class Place:
    """Where a row takes a chunk: its first ``take`` tokens into slots ``at:at + take`` of row ``row``."""

    row: int
    at: int
    take: int


def placements(found: list[PromptRow], keys: list[list[str]], columns: int, chunk: int) -> dict[str, list[Place]]:
    """The places of every chunk entry a cache of ``columns`` slots takes, by key: each row's
    stored tokens end at the last column, after its padding (masked out by the attention mask, as
    ``generate``'s own pad slots are), so a chunk's slots follow the row's earlier chunks."""
    places: dict[str, list[Place]] = {}
    for r, row in enumerate(found):
        real = max(0, columns - row.pad)
        at = columns - real
        for key in keys[r][: chunks_needed(real, chunk)]:
            take = min(chunk, columns - at)
            places.setdefault(key, []).append(Place(r, at, take))
            at += take
    return places


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
