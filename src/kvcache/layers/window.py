"""Sliding window with attention sinks: a ring buffer of the last ``window`` tokens plus the first
``sinks`` (StreamingLLM). Memory and per-token cost are constant once the window is full.

Slots ``0..sinks-1`` hold the first tokens; the token at position ``p >= sinks`` lives in slot
``sinks + (p - sinks) % window``. The ring is never un-rotated: a decode step writes its token
over the one leaving the window and attends the buffer as stored, since decode attention does not
depend on key order. Keys keep the rotary positions they arrived with (absolute positions).

A query at position ``q`` sees key ``k`` when ``k <= q`` and (``k > q - window`` or ``k < sinks``):
``window`` keys counting itself, plus the sinks. With ``sinks=0`` that is exactly Hugging Face's
sliding-window attention (mistral, gemma2 sliding layers), so ``make_cache`` uses this layer for a
model's own sliding layers. An update of several tokens that would overwrite slots some of its
own queries still need (a prefill longer than the window) attends a copy of the old slots followed
by the new tokens, masked by position, and then keeps the last ``window``.

``trim(n)`` can always take back tokens while the ring has not wrapped. After that it needs the
slots the last tokens overwrote: ``activate_past_recording()`` (which ``generate`` calls before
speculative decoding) logs them until the next trim (``rollback.py``), so a rejected draft is
removed exactly, whatever its length; more than the log holds is refused, changing nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import UnsupportedOperation
from ..attention import Reads, Visibility
from .options import Option
from .checks import Geometry
from .state import LayerState
from .own_attention import OwnAttentionLayer
from .rollback import Journal
from .store import SlotStore, UpTo


class WindowLayer(OwnAttentionLayer):
    kind = "window"
    spec_options = {"window": Option(int, least=1), "sinks": Option(int, least=0)}
    required_options = ("window",)
    keyword_options = {"initial_capacity": Option(int, least=1)}
    spec_order = 2
    is_sliding = True

    def __init__(self, window: int, sinks: int = 0, initial_capacity: int = 256) -> None:
        super().__init__()
        checked = self.check_options(window=window, sinks=sinks, initial_capacity=initial_capacity)
        self.window, self.sinks = checked["window"], checked["sinks"]
        #: Which slots a query sees: the window by absolute position, plus the sinks (every record's rule).
        self.visibility = Visibility(self.window, self.sinks)
        self.initial_capacity = checked["initial_capacity"]
        self.journal: Journal | None = None  # the undo log while recording (rollback.py)
        #: Grows geometrically (from ``initial_capacity``) up to ``sinks + window`` slots.
        self.store = SlotStore(growth=UpTo(self.initial_capacity, self.max_length))

    @property
    def max_length(self) -> int:
        """Slots the layer ever holds: sinks plus window."""
        return self.sinks + self.window

    # ---- positions ----------------------------------------------------------------------

    def _slot(self, pos: torch.Tensor) -> torch.Tensor:
        s = self.sinks
        return torch.where(pos < s, pos, s + (pos - s).remainder(self.window))

    def _slot_positions(self, seen: int, count: int, device) -> torch.Tensor:
        """Absolute position held by each of slots ``0..count-1`` after ``seen`` tokens: ``[count]``."""
        j = torch.arange(count, device=device)
        if seen <= self.max_length:
            return j
        last, s = seen - 1, self.sinks
        return torch.where(j < s, j, last - (last - j).remainder(self.window))

    def positions(self) -> torch.Tensor:
        g = self.geometry
        if g is None:
            return torch.empty(0, 0, 0, dtype=torch.long)
        n = self.length
        return self._slot_positions(self.seen, n, g.device).expand(g.batch, g.heads, n)

    # ---- appending ------------------------------------------------------------------------

    def _append(self, key, value):
        n, seen, cap = key.shape[2], self.seen, self.max_length
        device = key.device
        if seen + n <= cap:  # nothing leaves the window: written in order at the cursor
            self._write(key, value)
            keys, values = self.view()
            return Reads(keys, values, None, seen, n, all_visible=n == 1, visibility=self.visibility)  # slot j holds position j
        self._ensure_full_buffers(key, value)
        if n == 1:  # decode: the slot taken is the one leaving the window, which this query cannot see
            self._write(key, value)
            pos = lambda: self._slot_positions(seen + 1, cap, device)  # noqa: E731 (only a masked step needs it)
            return Reads(*self._ring(), pos, seen, 1, all_visible=True, visibility=self.visibility)
        # Several tokens, some of whose queries need slots this update overwrites: attend a copy.
        old_k, old_v = self.view()
        old_pos = self._slot_positions(seen, self.length, device)
        keys, values = torch.cat([old_k, key], dim=2), torch.cat([old_v, value], dim=2)
        self._write(key, value)
        new_pos = torch.arange(seen, seen + n, device=device)
        return Reads(keys, values, torch.cat([old_pos, new_pos]), seen, n, visibility=self.visibility)

    def _write(self, key, value, record: bool = True) -> None:
        """Store tokens ``seen..seen+n-1``: in order while they fit, else each in its ring slot
        (only the ones still in the window at the end). Logs the update first when recording."""
        n, seen, cap = key.shape[2], self.seen, self.max_length
        if seen + n <= cap:
            if record and self.journal is not None:
                self._record(seen, torch.empty(0, dtype=torch.long, device=key.device), key, value)
            self._append_in_order(key, value)
            return
        self._ensure_full_buffers(key, value)
        if n == 1:
            slot = seen if seen < self.sinks else self.sinks + (seen - self.sinks) % self.window
            if record and self.journal is not None:
                self._record(seen, torch.tensor([slot], device=key.device), key, value)
            self.store.write(slot, {"keys": key, "values": value})
        else:
            new_pos = torch.arange(seen, seen + n, device=key.device)
            keep = new_pos[(new_pos < self.sinks) | (new_pos >= seen + n - self.window)]
            slots = self._slot(keep)
            if record and self.journal is not None:
                self._record(seen, slots, key, value)
            self.store.put(slots, {"keys": key.index_select(2, keep - seen), "values": value.index_select(2, keep - seen)})
        self._seen, self.store.length = seen + n, cap

    def _record(self, seen: int, slots: torch.Tensor, key, value) -> None:
        # Slots beyond the stored ones hold nothing to restore (a full ring: every slot is stored).
        stored = self.length
        live = slots if stored >= self.max_length else slots[slots < stored]
        kbuf = self.store.tensors.get("keys", key[:, :, :0])
        vbuf = self.store.tensors.get("values", value[:, :, :0])
        self.journal.record(seen, stored, live, kbuf, vbuf, key, value)

    def _ring(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot of the full ring, keys ``[B, Hkv, sinks + window, D]`` and values, as stored."""
        return self.store.tensors["keys"], self.store.tensors["values"]

    def _ensure_full_buffers(self, key, value) -> None:
        if self.capacity < self.max_length:
            self.geometry = self.geometry or Geometry.of(key, value)
            self.store.reserve(self.max_length, self.geometry)

    # ---- rollback and state ---------------------------------------------------------------

    @property
    def recording_past(self) -> bool:
        return self.journal is not None

    def activate_past_recording(self, on: bool = True) -> None:
        """Log every update until the next trim so that ``trim`` can take back its tokens even
        after they overwrote window slots (speculative decoding; ``rollback.py``). ``False`` stops
        and frees the log. ``generate`` turns it on for assisted and prompt-lookup decoding."""
        if not on:
            self.journal = None
        elif self.journal is None:
            self.journal = Journal(limit=self.window)

    @property
    def nbytes(self) -> int:
        """The ring, plus the undo log while recording."""
        return self.store.nbytes + (0 if self.journal is None else self.journal.nbytes)

    @property
    def rollback_tokens(self) -> int:
        """How many of the last tokens ``trim`` can remove now."""
        logged = 0 if self.journal is None else self.journal.tokens
        return self.seen if self.seen - logged <= self.max_length else logged

    def check_trim(self, n: int) -> None:
        if int(n) < 0:
            raise ValueError(f"trim takes a token count >= 0, got {n}")
        if int(n) > self.seen:
            raise UnsupportedOperation(f"cannot remove {n} tokens from a {self.kind} layer that has seen {self.seen}")
        if int(n) > self.rollback_tokens:
            recording = "" if self.journal is not None else "; activate_past_recording() before the update keeps them"
            raise UnsupportedOperation(
                f"cannot remove {n} tokens from a window of {self.window} (+{self.sinks} sinks) that has "
                f"seen {self.seen}: it can take back the last {self.rollback_tokens}; the tokens the shorter "
                f"sequence needs were already overwritten{recording}"
            )
        self._refuse_unsettled_trim(n)

    def trim(self, n: int) -> None:
        """Remove the last ``n`` tokens, the window then holding exactly what it held ``n`` tokens
        ago. Closes the step: the log starts again (as Hugging Face's ``crop`` does)."""
        self.check_trim(n)
        target = self.seen - int(n)
        while self.seen > target and self.journal is not None and self.journal.entries:
            e = self.journal.entries.pop()
            if e.slots.numel():
                self.store.put(e.slots, {"keys": e.keys, "values": e.values})
            self._seen, self.store.length = e.first, e.length_before
            if e.first < target:  # part of this update stays
                m = target - e.first
                self._write(e.new_keys[:, :, :m], e.new_values[:, :, :m], record=False)
        if self.seen > target:  # never wrapped (check_trim): slots are positions, in order
            self.store.trim(self.seen - target)
            self._seen = target
        if self.journal is not None:
            self.journal.clear()

    def _rebatch(self, fn) -> None:
        super()._rebatch(fn)
        if self.journal is not None:
            self.journal.rebatch(fn)

    def reset(self) -> None:
        super().reset()
        self.store.drop()
        self.geometry = None
        self._seen = 0
        if self.journal is not None:
            self.journal.clear()

    def options(self) -> dict[str, Any]:
        return {"window": self.window, "sinks": self.sinks, "initial_capacity": self.initial_capacity}

    def check_state(self, state: LayerState) -> None:
        super().check_state(state)
        stored = state.tensors["keys"].shape[2] if "keys" in state.tensors else 0
        if stored != min(int(state.seen), self.max_length):
            raise ValueError(
                f"window state holds {stored} slots after {state.seen} tokens; a window of "
                f"{self.window} with {self.sinks} sinks holds {min(int(state.seen), self.max_length)}"
            )

    def load_state(self, state: LayerState) -> None:
        self.check_state(state)
        self.reset()
        if "keys" in state.tensors:
            keys, values = state.tensors["keys"], state.tensors["values"]
            self.geometry = Geometry.of(keys, values)
            self.store.load({"keys": keys, "values": values}, self.geometry, max(keys.shape[2], 1))
        self._seen = int(state.seen)
