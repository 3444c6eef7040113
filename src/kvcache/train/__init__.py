"""Training through a cache: the loss of sequences longer than memory, chunk by chunk through the
cache a model will be served with, and its exact gradients (``chunked_loss``).

::

    from kvcache.train import chunked_loss

    result = chunked_loss(model, ids, "h2o:budget=0.25", chunk=256, grad="replay")
    optimizer.step()          # the gradients are in the parameters' .grad
    optimizer.zero_grad()
    cache_loss(model, held_out, "h2o:budget=0.25", chunk=256)   # scored under the same cache, no gradients

Design: docs/training.md; docs/architecture.md, "Training through a cache".
"""

from __future__ import annotations

from .chunked import GRAD_MODES, ChunkedLoss, chunked_loss
from .evaluate import cache_loss

__all__ = ["GRAD_MODES", "ChunkedLoss", "cache_loss", "chunked_loss"]
