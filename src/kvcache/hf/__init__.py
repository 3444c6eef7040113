"""The model tier's transformers-facing modules: the cache a model is handed and what builds, saves
and loads it.

- ``bridge``: ``HFLayer`` (a storage layer in transformers' cache-layer interface), the
  ``"kvcache"`` attention and its registration, ``use_kvcache_attention``, ``FORWARD_STEP``;
  ``attention_kwargs``: the keywords a model's attention call passes besides q/k/v/mask;
  ``support``: which models bounded layers cannot serve; ``cache_arg``: the keyword a model takes
  its cache under;
- ``cache``: ``KVCache`` (a ``transformers.Cache``); ``foreign``: transformers' own layers for a
  hybrid model's non-attention layers; ``compiled``: the fixed-shape layers' bridge and
  ``compiled_decode``;
- ``spec``: cache spec strings; ``build``: ``make_cache``; ``cachefile``: ``load_cache`` /
  ``save_cache``, a file checked against its model;
- ``prefill``: a prompt a chunk at a time; ``scoring``: score once, compress many ways; ``kvzip``:
  KVzip as its paper has it (``compress_context``);
  ``linears``: a model's linear layers on prepacked weights inside a block.

This package re-exports the bridge's names (``from kvcache.hf import use_kvcache_attention``);
everything else is imported by its module (``kvcache.hf.cache``, ``kvcache.hf.build``, ...) or,
for users, from ``kvcache`` itself (``make_cache``, ``KVCache``, ``load_cache``, ...).

Design: docs/architecture.md, "The transformers bridge".
"""

from . import kvzip, scoring
from .bridge import (
    ATTENTION_NAME,
    EAGER_MASKS,
    FORWARD_STEP,
    SWITCH_HINT,
    ForwardStep,
    HFLayer,
    boolean_mask,
    causal_after_past,
    hf_attention_forward,
    kvcache_mask,
    register_attention,
    runs_kvcache_attention,
    use_kvcache_attention,
)
from .spec import valid_specs

__all__ = [
    "ATTENTION_NAME",
    "EAGER_MASKS",
    "FORWARD_STEP",
    "SWITCH_HINT",
    "ForwardStep",
    "HFLayer",
    "boolean_mask",
    "causal_after_past",
    "hf_attention_forward",
    "kvcache_mask",
    "register_attention",
    "kvzip",
    "runs_kvcache_attention",
    "scoring",
    "use_kvcache_attention",
    "valid_specs",
]
