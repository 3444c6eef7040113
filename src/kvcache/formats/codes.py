"""int8/int4/int2 codes (``quant.py``'s KIVI-style asymmetric quantization) with a scale and minimum
per group.

Values are coded per token in groups of ``group`` channels (``min(group, Dv)``): codes
``[..., Dv * bits / 8]`` uint8, scale and minimum ``[..., Dv / group]``. Keys are coded

- per token the same way when ``key_block`` is 1 (every token's key stands alone, so a slot can be
  rewritten by itself), or
- per channel over a block of ``key_block`` tokens: codes ``[..., key_block, D * bits / 8]``, scale
  and minimum ``[..., D]`` (a block is coded, and rewritten, whole).

4- and 2-bit codes are packed two and four a byte. Scales and minimums are kept in the dtype the
keys and values come in (a holder that wants float32 scales codes float32 tensors).

With ``fp8``, a code is an e4m3 float of its distance from the group's midpoint (``fp8.py``: the
``minimum`` holds the midpoint): 8 bits, the same layouts, read by the same kernels told so.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from . import fp8 as e4m3
from .quant import BITS, Quantized, dequantize_per_channel, dequantize_per_token, quantize_per_channel, quantize_per_token
from .base import Layout


class Codes:
    """Codes of ``bits`` bits; ``group`` channels per value (and per-token key) scale; keys per
    channel over ``key_block`` tokens when it is above 1; e4m3 floats with ``fp8`` (see the module
    docstring)."""

    exact = False

    def __init__(self, bits: int, group: int = 64, key_block: int = 1, fp8: bool = False) -> None:
        if bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
        if fp8 and bits != 8:
            raise ValueError(f"fp8 codes are 8 bits, got bits={bits!r}")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group must be a positive number of channels, got {group!r}")
        if isinstance(key_block, bool) or not isinstance(key_block, int) or key_block < 1:
            raise ValueError(f"key_block must be a positive number of tokens, got {key_block!r}")
        self.bits, self.group, self.key_block, self.fp8 = bits, group, key_block, bool(fp8)
        self.name = "fp8" if fp8 else f"int{bits}"

    def __repr__(self) -> str:
        return f"Codes(bits={self.bits}, group={self.group}, key_block={self.key_block}{', fp8=True' if self.fp8 else ''})"

    def group_of(self, dim: int) -> int:
        """Channels per (scale, minimum) pair of a per-token code of ``dim`` channels."""
        return min(self.group, dim)

    # ---- layouts ----------------------------------------------------------------------------

    def key_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        if self.key_block == 1:
            return self._token_layout("k", dim, dtype)
        return {
            "kcodes": ((self.key_block, dim * self.bits // 8), torch.uint8),
            "kscale": ((dim,), dtype),
            "kmin": ((dim,), dtype),
        }

    def value_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        return self._token_layout("v", dim, dtype)

    def _token_layout(self, prefix: str, dim: int, dtype: torch.dtype) -> Layout:
        groups = dim // self.group_of(dim)
        return {
            prefix + "codes": ((dim * self.bits // 8,), torch.uint8),
            prefix + "scale": ((groups,), dtype),
            prefix + "min": ((groups,), dtype),
        }

    def bytes_per_token(self, key_dim: int, value_dim: int, dtype: torch.dtype) -> float:
        size = dtype.itemsize
        keys = key_dim * self.bits / 8 + (
            2 * size * key_dim / self.key_block if self.key_block > 1 else 2 * size * key_dim / self.group_of(key_dim)
        )
        return keys + value_dim * self.bits / 8 + 2 * size * value_dim / self.group_of(value_dim)

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        per_byte = 8 // self.bits
        if key_dim % per_byte or value_dim % per_byte:
            raise ShapeError(
                f"{self.bits}-bit storage packs {per_byte} codes a byte: head dims must be multiples of "
                f"{per_byte}, got {key_dim} and {value_dim}"
            )
        for what, dim in (("value", value_dim), ("key", key_dim if self.key_block == 1 else None)):
            if dim is not None and dim % self.group_of(dim):
                raise ShapeError(f"{what} head dim {dim} is not a multiple of group_size {self.group_of(dim)} (channels a scale)")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Queries ``[..., D]`` into the space the codes are in (``Rotated`` turns them; here as they are)."""
        return x

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """A weighted sum of decoded codes ``[..., Dv]`` back from that space."""
        return x

    # ---- coding -----------------------------------------------------------------------------

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.key_block == 1:
            return self._encode_tokens("k", keys)
        if keys.shape[-2] != self.key_block:
            raise ShapeError(f"keys are coded by blocks of {self.key_block} tokens, got {keys.shape[-2]}")
        q = e4m3.quantize_per_channel(keys) if self.fp8 else quantize_per_channel(keys, self.bits)
        return {"kcodes": q.codes, "kscale": q.scale.squeeze(-2), "kmin": q.minimum.squeeze(-2)}

    def encode_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._encode_tokens("v", values)

    def _encode_tokens(self, prefix: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
        group = self.group_of(x.shape[-1])
        q = e4m3.quantize_per_token(x, group) if self.fp8 else quantize_per_token(x, self.bits, group)
        return {prefix + "codes": q.codes, prefix + "scale": q.scale, prefix + "min": q.minimum}

    def decode_keys(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.key_block == 1:
            return self._decode_tokens("k", parts, dtype)
        q = Quantized(parts["kcodes"], parts["kscale"].unsqueeze(-2), parts["kmin"].unsqueeze(-2), self.bits)
        return e4m3.dequantize_per_channel(q, dtype) if self.fp8 else dequantize_per_channel(q, dtype)

    def decode_values(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._decode_tokens("v", parts, dtype)

    def _decode_tokens(self, prefix: str, parts: dict[str, torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
        codes = parts[prefix + "codes"]
        q = Quantized(codes, parts[prefix + "scale"], parts[prefix + "min"], self.bits)
        group = self.group_of(codes.shape[-1] * 8 // self.bits)
        return e4m3.dequantize_per_token(q, group, dtype) if self.fp8 else dequantize_per_token(q, group, dtype)
