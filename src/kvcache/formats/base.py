"""What every storage format answers (see the package docstring)."""

from __future__ import annotations

from typing import Protocol

import torch

#: name -> (shape after the holder's leading dims, dtype) of each tensor of a format.
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Format(Protocol):
    #: What ``storage=`` calls it: ``full``, ``int8``, ``int4``, ``int2``.
    name: str
    #: Whether reading back gives the keys and values exactly as written.
    exact: bool
    #: Tokens a key unit spans: 1 (keys kept per token) or a block of tokens coded together.
    key_block: int

    def key_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        """The tensors of one key unit (a token, or ``key_block`` tokens) of ``dim`` channels;
        ``dtype`` is the full-precision dtype (of the keys, and of any scale)."""
        ...

    def value_layout(self, dim: int, dtype: torch.dtype) -> Layout:
        """The tensors of one token's value of ``dim`` channels."""
        ...

    def encode_keys(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Keys ``[..., D]`` (a token a unit) or ``[..., key_block, D]`` as the layout's tensors,
        each with the same leading dims."""
        ...

    def encode_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Values ``[..., Dv]`` as the layout's tensors."""
        ...

    def decode_keys(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """What ``encode_keys`` took, read back (in ``dtype``; default the stored or scale dtype)."""
        ...

    def decode_values(self, parts: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        ...

    def bytes_per_token(self, key_dim: int, value_dim: int, dtype: torch.dtype) -> float:
        """Bytes a token's key and value take in one head (``dtype`` as for the layouts)."""
        ...

    def check_dims(self, key_dim: int, value_dim: int) -> None:
        """Raise ``ShapeError`` unless keys of ``key_dim`` and values of ``value_dim`` channels fit."""
        ...


class CodedFormat(Format, Protocol):
    """Codes a token each that attention reads straight, without decoding them first (``Codes``,
    ``Rotated``): the coded library needs their width and groups, and a rotated format turns the
    query in and the output back."""

    #: Bits a code: 8, 4 or 2.
    bits: int
    #: Whether a code is an e4m3 float (``fp8.py``; 8 bits) rather than an integer.
    fp8: bool

    def group_of(self, dim: int) -> int:
        """Channels per (scale, minimum) pair of a token's code of ``dim`` channels."""
        ...

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Queries ``[..., D]`` into the space the codes are in."""
        ...

    def unrotate(self, x: torch.Tensor) -> torch.Tensor:
        """A weighted sum of decoded values ``[..., Dv]`` back from that space."""
        ...


def layout_bytes(layout: Layout) -> int:
    """Bytes of one unit of ``layout``."""
    total = 0
    for shape, dtype in layout.values():
        count = 1
        for n in shape:
            count *= n
        total += count * dtype.itemsize
    return total
