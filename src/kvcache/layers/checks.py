"""What every append to a layer must agree on, and the checks of appends and batch indices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DTypeError, ShapeError


@dataclass(frozen=True)
class Geometry:
    """What every append to a layer must agree on, fixed by the first append."""

    batch: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, key: torch.Tensor, value: torch.Tensor) -> Geometry:
        return cls(key.shape[0], key.shape[1], key.shape[3], value.shape[3], key.dtype, key.device)


def check_kv(key: Any, value: Any, expected: Geometry | None) -> None:
    """Raise a clear error unless ``key``/``value`` are a valid append for ``expected``.

    key: ``[B, Hkv, S, D]``; value: ``[B, Hkv, S, Dv]``. ``expected`` is None for a fresh layer.
    """
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(
                f"{name} must have rank 4 [batch, kv_heads, seq, head_dim], got shape {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise DTypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if key.shape[:3] != value.shape[:3]:
        raise ShapeError(
            f"key and value must agree on [batch, kv_heads, seq]: key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}"
        )
    for what in ("dtype", "device"):
        of_key, of_value = getattr(key, what), getattr(value, what)
        if of_key != of_value:
            raise DTypeError(f"key and value must share a {what}: key {of_key}, value {of_value}")
    if expected is None:
        return
    got = Geometry.of(key, value)
    for what in ("batch", "heads", "key_dim", "value_dim"):
        want, came = getattr(expected, what), getattr(got, what)
        if want != came:
            raise ShapeError(
                f"{what.replace('_', ' ')} mismatch: this cache holds {want}, the new "
                f"key/value have {came} (key {tuple(key.shape)}, value {tuple(value.shape)})"
            )
    for what, holds, are in (("dtype", "holds", "are"), ("device", "lives on", "are on")):
        want, came = getattr(expected, what), getattr(got, what)
        if want != came:
            raise DTypeError(f"{what} mismatch: this cache {holds} {want}, the new key/value {are} {came}")


def as_index(index: torch.Tensor | list[int] | range, batch: int, device: torch.device) -> torch.Tensor:
    """A batch index as a 1-D long tensor on ``device``, bounds-checked against ``batch``."""
    idx = torch.as_tensor(index, device=device)
    if idx.dtype == torch.bool:
        if idx.shape != (batch,):
            raise ShapeError(f"a boolean batch mask must have shape ({batch},), got {tuple(idx.shape)}")
        idx = idx.nonzero().flatten()
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ShapeError(f"a batch index must be a 1-D integer tensor, got {idx.dtype} of shape {tuple(idx.shape)}")
    idx = idx.long()
    if idx.numel() and (int(idx.min()) < -batch or int(idx.max()) >= batch):
        raise ShapeError(f"batch index out of range for batch size {batch}: {idx.tolist()}")
    return idx % batch if idx.numel() else idx
