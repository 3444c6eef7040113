"""The prompt store's byte backends and ``open_backend``, which picks one from a location string.

    backend = open_backend("memory" | "/some/folder" | "redis://:pw@host:6379/0", max_bytes=..., ttl=...)

``Backend`` (the interface) lives in ``backend_base``; each backend in a module of its own. The
Redis backend needs the ``redis`` package (the ``redis`` extra): it is imported when a ``redis://``
location is opened (or ``RedisBackend`` is looked up here), so ``import kvcache`` does not pull it in.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from .backend_base import Backend, check_key
from .folder_backend import FolderBackend
from .memory_backend import MemoryBackend

if TYPE_CHECKING:
    from .redis_backend import RedisBackend

REDIS_HINT = "pip install 'kvcache[redis]' (or pip install redis)"

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
        return _redis_backend()(location, max_bytes=max_bytes, ttl=ttl)
    if location.startswith("file://"):
        location = location[len("file://") :]
    return FolderBackend(location, max_bytes=max_bytes, ttl=ttl)


def _redis_backend() -> type[RedisBackend]:
    """``RedisBackend``, imported now; a clear error when the ``redis`` package is missing."""
    try:
        return importlib.import_module(".redis_backend", __package__).RedisBackend
    except ModuleNotFoundError as e:
        if e.name != "redis" and not (e.name or "").startswith("redis."):
            raise
        raise ModuleNotFoundError(f"a redis:// prompt store needs the redis package: {REDIS_HINT}", name=e.name) from e


def __getattr__(name: str) -> object:
    if name == "RedisBackend":
        return _redis_backend()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
