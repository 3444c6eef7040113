"""Building a cache for a model: one storage layer per transformer layer, read from its config.

``make_cache(model, spec)`` reads the model's config (``layer_types``, ``sliding_window``) and
builds the right layer for each: the spec's kind (``registry.py``) for full-attention layers, and
for the model's own sliding (or chunked) layers one of its window: a ``SlidingLayer`` (the last
tokens in position order, as Hugging Face keeps them, so the model's own attention and masks
apply) beside the kinds that work on the model's own attention (growable, static, concat), a
``WindowLayer`` (a ring buffer, attended by the ``"kvcache"`` attention) beside the bounded kinds,
which need that attention anyway. The result goes straight into
``model.generate(..., past_key_values=cache)`` or a plain forward loop.

Design: docs/architecture.md, "Sliding layers of a model".
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import SpecError, UnsupportedOperation
from ..layers import KVLayer, QuantizedLayer, SlidingLayer, StaticLayer, WindowLayer
from ..layers.fixed import FixedStaticLayer
from ..layers.fixed_quantized import FixedQuantizedLayer
from ..layers.fixed_window import FixedWindowLayer
from ..layers.registry import spec_kind
from ..persist.fingerprint import config_summary, text_config
from . import foreign
from .cache import KVCache
from .foreign import HYBRID_TYPES
from .spec import CacheSpec, parse_spec
from .support import bounded_refusal

SLIDING_TYPES = ("sliding_attention", "chunked_attention")


def make_cache(model: Any, spec: str | CacheSpec = "growable", *, compile: bool | int = False, **options: Any) -> KVCache:
    """A cache for ``model`` (a ``transformers`` model or config), ready for ``generate``.

    ``spec`` is a kind with options, as a string or keywords (``make_cache(model, "static",
    capacity=4096)``; keywords override the string's):

    - unbounded: ``"growable"`` (default), ``"static:capacity=N"`` (or caller-owned
      ``buffers=[(keys, values), ...]``, one pair ``[B, Hkv, C, D]`` per full-attention layer),
      ``"concat"``;
    - bounded: ``"window:window=W,sinks=S"``; ``"h2o:budget=N"``, ``"tova:..."``,
      ``"lastrec:..."`` (``budget`` in tokens, or below 1 a fraction of the tokens seen; ``recent``,
      ``sinks`` protected; ``storage=full|int8|int4|int2``); the query-aware ``"snapkv:budget=0.25,
      window=32,pool=7"``, ``"pyramidkv:...,beta=20"`` (budgets shrinking with depth, the same
      total) and ``"tova-layer:..."`` (one kept set per layer); ``"quantized:bits=4,group_size=64,residual=32"`` (bits 8, 4 or 2).

    Every kind is in the registry's table (``registry.py``; listed by ``kvcache.hf.valid_specs()``),
    its options what its layer class declares.

    The model's own sliding-window layers get a layer of its window (see the module docstring):
    the unbounded kinds work on the model's own attention, sliding layers included. ``model`` is
    not changed. A cache with any bounded layer needs the model to run the ``"kvcache"`` attention
    (their slots are not the past in order): call ``kvcache.use_kvcache_attention(model)`` first
    (also a context manager); otherwise its first update raises, changing nothing.

    ``compile=True`` builds the fixed-shape layers of ``layers/fixed*.py`` (kinds ``static``,
    ``window``, ``quantized``; refused for the others): the cache then decodes under
    ``torch.compile(model.forward, fullgraph=True)`` in one graph (``kvcache.hf.compiled``), and
    ``generate`` compiles with it when given a ``compile_config``. Quantized layers then hold at
    most ``compile`` tokens when it is a number, else the model's ``max_position_embeddings``.
    """
    config = text_config(model)
    parsed = parse_spec(spec, **options)
    visits, layers = getattr(config, "total_num_hidden_layers", None), getattr(config, "num_hidden_layers", None)
    if isinstance(visits, int) and isinstance(layers, int) and visits != layers:
        # Inkling 2 Loop (transformers 5.24): a looped layer's later passes write cache layers
        # past the model's layer count, which one cache layer per model layer cannot hold.
        raise UnsupportedOperation(
            f"this model runs some of its {layers} layers more than once ({visits} layer passes a token), each pass "
            f"with a cache layer of its own; kvcache builds one cache layer per model layer: use transformers' "
            f"DynamicCache(config=model.config) for it"
        )
    layer_types, per_layer = get_layer_types_and_kwargs(config)
    kind = spec_kind(parsed.kind)
    # Caller-owned buffers are one (keys, values) pair per full-attention layer, handed out in order.
    buffers = parsed.options.get("buffers")
    layer_options = {k: v for k, v in parsed.options.items() if k != "buffers"}
    n_full = sum(HYBRID_TYPES.get(t, t) == "full_attention" for t in layer_types)
    if buffers is not None and len(buffers) != n_full:
        raise SpecError(f"buffers: expected one (keys, values) pair per full-attention layer ({n_full}), got {len(buffers)}")

    stores: list[KVLayer | None] = []
    others: dict[int, tuple[str, Any]] = {}
    full_seen = 0
    for i, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer)):
        if layer_type in HYBRID_TYPES:  # kvcache attention beside Hugging Face's linear state
            others[i] = (layer_type, foreign.linear_state(kwargs))
            layer_type = HYBRID_TYPES[layer_type]
        if layer_type == "dummy":
            stores.append(None)
        elif layer_type in SLIDING_TYPES:
            stores.append(sliding_layer(kind.layer, kwargs["sliding_window"]))
        elif layer_type == "full_attention":
            pair = None if buffers is None else buffers[full_seen]
            try:
                stores.append(kind.build(layer_options, pair))
                stores[-1].at_depth(full_seen, n_full)  # PyramidKV sizes its budget by depth
            except ValueError as e:  # a layer's own check of its options
                raise SpecError(f"cache spec {str(parsed)!r}: {e}") from None
            full_seen += 1
        else:
            others[i] = (layer_type, foreign.foreign_layer(layer_type, kwargs, i))
            stores.append(None)
    if compile:
        tokens = compile if type(compile) is int else getattr(config, "max_position_embeddings", None) or 4096
        stores = [None if s is None else fixed_twin(s, tokens) for s in stores]
    refusal = bounded_refusal(config) if any(s is not None and s.needs_own_attention for s in stores) else None
    if refusal is not None:
        raise UnsupportedOperation(
            f"a {parsed.kind!r} cache has bounded layers, which cannot serve this model: {refusal}; "
            f"use an unbounded kind ('growable', 'static', 'concat') for it"
        )
    foreign_types = {i: t for i, (t, _) in others.items() if stores[i] is None}
    foreign.check_spec(parsed.kind, kind.layer.unbounded, foreign_types, {i: o for i, (_, o) in others.items()})
    if not any(s is not None for s in stores) and not any(not foreign.is_fixed_size(o) for _, o in others.values()):
        raise UnsupportedOperation(
            f"this model has no attention layer (layer types: {sorted(set(layer_types))}), so there are no keys "
            f"and values to cache; use transformers' DynamicCache(config=model.config) for it"
        )
    return KVCache(stores, parsed, config_summary(config), config, others)


def sliding_layer(spec_layer: type, window: int) -> KVLayer:
    """The layer for a model's own sliding layer of ``window`` beside layers of ``spec_layer``: in
    position order where the spec's layers attend on the model's own attention, a ring buffer
    beside bounded layers (the cache needs the ``"kvcache"`` attention then)."""
    if spec_layer.needs_own_attention:
        return WindowLayer(window=window)
    return SlidingLayer(window=window)


#: The eager kinds that have a fixed-shape twin (``compile=True``), and the twin.
FIXED_KINDS: dict[type, type] = {StaticLayer: FixedStaticLayer, WindowLayer: FixedWindowLayer, QuantizedLayer: FixedQuantizedLayer}


def fixed_twin(layer: KVLayer, tokens: int) -> KVLayer:
    """A new, empty fixed-shape layer like the empty ``layer`` (over the same caller-owned buffers);
    ``tokens``: the capacity of kinds that have none of their own (quantized)."""
    if type(layer) is SlidingLayer:  # fixed shapes: the ring of the model's window
        layer = WindowLayer(window=layer.window)
    twin = FIXED_KINDS.get(type(layer))
    if twin is None:
        names = ", ".join(sorted(k.kind for k in FIXED_KINDS))
        raise UnsupportedOperation(
            f"compile=True needs fixed shapes, which the kinds {names} keep; a {layer.kind} layer "
            f"grows or reorders its storage: make the cache without compile=True, or with one of those kinds"
        )
    return twin.like(layer, tokens)
