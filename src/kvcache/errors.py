"""Errors raised by kvcache. Every error says what was expected and what came.

Bad input raises a ``ValueError`` or ``TypeError`` subclass, so callers that already catch the
built-in types keep working. A call that raises leaves the cache exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "CacheFileError",
    "CacheFullError",
    "CacheSaveError",
    "CorruptedFileError",
    "DTypeError",
    "ForeignFileError",
    "KVCacheError",
    "ModelMismatchError",
    "ModelUnavailableError",
    "PoolError",
    "ShapeError",
    "SpecError",
    "StoreEntryError",
    "StoreUnavailable",
    "TruncatedFileError",
    "UnsupportedOperation",
]


class KVCacheError(Exception):
    """Base class of every error kvcache raises on purpose."""


class ShapeError(KVCacheError, ValueError):
    """A key/value tensor has the wrong rank, batch, head count, head dim or length."""


class DTypeError(KVCacheError, TypeError):
    """A key/value tensor has the wrong dtype or device, or is not a tensor."""


class CacheFullError(KVCacheError, ValueError):
    """An append would pass a fixed capacity. Nothing was written."""


class UnsupportedOperation(KVCacheError, ValueError):
    """The cache kind cannot do this, e.g. crop past what a window already dropped."""


class SpecError(KVCacheError, ValueError):
    """A cache spec string or its options are not valid."""


class CacheFileError(KVCacheError, ValueError):
    """A cache file cannot be loaded: truncated, corrupted, foreign or from another model."""


class TruncatedFileError(CacheFileError):
    """The file ends before the data its header announces."""


class CorruptedFileError(CacheFileError):
    """A tensor's checksum does not match: the bytes changed after saving."""


class ForeignFileError(CacheFileError):
    """The file is not a kvcache file, or has an unknown format version."""


class ModelMismatchError(CacheFileError):
    """The file was saved for a model with a different configuration."""


class CacheSaveError(KVCacheError, OSError):
    """A cache file could not be written (full disk, no permission, ...). The old file is intact."""


class ModelUnavailableError(KVCacheError):
    """A pretrained model cannot be had: unknown name, no network, a damaged download, a full disk,
    a failed conversion or a converted folder that no longer matches its manifest. Nothing half-made
    is left behind."""


class StoreEntryError(CacheFileError):
    """A prompt store entry cannot be used: damaged, truncated, foreign, for another model or
    cache, not the prefix it is stored under, or (with a secret) not signed with it. The store
    treats it as a miss and recomputes."""


class StoreUnavailable(KVCacheError, OSError):
    """The prompt store's backend cannot be reached or written: Redis down or timing out, a folder
    that cannot be written. PromptStore turns it into a miss with one warning."""


class PoolError(KVCacheError, ValueError):
    """A block pool call cannot be done: bad arguments, too few free blocks, a block in the wrong
    state for the call (free, shared, registered), or, from ``check``, a broken invariant. Nothing
    was changed."""
