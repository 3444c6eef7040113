"""A pool's blocks in one format: the tensors, and writing and reading whole blocks or single slots.

For each tensor of the format's layouts one tensor ``[layers, blocks, Hkv, ...]``, allocated zeroed
once (a masked slot read by a matmul must not be NaN; on the CPU on 2 MiB pages where Linux gives
them, ``huge_pages.py``) and never grown. Values are kept a token
each (``[..., block_size, ...]``); keys likewise when the format codes them per token, or one unit
a block when it codes them per channel over the block (``key_block == block_size``).

``dtype`` is the full-precision side: what writes are converted to before coding, what reads
return, and the dtype of any scale. Which blocks are whose is the pool's bookkeeping, not this.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from . import huge_pages
from .base import Format, layout_bytes


class BlockStorage:
    """``blocks`` blocks of ``block_size`` tokens for ``layers`` layers of ``kv_heads`` heads in
    ``format``; keys ``key_dim`` wide, values ``value_dim``, on ``device``."""

    def __init__(
        self, format: Format, layers: int, blocks: int, kv_heads: int, block_size: int, key_dim: int, value_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:  # fmt: skip
        format.check_dims(key_dim, value_dim)
        if format.key_block not in (1, block_size):
            raise ShapeError(
                f"a {format.name} block codes keys over {format.key_block} tokens; the pool's blocks hold {block_size}"
            )
        self.format, self.block_size, self.dtype = format, block_size, dtype
        self.key_dim, self.value_dim = key_dim, value_dim
        lead = (layers, blocks, kv_heads)
        per_token = (block_size,)
        key_unit = per_token if format.key_block == 1 else ()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dt) in format.key_layout(key_dim, dtype).items():
            self.tensors[name] = huge_pages.zeros(*lead, *key_unit, *shape, dtype=dt, device=device)
        for name, (shape, dt) in format.value_layout(value_dim, dtype).items():
            self.tensors[name] = huge_pages.zeros(*lead, *per_token, *shape, dtype=dt, device=device)
        self.key_names = tuple(format.key_layout(key_dim, dtype))
        self.value_names = tuple(format.value_layout(value_dim, dtype))
        self.device = next(iter(self.tensors.values())).device
        #: Bytes of one block over every layer (the tensors are exactly that).
        self.block_nbytes = block_bytes(format, layers, kv_heads, block_size, key_dim, value_dim, dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors, ``[blocks, Hkv, ...]`` views (what kernels read)."""
        return {name: t[layer] for name, t in self.tensors.items()}

    # ---- writing ----------------------------------------------------------------------------

    def write_blocks(self, layer: int, index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Code whole blocks ``index`` (int64 ``[n]``): keys ``[n, Hkv, block_size, D]``, values
        ``[n, Hkv, block_size, Dv]`` (any float dtype)."""
        self._put(layer, self.format.encode_keys(keys.to(self.dtype)), (index,))
        self._put(layer, self.format.encode_values(values.to(self.dtype)), (index,))

    def write_slots(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write token ``i`` (keys ``[T, Hkv, D]``, values ``[T, Hkv, Dv]``) into slot ``offsets[i]``
        of block ``blocks[i]`` (int64 ``[T]``); only a format that keeps keys per token takes it."""
        if self.format.key_block != 1:
            raise ShapeError(f"{self.format.name} blocks code keys over the whole block: a slot cannot be written alone")
        at = (blocks, slice(None), offsets)
        self._put(layer, self.format.encode_keys(keys.to(self.dtype)), at)
        self._put(layer, self.format.encode_values(values.to(self.dtype)), at)

    def _put(self, layer: int, parts: dict[str, torch.Tensor], at: tuple) -> None:
        for name, part in parts.items():
            self.tensors[name][layer][at] = part

    def copy(self, dst: int, src: int) -> None:
        """Block ``src``'s content, every layer, into block ``dst``."""
        for t in self.tensors.values():
            t[:, dst].copy_(t[:, src])

    # ---- reading ----------------------------------------------------------------------------

    def read_blocks(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[n, Hkv, block_size, D]`` and values ``[n, Hkv, block_size, Dv]`` of blocks
        ``index`` (int64 ``[n]``) in ``dtype``."""
        keys = self.format.decode_keys({n: self.tensors[n][layer, index] for n in self.key_names}, self.dtype)
        values = self.format.decode_values({n: self.tensors[n][layer, index] for n in self.value_names}, self.dtype)
        return keys, values


def block_bytes(
    format: Format, layers: int, kv_heads: int, block_size: int, key_dim: int, value_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block of ``format`` over every layer, from its layouts (``dtype`` as for them)."""
    keys = layout_bytes(format.key_layout(key_dim, dtype)) * (block_size // format.key_block)
    return layers * kv_heads * (keys + layout_bytes(format.value_layout(value_dim, dtype)) * block_size)


def flat(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, Hkv, bs, D]`` as one run of tokens ``[Hkv, n * bs, D]``."""
    n, heads, bs, dim = blocks.shape
    return blocks.transpose(0, 1).reshape(heads, n * bs, dim)


def as_blocks(tokens: torch.Tensor, block_size: int) -> torch.Tensor:
    """A run of tokens ``[Hkv, n * bs, D]`` as blocks ``[n, Hkv, bs, D]``."""
    heads, length, dim = tokens.shape
    return tokens.reshape(heads, length // block_size, block_size, dim).transpose(0, 1)
