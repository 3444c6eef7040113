"""The baseline: concatenate on every append, as Hugging Face ``DynamicLayer`` does.

Step t copies the whole past, so T tokens cost O(T^2) bytes copied and hold two copies of the
cache for a moment at every step. Kept as the reference for tests and benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Geometry, KVLayer


class ConcatLayer(KVLayer):
    kind = "concat"
    spec_order = 5
    unbounded = True

    def __init__(self) -> None:
        super().__init__()
        self._keys: torch.Tensor | None = None  # [B, Hkv, L, D]
        self._values: torch.Tensor | None = None  # [B, Hkv, L, Dv]

    def _append(self, key, value):
        if self._keys is None:
            new_keys, new_values = key.clone(), value.clone()
        else:
            new_keys = torch.cat([self._keys, key], dim=-2)
            new_values = torch.cat([self._values, value], dim=-2)
        self._keys, self._values = new_keys, new_values
        self.geometry = self.geometry or Geometry.of(key, value)
        self._seen += key.shape[-2]
        self.reallocations += 1
        return self._keys, self._values

    @property
    def length(self) -> int:
        return 0 if self._keys is None else self._keys.shape[-2]

    @property
    def capacity(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        if self._keys is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    def view(self):
        return self._keys, self._values

    def _trim(self, n: int) -> None:
        self._keys = self._keys[:, :, : self.length - n]
        self._values = self._values[:, :, : self._values.shape[-2] - n]

    def reset(self) -> None:
        self._keys = self._values = None
        self.geometry = None
        self._seen = 0

    def _rebatch(self, fn) -> None:
        if self._keys is None:
            return
        keys, values = fn(self._keys), fn(self._values)
        self._keys, self._values = keys, values
        g = self.geometry
        self.geometry = Geometry(keys.shape[0], g.heads, g.key_dim, g.value_dim, g.dtype, g.device)

    def options(self) -> dict[str, Any]:
        return {}
