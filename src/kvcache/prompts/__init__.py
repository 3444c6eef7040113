"""The prompt store: computed prompt prefixes kept and found by their tokens.

- ``keys``: the hash chain over chunks of token ids, salted with model, dtype, spec and chunk size;
- ``entry``: an entry's bytes (magic, a digest binding it to its key, a kvcache file);
- ``backends`` / ``redis_backend``: where entries live (memory, a folder, Redis);
- ``prompt_store``: ``PromptStore``, which finds, builds and stores caches.
"""

from .backends import Backend, open_backend
from .prompt_store import CHUNKED_KINDS, PromptStore, StoreStats

__all__ = ["Backend", "CHUNKED_KINDS", "PromptStore", "StoreStats", "open_backend"]
