"""Full precision: keys and values as they were computed, in their dtype (or one given)."""

from __future__ import annotations

import torch

from .base import Layout


class FullPrecision:
    """Keys and values as computed; ``dtype`` (default: whatever comes) is what they are kept in."""

    name = "full"
    exact = True
    key_block = 1

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"FullPrecision({self.dtype})" if self.dtype else "FullPrecision()"

    def key_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        return {"keys": ((dim,), self.dtype or dtype)}

    def value_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        return {"values": ((dim,), self.dtype or dtype)}

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"keys": keys if self.dtype in (None, keys.dtype) else keys.to(self.dtype)}

    def encode_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": values if self.dtype in (None, values.dtype) else values.to(self.dtype)}

    def decode_keys(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        keys = parts["keys"]
        return keys if dtype is None or keys.dtype == dtype else keys.to(dtype)

    def decode_values(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        values = parts["values"]
        return values if dtype is None or values.dtype == dtype else values.to(dtype)

    def bytes_per_token(self, key_dim: int, value_dim: int, dtype: torch.dtype) -> float:
        return (key_dim + value_dim) * (self.dtype or dtype).itemsize

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        return None
