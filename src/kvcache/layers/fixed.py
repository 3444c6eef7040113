"""Fixed-shape layers for ``torch.compile``: every decode step has the same shapes and reads no
Python number, so a compiled forward pass decodes without a graph break or a recompilation.

The eager layers return views of the slots in use (``[:, :, :length]``), which grow every step,
and keep their counts as Python ints, which a compiled graph would bake in as constants (and
recompile when they change). The layers here keep their counts in 0-d tensors on the buffers'
device, write new tokens with ``index_copy_`` at positions computed from those tensors, and hand
attention the whole capacity: the mask (built by ``transformers`` from ``get_mask_sizes``, or by
the layer from its slot positions) hides the slots not filled yet. The buffers and counters are
marked with ``torch._dynamo.mark_static_address``, as Hugging Face's ``StaticLayer`` does.

Eager calls still work on them (prefill, trimming, saving): they read the counters back as ints
(``int(tensor)``, a device sync), which is why the eager kinds keep Python ints.
``make_cache(model, spec, compile=True)`` builds these layers.
"""

from __future__ import annotations

import torch

from ..attention import Reads, attend
from ..errors import UnsupportedOperation
from .checks import Geometry
from .static import StaticLayer
from .store import SlotStore


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these tensors keep their address for the cache's life (not while tracing)."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class Counter:
    """A count kept in a 0-d long tensor (``value``) that compiled code advances in place; eager
    code reads and sets it as an int. Moves to the device of the buffers it counts (``to``)."""

    def __init__(self) -> None:
        self.value = torch.zeros((), dtype=torch.long)
        mark_static(self.value)

    def to(self, device: torch.device) -> None:
        if self.value.device != device:
            self.value = self.value.to(device)
            mark_static(self.value)

    def get(self) -> int:
        return int(self.value)

    def set(self, n: int) -> None:
        self.value.fill_(int(n))


class CountedStore(SlotStore):
    """A ``SlotStore`` whose ``length`` lives in a ``Counter`` and whose tensors are marked static."""

    def __init__(self, *args, **kwargs) -> None:
        self.count = Counter()
        super().__init__(*args, **kwargs)

    @property
    def length(self) -> int:
        return self.count.get()

    @length.setter
    def length(self, n: int) -> None:
        self.count.set(n)

    def _switch(self, tensors: dict[str, torch.Tensor]) -> None:
        super()._switch(tensors)
        if tensors:
            self.count.to(next(iter(tensors.values())).device)
            mark_static(*tensors.values())


class TensorSeen:
    """For a layer class: ``seen`` kept in a ``Counter`` (``seen_counter``, made before the
    layer's ``__init__`` sets it), read by compiled code as ``seen_tensor``."""

    seen_counter: Counter
    compiled = True

    @property
    def _seen(self) -> int:
        return self.seen_counter.get()

    @_seen.setter
    def _seen(self, n: int) -> None:
        self.seen_counter.set(n)

    @property
    def seen_tensor(self) -> torch.Tensor:
        """``seen`` as a 0-d long tensor: what compiled code reads (``HFLayer.get_seq_length``)."""
        return self.seen_counter.value


class FixedDecodeAttention(TensorSeen):
    """For a bounded layer class: a decode step's record (its ``first_query`` a tensor) is attended
    over the whole fixed buffers with the mask ``_decode_mask`` makes; other records the eager way."""

    def attend(self, query, *, scale=None, softcap=None, mask=None, sinks=None, bias=None):
        if bias is not None:
            raise UnsupportedOperation(
                f"a {self.kind} layer made with compile=True attends without the model's position bias; "
                f"make the cache without compile=True for this model"
            )
        reads = self.pending
        if reads is None or not isinstance(reads.first_query, torch.Tensor):
            return super().attend(query, scale=scale, softcap=softcap, mask=self._eager_mask(mask), sinks=sinks)
        visible = self._decode_mask(reads.first_query, mask)
        out = attend(query, reads.keys, reads.values, scale=scale, mask=visible, softcap=softcap, sinks=sinks)
        self._reads_left -= 1
        if self._reads_left <= 0:
            self._finish(None)
        return out

    def _eager_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The model's mask as the eager attention takes it (columns: absolute positions)."""
        return mask

    def _decode_mask(self, query_at: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Boolean mask over the fixed buffers' slots for the query at position ``query_at`` (0-d)."""
        raise NotImplementedError


class FixedStaticLayer(TensorSeen, StaticLayer):
    """``static`` with fixed shapes: ``update`` returns the whole ``[B, Hkv, C, D]`` buffers, the
    new tokens written at the positions ``seen..seen+S-1`` taken from a tensor (see the module
    docstring). Same kind, options and saved state as ``StaticLayer``."""

    def __init__(self, capacity: int | None = None, *, keys=None, values=None) -> None:
        self.seen_counter = Counter()
        super().__init__(capacity, keys=keys, values=values)
        buffers = self.store.tensors
        self.store = CountedStore(growth=self.store.growth)
        if buffers:
            self.store.adopt(buffers)
            self.seen_counter.to(keys.device)

    @classmethod
    def like(cls, layer: StaticLayer, tokens: int | None = None) -> FixedStaticLayer:
        """An empty twin of the empty ``layer`` (its capacity is its own: ``tokens`` is ignored)."""
        buffers = layer.store.tensors
        if buffers:
            return cls(layer.max_length, keys=buffers["keys"], values=buffers["values"])
        return cls(layer.max_length)

    def _append(self, key, value):
        store, n = self.store, key.shape[2]
        if not store.tensors:
            geometry = self.geometry or Geometry.of(key, value)
            store.reserve(self._capacity, geometry)
            self.geometry = geometry
            self.seen_counter.to(geometry.device)
        if not torch.compiler.is_compiling():
            self.check_append(n)  # compiled code cannot read the count: index_copy_ refuses overflow
        keys, values = store.tensors["keys"], store.tensors["values"]
        at = store.count.value + torch.arange(n, device=keys.device)
        keys.index_copy_(2, at, key)
        values.index_copy_(2, at, value)
        query_at = self.seen_counter.value.clone()  # unused by the model's attention: traced away
        store.count.value.add_(n)
        self.seen_counter.value.add_(n)
        return Reads(keys, values, None, query_at, n)

