"""The prompt store (``kvcache.PromptStore``) as the tier past the engine's pool.

A request that joins asks the pool first (its registered blocks); past the pool's hits it asks the
store once (``fetch``): the longest stored prefix of its prompt, read as a ``growable`` cache, the
same entries ``PromptStore.cache_for`` gives ``generate`` (so the engine and plain ``generate``
share a store). What the store holds beyond the pool's hits is copied into the request's fresh
blocks (``write``) and counts as computed. Once a request's prompt is computed, and before a
preempted request gives its blocks back, its full chunks not stored yet are written to the store
(``save``), so a later request (in this process, or another one on the same folder or Redis) and
the preempted request itself reload instead of recomputing.

Entries are untrusted: the store checks every one and treats a bad one as a miss; an unreachable
backend makes the store a no-op for a while (``PromptStore``'s rules). Float pools only: a coded
pool's blocks hold what attention over coded blocks computed, which full-precision entries are not.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedOperation
from ..hf.build import make_cache
from ..prompts import PromptStore
from .pool import BlockPool
from .request import Request


class StoreTier:
    def __init__(self, store: PromptStore, model: Any, pool: BlockPool):
        if not isinstance(store, PromptStore):
            raise TypeError(f"store must be a kvcache.PromptStore, got {type(store).__name__}")
        self.store, self.model, self.pool = store, model, pool

    def fetch(self, tokens: list[int], beyond: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int] | None:
        """The store's longest prefix of ``tokens`` if it is longer than ``beyond`` tokens: per
        layer ``(keys [Hkv, R, D], values [Hkv, R, Dv])`` and ``R`` (at most ``len(tokens) - 1``:
        the last token is always computed); else None."""
        if len(tokens) - 1 <= beyond:
            return None
        cache, reused = self.store.cache_for(self.model, torch.tensor([tokens], device=self.pool.device), "growable")
        if reused <= beyond:
            return None
        out = []
        for layer in cache.kv_layers:
            k, v = layer.view()
            out.append((k[0, :, :reused], v[0, :, :reused]))
        return out, reused

    def write(self, table: list[int], start: int, fetched: list[tuple[torch.Tensor, torch.Tensor]], end: int) -> None:
        """Copy tokens ``[start, end)`` of ``fetched`` into the blocks of ``table`` (allocated, writable)."""
        pool, bs = self.pool, self.pool.block_size
        positions = range(start, end)
        blocks = torch.tensor([table[t // bs] for t in positions], dtype=torch.long, device=pool.device)
        offsets = torch.tensor([t % bs for t in positions], dtype=torch.long, device=pool.device)
        for t in range(start, end):
            if t == start or t % bs == 0:
                take = min(bs - t % bs, end - t)
                pool.claim(table[t // bs], t % bs, take)
        for layer, (k, v) in enumerate(fetched):
            pool.storage.write_slots(layer, blocks, offsets, k[:, start:end].transpose(0, 1), v[:, start:end].transpose(0, 1))

    def save(self, request: Request) -> int:
        """Store the full chunks of ``request``'s computed tokens that the store lacks; the tokens
        newly stored."""
        if request.cache is not None:  # its own cache holds its context, not the pool's blocks
            return 0
        chunk = self.store.chunk
        held = request.computed // chunk * chunk
        if held == 0:
            return 0
        pool, bs = self.pool, self.pool.block_size
        blocks = request.table[: -(-held // bs)]
        past = []
        for layer in range(pool.layers):
            k, v = pool.gather(layer, blocks)
            past.append((k[None, :, :held], v[None, :, :held]))
        cache = make_cache(self.model, "growable")
        cache.extend(past)
        return self.store.put(cache, torch.tensor([request.tokens[:held]], device=pool.device))


def open_store(store: object, pool: BlockPool) -> PromptStore | None:
    """The engine's ``store`` argument as a ``PromptStore`` (a backend name opened), None for none;
    refused in front of a coded pool."""
    if store is None:
        return None
    if not pool.exact:
        raise UnsupportedOperation(
            "the prompt store tier holds full-precision chunks; a coded pool's blocks hold what attention over coded "
            "blocks computed, so a store cannot stand behind it: use spec 'growable' with a store"
        )
    if isinstance(store, str):
        return PromptStore(store)
    if not isinstance(store, PromptStore):
        raise TypeError(f"store must be a kvcache.PromptStore or a backend name, got {type(store).__name__}")
    return store
