"""Score once, compress many ways; and KVzip's query-agnostic scores.

A bounded cache decides what to keep from the attention weights of the pass that filled it. When
several policies and budgets must be compared on one prompt (a quality harness), or one context
compressed once and then asked many questions (a prompt store), the expensive part, the model's
forward pass, need not run once per policy:

- ``recording_cache(model, modes)``: a cache of ``RecordingLayer``s that keeps every token and
  records, per layer, the weights of each forward pass in the modes asked for;
- ``compress(model, spec, keys_values, weights)``: a cache of ``spec`` holding exactly what it would
  hold had it attended those tokens itself in one pass with those weights (the layers' own
  ``update`` then ``settle(weights)``: the same code path as a forward pass);
KVzip, which scores a context by having the model reconstruct it and chooses over the whole cache,
is ``kvzip.py``; it records with this module's ``recording_cache``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..layers.own_attention import OwnAttentionLayer
from ..layers.policies import RepeatScores
from ..layers.recording import RecordingLayer
from .bridge import use_kvcache_attention
from .build import make_cache
from .cache import KVCache
from .cache_arg import cache_kwargs

#: The weights mode the plain ``kvzip`` kind scores by: the most any query paid each slot.
KVZIP_MODE = RepeatScores.weights


def recording_cache(model: Any, modes: Sequence[str]) -> KVCache:
    """A cache whose attention layers keep every token and record each pass's weights in ``modes``
    (see ``RecordingLayer``); the model must run the ``"kvcache"`` attention, as for any bounded cache."""
    plain = make_cache(model, "growable")
    modes = tuple(modes)
    recording = [None if s is None else RecordingLayer(modes) for s in plain.kv_layers]
    return KVCache(recording, plain.spec, plain.config_summary, plain.attention_config, dict(plain.others))


def recorded(cache: KVCache, mode: str) -> list[torch.Tensor | None]:
    """The last pass's weights in ``mode``, per layer, float32 ``[B, Hkv, T]`` (None: no cache there)."""
    out = []
    for layer in cache.kv_layers:
        if layer is None:
            out.append(None)
            continue
        if not isinstance(layer, RecordingLayer):
            raise TypeError(f"recorded() reads a recording_cache, got a {layer.kind} layer")
        if layer.recorded is None or mode not in layer.recorded:
            raise ValueError(f"no weights recorded in mode {mode!r} (recording {layer.modes}; run a pass first)")
        out.append(layer.recorded[mode])
    return out


def keys_values(cache: KVCache, stop: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Every layer's stored keys and values ``[B, Hkv, T, D]`` (views), the first ``stop`` tokens."""
    out = []
    for layer in cache.kv_layers:
        if layer is None:
            out.append(None)
            continue
        k, v = layer.view()
        out.append((k[:, :, :stop], v[:, :, :stop]))
    return out


def compress(
    model: Any,
    spec: str,
    past: Sequence[tuple[torch.Tensor, torch.Tensor] | None],
    weights: dict[str, Sequence[torch.Tensor | None]] | None = None,
) -> KVCache:
    """A new cache of ``spec`` holding what it keeps after one pass over ``past`` (per layer
    ``(keys, values)`` ``[B, Hkv, T, D]``, every token from position 0), its bounded layers scored
    by ``weights``: mode -> per layer float32 ``[B, Hkv, T]`` (each layer takes the modes it asks
    for, ``"queries:N"`` included; a policy that asks for none needs none). Raises ``KeyError``
    naming a missing mode.

    Only kinds whose prompt pass attends every earlier token are reproduced this way; a sliding
    window masks its prompt's own attention, so ``compress`` refuses it (``ValueError``)."""
    cache = make_cache(model, spec)
    masked = sorted({s.kind for s in cache.kv_layers if isinstance(s, OwnAttentionLayer) and s.is_sliding})
    if masked:
        raise ValueError(f"compress: {spec!r} has {masked} layers, whose prompt pass does not attend every earlier token; prefill them instead")
    if len(past) != len(cache.kv_layers):
        raise ValueError(f"compress: expected one (keys, values) per layer ({len(cache.kv_layers)}), got {len(past)}")
    for i, (layer, pair) in enumerate(zip(cache.kv_layers, past)):
        if layer is None:
            continue
        reads = layer.append(*pair)
        if isinstance(layer, OwnAttentionLayer):
            mode = reads.weights
            if mode is None:
                layer.settle()
                continue
            modes = (mode,) if isinstance(mode, str) else mode
            missing = [m for m in modes if weights is None or m not in weights]
            if missing:
                raise KeyError(f"compress: {spec!r} layer {i} scores by attention weights {missing}, which were not given")
            # (a flat store reads a pass per KV head too: by_head.py)
            layer.settle(weights[mode][i] if isinstance(mode, str) else {m: weights[m][i] for m in modes})
    return cache
