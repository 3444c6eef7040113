"""The ``quantized`` kind with fixed shapes, for ``torch.compile`` (see ``fixed.py``).

The codes are allocated for a fixed number of tokens (``capacity``) on the first update, zeroed,
and never reallocated. A decode step (one token) does what ``QuantizedLayer._plan`` decides,
with the decisions as tensors instead of Python branches: it writes the key and the value into the
residual at slots ``seen - quantized_keys`` and ``seen - quantized_values``, always quantizes the
residual's first ``group_size`` keys and values, and stores them (and shifts the residual) only
where the eager layer would, through ``torch.where``; so the codes are the eager layer's, bit for bit. Attention then reads the
whole capacity in position order: the codes dequantized where a position is quantized, the
residual where it is not, masked past the query (inductor fuses the dequantization into it).

Longer updates (a prefill) take the eager layer's path, which reads the counts as ints.
"""

from __future__ import annotations

import math

import torch

from ..attention import Reads
from ..errors import CacheFullError
from .checks import Geometry
from .fixed import Counter, CountedStore, FixedDecodeAttention
from .quantized import QuantizedLayer
from .state import LayerState


class FixedQuantizedLayer(FixedDecodeAttention, QuantizedLayer):
    """``quantized`` whose decode steps keep fixed shapes, for at most ``capacity`` tokens (rounded
    up to a multiple of ``group_size``). Same kind, options and saved state as ``QuantizedLayer``."""

    def __init__(
        self, bits: int | None = None, group_size: int = 64, residual: int = 32, block: int = 512, codes: str = "int", *,
        capacity: int,
    ) -> None:  # fmt: skip
        self.seen_counter = Counter()
        super().__init__(bits, group_size, residual, block, codes)
        if int(capacity) < 1:
            raise ValueError(f"capacity must be a positive number of tokens, got {capacity}")
        self.token_capacity = math.ceil(int(capacity) / self.group_size) * self.group_size
        codes = self.codes
        codes.keys, codes.values, codes.residual_keys, codes.residual_values = (
            CountedStore(layout=store.layout) for store in codes.stores
        )

    @classmethod
    def like(cls, layer: QuantizedLayer, tokens: int) -> FixedQuantizedLayer:
        """An empty twin of the empty ``layer`` holding at most ``tokens`` tokens."""
        return cls(**layer.options(), capacity=tokens)

    @property
    def max_length(self) -> int:
        return self.token_capacity

    def check_append(self, n: int) -> None:
        if self.seen + int(n) > self.token_capacity:
            raise CacheFullError(
                f"compiled quantized cache is full: capacity {self.token_capacity} tokens, {self.seen} stored, "
                f"{n} more requested. Nothing was written; make the cache with a larger capacity."
            )

    def _append(self, key, value):
        if not self.codes.allocated:
            self._allocate(Geometry.of(key, value))
        if not torch.compiler.is_compiling():
            self.check_append(key.shape[2])
        if key.shape[2] != 1:
            return super()._append(key, value)
        return self._decode_step(key, value)

    def load_state(self, state: LayerState) -> None:
        """As ``QuantizedLayer.load_state``, into buffers of the fixed capacity (refused past it)."""
        self.check_state(state)
        if int(state.seen) > self.token_capacity:
            raise CacheFullError(
                f"compiled quantized cache is too small for this state: capacity {self.token_capacity} tokens, "
                f"the state holds {state.seen}. Nothing was changed; make the cache with a larger capacity."
            )
        self.reset()
        if state.tensors:
            t = state.tensors
            self._allocate(Geometry.of(t["residual_keys"], t["residual_values"]))
            self.codes.fill(t)
        self._seen = int(state.seen)

    def _allocate(self, g: Geometry) -> None:
        """Every buffer at its final size, zeroed (unused code slots dequantize to finite zeros)."""
        self.codes.check_dims(torch.empty(0, 0, 0, g.key_dim), torch.empty(0, 0, 0, g.value_dim))
        codes, G, R = self.codes, self.group_size, self.residual
        codes.keys.allocate(self.token_capacity // G, g, zeroed=True)
        codes.values.allocate(self.token_capacity, g, zeroed=True)
        codes.residual_keys.allocate(R + G, g, zeroed=True)
        codes.residual_values.allocate(R + G, g, zeroed=True)
        self.seen_counter.to(g.device)
        self.geometry = g

    def _decode_step(self, key, value):
        """Append one token ``[B, Hkv, 1, D]`` as ``QuantizedLayer._append`` would, with tensor counts."""
        codes, G, R = self.codes, self.group_size, self.residual
        rk, rv = codes.exact_keys, codes.exact_values
        seen = self.seen_counter.value
        blocks, quantized_values = codes.keys.count.value, codes.values.count.value
        exact_keys, exact_values = seen - blocks * G, seen - quantized_values  # before this token

        rk.index_copy_(2, exact_keys.view(1), key)
        keys_leave = exact_keys + 1 == R + G  # a block of G keys leaves the residual
        _put_where(codes.keys, blocks.view(1), keys_leave, **codes.format.encode_keys(rk[:, :, :G].unsqueeze(2)))
        rk.copy_(torch.where(keys_leave, rk.roll(-G, dims=2), rk))

        rv.index_copy_(2, exact_values.view(1), value)
        values_leave = exact_values + 1 == R + G  # and of G values (in step with the keys but in a loaded state)
        slots = quantized_values + torch.arange(G, device=rv.device)
        _put_where(codes.values, slots, values_leave, **codes.format.encode_values(rv[:, :, :G]))
        rv.copy_(torch.where(values_leave, rv.roll(-G, dims=2), rv))

        codes.residual_keys.count.value.copy_(exact_keys + 1 - G * keys_leave.long())
        codes.residual_values.count.value.copy_(exact_values + 1 - G * values_leave.long())
        blocks.add_(keys_leave.long())
        quantized_values.add_(G * values_leave.long())
        query_at = seen.clone()
        seen.add_(1)
        keys, values = self._in_order()
        return Reads(keys, values, None, query_at, 1, returned=(rk, rv))

    def _in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, Hkv, capacity, D]`` and values of positions ``0..capacity-1``: dequantized
        codes below the quantized counts, the residual above (garbage past ``seen``: masked)."""
        codes, g, G = self.codes, self.geometry, self.group_size
        position = torch.arange(self.token_capacity, device=g.device)
        keys = codes.format.decode_keys(codes.keys.tensors, g.dtype).reshape(g.batch, g.heads, self.token_capacity, g.key_dim)
        values = codes.format.decode_values(codes.values.tensors, g.dtype)
        return (
            _overlay(keys, codes.exact_keys, position, codes.keys.count.value * G),
            _overlay(values, codes.exact_values, position, codes.values.count.value),
        )

    def _decode_mask(self, query_at, mask):
        visible = torch.arange(self.token_capacity, device=query_at.device) <= query_at  # [capacity]: positions
        return visible if mask is None else mask & visible


def _put_where(store: CountedStore, slots: torch.Tensor, condition: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Write each ``[B, Hkv, M, ...]`` tensor at ``slots`` ``[M]`` of the store where ``condition``
    holds; elsewhere the slots keep their content (slots past a full store's end are its last, rewritten
    unchanged: ``condition`` never holds there)."""
    at = slots.clamp(max=store.capacity - 1)
    for name, new in tensors.items():
        buffer = store.tensors[name]
        buffer.index_copy_(2, at, torch.where(condition, new, buffer.index_select(2, at)))


def _overlay(decoded: torch.Tensor, exact: torch.Tensor, position: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """Position ``p`` from ``decoded`` below ``quantized`` tokens, else residual slot ``p - quantized``."""
    residual = exact.index_select(2, (position - quantized).clamp(0, exact.shape[2] - 1))
    return torch.where((position < quantized).view(1, 1, -1, 1), decoded, residual)
