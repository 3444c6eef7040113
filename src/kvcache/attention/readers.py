"""Block readers: keys and values handed to the kernel one block of slots at a time.

A store that keeps plain tensors gives the kernel views (``[B, Hkv, T, D]``) and needs no reader.
A store that keeps something else, e.g. codes (``layers/quantized.py``), subclasses
``BlockReader``: the kernel asks it for its keys, then its values, block by block in slot order,
and never holds more than one block of either in full precision beside the scores.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Union

import torch


class BlockReader(ABC):
    """Keys ``[B, Hkv, T, D]`` and values ``[B, Hkv, T, Dv]`` read in blocks along ``T``.

    ``key_blocks()`` and ``value_blocks()`` yield ``[B, Hkv, t, D]`` / ``[B, Hkv, t, Dv]`` tensors
    in slot order whose lengths add up to ``T`` (keys and values may be split differently).
    """

    @property
    @abstractmethod
    def shape(self) -> torch.Size:
        """The keys' shape ``[B, Hkv, T, D]``."""

    @property
    @abstractmethod
    def value_shape(self) -> torch.Size:
        """The values' shape ``[B, Hkv, T, Dv]``."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The dtype blocks come in (the query's)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def key_blocks(self) -> Iterator[torch.Tensor]: ...

    @abstractmethod
    def value_blocks(self) -> Iterator[torch.Tensor]: ...

    def decode_scores(self, query: torch.Tensor) -> torch.Tensor | None:
        """Scores ``[B, Hkv, R, T]`` of a decode step's scaled query rows ``[B, Hkv, R, D]``
        computed by the reader itself (e.g. straight from codes), or None: the kernel then takes
        them block by block from ``key_blocks()``."""
        return None

    def decode_values(self, weights: torch.Tensor) -> torch.Tensor | None:
        """``weights @ values`` ``[B, Hkv, R, Dv]`` for weights ``[B, Hkv, R, T]`` computed by the
        reader itself, or None: the kernel then reads ``value_blocks()``."""
        return None


#: What the kernel reads keys (and values) from.
TensorLike = Union[torch.Tensor, BlockReader]
