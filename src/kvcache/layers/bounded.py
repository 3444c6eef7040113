"""What bounded layers share: attention that knows where every stored slot sits in the sequence.

A bounded layer (window, eviction, quantized storage) keeps slots out of position order, drops
some positions, or stores codes instead of keys. The keys ``update`` returns are then not "the
past, in order" that a plain attention call and Hugging Face's mask expect. So the layer runs its
own attention: ``update(key, value)`` records the set the new queries must attend, and
``attend(query)`` runs attention over it with a mask made from absolute positions
(``position_mask``) and hands the attention weights to whatever needs them (an eviction policy).

Through ``transformers`` this takes the ``"kvcache"`` attention implementation, which
``make_cache`` switches on for models with bounded layers (``hf.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..attention import attend_weighted, group_heads
from ..errors import UnsupportedOperation
from .base import KVLayer


@dataclass
class AttentionSet:
    """What the queries of the last update attend: keys ``[B, Hkv, N, D]``, values
    ``[B, Hkv, N, Dv]``, the absolute position of each ``[B|1, Hkv|1, N]`` (-1 for an empty slot),
    the position of the first new token, and whether every slot is visible to every query."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor | Callable[[], torch.Tensor]  # a callable when only a masked step needs it
    first_query: int
    all_visible: bool = False


