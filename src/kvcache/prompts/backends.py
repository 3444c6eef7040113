"""The prompt store's byte backends and ``open_backend``, which picks one from a location string.

    backend = open_backend("memory" | "/some/folder" | "redis://:pw@host:6379/0", max_bytes=..., ttl=...)

``Backend`` (the interface) lives in ``backend_base``; each backend in a module of its own.
"""

from __future__ import annotations

import os

from .backend_base import Backend, check_key
from .folder_backend import FolderBackend
from .memory_backend import MemoryBackend
from .redis_backend import RedisBackend

__all__ = ["Backend", "FolderBackend", "MemoryBackend", "RedisBackend", "check_key", "open_backend"]


def open_backend(location: str | Backend, *, max_bytes: int | None = None, ttl: float | None = None) -> Backend:
    """The backend a location names: ``"memory"`` / ``"memory://"``; ``redis://``, ``rediss://``,
    ``unix://`` URLs; a folder path or ``file://path``; or a ``Backend``, returned as it is."""
    if isinstance(location, Backend):
        return location
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise ValueError(f"a prompt store location is 'memory', a redis:// URL or a folder, got {location!r}")
    if location in ("memory", "memory://"):
        return MemoryBackend(max_bytes, ttl)
    if location.startswith(("redis://", "rediss://", "unix://")):
        return RedisBackend(location, max_bytes=max_bytes, ttl=ttl)
    if location.startswith("file://"):
        location = location[len("file://") :]
    return FolderBackend(location, max_bytes=max_bytes, ttl=ttl)
