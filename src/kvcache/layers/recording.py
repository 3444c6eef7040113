"""A layer that keeps every token and records what each update's queries paid each slot.

It scores for several policies at once: one forward pass through a cache of recording layers
reports, per layer, the attention weights in every mode asked for (``"sum"``, ``"last"``,
``"max"``, ``"window:N"``; ``attention.attend_weighted``), over all the tokens. A bounded layer
given the same keys and values and those weights (``OwnAttentionLayer.settle(weights)``) then keeps
exactly what it would have kept had it run the pass itself: so a harness, or KVzip's repetition
pass (``kvcache.hf.scoring``), runs the model once and compresses with many policies and budgets.

Not a spec kind: built by ``kvcache.hf.scoring.recording_cache``, never saved.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .own_attention import OwnAttentionLayer
from .store import Geometric, SlotStore


class RecordingLayer(OwnAttentionLayer):
    """Every token in order (a growable store); ``recorded`` holds the last attended update's
    weights: mode -> float32 ``[B, Hkv, T]`` over every slot stored then. Not in the registry's
    table: a tool, not a cache to keep."""

    kind = "recording"

    def __init__(self, modes: tuple[str, ...]) -> None:
        super().__init__()
        if not modes:
            raise ValueError("a recording layer needs at least one weights mode to record")
        self.modes = tuple(modes)
        self.recorded: dict[str, torch.Tensor] | None = None
        self.store = SlotStore(growth=Geometric(256, 2.0))

    def _append(self, key, value):
        return replace(self._record_in_order(key, value), weights=self.modes)

    def _settle(self, weights: dict[str, torch.Tensor] | None) -> None:
        self.recorded = weights

    def reset(self) -> None:
        super().reset()
        self.store.drop()
        self.geometry, self._seen, self.recorded = None, 0, None

    def options(self) -> dict[str, Any]:
        return {"modes": self.modes}

