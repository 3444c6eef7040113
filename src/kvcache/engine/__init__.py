"""Groundwork for the paged-attention engine (continuous batching over a paged KV pool).

- ``pool``: ``BlockPool``, fixed-size KV blocks for every layer, reference counted, with prefix
  caching by a hash chain over full blocks (``chain_keys``) and copy-on-write of shared blocks.
"""

from .pool import BlockPool, PoolError, chain_keys

__all__ = ["BlockPool", "PoolError", "chain_keys"]
