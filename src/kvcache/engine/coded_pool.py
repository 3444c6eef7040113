"""A block pool whose full blocks are stored coded (int8, int4 or int2), with one full-precision
open block per running sequence.

Layout, per layer (``NB`` coded blocks of ``bs`` slots, ``NT`` open blocks):

- key codes uint8 ``[NB, Hkv, bs, D * bits / 8]`` with a scale and minimum float32 ``[NB, Hkv, D]``:
  keys are quantized per channel over the block's ``bs`` tokens (KIVI: keys have outlier channels);
- value codes uint8 ``[NB, Hkv, bs, Dv * bits / 8]`` with a scale and minimum float32
  ``[NB, Hkv, bs, Dv / value_group]``: values per token, in groups of ``value_group`` channels;
- open blocks float32 ``[NT, Hkv, bs, D]`` / ``[NT, Hkv, bs, Dv]`` (``tail_keys``, ``tail_values``).

A sequence's tokens lie in its block table as in ``BlockPool``, except that the tokens of its last,
unfilled block lie in its open block (``take_tail``) until the block fills: then ``code_blocks``
quantizes them into the table's block, whose codes never change again (so registered and shared
blocks are immutable, as in the float pool). Quantization is ``quant.py``'s, so a coded block
dequantizes exactly as ``quant.dequantize_per_channel`` / ``dequantize_per_token`` say.

The bookkeeping (reference counts, prefix keys, the LRU, written slots) is ``BlockPool``'s; only the
storage differs. ``write`` and ``gather`` keep their meaning: ``write`` codes a whole block at once
(the only write a coded block takes), ``gather`` dequantizes.
"""

from __future__ import annotations

import torch

from .. import quant
from .pool import BlockPool, PoolError