class BoundedLayer(KVLayer):
    """A layer whose attention goes through ``attend`` (see the module docstring)."""

    needs_own_attention = True
    #: What the layer needs from the attention pass: None, "sum" or "last" (see ``attend_weighted``).
    attention_weights: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._pending: AttentionSet | None = None
        self._pending_queries = 0
        #: Attention calls that read each update's set: the layer's own, plus one per later layer
        #: that reuses this layer's keys and values (Gemma 3n / 4 ``kv_sharing_modes``; set by ``KVCache``).
        self.readers = 1
        self._reads_left = 0
        self._owner_weights: torch.Tensor | None = None

    @property
    def awaiting_attention(self) -> bool:
        """True between an ``update`` and the ``attend`` of its queries."""
        return self._pending is not None

    def attend(
        self,
        query: torch.Tensor,
        *,
        scale: float | None = None,
        softcap: float | None = None,
        mask: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the last update's queries ``[B, Hq, Sq, D]`` over what they may see.

        ``mask`` is optional extra masking in Hugging Face's layout, ``[B|1, 1|Hq, Sq|1, P]`` over
        absolute positions ``0..P-1`` (boolean, True = attend; an additive float mask counts as
        masked where it is very negative): it carries the padding of a left-padded batch, or a
        model's own per-head masking (Doge). ``sinks`` ``[Hq]``: learned attention sinks, as in
        ``attend``. Returns ``[B, Hq, Sq, Dv]``.

        A layer that shares this one's keys and values (``readers > 1``) reads after the owner and
        may bring only the last ``Sq`` of the update's queries (Gemma 4 skips the others in the
        shared layers); ``mask`` then has those rows.
        """
        pending = self._pending
        if pending is None:
            raise UnsupportedOperation(f"{self.kind} layer: attend() needs an update() first, for its queries")
        n, owner = query.shape[2], self._reads_left == self.readers
        if n != self._pending_queries and (owner or n > self._pending_queries):
            raise UnsupportedOperation(
                f"{self.kind} layer: the last update appended {self._pending_queries} tokens, "
                f"but attend() got {n} queries"
                + ("" if owner else f" (a layer sharing its keys and values may bring at most {self._pending_queries})")
            )
        if n != self._pending_queries:  # the last n queries
            pending = replace(pending, first_query=pending.first_query + self._pending_queries - n)
        out, weights = self._attend_pending(query, pending, scale, softcap, mask, sinks)
        self._read_done(weights)
        return out

    def _attend_pending(self, query, pending: AttentionSet, scale, softcap, mask, sinks):
        """``attend``'s work once its checks passed: returns ``([B, Hq, Sq, Dv], weights or None)``."""
        rows = None
        if mask is not None or not pending.all_visible:
            positions = pending.positions() if callable(pending.positions) else pending.positions
            rows = position_mask(pending.first_query, positions, mask, self._visible, pending.keys.shape[1])
        return attend_weighted(
            query,
            pending.keys,
            pending.values,
            scale=scale,
            softcap=softcap,
            mask_rows=rows,
            weights=self.attention_weights,
            sinks=sinks,
        )

    def _read_done(self, weights: torch.Tensor | None) -> None:
        """Count one read of the pending set; after the last reader the layer settles (eviction
        runs) with the weights of the first read, the layer's own queries. Readers sharing the K/V
        thus all attend the set as it was before anything is dropped, as Hugging Face's do."""
        if self._reads_left == self.readers:
            self._owner_weights = weights
        self._reads_left -= 1
        if self._reads_left <= 0:
            weights, self._owner_weights = self._owner_weights, None
            self._pending = None
            self._attended(weights)

    def skip_attention(self) -> None:
        """Let the last update's tokens go unattended (keys/values imported from elsewhere): the
        layer settles as if attention had run and reported nothing (eviction uses the scores it has)."""
        if self._pending is not None:
            self._pending = self._owner_weights = None
            self._attended(None)

    def _set_pending(self, pending: AttentionSet, queries: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._pending = pending
        self._pending_queries = queries
        self._reads_left = self.readers
        return pending.keys, pending.values

    def _visible(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Which keys each query may see, by position: ``[rows, 1]`` x ``[..., 1, N]`` -> bool.

        Causal by default; the window layer adds its window and sinks."""
        return (k_pos >= 0) & (k_pos <= q_pos)

    def _attended(self, weights: torch.Tensor | None) -> None:
        """Called after attention with the weights asked for in ``attention_weights``."""

    def reset(self) -> None:
        self._pending = self._owner_weights = None

    def check_trim(self, n: int) -> None:
        super().check_trim(n)
        if int(n) and self._pending is not None:
            raise UnsupportedOperation(f"{self.kind} layer: cannot trim between an update and its attention")


def position_mask(
    first_query: int,
    k_pos: torch.Tensor,
    hf_mask: torch.Tensor | None,
    visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    kv_heads: int = 1,
) -> Callable[[int, int], torch.Tensor]:
    """A ``mask_rows`` function for ``attend_weighted``: query row ``i`` sits at absolute position
    ``first_query + i``, key slot ``j`` at ``k_pos[..., j]`` (``[B|1, Hkv|1, N]`` or ``[N]``, -1 = empty).

    Returns, for rows ``start:stop``, ``visible(q_pos, k_pos)`` AND the columns of ``hf_mask``
    (``[B|1, 1, Sq|1, P]`` over absolute positions, or per query head ``[B|1, Hq, Sq|1, P]``) picked
    at each slot's position: ``[B|1, Hkv|1, rows, N]`` booleans, or ``[B|1, Hkv, group, rows, N]``
    for a per-head mask (``kv_heads``: how many key/value heads the query heads split under).
    """
    while k_pos.dim() < 3:
        k_pos = k_pos.unsqueeze(0)
    kp = k_pos.unsqueeze(-2).unsqueeze(2)  # [B|1, Hkv|1, 1, 1, N]
    if hf_mask is not None:
        if hf_mask.dtype != torch.bool:
            hf_mask = hf_mask > torch.finfo(hf_mask.dtype).min / 2
        while hf_mask.dim() < 4:
            hf_mask = hf_mask.unsqueeze(0)
        per_head = hf_mask.shape[1] > 1
        if per_head:
            hf_mask = group_heads(hf_mask, kv_heads)  # [B|1, Hkv, group, Sq|1, P]
        else:
            hf_mask = hf_mask.unsqueeze(2)  # [B|1, 1, 1, Sq|1, P]
        columns = kp.clamp(0, hf_mask.shape[-1] - 1)

    def rows(start: int, stop: int) -> torch.Tensor:
        q_pos = torch.arange(first_query + start, first_query + stop, device=k_pos.device).view(-1, 1)
        allowed = visible(q_pos, kp)  # [B|1, Hkv|1, 1, rows, N]
        if hf_mask is None:
            return allowed.squeeze(2)
        m = hf_mask[..., start:stop, :] if hf_mask.shape[-2] != 1 else hf_mask
        shape = [max(a, b) for a, b in zip(m.shape[:3], kp.shape[:3])]
        m = m.expand(*shape, stop - start, m.shape[-1])
        idx = columns.expand(*shape, stop - start, kp.shape[-1])
        picked = allowed & torch.gather(m, -1, idx)
        return picked if per_head else picked.squeeze(2)

    return rows
