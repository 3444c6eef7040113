"""``PromptStore``: caches pre-filled with the longest stored prefix of a prompt.

::

    store = kvcache.PromptStore("redis://cache-host:6379/0")          # or a folder, or "memory"
    cache, reused = store.cache_for(model, input_ids, "growable")     # holds `reused` tokens
    out = model.generate(input_ids, past_key_values=cache)            # computes only the rest
    store.put(cache, out)                                             # keeps the new full chunks

Two ways to store, by cache kind (``mode``):

- ``"chunks"`` (growable, static, concat: every token's keys and values, in order): one entry per
  chunk of ``chunk`` tokens, holding that chunk's keys and values for every layer; a prefix is the
  chain of its chunks, so prompts that share a beginning share its entries. Batches may mix rows
  of any left padding.
- ``"states"`` (quantized, windows, eviction policies, ...: state that depends on the whole
  prefix): one entry per chunk boundary holding the whole cache as it was after exactly that many
  tokens. Such a state exists only if the prompt was run up to the boundary and stored there:
  ``PromptStore.prefill`` does that. One request at a time (batch 1, no padding). Reusing one is
  exact with respect to a prefill split at the boundary, which for these kinds can differ from a
  single pass over the whole prompt (a split prefill evicts or quantizes at the boundary).

Every entry read is untrusted: a damaged, foreign, other-model, other-prefix or lying entry is a
miss, logged on ``kvcache.prompts`` and recomputed. A chunk entry's header is checked before its
bytes are used (``chunk_entry``) and its digest as they are copied into the cache's own buffers
(``chunk_fill``), which count them in only once every entry passed; a state entry is checked whole
(``entry.unseal``) and then by ``cachefile``'s checks. A
backend that cannot be reached (``StoreUnavailable``) makes the store a no-op for ``retry_after``
seconds, with one warning per outage.

Design: docs/architecture.md, "The prompt store".
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..hf.build import make_cache
from ..hf.cache import KVCache
from ..hf.cachefile import cache_from_bytes, model_dtype
from ..errors import CacheFileError, StoreEntryError, StoreUnavailable, UnsupportedOperation
from ..hf.prefill import check_chunk
from ..hf.prefill import prefill as run_prefill
from ..hf.spec import CacheSpec, parse_spec
from .backends import Backend, open_backend
from .chunk_entry import ChunkLayout, open_chunk
from .chunk_fill import ChunkFiller
from .chunks import Place, chunk_payload, chunk_tokens, placements
from .entry import seal, unseal
from .keys import PromptRow, chain, rows, salt

log = logging.getLogger("kvcache.prompts")
T = TypeVar("T")

#: Kinds whose slots are every token's keys and values in order: a prefix is its chunks, joined.
CHUNKED_KINDS = frozenset({"growable", "static", "concat"})


@dataclass
class StoreStats:
    """What the store did since it was made (``PromptStore.stats``)."""

    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    stored_tokens: int = 0
    bad_entries: int = 0
    unavailable: int = 0


class PromptStore:
    """Keys and values of computed prompt prefixes, kept in a ``backend`` and found by token prefix.

    ``backend``: ``"memory"`` (this process), a folder path, ``"redis://[:password@]host:port/db"``
    or a ``Backend``. ``chunk``: tokens per key (reuse is at chunk granularity). ``max_bytes`` and
    ``ttl`` (seconds) bound the backend (least recently used entries go first). ``secret``: entries
    are signed with it (HMAC-SHA256) and entries not signed with it are misses: set it when others
    can write to the backend. ``retry_after``: seconds an unreachable backend is left alone.

    ``timer``: None, or a function ``timer(part, seconds, nbytes)`` the store calls after each
    backend read (``part`` ``"fetch"``: a ``contains_many``, a ``get``, or each entry of
    ``iter_values``; ``nbytes`` the bytes of the entries it returned) and after opening each entry
    it read (``"open"``: a chunk entry's header checks; a state entry's digest, decoding and
    checks; ``nbytes`` its size), with the seconds it took (``time.perf_counter``). A chunk entry's
    copy into the cache, its digest computed on the way, is neither. For profiling where a lookup's
    time goes (the ``prompt`` benchmark); it changes nothing the store does.
    """

    def __init__(
        self,
        backend: str | Backend = "memory",
        *,
        chunk: int = 256,
        max_bytes: int | None = None,
        ttl: float | None = None,
        secret: bytes | str | None = None,
        retry_after: float = 30.0,
        timer: Callable[[str, float, int], None] | None = None,
    ) -> None:
        check_chunk(chunk)
        self.backend = open_backend(backend, max_bytes=max_bytes, ttl=ttl)
        self.chunk = chunk
        self.secret = secret.encode() if isinstance(secret, str) else secret
        self.retry_after = retry_after
        self.timer = timer
        self.stats = StoreStats()
        self._down_until = 0.0
        self._layouts: dict[bytes, ChunkLayout] = {}

    def __repr__(self) -> str:
        return f"PromptStore({self.backend.location!r}, chunk={self.chunk})"

    # ---- finding --------------------------------------------------------------------------

    def cache_for(
        self, model: Any, input_ids: torch.Tensor, spec: str | CacheSpec = "growable", *, attention_mask: torch.Tensor | None = None, **options: Any
    ) -> tuple[KVCache, int]:
        """A new cache of ``spec`` for ``model`` holding the longest stored prefix of ``input_ids``
        ``[B, T]``, and how many tokens (columns) it holds.

        Give the prompt's ``attention_mask`` for a left-padded batch. The cache always leaves at
        least the last token to compute, so ``model.generate(input_ids, attention_mask=...,
        past_key_values=cache)`` goes on from it. Raises ``UnsupportedOperation`` for a cache kind
        the store cannot hold (layers that are not attention) or a batch a ``"states"`` kind
        cannot take; never for what is (or is not) in the backend.
        """
        parsed = parse_spec(spec, **options)
        cache = make_cache(model, parsed)
        found = rows(input_ids, attention_mask)
        mode = self.mode(cache)
        if any(row.pad for row in found) and "position_ids" not in inspect.signature(model.forward).parameters:
            raise UnsupportedOperation(
                f"{type(model).__name__}.forward takes no position_ids, so generate numbers a padded row's "
                "positions from its pads and its keys are not the unpadded prompt's: reuse it without padding"
            )
        key_salt = salt(cache.fingerprint or "", model_dtype(model) or torch.get_default_dtype(), str(cache.spec), self.chunk)
        width = input_ids.shape[1]
        if mode == "chunks":
            cache, reused = self._fill_from_chunks(model, cache, found, key_salt, width)
        else:
            _one_request(found, width, "cache_for")
            loaded = self._state_for(model, cache, found[0].tokens[: width - 1], key_salt)
            cache, reused = (cache, 0) if loaded is None else (loaded, loaded.seen)
        if reused:
            self.stats.hits += 1
            self.stats.reused_tokens += reused
        else:
            self.stats.misses += 1
        return cache, reused

    def mode(self, cache: KVCache) -> str:
        """``"chunks"`` or ``"states"`` (see the module), or ``UnsupportedOperation`` for caches
        with layers that are not attention (linear attention, state-space layers)."""
        if cache.other_kinds:
            raise UnsupportedOperation(
                f"the prompt store holds attention caches; this model has non-attention layers "
                f"({', '.join(sorted(set(cache.other_kinds.values())))}) whose state it cannot store"
            )
        kinds = {s.kind for s in cache.kv_layers if s is not None}
        return "chunks" if kinds <= CHUNKED_KINDS else "states"

    def _fill_from_chunks(self, model: Any, cache: KVCache, found: list[PromptRow], key_salt: bytes, width: int) -> tuple[KVCache, int]:
        """The empty ``cache`` (or, after a bad entry, a new one like it) filled with the longest
        prefix every row has stored, and its columns."""
        keys = [chain(key_salt, row.tokens, self.chunk) for row in found]
        present = [self._read(self.backend.contains_many, [False] * len(k), k) for k in keys]
        matched = [next((i for i, p in enumerate(here) if not p), len(here)) for here in present]
        layout = self._layout(cache, model, key_salt)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        while True:
            # Columns every row can fill: a row padded by p with n chunks found fills p + n * chunk.
            columns = min(min(row.pad + n * self.chunk for row, n in zip(found, matched)), width - 1)
            if all(columns <= row.pad for row in found):
                return cache, 0  # nothing but padding to reuse
            places = placements(found, keys, columns, self.chunk)
            filler = ChunkFiller(cache, layout, columns, [row.pad for row in found], device, self.secret)
            bad = self._fill(filler, layout, places, lambda key: chunk_tokens(found, keys, key, self.chunk))
            if not bad:
                filler.commit()
                return cache, columns
            for r, row_keys in enumerate(keys):  # that row's prefix ends before the first chunk that failed
                matched[r] = min([matched[r]] + [j for j, key in enumerate(row_keys) if key in bad])
            cache = make_cache(model, cache.spec)  # nothing was counted in, but the layers took a geometry

    def _fill(self, filler: ChunkFiller, layout: ChunkLayout, places: dict[str, list[Place]], tokens: Callable[[str], list[int]]) -> set[str]:
        """Stream each entry of ``places`` into ``filler`` as it is read; the keys of those that
        were missing or bad (logged and deleted)."""
        bad = set()
        for key, raw in self._read_each(list(places)):
            if raw is None:  # gone since the presence check (evicted, expired)
                bad.add(key)
                continue
            start = time.perf_counter()
            try:
                entry = open_chunk(layout, key, raw, tokens(key))
            except Exception as e:  # noqa: BLE001 - an entry nothing foresaw is still only a miss
                bad.add(key)
                self._bad(key, e)
                continue
            finally:
                if self.timer is not None:
                    self.timer("open", time.perf_counter() - start, len(raw))
            try:
                filler.fill(entry, places[key])
            except StoreEntryError as e:
                bad.add(key)
                self._bad(key, e)
        return bad

    def _layout(self, cache: KVCache, model: Any, key_salt: bytes) -> ChunkLayout:
        """What chunk entries under ``key_salt`` hold (kept: it asks for a cache to be made)."""
        if key_salt not in self._layouts:
            self._layouts[key_salt] = ChunkLayout.of(cache, model_dtype(model) or torch.get_default_dtype(), self.chunk)
        return self._layouts[key_salt]

    def _state_for(self, model: Any, cache: KVCache, tokens: list[int], key_salt: bytes) -> KVCache | None:
        """The stored state at the longest chunk boundary within ``tokens``, or None."""
        keys = ["s-" + k for k in chain(key_salt, tokens, self.chunk)]
        present = self._read(self.backend.contains_many, [False] * len(keys), keys)
        for n in range(len(keys), 0, -1):
            if not present[n - 1]:
                continue
            prefix = tokens[: n * self.chunk]

            def problem(loaded: KVCache) -> str | None:
                same = str(loaded.spec) == str(cache.spec) and loaded.seen == len(prefix) and loaded.token_ids == prefix
                return None if same else f"a {loaded.spec} cache of another prefix"

            loaded = self._open(model, keys[n - 1], self._read(self.backend.get, None, keys[n - 1]), problem)
            if loaded is not None:
                loaded.token_ids = None
                return loaded
        return None

    def _open(self, model: Any, key: str, raw: bytes | None, problem: Callable[[KVCache], str | None]) -> KVCache | None:
        """The cache an entry holds if its digest, ``load_cache``'s checks and ``problem`` (what it
        must hold: None if right) all pass; else None, a miss (logged and deleted if it was bad)."""
        if raw is None:
            return None  # gone between the presence check and the read (evicted, expired)
        start = time.perf_counter()
        try:
            payload = bytes(unseal(key, raw, self.secret))
            loaded = cache_from_bytes(payload, model, name=f"entry {key[:16]}", digest_checked=True)
            wrong = problem(loaded)
            if wrong is not None:
                raise StoreEntryError(f"entry {key[:16]}: {wrong}")
            return loaded
        except Exception as e:  # noqa: BLE001 - an entry nothing above foresaw is still only a miss
            return self._bad(key, e)
        finally:
            if self.timer is not None:
                self.timer("open", time.perf_counter() - start, len(raw))

    def _bad(self, key: str, error: Exception) -> None:
        """A damaged or lying entry: logged, deleted (a later put writes it again), a miss. An
        error other than a ``CacheFileError`` is one no check foresaw, named as such."""
        if not isinstance(error, CacheFileError):
            error = StoreEntryError(f"entry {key[:16]}: cannot be read ({type(error).__name__}: {error})")
        self.stats.bad_entries += 1
        log.warning("prompt store %s: %s; recomputing", self.backend.location, error)
        self._call(self.backend.delete, None, key)
        return None

    # ---- storing --------------------------------------------------------------------------

    def put(self, cache: KVCache, token_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None) -> int:
        """Store what ``cache`` computed for ``token_ids`` ``[B, T]`` (the prompt, or ``generate``'s
        output: its first ``cache.seen`` columns are what the cache holds); returns the tokens newly
        stored. ``attention_mask``: the prompt's, for a left-padded batch.

        ``"chunks"`` kinds store every full chunk not stored yet; ``"states"`` kinds store the
        whole cache when it holds exactly a multiple of ``chunk`` tokens (else nothing: use
        ``prefill``, which stops at the boundaries).
        """
        if not isinstance(cache, KVCache):
            raise TypeError(f"put expects a kvcache.KVCache, got {type(cache).__name__}")
        found = rows(token_ids, attention_mask)
        columns = cache.seen
        mode = self.mode(cache)
        if token_ids.shape[1] < columns:
            raise ValueError(f"token_ids has {token_ids.shape[1]} columns; the cache holds {columns} tokens: give every token it holds")
        geometry = next((s.geometry for s in cache.kv_layers if s is not None and s.geometry is not None), None)
        if geometry is None:
            return 0
        if geometry.batch != len(found):
            raise ValueError(f"token_ids has {len(found)} rows; the cache holds a batch of {geometry.batch}")
        key_salt = salt(cache.fingerprint or "", geometry.dtype, str(cache.spec), self.chunk)
        if mode == "states":
            _one_request(found, token_ids.shape[1], "put")
            return self._put_state(cache, found[0].tokens[:columns], key_salt)
        stored = 0
        for r, row in enumerate(found):
            held = row.tokens[: max(0, columns - row.pad)]
            keys = chain(key_salt, held, self.chunk)
            present = self._read(self.backend.contains_many, [True] * len(keys), keys)
            for j, (key, here) in enumerate(zip(keys, present)):
                if here:
                    continue
                start = row.pad + j * self.chunk
                payload = chunk_payload(cache, r, start, self.chunk, held[j * self.chunk : (j + 1) * self.chunk])
                if self._call(self.backend.put, False, key, seal(key, payload, self.secret)):
                    stored += self.chunk
        self.stats.stored_tokens += stored
        return stored

    def _put_state(self, cache: KVCache, tokens: list[int], key_salt: bytes) -> int:
        if not tokens or len(tokens) % self.chunk:
            log.debug("prompt store: a %s cache of %d tokens is not at a chunk boundary; nothing stored", cache.spec, len(tokens))
            return 0
        key = "s-" + chain(key_salt, tokens, self.chunk)[-1]
        if self._read(self.backend.contains_many, [True], [key])[0]:
            return 0
        stored = self._call(self.backend.put, False, key, seal(key, cache.to_bytes(token_ids=tokens), self.secret))
        self.stats.stored_tokens += len(tokens) if stored else 0
        return len(tokens) if stored else 0

    # ---- both -----------------------------------------------------------------------------

    def prefill(
        self,
        model: Any,
        input_ids: torch.Tensor,
        spec: str | CacheSpec = "growable",
        *,
        attention_mask: torch.Tensor | None = None,
        progress: bool = False,
        **options: Any,
    ) -> tuple[KVCache, int]:
        """``cache_for``, then every prompt token but the last through ``model`` (so ``generate``
        computes the last and the first new token), storing as it goes; returns the cache and the
        tokens it reused. A ``"states"`` kind runs to each chunk boundary and stores its state there."""
        cache, reused = self.cache_for(model, input_ids, spec, attention_mask=attention_mask, **options)
        end = input_ids.shape[1] - 1
        if end <= reused:
            return cache, reused
        if self.mode(cache) == "chunks":
            mask = None if attention_mask is None else attention_mask[:, :end]
            run_prefill(model, input_ids[:, reused:end], cache, chunk=max(self.chunk, 512), attention_mask=mask, progress=progress)
            self.put(cache, input_ids[:, :end], attention_mask=mask)
            return cache, reused
        bounds = [b for b in range(reused + self.chunk - reused % self.chunk, end + 1, self.chunk)] + [end]
        start = reused
        for stop in bounds:
            if stop > start:
                run_prefill(model, input_ids[:, start:stop], cache, chunk=self.chunk, progress=progress)
                self.put(cache, input_ids[:, :stop])
                start = stop
        return cache, reused

    def _read_each(self, keys: list[str]) -> Iterator[tuple[str, bytes | memoryview | None]]:
        """``backend.iter_values(keys)``, each read reported to ``timer`` as ``"fetch"``; the keys
        not read when the backend became unreachable come as None."""
        values = self._call(self.backend.iter_values, iter(()), keys)
        done = 0
        try:
            while done < len(keys):
                start = time.perf_counter()
                item = self._call(next, None, values, None)
                if self.timer is not None:
                    self.timer("fetch", time.perf_counter() - start, 0 if item is None or item[1] is None else len(item[1]))
                if item is None:
                    break
                done += 1
                yield item
        finally:
            getattr(values, "close", lambda: None)()  # a backend mid-read lets go of its connection
        for key in keys[done:]:
            yield key, None

    def _read(self, fn: Callable[..., T], default: T, *args: Any) -> T:
        """``_call`` for a backend read, reported to ``timer`` as ``"fetch"`` with the entry bytes it returned."""
        if self.timer is None:
            return self._call(fn, default, *args)
        start = time.perf_counter()
        result = self._call(fn, default, *args)
        values = result if isinstance(result, list) else [result]
        self.timer("fetch", time.perf_counter() - start, sum(len(v) for v in values if isinstance(v, (bytes, bytearray, memoryview))))
        return result

    def _call(self, fn: Callable[..., T], default: T, *args: Any) -> T:
        """``fn(*args)`` on the backend, or ``default`` while it is unreachable (one warning an outage)."""
        now = time.monotonic()
        if now < self._down_until:
            return default
        try:
            result = fn(*args)
        except StoreUnavailable as e:
            self.stats.unavailable += 1
            if self._down_until == 0.0:
                warnings.warn(f"prompt store unavailable, going on without it for {self.retry_after:g} s: {e}", RuntimeWarning, stacklevel=3)
            self._down_until = now + self.retry_after
            return default
        if self._down_until:
            log.info("prompt store %s is reachable again", self.backend.location)
            self._down_until = 0.0
        return result


def _one_request(found: list[PromptRow], width: int, what: str) -> None:
    if len(found) != 1 or found[0].pad:
        raise UnsupportedOperation(
            f"{what}: a cache kind whose state depends on the whole prefix (quantized, windows, eviction) is "
            f"stored per request: one unpadded row, got {len(found)} row(s) of {width} columns with padding "
            f"{[row.pad for row in found]}; use growable, static or concat to reuse prefixes in batches"
        )
