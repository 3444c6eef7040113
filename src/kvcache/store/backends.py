"""DEV PLACEHOLDER: replaced by the backends branch."""
from __future__ import annotations
import threading
from collections import OrderedDict


class Backend:
    location = "memory"
    max_bytes = None
    ttl = None


class MemoryBackend(Backend):
    def __init__(self, max_bytes=None, ttl=None):
        self.max_bytes, self.ttl = max_bytes, ttl
        self._d = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def get_many(self, keys):
        return [self.get(k) for k in keys]

    def contains_many(self, keys):
        with self._lock:
            return [k in self._d for k in keys]

    def put(self, key, value):
        with self._lock:
            self._d[key] = bytes(value)
            return True

    def delete(self, key):
        with self._lock:
            self._d.pop(key, None)

    def nbytes(self):
        return sum(map(len, self._d.values()))

    def __len__(self):
        return len(self._d)

    def clear(self):
        self._d.clear()

    def close(self):
        pass


def open_backend(location, *, max_bytes=None, ttl=None):
    if isinstance(location, Backend):
        return location
    return MemoryBackend(max_bytes, ttl)
