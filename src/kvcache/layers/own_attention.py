"""What layers that run their own attention share: a pending read record, attention by absolute
position, and settling.

Such a layer (the bounded kinds: window and eviction, which keep slots out of position order and
drop positions; and quantized storage, which grows but stores codes instead of keys) hands the
model keys that are not "the past, in order" that a plain attention call expects. So the layer keeps the read record its
append returned (``attention.Reads``: keys and values, each slot's absolute position, where the
new queries sit, the visibility rule and the weights the pass must report) as ``pending``, and
``attend(query)`` runs the one attention function over it (``attention.attend_reads``), then
settles: it hands the weights the record asked for to ``_settle`` (an eviction policy scores and
evicts there).

Nothing waits for a call a caller could forget: an update that comes before the last one was
attended settles it first without weights, and ``settle()`` does that on demand. Through
``transformers``, the ``"kvcache"`` attention finds the layer through the cache (``hf/bridge.py``).

Design: docs/architecture.md, "Kinds that run their own attention".
"""

from __future__ import annotations

import torch

from ..attention import CAUSAL, Reads, attend_reads, is_queries
from ..errors import ShapeError, UnsupportedOperation
from .base import KVLayer
from .checks import check_kv


class OwnAttentionLayer(KVLayer):
    """A layer whose attention goes through its pending read record (see the module docstring)."""

    needs_own_attention = True

    def __init__(self) -> None:
        super().__init__()
        self.pending: Reads | None = None  # the last update's read record, until it settles
        #: Attention calls that attend the last update's record (its ``attended_by``) and those to come.
        self._attended_by = 1
        self._reads_left = 0
        self._owner_weights: torch.Tensor | None = None

    def append(self, key: torch.Tensor, value: torch.Tensor, attended_by: int = 1) -> Reads:
        """Append ``[B, Hkv, S, D]`` keys and values; returns the read record, kept as ``pending``
        until its attention (``attend``) or ``settle``. An unattended last update settles first.
        ``attended_by``: the attention calls that attend this record, the layer's own plus one per
        later layer that reuses this layer's keys and values (Gemma 3n / 4 ``kv_sharing_modes``: the
        cache's bridge passes them, ``cache.kv_attended_by``); the layer settles after the last."""
        if isinstance(attended_by, bool) or not isinstance(attended_by, int) or attended_by < 1:
            raise ValueError(f"attended_by must be a positive integer, got {attended_by!r}")
        if not self._fits(key, value):
            check_kv(key, value, self.geometry)
        self.settle()
        self.pending = self._append(key, value)
        self._attended_by = self._reads_left = attended_by
        return self.pending

    def update(self, key: torch.Tensor, value: torch.Tensor, attended_by: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """``append``, returning what the model gets: the record's ``returned`` keys and values."""
        return self.append(key, value, attended_by).returned

    @property
    def unattended(self) -> bool:
        """Whether the last update appended tokens that no attention has read yet."""
        return self.pending is not None and self.pending.queries > 0 and self._reads_left == self._attended_by

    def attend(
        self,
        query: torch.Tensor,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        mask: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the last update's queries ``[B, Hq, Sq, D]`` over what they may see.

        ``mask`` is optional extra masking, boolean (True = attend) ``[B|1, 1|Hq, Sq|1, P]`` over
        absolute positions ``0..P-1`` (``P``: the positions up to the update's last, what the
        layer's ``mask_sizes`` announced): it carries the padding of a left-padded batch, or a
        model's own per-head masking. ``bias``: additive logits over the same positions
        ``[B|1, Hq|1, Sq, P]`` (relative-position logits, Inkling). ``sinks``: attention sinks, as
        in ``attend``. Returns ``[B, Hq, Sq, Dv]``.

        A layer that shares this one's keys and values (an update with ``attended_by > 1``) reads after the owner and
        may bring only the last ``Sq`` of the update's queries (Gemma 4 skips the others in the
        shared layers); ``mask`` then has those rows. After the last reader the layer settles
        with the owner's weights, so every reader attends the record as the owner did.
        """
        reads = self.pending
        if reads is None:
            raise UnsupportedOperation(
                f"{self.kind} layer: attend() reads the queries of the last update(), which was already attended"
                if self.initialized
                else f"{self.kind} layer: attend() needs an update() first, for its queries"
            )
        n, owner, appended = query.shape[2], self._reads_left == self._attended_by, reads.queries
        if n != appended and (owner or n > appended):
            raise UnsupportedOperation(
                f"{self.kind} layer: the last update appended {appended} tokens, but attend() got {n} queries"
                + ("" if owner else f" (a layer sharing its keys and values may bring at most {appended})")
            )
        positions = reads.first_query + appended
        for name, t in (("mask", mask), ("bias", bias)):
            if t is not None and t.shape[-1] < positions:
                raise UnsupportedOperation(
                    f"{self.kind} layer: the model's attention {name} has {t.shape[-1]} columns, fewer than the positions "
                    f"up to the last token ({positions}): this model builds it over the slots the cache returned, "
                    f"which a bounded layer keeps out of position order; use an unbounded kind (growable, static, concat)"
                )
        out, weights = attend_reads(
            query,
            reads,
            (reads.visibility or CAUSAL).for_query_heads(query.shape[1] if query.dim() == 4 else 0),
            first_query=reads.first_query + appended - n,  # a sharing reader's queries are the last n
            scale=scale,
            softcap=softcap,
            mask=mask,
            sinks=sinks,
            weights=reads.weights,
            bias=bias,
        )
        if owner:
            self._owner_weights = weights
        self._reads_left -= 1
        if self._reads_left <= 0:
            self._finish(self._owner_weights)
        return out

    def weights_for(self, queries: int) -> str | tuple[str, ...] | None:
        """The attention weights mode a pass of ``queries`` tokens must report (the ``weights`` of
        such an update's record): none, for a layer without a policy that scores."""
        return None

    def settle(self, weights: torch.Tensor | dict[str, torch.Tensor] | None = None) -> None:
        """Finish the last update without attending it here (keys and values imported from
        elsewhere, or a forward pass that did not attend them): the layer keeps what its policy
        keeps with the scores it has, plus ``weights`` if given: the update's queries' attention
        weights over the read record's slots as ``attend`` would have reduced them
        (the record's ``weights`` mode, float32 ``[B, Hkv, N]``; a dict mode -> tensor when the
        record asks for several, ``"queries:N"`` rows included), computed elsewhere, e.g. by one
        pass that scores for several policies at once. Does nothing when nothing is left to settle."""
        if self.pending is None:
            return
        self._finish(None if weights is None else self._checked_weights(weights))

    def _checked_weights(self, weights: torch.Tensor | dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
        """``settle``'s ``weights`` in float32, once they are what the pending pass asked for."""
        n, asked = self.pending.keys.shape, self.pending.weights
        if asked is None:
            raise ValueError(f"{self.kind} layer: its policy uses no attention weights, got some")
        one = isinstance(asked, str)
        if one != isinstance(weights, torch.Tensor) or (not one and (not isinstance(weights, dict) or set(weights) != set(asked))):
            want = "one tensor" if one else f"a dict of modes {sorted(asked)}"
            got = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
            raise ValueError(f"{self.kind} layer: weights must be {want} (what its pass asks for), got {got}")
        for mode, w in ((asked, weights),) if one else weights.items():
            if not is_queries(mode) and tuple(w.shape) != (n[0], n[1], n[2]):
                raise ShapeError(f"{self.kind} layer: weights must be [B, Hkv, N] = {tuple(n[:3])} over the read record's slots, got {tuple(w.shape)}")
        return weights.float() if one else {m: w.float() for m, w in weights.items()}

    def _finish(self, weights: torch.Tensor | None) -> None:
        self.pending, self._owner_weights = None, None
        self._settle(weights)

    def _settle(self, weights: torch.Tensor | None) -> None:
        """Called once per update, after its attention, with the weights asked for in
        the record's ``weights`` (None when it went unattended)."""

    def reset(self) -> None:
        self.pending = self._owner_weights = None

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        self._refuse_unsettled_trim(n)

    def _refuse_unsettled_trim(self, n: int) -> None:
        if int(n) and self.pending is not None:
            raise UnsupportedOperation(
                f"{self.kind} layer: cannot trim between an update and its attention (attend() or settle() first)"
            )
