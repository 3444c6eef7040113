"""The in-process backend: an LRU of bytes with a byte budget and a TTL."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from .backend_base import Backend, as_bytes_view, check_budget, check_key


class MemoryBackend(Backend):
    """An in-process LRU: an ordered dict (oldest use first) under one lock; expiry times are
    checked when an entry is met."""

    def __init__(self, max_bytes: int | None = None, ttl: float | None = None):
        check_budget(max_bytes, ttl)
        self.location, self.max_bytes, self.ttl = "memory", max_bytes, ttl
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # key -> (value, expiry)
        self._total = 0
        self._lock = threading.Lock()

    def _live(self, key: str, now: float) -> bytes | None:
        item = self._entries.get(key)
        if item is not None and item[1] <= now:
            self._drop(key)
            return None
        return None if item is None else item[0]

    def _drop(self, key: str) -> None:
        value, _ = self._entries.pop(key)
        self._total -= len(value)

    def _purge_expired(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, expiry) in self._entries.items() if expiry <= now]:
            self._drop(key)

    def get(self, key: str) -> bytes | None:
        check_key(key)
        with self._lock:
            value = self._live(key, time.monotonic())
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        for key in keys:
            check_key(key)
        with self._lock:
            now = time.monotonic()
            return [self._live(key, now) is not None for key in keys]

    def put(self, key: str, value) -> bool:
        check_key(key)
        data = value if type(value) is bytes else bytes(as_bytes_view(value))  # immutable: no copy needed
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return False
        expiry = time.monotonic() + self.ttl if self.ttl is not None else float("inf")
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = (data, expiry)
            self._total += len(data)
            if self.max_bytes is not None and self._total > self.max_bytes:
                self._purge_expired()
                while self._total > self.max_bytes:
                    self._drop(next(iter(self._entries)))
        return True

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            if key in self._entries:
                self._drop(key)

    def nbytes(self) -> int:
        with self._lock:
            self._purge_expired()
            return self._total

    def __len__(self) -> int:
        with self._lock:
            self._purge_expired()
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._total = 0
