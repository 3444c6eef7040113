"""A layer's content detached from the layer: what save/load, snapshots and the prompt store carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class LayerState:
    """A layer's content, detached from the layer: what save/load and snapshots carry.

    ``tensors`` holds ``keys`` ``[B, Hkv, L, D]`` and ``values`` ``[B, Hkv, L, Dv]`` (and whatever
    else a kind needs); ``options`` are the constructor's keyword arguments.
    """

    kind: str
    options: dict[str, Any]
    seen: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def clone(self) -> LayerState:
        return LayerState(
            self.kind, dict(self.options), self.seen, {k: t.clone() for k, t in self.tensors.items()}
        )
