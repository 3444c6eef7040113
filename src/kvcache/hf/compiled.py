"""What a compiled decode needs at the model level: the bridge of the fixed-shape layers and a
compiled decode step over a cache made with ``make_cache(..., compile=True)``.

Layers made with ``compile=True`` (``layers/fixed*.py``) get ``FixedHFLayer``: ``is_compileable``,
a mask over their whole capacity and ``seen`` as a tensor, as Hugging Face's ``StaticLayer`` does,
so a compiled forward pass keeps one graph and ``generate`` compiles with them.

::

    cache = kvcache.make_cache(model, "static:capacity=4096", compile=True)
    step = compiled_decode(model)           # torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        logits = model(prompt_ids, past_key_values=cache).logits   # prefill: eager
    token = logits[:, -1:].argmax(-1)
    for _ in range(n):
        token = step(token, cache).logits[:, -1:].argmax(-1)       # one graph, compiled once

The first step compiles (tens of seconds on a CPU); the next ones reuse the graph as long as the
batch size and the cache layout stay the same (a new cache of the same spec included). A compiled
step does not check the capacity (that would read a count out of the graph): stop before
``cache.seen`` reaches it (an eager call refuses). Pass no 2-D ``attention_mask`` (it grows every
step, and so recompiles); a cache with bounded layers needs ``kvcache.use_kvcache_attention(model)``
first. ``generate`` takes the same caches: ``model.generate(..., past_key_values=cache,
compile_config=CompileConfig(fullgraph=True))`` (on a CPU also ``config._compile_all_devices = True``).

Design: docs/architecture.md, "Compiled decode".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layers import KVLayer
from .bridge import HFLayer
from .cache_arg import cache_name


class FixedHFLayer(HFLayer):
    """``HFLayer`` over a fixed-shape layer (``layers/fixed.py``): compileable. Its update returns
    the whole capacity, so the model's mask covers the capacity (``get_mask_sizes``) and the
    query offset is the layer's ``seen`` as a tensor, which compiled code reads without baking
    it in (as Hugging Face's ``StaticLayer`` does)."""

    is_compileable = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.layer.max_length, 0

    def get_seq_length(self) -> torch.Tensor:
        return self.layer.seen_tensor


def hf_layer(layer: KVLayer, attended_by: int = 1) -> HFLayer:
    """The ``transformers`` layer for ``layer`` (``attended_by``: as ``HFLayer``'s): compileable for
    the fixed-shape layers."""
    return FixedHFLayer(layer, attended_by) if layer.compiled else HFLayer(layer, attended_by)


def compiled_decode(model: Any, **compile_options: Any) -> Callable[..., Any]:
    """``step(input_ids, cache, **kwargs)``: ``model.forward`` compiled with ``fullgraph=True``
    (``compile_options`` go to ``torch.compile``: ``mode``, ``backend``, ...), run without autograd
    (in-place writes to the cache would otherwise make its buffers require grad and recompile)."""
    forward = torch.compile(model.forward, **{"fullgraph": True, **compile_options})
    name = cache_name(model)  # read once, not on every step

    def step(input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return forward(input_ids=input_ids, **{name: cache}, use_cache=True, **kwargs)

    return step
