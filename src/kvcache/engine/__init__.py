"""Groundwork for the paged-attention engine (continuous batching over a paged KV pool).

- ``pool``: ``BlockPool``, fixed-size KV blocks for every layer, reference counted, with prefix
  caching by a hash chain over full blocks (``chain_keys``) and copy-on-write of shared blocks.
- ``paged``: ``paged_decode``, decode attention of one token per sequence over its block table.
"""

from .paged import paged_decode
from .pool import BlockPool, PoolError, chain_keys

__all__ = ["BlockPool", "PoolError", "chain_keys", "paged_decode"]
