"""The folder backend: one file per entry, shared by every process that opens the folder.

Layout: ``folder/<fan>/<key>.kvp`` where ``<fan>`` is two hex digits of a hash of the key (256
sub-folders, whatever prefix the keys share). Writes are atomic (``persist.atomic``: temporary
folder, fsync, rename), so a reader sees a complete old or new value and two writers of a key
leave one complete value. A file's times carry the bookkeeping, so processes need no shared
state: mtime is the last write (TTL), atime the last use (LRU); both are set explicitly from a
fine clock because the kernel stamps files with a coarse one.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import StoreUnavailable
from ..persist.atomic import atomic_write
from .backend_base import DEFAULT_MAX_ENTRY_BYTES, Backend, as_bytes_view, check_budget, check_key
from .folder_index import SUFFIX, FolderIndex, Listed, fan_folders, list_fan, remove_if_same

# A read that finds no usable file is a miss; any other failure means the folder is unusable.
_MISSING = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ELOOP, errno.ENXIO}


def _read_whole(fd: int, size: int, buffer: bytearray | None) -> bytes | memoryview | None:
    """The ``size`` bytes of the open file ``fd``, or None if it holds another count now: new
    bytes, or a view of ``buffer`` they were read into, or of a new bytearray if ``buffer`` is
    smaller than ``size + 1`` (one byte more, to see a file that grew)."""
    if buffer is None:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(size + 1)
        return data if len(data) == size else None
    target = buffer if len(buffer) > size else bytearray(size + 1)
    view, got = memoryview(target), 0
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
        while got <= size:
            n = f.readinto(view[got : size + 1])
            if not n:
                break
            got += n
    return view[:size] if got == size else None


def fan_of(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()


class _Clock:
    """Nanosecond wall-clock stamps, strictly increasing within the process, so that uses in
    quick succession keep their order."""

    def __init__(self):
        self._last = 0
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last


_now_ns = _Clock()


class FolderBackend(Backend):
    """Entries as files under ``path`` (created with its parents). After a ``put`` that takes the
    folder over ``max_bytes``, the least recently used files go until it fits (``FolderIndex``
    lists only the fan-out folders that changed). ``nbytes``, ``len`` and ``clear`` list the whole
    folder. ``max_entry_bytes``: a larger file is a miss, never read."""

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes: int | None = None,
        ttl: float | None = None,
        *,
        max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES,
    ):
        check_budget(max_bytes, ttl)
        self.path = Path(path).expanduser().absolute()
        self.location, self.max_bytes, self.ttl = str(self.path), max_bytes, ttl
        self.max_entry_bytes = max_entry_bytes
        self._io("create the folder", lambda: self.path.mkdir(parents=True, exist_ok=True))
        self._index = FolderIndex(str(self.path))

    def _io(self, what: str, call: Callable):
        try:
            return call()
        except OSError as e:
            raise StoreUnavailable(f"prompt store {self.location}: cannot {what}: {e.strerror or e}") from e

    def file_of(self, key: str) -> Path:
        check_key(key)
        return self.path / fan_of(key) / (key + SUFFIX)

    def _written_before_ns(self) -> int:
        """Entries last written before this time (ns) have expired (0: none has)."""
        return 0 if self.ttl is None else time.time_ns() - round(self.ttl * 1e9)

    def _expired(self, mtime_ns: int) -> bool:
        return mtime_ns < self._written_before_ns()

    def get(self, key: str) -> bytes | None:
        return self._read(key, None)

    def iter_values(self, keys: Sequence[str]) -> Iterator[tuple[str, bytes | memoryview | None]]:
        """Each value read into one buffer (grown as needed), handed out as a view of it."""
        buffer = bytearray()
        for key in keys:
            value = self._read(key, buffer)
            if isinstance(value, memoryview):
                buffer = value.obj  # a larger one where the last was too small
            yield key, value

    def _read(self, key: str, buffer: bytearray | None) -> bytes | memoryview | None:
        """The value of ``key``: new bytes (``buffer`` None), or a view of ``buffer`` or of a
        larger bytearray where ``buffer`` is too small."""
        path = self.file_of(key)
        try:
            # O_NONBLOCK: a FIFO planted under an entry's name must not hang the reader.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            return self._miss(e)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size > self.max_entry_bytes:
                return None
            if self._expired(info.st_mtime_ns):
                remove_if_same(str(path), info.st_ino, info.st_mtime_ns)
                return None
            data = _read_whole(fd, info.st_size, buffer)
            if data is None:
                return None  # changed in place while read: not one of our atomic writes
            try:  # a use: only this inode (the file read), and best effort (another user's file)
                os.utime(fd, ns=(_now_ns(), info.st_mtime_ns))
            except OSError:
                pass
            return data
        except OSError as e:
            return self._miss(e)
        finally:
            os.close(fd)

    def _miss(self, error: OSError) -> None:
        if error.errno in _MISSING:
            return None
        raise StoreUnavailable(f"prompt store {self.location}: cannot read: {error.strerror or error}") from error

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        paths = [self.file_of(key) for key in keys]
        found = []
        for path in paths:
            try:
                info = os.stat(path, follow_symlinks=False)
                found.append(stat.S_ISREG(info.st_mode) and not self._expired(info.st_mtime_ns))
            except OSError as e:
                self._miss(e)  # raises unless the file is just absent or unusable
                found.append(False)
        return found

    def put(self, key: str, value) -> bool:
        path = self.file_of(key)
        view = as_bytes_view(value)
        if self.max_bytes is not None and view.nbytes > self.max_bytes:
            return False

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(view)
            now = _now_ns()
            os.utime(tmp, ns=(now, now))

        self._io("create a sub-folder", lambda: path.parent.mkdir(parents=True, exist_ok=True))
        self._io("write an entry", lambda: atomic_write(path, write))
        if self.max_bytes is not None:
            self._evict(self.max_bytes)
        return True

    def _evict(self, budget: int) -> None:
        self._io("evict", lambda: self._index.evict(budget, self._written_before_ns()))

    def _scan(self) -> Iterator[Listed]:
        """Every live entry file, listed now (see ``folder_index.list_fan``)."""
        for fan in self._io("list the folder", lambda: fan_folders(str(self.path))):
            yield from list_fan(fan, self._written_before_ns())

    def delete(self, key: str) -> None:
        path = self.file_of(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreUnavailable(f"prompt store {self.location}: cannot delete {key}: {e.strerror or e}") from e

    def nbytes(self) -> int:
        return sum(entry.size for entry in self._scan())

    def __len__(self) -> int:
        return sum(1 for _ in self._scan())

    def clear(self) -> None:
        for entry in list(self._scan()):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StoreUnavailable(f"prompt store {self.location}: cannot clear: {e.strerror or e}") from e
