"""Per-token codes of rotated keys and values: the ``int8h``/``int4h``/``int2h`` slot storages.

A per-token code (``codes.py``, one scale and minimum per group of a token's channels) spends its
levels on the group's range. Keys have outlier channels, a few many times the size of the rest,
so the range is theirs and the other channels get few levels: on SmolLM2 at 2K, int4 codes move a
key by 13% of its norm. Multiplying by an orthonormal Hadamard matrix ``H`` (entries
``+-1/sqrt(n)``) first spreads every channel over all of them; the token's channels become alike
and the same bits code them finer (8.6% there; values 9.9% to 8.8%). QuaRot (Ashkboos et al.,
2024) rotates activations and the cache this way before quantizing them.

What is stored is ``code(x H)``; reading back gives ``decode(...) H^T``. Attention can also work
in the rotated space without reading back, as the coded kernels do: ``q . k = (q H) . (k H)``, and
``sum p v = (sum p (v H)) H^T`` (:meth:`Rotated.rotate`, :meth:`Rotated.unrotate`).

``H`` is block diagonal: Sylvester's Hadamard matrix of the largest power of two that divides the
head dim, on every block of that many channels (64 for a head dim of 64, 32 for 96, 16 for 80).
The rotation is computed in float32 (float64 for float64 input) and rounded to the input's dtype
before coding. Nothing depends
on the data, so a slot is still coded, and can be rewritten, on its own.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from .codes import Codes


def block_of(dim: int) -> int:
    """The Hadamard block for ``dim`` channels: the largest power of two dividing it."""
    return dim & -dim


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's orthonormal Hadamard matrix ``[n, n]`` (``n`` a power of two), float64, symmetric;
    a new tensor each call (``rotate`` keeps its own, made once per dtype and device)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


@lru_cache(maxsize=32)
def _matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``hadamard(n)`` in ``dtype`` on ``device``, made once (no copy to a GPU at every step)."""
    return hadamard(n).to(device, dtype)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x H`` for ``x`` ``[..., D]`` (block diagonal ``H``), in ``x``'s dtype. ``H`` is symmetric and
    its own inverse, so the same call turns it back."""
    d = x.shape[-1]
    b = block_of(d)
    if b == 1:
        return x
    work = torch.promote_types(x.dtype, torch.float32)  # float32, or float64 for float64 input
    h = _matrix(b, work, x.device)
    out = x.to(work).reshape(*x.shape[:-1], d // b, b) @ h
    return out.reshape(x.shape).to(x.dtype)


class Rotated(Codes):
    """``Codes`` (a token per key unit) of ``x H``: see the module docstring."""

    def __init__(self, bits: int, group: int = 64) -> None:
        super().__init__(bits, group, key_block=1)
        self.name = f"int{bits}h"

    def __repr__(self) -> str:
        return f"Rotated(bits={self.bits}, group={self.group})"

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Queries (or keys, values) ``[..., D]`` into the space the codes are in."""
        return rotate(x)

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """An output (a weighted sum of coded values) ``[..., Dv]`` back from that space."""
        return rotate(x)

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        return super().encode_keys(rotate(keys))

    def encode_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        return super().encode_values(rotate(values))

    def decode_keys(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return rotate(super().decode_keys(parts, torch.float32)).to(dtype or parts["kscale"].dtype)

    def decode_values(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return rotate(super().decode_values(parts, torch.float32)).to(dtype or parts["vscale"].dtype)
