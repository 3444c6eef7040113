"""The interface of the prompt store's byte-level key/value stores (memory, a folder, Redis).

A backend maps a key (``str`` of ``[A-Za-z0-9_.-]``, 1-128 characters, not starting with a dot)
to a value (``bytes``; ``iter_values`` may hand out views instead). It does not interpret values:
the prompt store's entries carry their own digest. Every backend keeps at most ``max_bytes`` of
values, evicting the least recently used entries (a ``get`` or a ``put`` is a use), and forgets an
entry ``ttl`` seconds after its last write. A missing entry is never an error; a backend that
cannot be reached or written raises ``StoreUnavailable``. One backend object may be shared by many
threads.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
DEFAULT_MAX_ENTRY_BYTES = 2 << 30


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid store key, else raise ``ValueError`` naming it.

    A leading dot is refused too: ``..`` would climb out of a folder store, and dot names are
    the directory store's temporary files.
    """
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise ValueError(f"a store key is 1-128 characters of [A-Za-z0-9_.-] not starting with '.', got {key!r}")
    return key


def as_bytes_view(value) -> memoryview:
    """The bytes of ``value`` (``bytes``, ``bytearray`` or a contiguous ``memoryview``) as a flat
    byte view, without copying."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"a store value is bytes, bytearray or memoryview, got {type(value).__name__}")
    view = memoryview(value)
    if not view.c_contiguous:
        raise ValueError("a store value given as a memoryview must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_budget(max_bytes: int | None, ttl: float | None) -> None:
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes is a byte count >= 0 or None, got {max_bytes!r}")
    if ttl is not None and not ttl > 0:
        raise ValueError(f"ttl is a number of seconds > 0 or None, got {ttl!r}")


class Backend(ABC):
    """The interface the prompt store codes against. ``location`` names the store in messages
    (never with a password); ``max_bytes`` is the byte budget of the values held (None: unbounded);
    ``ttl`` the seconds an entry lives after its last write (None: forever)."""

    location: str
    max_bytes: int | None
    ttl: float | None

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value stored under ``key``, or None if absent or expired. Counts as a use."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``[get(k) for k in keys]``, in one round trip where the backend can."""
        return [self.get(key) for key in keys]

    def iter_values(self, keys: Sequence[str]) -> Iterator[tuple[str, bytes | memoryview | None]]:
        """``(key, value or None)`` for each of ``keys`` in turn, read as the caller asks for it: a
        value may be a view of a buffer the backend reuses, valid only until the next is asked for
        (copy it to keep it). Each is a use, as ``get`` is. The default reads them with ``get_many``."""
        yield from zip(keys, self.get_many(keys))

    @abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held now (not a use)."""

    @abstractmethod
    def put(self, key: str, value: bytes | bytearray | memoryview) -> bool:
        """Store ``value`` under ``key``, then evict least recently used entries until the values
        total at most ``max_bytes``. Returns False, storing nothing, if the value alone is over
        ``max_bytes``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if held."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of values held now."""

    @abstractmethod
    def __len__(self) -> int:
        """Entries held now."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every entry of this store (and nothing else)."""

    def close(self) -> None:
        """Release connections or files; the default has none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, max_bytes={self.max_bytes}, ttl={self.ttl})"
