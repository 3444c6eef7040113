"""Block readers: what the kernel reads keys and values from, one block of slots at a time.

Every call of the kernel reads a ``BlockReader``. Plain tensors (a cache's views ``[B, Hkv, T, D]``)
come wrapped in a ``TensorReader``, one block that is the tensors themselves, which also hands them
out whole (``tensors()``) so that the kernel's fast paths (torch's SDPA, the one-pass C++ decode)
can take them. A store that keeps something else, e.g. codes (``layers/quantized.py``), subclasses
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
    The kernel reads a reader only through ``key_scores`` and ``weighted_values`` (built on the
    blocks and the optional ``decode_*`` shortcuts), ``first`` and ``tensors``, and offers a plain
    decode step whole to ``decode_attention`` first (the kernel's ``route`` decides when).
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

    def decode_attention(
        self, query: torch.Tensor, scale: float, softcap: float | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A whole decode step computed by the reader itself (e.g. in one pass over codes), with no
        mask or weights: ``(out, lse)``, the attention ``[B, Hkv, R, Dv]``, in the query's dtype, of
        query rows ``[B, Hkv, R, D]`` over every key, scores ``scale * q . k`` capped as
        ``softcap * tanh(score / softcap)`` (None: no cap), and each row's log-sum-exp of its scores
        float32 ``[B, Hkv, R]`` (the kernel adds attention sinks with it); or None: the kernel then
        takes its blockwise path."""
        return None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values as two whole tensors when the reader holds them so (``TensorReader``),
        for the paths that need them whole (torch's SDPA, the one-pass C++ decode); None: read in blocks."""
        return None

    def first(self, length: int) -> BlockReader:
        """A reader of the first ``length`` slots. A block reader reads all of them: the kernel
        asks for fewer only of a reader that ``tensors()`` hands out whole."""
        if length < self.shape[2]:
            raise NotImplementedError(f"{type(self).__name__} reads all its {self.shape[2]} slots, not the first {length}")
        return self

    def key_scores(self, query: torch.Tensor, decode: bool) -> torch.Tensor:
        """Scores ``[B, Hkv, R, T]`` of scaled query rows ``query`` ``[B, Hkv, R, D]`` against every key.

        ``decode`` (a handful of rows, at most ``kernel.DECODE_ROWS``): ``decode_scores`` if the
        reader has them, else ``K @ q^T`` per block, transposed (a view): with T rows and a handful
        of columns that product streams K in its stored order, which BLAS does close to memory
        speed (``q @ K^T``, the same numbers transposed, measured slower on a 2-core CPU).
        Otherwise ``q @ K^T`` per block."""
        if decode:
            scores = self.decode_scores(query)
            if scores is not None:
                return scores
            q_t = query.transpose(-1, -2)
            return torch.cat([torch.matmul(block, q_t) for block in self.key_blocks()], dim=2).transpose(-1, -2)
        return torch.cat([torch.matmul(query, block.transpose(-1, -2)) for block in self.key_blocks()], dim=3)

    def weighted_values(self, weights: torch.Tensor, decode: bool) -> torch.Tensor:
        """``weights @ values`` ``[B, Hkv, R, Dv]`` for weights ``[B, Hkv, R, T]``: ``decode_values``
        if ``decode`` and the reader has them, else each value block times its columns of the weights."""
        out = self.decode_values(weights) if decode else None
        if out is not None:
            return out
        start = 0
        for block in self.value_blocks():
            stop = start + block.shape[2]
            part = torch.matmul(weights[..., start:stop], block)
            out, start = part if out is None else out + part, stop
        return out


class TensorReader(BlockReader):
    """Plain keys ``[B, Hkv, T, D]`` and values ``[B, Hkv, T, Dv]`` (e.g. views of a cache's
    buffers, read in place) as a reader: one block each, the tensors themselves."""

    __slots__ = ("key", "value")

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key, self.value = key, value  # not checked here: the kernel checks them

    shape = property(lambda self: self.key.shape)
    value_shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.key.dtype)
    device = property(lambda self: self.key.device)

    def key_blocks(self) -> Iterator[torch.Tensor]:
        yield self.key

    def value_blocks(self) -> Iterator[torch.Tensor]:
        yield self.value

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key, self.value

    def first(self, length: int) -> TensorReader:
        """Views of the first ``length`` slots (itself when that is all of them)."""
        if length < self.key.shape[2]:
            return TensorReader(self.key[:, :, :length], self.value[:, :, :length])
        return self

    def key_scores(self, query: torch.Tensor, decode: bool) -> torch.Tensor:
        if decode:
            return torch.matmul(self.key, query.transpose(-1, -2)).transpose(-1, -2)  # a view
        return torch.matmul(query, self.key.transpose(-1, -2))

    def weighted_values(self, weights: torch.Tensor, decode: bool) -> torch.Tensor:
        return torch.matmul(weights, self.value)


#: What a store hands the kernel: a tensor (with its values beside it) or a reader.
TensorLike = Union[torch.Tensor, BlockReader]
