"""The prompt store: computed prompt prefixes kept and found by their tokens.

- ``keys``: the hash chain over chunks of token ids, salted with model, dtype, spec and chunk size;
- ``entry``: an entry's bytes (magic, a digest binding it to its key, a kvcache file);
  ``checksum`` and ``stream``: that digest, computed in the pass that copies the entry;
- ``chunks``, ``chunk_entry``, ``chunk_fill``: chunk entries made, their headers checked, and
  written straight into a cache's buffers;
- ``backends`` / ``redis_backend``: where entries live (memory, a folder, Redis);
- ``prompt_store``: ``PromptStore``, which finds, builds and stores caches.
"""

from .backends import Backend, open_backend
from .prompt_store import CHUNKED_KINDS, PromptStore, StoreStats
from .redis_reader import BulkReader

__all__ = ["Backend", "BulkReader", "CHUNKED_KINDS", "PromptStore", "StoreStats", "open_backend"]
