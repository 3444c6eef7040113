"""What suite ``memory`` drives: the run's sizes (:class:`Setup`) and the contender caches.

Every contender is one cache object used through its model-level ``update(key, value, layer_idx)``
with ``key``, ``value`` ``[1, kv_heads, 1, head_dim]``: Hugging Face's ``DynamicCache``
(``concat``), a buffer grown by 256 slots (``step256``, :class:`Step256Cache`), and ours
(``growable``, ``static``). :func:`make_contender` also gives a function returning the tensors
whose storage a layer holds, which is what :mod:`.memory_measure` watches. See
:mod:`kvcache.apps.bench.memory` for the suite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contenders import make_contender as make_named
from .common import cache_config
from .update import Step256

CONTENDERS = ("concat", "step256", "growable", "static")


@dataclass
class Setup:
    """What one contender's run does (picklable, sent to the worker process)."""

    tokens: int
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    samples: int = 512  # RSS samples over the run (about)
    checkpoints: int = 16  # concat: lengths it is brought to
    window: int = 4  # concat: single-token appends before each checkpoint

    @property
    def sample_every(self) -> int:
        return max(1, self.tokens // self.samples)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values in one layer."""
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class Step256Cache:
    """``update(k, v, layer_idx)`` over one ``Step256`` per layer, like a model-level cache."""

    def __init__(self, layers: int) -> None:
        self.layers = [Step256() for _ in range(layers)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int):
        layer = self.layers[layer_idx]
        layer.update(key, value)
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]


def make_contender(name: str, setup: Setup):
    """A fresh cache and a function giving layer i's storage tensors ``(keys, values)`` (or Nones)."""
    config = cache_config(setup.layers, setup.kv_heads, setup.head_dim, setup.tokens)
    if name == "step256":
        cache = Step256Cache(setup.layers)
        return cache, lambda i: (cache.layers[i].keys, cache.layers[i].values)
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")
    cache = make_named("dynamic" if name == "concat" else name, config, capacity=setup.tokens)
    if name == "concat":  # Hugging Face's DynamicCache: torch.cat on every append
        return cache, lambda i: (getattr(cache.layers[i], "keys", None), getattr(cache.layers[i], "values", None))
    return cache, lambda i: cache.kv_layers[i].view()  # views of the buffers: their storage is the whole buffer
