"""The contract every storage layer keeps (its checks in ``checks.py``, its state in ``state.py``).

A layer stores the keys and values of one transformer layer as ``[B, Hkv, L, D]`` (values may
have their own head dim ``Dv``). ``append`` adds ``[B, Hkv, S, D]`` and returns the read record
(``attention.Reads``) of what attention reads, as views of the store; ``update`` (the
``transformers`` verb) returns its keys and values. Invariants (docs/architecture.md):

- a call that raises changes nothing;
- returned views stay valid until the next mutating call;
- ``seen`` counts tokens ever appended (the position of the next token); ``length`` counts slots
  stored. They differ only for bounded layers.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..attention import Reads
from ..errors import ShapeError, UnsupportedOperation
from .checks import Geometry, as_index, check_kv
from .options import DeclaredKind
from .state import LayerState

if TYPE_CHECKING:
    from .store import SlotStore


class KVLayer(DeclaredKind, ABC):
    """One transformer layer's key/value store. Subclasses choose how storage grows or is bounded.

    The defaults below read a ``store`` (``store.py``) holding ``keys`` and ``values`` in the
    slots ``[0, length)``; a kind that stores something else overrides them."""

    kind: ClassVar[str]
    #: True for layers that keep only a recent window (mask sizes differ, see ``hf/bridge.py``).
    is_sliding: ClassVar[bool] = False
    #: True for kinds whose attention must read their update's record (``own_attention.py``).
    needs_own_attention: ClassVar[bool] = False
    #: True for kinds whose ``_append`` is ``_record_in_order`` (set per class, never by hand):
    #: ``update`` then returns ``_append_in_order``'s keys and values without building the record.
    appends_in_order: ClassVar[bool] = False
    #: True for the fixed-shape twins that decode under ``torch.compile`` (``layers/fixed*.py``);
    #: ``compiled.hf_layer`` gives them their own bridge.
    compiled: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.appends_in_order = cls._append is KVLayer._record_in_order

    @property
    def exact(self) -> bool:
        """Whether the layer reads keys and values back exactly as written (no codes)."""
        return True

    @property
    def recording_past(self) -> bool:
        """Whether the layer logs what its updates overwrite, so ``crop`` can take tokens back (a
        window's ring while speculative decoding runs). Layers that only append log nothing."""
        return False

    def activate_past_recording(self, on: bool = True) -> None:
        """Start (``False``: stop) keeping what ``crop`` needs to take tokens back (``generate`` calls
        it before speculative decoding). Layers that only append need nothing: a no-op."""

    def __init__(self) -> None:
        self.geometry: Geometry | None = None
        self._seen = 0
        self.store: SlotStore  # set by each kind

    @property
    def reallocations(self) -> int:
        """How many times the store was (re)allocated: the first allocation counts."""
        return self.store.reallocations

    # ---- the hot path -------------------------------------------------------------------

    def append(self, key: torch.Tensor, value: torch.Tensor) -> Reads:
        """Append ``key`` ``[B, Hkv, S, D]`` and ``value`` ``[B, Hkv, S, Dv]``; returns the read
        record of this update: what its queries attend (views of the store, not copies), where
        each slot and query sits, and what the pass must report (``attention.Reads``)."""
        if not self._fits(key, value):
            check_kv(key, value, self.geometry)  # raises with a message, or accepts a first append
        return self._append(key, value)

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``append``, returning the keys and values the model attends (``Reads.returned``)."""
        if not self._fits(key, value):  # as append does, one call less on the decode path
            check_kv(key, value, self.geometry)
        if self.appends_in_order:  # the decode hot path of growable and static: no record to build
            return self._append_in_order(key, value)
        return self._append(key, value).returned

    def _fits(self, key: Any, value: Any) -> bool:
        """Fast path of ``check_kv`` for the common case: an append like the previous ones."""
        g = self.geometry
        if g is None or not isinstance(key, torch.Tensor) or not isinstance(value, torch.Tensor):
            return False
        ks, vs = key.shape, value.shape
        return (
            len(ks) == 4
            and len(vs) == 4
            and ks[0] == g.batch
            and ks[1] == g.heads
            and ks[3] == g.key_dim
            and vs[0] == g.batch
            and vs[1] == g.heads
            and vs[2] == ks[2]
            and vs[3] == g.value_dim
            and key.dtype == g.dtype
            and value.dtype == g.dtype
            and key.device == g.device
            and value.device == g.device
        )

    @abstractmethod
    def _append(self, key: torch.Tensor, value: torch.Tensor) -> Reads:
        """Append already-validated tensors; the update's read record. Must raise before changing anything."""

    def settle(self) -> None:
        """Finish the last update without attention weights; only bounded layers have work to do."""

    def _append_in_order(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append after the stored slots, growing the store by its strategy (which may refuse,
        before anything changes); returns views of every stored slot ``[B, Hkv, L, D]``
        (``_record_in_order`` makes them the record of an in-order update)."""
        store, n = self.store, key.shape[2]
        need = store.length + n
        if need > store.capacity or not store.tensors:
            geometry = self.geometry or Geometry.of(key, value)
            store.reserve(need, geometry)
            self.geometry = geometry
        keys, values = store.tensors["keys"], store.tensors["values"]
        keys.narrow(2, store.length, n).copy_(key)
        values.narrow(2, store.length, n).copy_(value)
        store.length = need
        self._seen += n
        return keys.narrow(2, 0, need), values.narrow(2, 0, need)

    def _record_in_order(self, key: torch.Tensor, value: torch.Tensor) -> Reads:
        """``_append_in_order`` as the record of an update: slot ``j`` holds position ``j``."""
        seen, n = self._seen, key.shape[2]
        keys, values = self._append_in_order(key, value)
        return Reads(keys, values, None, seen, n, all_visible=n == 1)

    # ---- filled in place (the prompt store) ---------------------------------------------

    def next_slots(self, n: int, geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views ``[B, Hkv, n, D]`` and ``[B, Hkv, n, Dv]`` of the ``n`` slots after the
        stored ones, for the caller to fill before ``commit_slots(n)`` counts them in: keys and
        values written straight into the store, with no copy of their own. Until then the layer
        holds what it held (unused slots are no content). For kinds whose slot j holds position j
        (growable, static, concat); the store's growth may refuse, changing nothing."""
        if self.needs_own_attention or self.is_sliding:
            raise UnsupportedOperation(f"a {self.kind} layer does not keep its slots in position order to be filled in place")
        if self.geometry is not None and self.geometry != geometry:
            raise ShapeError(f"next_slots: this layer holds {self.geometry}, the slots asked for are {geometry}")
        store, need = self.store, self.store.length + n
        if need > store.capacity or not store.tensors:
            store.reserve(need, geometry)
        self.geometry = geometry
        return store.run("keys", store.length, need), store.run("values", store.length, need)

    def commit_slots(self, n: int) -> None:
        """Count the ``n`` slots that ``next_slots(n, ...)`` handed out, now written, as appended."""
        self.store.length += n
        self._seen += n

    # ---- sizes --------------------------------------------------------------------------

    @property
    def seen(self) -> int:
        """Tokens ever appended (minus trimmed): the absolute position of the next token."""
        return self._seen

    @property
    def length(self) -> int:
        """Slots stored now."""
        return self.store.length

    @property
    def capacity(self) -> int:
        """Slots the current allocation can hold without reallocating."""
        return self.store.capacity

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask ``transformers`` builds for the next
        ``query_length`` queries: every position from 0. Unbounded kinds hold the past in order;
        bounded kinds pick the mask's columns at their slots' positions (``hf/bridge.py``)."""
        return self.seen + query_length, 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated for this layer's keys and values (the honest memory figure)."""
        return self.store.nbytes

    @property
    def initialized(self) -> bool:
        return self.geometry is not None

    def view(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The stored keys ``[B, Hkv, L, D]`` and values ``[B, Hkv, L, Dv]`` as views; (None, None) if empty."""
        store = self.store
        if not store.tensors:
            return None, None
        return store.run("keys", 0, store.length), store.run("values", 0, store.length)

    def memo_view(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``view()`` for readers outside the hot path (``HFLayer.keys``/``values``): a kind whose
        view is a computation (the quantized layer dequantizes its store) keeps it until its
        content changes; for the others it is ``view()``."""
        return self.view()

    def positions(self) -> torch.Tensor:
        """Absolute position of each stored slot, ``[B, Hkv, L]`` (an expanded view)."""
        g = self.geometry
        if g is None:
            return torch.empty(0, 0, 0, dtype=torch.long)
        pos = torch.arange(self.seen - self.length, self.seen, device=g.device)
        return pos.expand(g.batch, g.heads, self.length)

    # ---- rollback and reuse -------------------------------------------------------------

    def check_append(self, n: int) -> None:
        """Raise unless ``n`` more tokens fit (only fixed-capacity kinds ever refuse); changes nothing."""

    def check_trim(self, n: int) -> None:
        """Raise unless ``trim(n)`` can be done; changes nothing."""
        if int(n) < 0:
            raise ValueError(f"trim takes a token count >= 0, got {n}")
        if int(n) > self.length:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a {self.kind} layer holding {self.length}"
            )

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens (rollback, e.g. rejected speculative tokens)."""
        self.check_trim(n)
        n = int(n)
        if n:
            self._trim(n)
            self._seen -= n

    def _trim(self, n: int) -> None:
        """Drop the last ``n`` stored slots; ``0 < n <= length`` is already checked."""
        self.store.trim(n)

    @abstractmethod
    def reset(self) -> None:
        """Forget every token. Kinds that own fixed buffers keep them."""

    # ---- batch and beam work ------------------------------------------------------------

    def select(self, index: torch.Tensor | list[int]) -> None:
        """Keep only the batch rows in ``index`` (a long index or a boolean mask), in that order."""
        if self.geometry is None:
            return
        idx = as_index(index, self.geometry.batch, self.geometry.device)
        self._rebatch(lambda t: t.index_select(0, idx))

    def repeat(self, n: int) -> None:
        """Repeat every batch row ``n`` times in place order (``repeat_interleave``), e.g. for beams."""
        n = int(n)
        if n < 1:
            raise ValueError(f"repeat count must be >= 1, got {n}")
        if self.geometry is None or n == 1:
            return
        self._rebatch(lambda t: t.repeat_interleave(n, dim=0))

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]``. The batch size stays."""
        if self.geometry is None:
            return
        idx = as_index(beam_idx, self.geometry.batch, self.geometry.device)
        if idx.numel() != self.geometry.batch:
            raise ShapeError(
                f"reorder needs one index per batch row ({self.geometry.batch}), got {idx.numel()}"
            )
        self._rebatch(lambda t: t.index_select(0, idx))

    def _rebatch(self, fn) -> None:
        """Replace the stored rows by ``fn(rows)`` for each stored tensor (``[B, ...]`` to ``[B', ...]``)."""
        if self.store.allocated:
            self.geometry = replace(self.geometry, batch=self.store.rebatch(fn))

    # ---- state ----------------------------------------------------------------------------

    @abstractmethod
    def options(self) -> dict[str, Any]:
        """Constructor keyword arguments that rebuild an empty layer like this one."""

    def state(self) -> LayerState:
        """The content as plain tensors (views; clone them to keep a copy)."""
        keys, values = self.view()
        tensors = {} if keys is None else {"keys": keys, "values": values}
        return LayerState(self.kind, self.options(), self.seen, tensors)

    @classmethod
    def from_state(cls, state: LayerState) -> KVLayer:
        """A new layer holding ``state``'s content (copied, never aliased)."""
        if state.kind != cls.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot build a {cls.kind!r} layer")
        layer = cls(**state.options)
        layer.load_state(state)
        return layer

    def check_state(self, state: LayerState) -> None:
        """Raise unless ``load_state(state)`` would succeed; changes nothing."""
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        stored = 0
        if "keys" in state.tensors:
            keys, values = state.tensors["keys"], state.tensors["values"]
            check_kv(keys, values, None)
            stored = keys.shape[2]
            if int(state.seen) < stored:
                raise ValueError(f"state has {stored} slots but only {state.seen} tokens seen")
        if not self.needs_own_attention and int(state.seen) != stored:
            # Unbounded kinds keep every token: positions are slots, so any other count is a lie.
            raise ValueError(f"a {self.kind} layer holds every token it has seen: {stored} slots, but {state.seen} seen")

    def load_state(self, state: LayerState) -> None:
        """Replace this layer's content with ``state``'s (copied). Raises before changing anything."""
        self.check_state(state)
        self.reset()
        if "keys" in state.tensors:
            self.update(state.tensors["keys"], state.tensors["values"])
        self._seen = int(state.seen)

    def fork(self) -> KVLayer:
        """An independent copy: appending to either never changes the other."""
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(length={self.length}, seen={self.seen}, "
            f"capacity={self.capacity}, nbytes={self.nbytes})"
        )

