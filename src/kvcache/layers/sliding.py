"""A model's own sliding-window layer, kept in position order so the model's own masks apply.

Hugging Face keeps a sliding layer (``DynamicSlidingWindowLayer``) as the last ``window - 1``
tokens in order: an update returns them followed by the new tokens, and ``get_mask_sizes`` says
the keys start at position ``seen - kept``. Any attention implementation then masks the window
correctly. This layer keeps the same tokens and returns the same keys, without a ``torch.cat`` of
the window per step: the tokens lie in order in a buffer of ``window - 1 + spare`` slots, a run
``[head, head + kept)``. An update writes after the run and returns a view of it plus the new
tokens; the run then starts ``n`` slots later. When the next update would not fit, the kept run
moves to the front first: one copy of ``window - 1`` tokens every ``spare`` tokens (``spare``
defaults to a quarter of the window, at least 16), instead of one per token.

An update longer than the spare room (a prefill past the window) attends a temporary
concatenation of the kept tokens and its own, as Hugging Face does, and keeps the last
``window - 1``: the buffer never grows past ``window - 1 + spare`` slots.

``make_cache`` places this layer on a model's sliding layers for the unbounded kinds (growable,
static, concat), which work on the model's own attention; bounded kinds, which need the
``"kvcache"`` attention anyway, get the ring buffer of ``window.py`` there.

The slots before ``head`` still hold the tokens that left the window, in order, until the run
moves: ``trim`` takes back tokens while the window they leave behind is still there. While
``activate_past_recording()`` is on (speculative decoding), nothing after the last trim leaves the
buffer, so rejected draft tokens can always be removed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..attention import Reads
from ..errors import UnsupportedOperation
from .base import KVLayer
from .checks import Geometry
from .options import Option
from .state import LayerState
from .store import SlotStore


class SlidingLayer(KVLayer):
    """The last ``window - 1`` tokens of a sliding-attention layer, in position order."""

    kind = "sliding"
    spec_options = {"window": Option(int, least=1)}
    keyword_options = {"spare": Option(int, least=1)}
    is_sliding = True

    @classmethod
    def spec_kinds(cls) -> dict[str, dict[str, Any]]:
        return {}  # placed by make_cache on a model's sliding layers, never named by a spec

    def __init__(self, window: int, spare: int | None = None) -> None:
        super().__init__()
        checked = self.check_options(window=window, **({} if spare is None else {"spare": spare}))
        self.window = checked["window"]
        self.spare = checked.get("spare", max(16, self.window // 4))
        self.head = 0  # the first kept slot: slots [0, head) hold older tokens, in order
        self.recording_from: int | None = None  # while recording: nothing from this position leaves
        self.store = SlotStore()

    # ---- sizes ----------------------------------------------------------------------------

    @property
    def max_length(self) -> int:
        """The model's window (what Hugging Face's sliding layer reports)."""
        return self.window

    @property
    def keep(self) -> int:
        """Tokens an update leaves behind: ``window - 1`` (more while recording)."""
        extra = 0 if self.recording_from is None else self.seen - self.recording_from
        return self.window - 1 + max(extra, 0)

    @property
    def length(self) -> int:
        return self.store.length - self.head

    @property
    def visible(self) -> int:
        """Kept tokens the next queries can see: at most ``window - 1`` (the mask's past)."""
        return min(self.length, self.window - 1)

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The mask covers the visible kept tokens, then the queries (Hugging Face's sliding layer)."""
        return self.visible + query_length, self.seen - self.visible

    def view(self):
        store = self.store
        if not store.tensors:
            return None, None
        return store.run("keys", self.head, store.length), store.run("values", self.head, store.length)

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key, value):
        keys, values = self._append_window(key, value)
        n, seen = key.shape[2], self.seen - key.shape[2]
        first = seen - (keys.shape[2] - n)  # the position of the first slot returned: in order from there
        positions = lambda: torch.arange(first, seen + n, device=keys.device)  # noqa: E731 (rarely read)
        return Reads(keys, values, positions, seen, n)

    def _append_window(self, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        """Append; returns the keys and values the new queries see: the visible kept tokens, then the new."""
        n, visible = key.shape[2], self.visible
        first = self.store.length - visible  # the first slot the new queries see
        if visible + n > self.window - 1 + self.spare:  # longer than the spare room: attend a temporary concatenation
            past_k, past_v = self.view() if self.store.allocated else (key[:, :, :0], value[:, :, :0])
            keys, values = torch.cat([past_k, key], dim=2), torch.cat([past_v, value], dim=2)
            self._seen += n
            self._hold(keys, values)
            skip = past_k.shape[2] - visible  # kept while recording, but out of the queries' window
            return keys[:, :, skip:], values[:, :, skip:]
        if not self.store.allocated or self.store.length + n > self.store.capacity:
            self._move_to_front(key, value)
            first = self.store.length - visible
        self.store.append({"keys": key, "values": value})
        self._seen += n
        keys, values = self.store.run("keys", first, self.store.length), self.store.run("values", first, self.store.length)
        self.head = self.store.length - min(self.store.length, self.keep)
        return keys, values

    def _room_for(self, kept: int) -> int:
        """Slots the buffer needs to hold ``kept`` tokens and take appends: the window less one
        (or the kept run, longer while recording) plus the spare room."""
        return max(self.window - 1, kept) + self.spare

    def _move_to_front(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Put the kept run at slot 0, in a buffer sized by ``_room_for`` (allocated on first use,
        reallocated when too small or more than twice too large; ``key``/``value``: its geometry)."""
        kept_k, kept_v = self.view()
        kept = {} if kept_k is None else {"keys": kept_k.clone(), "values": kept_v.clone()}
        self._fit(self._room_for(self.length), key, value)
        self.store.length = 0
        if kept:
            self.store.append(kept)
        self.head = 0

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep the last ``keep`` of ``keys``/``values`` ``[B, Hkv, N, D]`` (positions ending at
        ``seen - 1``) at the front of the buffer."""
        keep = min(keys.shape[2], self.keep)
        self._fit(self._room_for(keep), keys, values)
        self.store.length = 0
        self.store.append({"keys": keys[:, :, keys.shape[2] - keep :], "values": values[:, :, values.shape[2] - keep :]})
        self.head = 0

    def _fit(self, capacity: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """New, empty buffers of ``capacity`` slots unless the current ones fit (not more than twice
        as large: a long recording's buffer is given back once its tokens are trimmed)."""
        if not self.store.allocated or not capacity <= self.store.capacity <= 2 * capacity:
            self.geometry = self.geometry or Geometry.of(key, value)
            self.store.allocate(capacity, self.geometry, keep=False)

    # ---- rollback -------------------------------------------------------------------------

    def activate_past_recording(self, on: bool = True) -> None:
        """Keep every token from now until the next trim (``generate`` calls it before speculative
        decoding, whose rejected tokens ``crop`` removes); ``False`` stops, and the layer keeps
        the window less one again (a buffer grown while recording is given back)."""
        if on:
            self.recording_from = self.seen if self.recording_from is None else self.recording_from
            return
        self.recording_from = None
        self.head = self.store.length - min(self.length, self.window - 1)
        self._give_back()

    def _give_back(self) -> None:
        """Move the kept run into a smaller buffer if the current one is more than twice too large."""
        if self.store.allocated and self.store.capacity > 2 * self._room_for(self.length):
            self._move_to_front(*self.view())

    @property
    def rollback_tokens(self) -> int:
        """How many of the last tokens ``trim`` can remove now: the buffer must still hold the
        ``window - 1`` tokens before them (or every token, for a sequence shorter than that)."""
        stored = self.store.length  # slots [0, stored) hold positions seen - stored .. seen - 1
        if stored >= self.seen:
            return self.seen
        return max(stored - (self.window - 1), 0)

    def check_trim(self, n: int) -> None:
        if int(n) < 0:
            raise ValueError(f"trim takes a token count >= 0, got {n}")
        if int(n) > self.rollback_tokens:
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a sliding window of {self.window} that has seen {self.seen}: "
                f"it can take back the last {self.rollback_tokens}; the tokens the shorter sequence needs already "
                f"left the window (activate_past_recording() before the update keeps them)"
            )

    def trim(self, n: int) -> None:
        """Remove the last ``n`` tokens: the layer then holds what it held ``n`` tokens ago. Ends
        the recording's span (the next tokens are recorded from here)."""
        self.check_trim(n)
        n = int(n)
        self.store.length -= n
        self._seen -= n
        self.head = self.store.length - min(self.store.length, self.window - 1)
        if self.recording_from is not None:
            self.recording_from = self.seen
        self._give_back()

    # ---- the rest of the contract ---------------------------------------------------------

    def _rebatch(self, fn) -> None:
        if self.store.allocated:
            self._move_to_front(*self.view())
            batch = self.store.rebatch(fn, capacity=self.store.capacity)
            self.geometry = replace(self.geometry, batch=batch)

    def reset(self) -> None:
        self.store.drop()
        self.geometry = None
        self._seen = self.head = 0
        if self.recording_from is not None:
            self.recording_from = 0

    def options(self) -> dict[str, Any]:
        return {"window": self.window, "spare": self.spare}

    def check_state(self, state: LayerState) -> None:
        if state.kind != self.kind:
            raise ValueError(f"state of kind {state.kind!r} cannot load into a {self.kind!r} layer")
        stored = 0
        if "keys" in state.tensors:
            stored = state.tensors["keys"].shape[2]
            super().check_state(LayerState(state.kind, state.options, stored, state.tensors))  # shapes, dtypes
        seen = int(state.seen)
        if not min(seen, self.window - 1) <= stored <= seen:
            raise ValueError(
                f"sliding state holds {stored} slots after {seen} tokens; a window of {self.window} holds "
                f"the last {min(seen, self.window - 1)} (up to every token while recording)"
            )

    @classmethod
    def state_of_ring(cls, ring: KVLayer, options: dict[str, Any]) -> LayerState:
        """The state this layer (``options``) holds after the tokens a ring of the same window holds
        (a ``WindowLayer`` without sinks): its last ``window - 1`` tokens, in position order."""
        seen, keys, values = ring.seen, *ring.view()
        if keys is None:
            return LayerState(cls.kind, dict(options), seen, {})
        order = ring.positions()[0, 0].argsort()
        keep = order[max(0, order.numel() - (options["window"] - 1)) :]
        return LayerState(cls.kind, dict(options), seen, {"keys": keys.index_select(2, keep), "values": values.index_select(2, keep)})

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        self._seen = int(state.seen)
        if "keys" in state.tensors:
            keys, values = state.tensors["keys"], state.tensors["values"]
            self.geometry = Geometry.of(keys, values)
            self.store.load({"keys": keys, "values": values}, self.geometry, self._room_for(keys.shape[2]))