class CodedBlockPool(BlockPool):
    """``blocks`` coded blocks of ``bits`` bits and ``tails`` float32 open blocks (see the module
    docstring); the other arguments as ``BlockPool``'s. ``dtype`` is the model's: what ``gather``
    return and what ``write`` takes."""

    exact = False
    open_blocks = True

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_size: int,
        blocks: int,
        bits: int,
        value_group: int,
        tails: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        value_dim: int | None = None,
    ):
        if bits not in quant.BITS:
            raise PoolError(f"bits must be one of {quant.BITS}, got {bits!r}")
        vdim = head_dim if value_dim is None else value_dim
        per_byte = 8 // bits
        if head_dim % per_byte or vdim % per_byte:
            raise PoolError(f"{bits}-bit codes pack {per_byte} a byte: head dims {head_dim}/{vdim} must be multiples of {per_byte}")
        if not isinstance(value_group, int) or value_group < 1 or vdim % value_group or value_group % per_byte:
            raise PoolError(
                f"value_group must divide the value head dim {vdim} and be a multiple of {per_byte}, got {value_group!r}"
            )
        if not isinstance(tails, int) or tails < 1:
            raise PoolError(f"tails must be a positive number of open blocks, got {tails!r}")
        self.bits, self.value_group, self.tail_count = bits, value_group, tails
        super().__init__(layers, kv_heads, head_dim, block_size, blocks, dtype, device, value_dim)
        self._free_tails = list(range(tails - 1, -1, -1))

    def _allocate_storage(self, device: torch.device) -> torch.device:
        L, NB, H, bs, bits = self.layers, self.total, self.kv_heads, self.block_size, self.bits
        D, Dv, f32 = self.head_dim, self.value_dim, torch.float32
        self.key_codes = torch.zeros(L, NB, H, bs, D * bits // 8, dtype=torch.uint8, device=device)
        self.key_scale = torch.zeros(L, NB, H, D, dtype=f32, device=device)
        self.key_min = torch.zeros(L, NB, H, D, dtype=f32, device=device)
        self.value_codes = torch.zeros(L, NB, H, bs, Dv * bits // 8, dtype=torch.uint8, device=device)
        self.value_scale = torch.zeros(L, NB, H, bs, Dv // self.value_group, dtype=f32, device=device)
        self.value_min = torch.zeros(L, NB, H, bs, Dv // self.value_group, dtype=f32, device=device)
        self.tail_keys = torch.zeros(L, self.tail_count, H, bs, D, dtype=f32, device=device)
        self.tail_values = torch.zeros(L, self.tail_count, H, bs, Dv, dtype=f32, device=device)
        return self.key_codes.device

    def _parts(self) -> tuple[torch.Tensor, ...]:
        return (self.key_codes, self.key_scale, self.key_min, self.value_codes, self.value_scale, self.value_min)

    @property
    def nbytes(self) -> int:
        """Bytes of the coded blocks (codes, scales, minimums) and the open blocks, all allocated at
        construction."""
        return self.coded_nbytes + self.tail_keys.nbytes + self.tail_values.nbytes

    @property
    def coded_nbytes(self) -> int:
        return sum(t.nbytes for t in self._parts())

    @property
    def block_nbytes(self) -> int:
        """Bytes of one coded block over every layer (codes, scales and minimums)."""
        return self.coded_nbytes // self.total

    @property
    def tail_nbytes(self) -> int:
        """Bytes of one open block over every layer (float32 keys and values)."""
        return (self.tail_keys.nbytes + self.tail_values.nbytes) // self.tail_count

    @staticmethod
    def bytes_per_block(layers: int, kv_heads: int, head_dim: int, block_size: int, bits: int, value_group: int,
                     value_dim: int | None = None) -> int:
        """Bytes of one coded block over every layer."""
        vdim = head_dim if value_dim is None else value_dim
        per_head = block_size * (head_dim + vdim) * bits // 8 + 2 * 4 * head_dim + 2 * 4 * block_size * vdim // value_group
        return layers * kv_heads * per_head

    # ---- open blocks ----------------------------------------------------------------------------

    @property
    def free_tails(self) -> int:
        return len(self._free_tails)

    def take_tail(self) -> int:
        """An open block for a sequence's unfilled last block (its content undefined until written)."""
        if not self._free_tails:
            raise PoolError(f"all {self.tail_count} open blocks are taken (one per running sequence)")
        return self._free_tails.pop()

    def give_tail(self, tail: int) -> None:
        if not 0 <= tail < self.tail_count or tail in self._free_tails:
            raise PoolError(f"open block {tail!r} is not taken")
        self._free_tails.append(tail)

    # ---- coding ---------------------------------------------------------------------------------

    def code_blocks(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize whole blocks into coded blocks ``blocks`` (int64 ``[n]``) of ``layer``: ``keys``
        ``[n, Hkv, bs, D]`` and ``values`` ``[n, Hkv, bs, Dv]`` (any float dtype). The caller has
        claimed the slots (the engine's step) or checks writability (``write``)."""
        qk = quant.quantize_per_channel(keys.float(), self.bits)
        qv = quant.quantize_per_token(values.float(), self.bits, self.value_group)
        self.key_codes[layer].index_copy_(0, blocks, qk.codes)
        self.key_scale[layer].index_copy_(0, blocks, qk.scale.squeeze(2))
        self.key_min[layer].index_copy_(0, blocks, qk.minimum.squeeze(2))
        self.value_codes[layer].index_copy_(0, blocks, qv.codes)
        self.value_scale[layer].index_copy_(0, blocks, qv.scale)
        self.value_min[layer].index_copy_(0, blocks, qv.minimum)

    def decoded(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[n, Hkv, bs, D]`` and values ``[n, Hkv, bs, Dv]`` (float32) of coded blocks ``index``."""
        kq = quant.Quantized(self.key_codes[layer, index], self.key_scale[layer, index].unsqueeze(2),
                             self.key_min[layer, index].unsqueeze(2), self.bits)
        vq = quant.Quantized(self.value_codes[layer, index], self.value_scale[layer, index],
                             self.value_min[layer, index], self.bits)
        return quant.dequantize_per_channel(kq), quant.dequantize_per_token(vq, self.value_group)

    def write(self, layer: int, block: int, offset: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Code a whole block: ``offset`` 0 and ``keys`` ``[Hkv, bs, D]``, ``values`` ``[Hkv, bs, Dv]``
        (a coded block takes no partial write)."""
        layer, block = self._layer(layer), self._block(block)
        self._check_writable(block)
        keys = self._slots("keys", keys, self.head_dim)
        values = self._slots("values", values, self.value_dim)
        if offset != 0 or keys.shape[1] != self.block_size or values.shape[1] != self.block_size:
            raise PoolError(
                f"a coded block is written whole: offset 0 and {self.block_size} slots, got offset {offset!r} and "
                f"{keys.shape[1]}/{values.shape[1]} slots"
            )
        self.code_blocks(layer, torch.tensor([block], device=self.device), keys[None], values[None])
        self._written[layer][block] = (1 << self.block_size) - 1

    def _copy_storage(self, dst: int, src: int) -> None:
        for part in self._parts():
            part[:, dst].copy_(part[:, src])

    def _gather_layer(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.decoded(layer, index)
        return flat(k).to(self.dtype), flat(v).to(self.dtype)


def flat(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[n, Hkv, bs, D]`` as one run of tokens ``[Hkv, n * bs, D]``."""
    n, heads, bs, dim = blocks.shape
    return blocks.transpose(0, 1).reshape(heads, n * bs, dim)
