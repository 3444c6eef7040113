"""What the inference cache held, read back for training: each layer's state after a chunk
(``read_states``), its visibility rule (``rule_of``), which kinds can be replayed (``check_replayable``),
and the archive of keys and values by position from which an earlier state is put back together.

Replay needs, in the backward sweep, the state each chunk attended. Eviction only ever removes a
position, so a state is a set of positions whose keys and values were computed once; the archive
keeps each layer's keys and values at every position a state ever held (``[B, Hkv, L, D]``), and
a state is read back from it by its positions. That is the one store of training that grows with
the sequence: the keys and values of the whole sequence, once (what a full cache of the sequence
would hold); the activations of every chunk but one are recomputed instead.
"""

from __future__ import annotations

import torch

from ..attention import Visibility
from ..attention.masks import CAUSAL
from ..errors import UnsupportedOperation
from ..layers import KVLayer
from ..layers.sliding import SlidingLayer
from ..layers.window import WindowLayer
from .replay import ReplayState

#: Kinds whose decisions are not a set of positions per (row, KV head): Ada-KV keeps each head's
#: slots in one flat run of the layer.
UNREPLAYABLE = {
    "adakv": "it keeps every head's slots in one flat run, not per (row, KV head)",
    "auto": "it may recode its slots (int8, int4, int2) at any pass, and coded storage is not replayed",
    "auto-heads": "it keeps every head's slots in one flat run and may recode them at any pass",
}


def check_replayable(layers: list[KVLayer | None]) -> None:
    """Refuse, naming the reason, a cache whose decisions cannot be replayed or whose values the
    replay would not reproduce."""
    for i, layer in enumerate(layers):
        if layer is None:
            raise UnsupportedOperation(
                f"layer {i} keeps no keys and values of its own (it reuses another layer's); chunked training "
                "does not replay such models yet"
            )
        why = UNREPLAYABLE.get(layer.kind)
        if why is not None:
            raise UnsupportedOperation(f"chunked training cannot replay a {layer.kind!r} cache: {why}; use another kind")
        if not layer.exact:
            raise UnsupportedOperation(
                f"chunked training does not replay coded storage yet (a {layer.kind!r} layer reads even a chunk's own "
                "tokens through their codes, and no straight-through path is written); train with full storage "
                "(storage=full, or the same kind without quantized) and serve with the codes"
            )


def rule_of(layer: KVLayer) -> Visibility:
    """Which positions a query of this layer sees: a window's band and sinks, a model's own sliding
    window, or causal."""
    if isinstance(layer, WindowLayer):
        return layer.visibility
    if isinstance(layer, SlidingLayer):
        return Visibility(layer.window)
    return CAUSAL


def read_state(layer: KVLayer, copy: bool = True) -> ReplayState | None:
    """The layer's state (None before any token): keys and values as its attention reads them (a
    coded store's dequantized), copies unless ``copy`` is False (views of the store, valid until the
    cache changes), and positions ``[B, Hkv, N]``, always a copy (they are kept as decisions)."""
    keys, values = layer.view()
    if keys is None:
        return None
    positions = layer.positions().expand(*keys.shape[:3]).clone()
    if copy:
        keys, values = keys.detach().clone(), values.detach().clone()
    return ReplayState(keys, values, positions)


def read_states(layers: list[KVLayer], copy: bool = True) -> list[ReplayState | None]:
    return [read_state(layer, copy) for layer in layers]


class Archive:
    """Each layer's keys and values by absolute position, ``[B, Hkv, length + 1, D]`` (the last
    cell takes writes at position -1, an empty slot), filled from the states the cache held."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.keys, self.values) for t in d.values())

    def _cells(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.where(positions < 0, self.length, positions)

    def write(self, layer: int, state: ReplayState | None) -> None:
        """Note the keys and values of ``state``'s positions (they never change once computed)."""
        if state is None:
            return
        if layer not in self.keys:
            b, h, _, d = state.keys.shape
            self.keys[layer] = state.keys.new_zeros(b, h, self.length + 1, d)
            self.values[layer] = state.values.new_zeros(b, h, self.length + 1, state.values.shape[-1])
        at = self._cells(state.positions).unsqueeze(-1)
        self.keys[layer].scatter_(2, at.expand_as(state.keys), state.keys)
        self.values[layer].scatter_(2, at.expand_as(state.values), state.values)

    def read(self, layer: int, positions: torch.Tensor | None) -> ReplayState | None:
        """The state of ``positions`` ``[B, Hkv, N]`` (None: no state)."""
        if positions is None:
            return None
        at = self._cells(positions).unsqueeze(-1)
        keys, values = self.keys[layer], self.values[layer]
        return ReplayState(
            keys.gather(2, at.expand(*at.shape[:3], keys.shape[-1])),
            values.gather(2, at.expand(*at.shape[:3], values.shape[-1])),
            positions,
        )
