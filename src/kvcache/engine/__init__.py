"""The paged-attention engine: many requests over one model, continuous batching over a paged KV
pool with prefix sharing.

- ``engine``: ``Engine`` (submit, step, running, generate_batch); ``probe``: whether it can serve a
  model; ``inputs``: the checks of what callers hand it.
- ``scheduler``: which requests compute which tokens each step; admission, prefix hits, preemption.
- ``step``: one step as one forward pass of a packed sequence; its attention over the pool;
  ``block_io``: what the step reads and writes, by the pool's format.
- ``request``: ``RequestHandle`` (tokens as they come, result, cancel, stats) and ``RequestStats``.
- ``pool``: ``BlockPool``, the bookkeeping of fixed-size KV blocks for every layer: reference
  counts, prefix caching by a hash chain over full blocks (``chain_keys``), copy-on-write of shared
  blocks, open blocks; its tensors are a ``formats.BlockStorage`` (full precision, or int8/int4/int2
  codes with one exact open block per request). ``pool_setup``: which spec gives which pool.
- ``paged``: ``paged_decode``, decode attention of one token per sequence over its block table.
"""

from ..errors import PoolError
from .block_keys import chain_keys
from .engine import Engine, EngineStats
from .logprobs import check_top
from .paged import paged_decode
from .pool import BlockPool
from .pool_setup import PoolShape, pool_shape
from .request import RequestCancelled, RequestHandle, RequestStats

__all__ = [
    "BlockPool", "Engine", "EngineStats", "PoolError", "PoolShape", "RequestCancelled", "RequestHandle", "RequestStats",
    "chain_keys", "check_top", "paged_decode", "pool_shape",
]
