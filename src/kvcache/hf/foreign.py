"""Hugging Face's own cache layers for the layers kvcache does not store.

Hybrid families mix attention with layers that keep other state: linear attention, convolution
and mamba layers (``"linear_attention"``, ``"conv"``: a fixed-size conv state ``[B, C, K]`` and
recurrent state per layer, whatever the length), layers that run both side by side (``"hybrid"``,
``"hybrid_sliding"``), and attention layers with extra per-token state (``"indexed_attention"``,
DeepSeek's compressed kinds). ``make_cache`` keeps kvcache storage for plain attention (including
the attention half of a hybrid layer) and Hugging Face's own layer object for the rest, built as
``DynamicCache(config=...)`` builds it. ``KVCache`` routes the models' linear-state calls
(``update_conv_state``, ``get_recurrent_state``, ``has_previous_state``, ...) to those objects.

What kvcache cannot cover for a foreign layer it refuses, naming the layer kind: saving, ``extend``,
bounded or fixed-capacity specs around layers that grow with the sequence, removing tokens from a
recurrent state.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ..errors import ShapeError, UnsupportedOperation

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
#: Layer types that hold a kvcache attention store and, beside it, a linear-attention state.
HYBRID_TYPES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


def foreign_layer(layer_type: str, kwargs: dict[str, Any], index: int):
    """Hugging Face's layer object for a layer type kvcache does not store (as ``DynamicCache`` builds it)."""
    if layer_type not in DYNAMIC_LAYER_TYPE_MAPPING:
        raise UnsupportedOperation(
            f"layer {index} of this model has type {layer_type!r}, which neither kvcache nor transformers' "
            f"DynamicCache knows; kvcache stores {', '.join(map(repr, ATTENTION_TYPES))} layers and keeps "
            f"transformers' own layers for {', '.join(repr(t) for t in DYNAMIC_LAYER_TYPE_MAPPING if t not in ATTENTION_TYPES)}"
        )
    return DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs)


def linear_state(kwargs: dict[str, Any]) -> LinearAttentionLayer:
    """The linear-attention half of a hybrid layer: Hugging Face's ``LinearAttentionLayer``."""
    return LinearAttentionLayer(number_of_states=kwargs.get("number_of_states", 1))


def is_fixed_size(layer) -> bool:
    """Whether a foreign layer's memory stays the same whatever the sequence length."""
    return isinstance(layer, LinearAttentionCacheLayerMixin) and not hasattr(layer, "keys")


def check_spec(spec_kind: str, unbounded: bool, foreign_types: dict[int, str], foreign: dict[int, Any]) -> None:
    """Refuse a bounded or fixed-capacity spec when a foreign layer grows with the sequence;
    ``unbounded``: the spec's kind promises nothing about memory (its layers grow too)."""
    growing = {i: t for i, t in foreign_types.items() if not is_fixed_size(foreign[i])}
    if not unbounded and growing:
        kinds = sorted(set(growing.values()))
        raise UnsupportedOperation(
            f"a {spec_kind!r} cache bounds or fixes the memory of every layer, and this model's "
            f"{', '.join(map(repr, kinds))} layers ({', '.join(map(str, growing))}) keep transformers' own "
            f"storage, which grows with the sequence; use 'growable' or 'concat' for this model"
        )


# ---- the state of a linear-attention layer ----------------------------------------------------


def _state_dicts(layer) -> list[dict[int, torch.Tensor | None]]:
    return [layer.conv_states, layer.recurrent_states] if isinstance(layer, LinearAttentionCacheLayerMixin) else []


def tensors(layer) -> Iterator[torch.Tensor]:
    """Every tensor a foreign layer holds (conv/recurrent states, keys, values, indexer keys, ...)."""
    seen: set[int] = set()
    for value in vars(layer).values():
        items = value.values() if isinstance(value, dict) else [value]
        for t in items:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                yield t


def nbytes(layer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(layer))


def check_rows(layer, indices: torch.Tensor) -> None:
    """Raise, changing nothing, if ``indices`` name a row the linear states do not have."""
    for states in _state_dicts(layer):
        for t in states.values():
            if t is not None and indices.numel() and (int(indices.max()) >= t.shape[0] or int(indices.min()) < -t.shape[0]):
                raise ShapeError(f"batch index out of range: the linear-attention state holds {t.shape[0]} rows")


def select_rows(layer, indices: torch.Tensor) -> None:
    """Keep rows ``indices`` (batch select, beam reorder) of every linear state ``[B, ...]``."""
    for states in _state_dicts(layer):
        for k, t in states.items():
            if t is not None:
                states[k] = t.index_select(0, indices.to(t.device))


def repeat_rows(layer, repeats: int) -> None:
    for states in _state_dicts(layer):
        for k, t in states.items():
            if t is not None:
                states[k] = t.repeat_interleave(repeats, dim=0)


