"""kvcache: fast, bounded and persistent key/value caches for LLM inference in PyTorch.

    import kvcache
    kvcache.use_kvcache_attention(model)              # the fast decode attention (bounded caches need it)
    cache = kvcache.make_cache(model)                 # growable, the default
    out = model.generate(ids, past_key_values=cache)   # transformers >= 5.24: cache=cache
    cache.save("chat.kv"); cache = kvcache.load_cache("chat.kv", model)

Importing kvcache registers the ``"kvcache"`` attention implementation with ``transformers``.
"""

from .attention import attend
from .engine import Engine
from .errors import (
    CacheFileError,
    CacheFullError,
    CacheSaveError,
    CorruptedFileError,
    DTypeError,
    ForeignFileError,
    KVCacheError,
    ModelMismatchError,
    ShapeError,
    SpecError,
    StoreEntryError,
    StoreUnavailable,
    TruncatedFileError,
    UnsupportedOperation,
)
from .hf.bridge import register_attention, use_kvcache_attention
from .hf.build import make_cache
from .hf.cache import CacheSnapshot, KVCache
from .hf.cache_arg import cache_kwargs, cache_name
from .hf.cachefile import load_cache, save_cache
from .hf.prefill import prefill
from .hf.spec import CacheSpec, parse_spec
from .prompts import PromptStore

__version__ = "0.1.0"

register_attention()

__all__ = [
    "CacheFileError",
    "CacheFullError",
    "CacheSaveError",
    "CacheSnapshot",
    "CacheSpec",
    "CorruptedFileError",
    "DTypeError",
    "Engine",
    "ForeignFileError",
    "KVCache",
    "KVCacheError",
    "PromptStore",
    "ModelMismatchError",
    "ShapeError",
    "SpecError",
    "StoreEntryError",
    "StoreUnavailable",
    "TruncatedFileError",
    "UnsupportedOperation",
    "attend",
    "cache_kwargs",
    "cache_name",
    "load_cache",
    "make_cache",
    "parse_spec",
    "prefill",
    "register_attention",
    "save_cache",
    "use_kvcache_attention",
]