def check_crop(layer, layer_type: str, index: int, n: int) -> None:
    """Raise, changing nothing, if ``crop(-n)`` cannot put this foreign layer back ``n`` tokens."""
    if n == 0:
        return
    if isinstance(layer, LinearAttentionCacheLayerMixin) and not (layer.record_past and layer.is_croppable):
        raise UnsupportedOperation(
            f"crop(-{n}): layer {index} is a {layer_type!r} layer whose state folds every token in "
            f"(a recurrent or convolution state, not recorded per token), so tokens cannot be removed from it; "
            f"crop works on caches whose layers are all attention. Keep a copy with snapshot() or fork() "
            f"before the tokens you may drop. The cache is unchanged"
        )
    length = layer.get_seq_length() if hasattr(layer, "get_seq_length") and not is_fixed_size(layer) else None
    if length is not None and n > length:
        raise UnsupportedOperation(f"crop(-{n}): layer {index} ({layer_type!r}) holds only {length} tokens")


def crop(layer, n: int) -> None:
    if n:
        layer.crop(-n)


def clone(layer):
    """An independent copy of a foreign layer (its tensors copied)."""
    return copy.deepcopy(layer)


def refuse(operation: str, foreign_types: dict[int, str], what_works: str) -> None:
    """Raise the one error for an operation kvcache cannot do on caches with foreign layers."""
    if foreign_types:
        kinds = sorted(set(foreign_types.values()))
        raise UnsupportedOperation(
            f"{operation}: this cache has {', '.join(map(repr, kinds))} layers "
            f"({', '.join(map(str, foreign_types))}) whose state kvcache keeps in transformers' own layer objects; "
            f"{what_works}"
        )


class ForeignLayers:
    """The part of ``KVCache`` that serves Hugging Face's linear-state calls and keeps batch
    operations in step across foreign layers.

    ``others[i] = (layer_type, layer)``: for a layer kvcache does not store, ``layer`` is Hugging
    Face's object in slot i; for a hybrid layer (kvcache attention store in slot i), it is the
    ``LinearAttentionLayer`` holding its linear state.
    """

    def _set_others(self, others: dict[int, tuple[str, Any]]) -> None:
        self.others = dict(others)
        self.other_kinds = {i: t for i, (t, _) in self.others.items()}
        self.linear = {i: obj for i, (_, obj) in self.others.items() if isinstance(obj, LinearAttentionCacheLayerMixin)}
        # Linear states that are not a slot's layer (the linear half of hybrid layers).
        self._companions = {i: obj for i, obj in self.linear.items() if self.kv_layers[i] is not None}

    def _slot_layer(self, i: int, default):
        kind_and_layer = self.others.get(i)
        return default if kind_and_layer is None or self.kv_layers[i] is not None else kind_and_layer[1]

    # ---- what models call for linear attention / mamba / conv layers -----------------------

    def _linear_at(self, layer_idx: int):
        layer = self.linear.get(layer_idx)
        if layer is None:
            raise ValueError(
                f"layer {layer_idx} keeps no linear-attention state (it is a {self._kind(layer_idx)!r} layer); "
                f"layers with one: {sorted(self.linear)}"
            )
        return layer

    def _kind(self, i: int) -> str:
        return self.other_kinds.get(i, "attention" if self.kv_layers[i] is not None else "dummy")

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        layer = self._linear_at(layer_idx)
        return layer.conv_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check_first_write(layer_idx)
        return self._linear_at(layer_idx).update_conv_state(conv_states, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        layer = self._linear_at(layer_idx)
        return layer.recurrent_states[state_idx] if layer.has_previous_state[state_idx] else None

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._check_first_write(layer_idx)
        return self._linear_at(layer_idx).update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None:
            if not self.linear:
                raise ValueError("has_previous_state: this cache has no linear-attention layer")
            layer_idx = max(self.linear)
        layer = self._linear_at(layer_idx)
        if state_idx is None:
            return all(layer.has_previous_state.values())
        return layer.has_previous_state[state_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        layer = self.linear.get(layer_idx)
        return bool(getattr(layer if layer is not None else self.layers[layer_idx], "record_past", False))

    def activate_past_recording(self) -> None:
        super().activate_past_recording()
        for layer in self._companions.values():
            layer.activate_past_recording()

    @property
    def is_croppable(self) -> bool:
        return super().is_croppable and all(layer.is_croppable for layer in self._companions.values())

    def _check_first_write(self, layer_idx: int) -> None:
        """A linear layer before the first attention layer writes first: check the attention there."""
        if layer_idx == self._first_state:
            self.check_attention()

    # ---- batch operations and reset -------------------------------------------------------

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rows(beam_idx, "reorder_cache", lambda layer: select_rows(layer, beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(indices, "batch_select_indices", lambda layer: select_rows(layer, indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows(None, "batch_repeat_interleave", lambda layer: repeat_rows(layer, repeats), repeats)

    def _rows(self, indices, verb: str, linear_op, *args) -> None:
        if indices is not None:
            for layer in self.linear.values():
                check_rows(layer, indices)
        for i, layer in enumerate(self.layers):
            if layer is not self.linear.get(i):
                getattr(layer, verb)(indices if indices is not None else args[0])
        for layer in self.linear.values():
            linear_op(layer)

    def reset(self) -> None:
        super().reset()
        for layer in self._companions.values():
            layer.reset()

    @property
    def others_nbytes(self) -> int:
        return sum(nbytes(obj) for _, obj in self.others.values())
