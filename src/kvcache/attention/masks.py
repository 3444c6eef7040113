"""Masks from absolute positions: the one place where "which key may a query see" is decided.

Bounded layers keep slots out of position order (a window's ring, an eviction policy's
survivors), so a mask cannot be "the first ``T`` columns". Instead every slot carries its absolute
position and every query row sits at ``first_query + i``; a layer's ``Visibility`` rule turns the
pair into booleans, per block of query rows, so a long prefill never builds a ``T x T`` mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import DTypeError
from .heads import group_heads


class VisibilityRule(Protocol):
    """Which slots a query may see: ``rule(q_pos, k_pos)`` with ``q_pos`` ``[rows, 1]`` and
    ``k_pos`` ``[..., 1, N]`` gives booleans ``[..., rows, N]``. ``for_query_heads(Hq)`` is the rule
    for a pass with ``Hq`` query heads (a rule that differs per query head needs the count)."""

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor: ...

    def for_query_heads(self, query_heads: int) -> VisibilityRule: ...


@dataclass(frozen=True)
class Visibility:
    """Which keys a query sees, by absolute position: causal (``k <= q``), and with a ``window``
    only the last ``window`` positions (counting the query's own) plus the first ``sinks``.
    Empty slots (position -1) are never seen."""

    window: int | None = None
    sinks: int = 0

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """``q_pos`` ``[rows, 1]``, ``k_pos`` ``[..., 1, N]``: booleans ``[..., rows, N]``."""
        seen = (k_pos >= 0) & (k_pos <= q_pos)
        if self.window is None:
            return seen
        return seen & ((k_pos > q_pos - self.window) | (k_pos < self.sinks))

    def for_query_heads(self, query_heads: int) -> Visibility:
        return self  # the same for every query head


CAUSAL = Visibility()


def position_rows(
    first_query: int,
    k_pos: torch.Tensor,
    visible: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = CAUSAL,
    extra: torch.Tensor | None = None,
    kv_heads: int = 1,
) -> Callable[[int, int], torch.Tensor]:
    """A ``mask_rows`` function for ``attend_weighted``: query row ``i`` sits at absolute position
    ``first_query + i``, key slot ``j`` at ``k_pos[..., j]`` (``[B|1, Hkv|1, N]`` or ``[N]``, -1 = empty).

    Returns, for rows ``start:stop``, ``visible(q_pos, k_pos)`` AND the columns of ``extra``
    (boolean, True = attend, ``[B|1, 1, Sq|1, P]`` over absolute positions ``0..P-1``, or per query
    head ``[B|1, Hq, Sq|1, P]``) picked at each slot's position: ``[B|1, Hkv|1, rows, N]``, or
    ``[B|1, Hkv, group, rows, N]`` for a per-head mask (``kv_heads``: how many key/value heads the
    query heads split under).
    """
    while k_pos.dim() < 3:
        k_pos = k_pos.unsqueeze(0)
    kp = k_pos.unsqueeze(-2).unsqueeze(2)  # [B|1, Hkv|1, 1, 1, N]
    per_head = False
    if extra is not None:
        if extra.dtype != torch.bool:
            raise DTypeError(
                f"a mask over absolute positions must be boolean (True = attend), got {extra.dtype}; "
                "kvcache.hf.boolean_mask turns transformers' additive masks into one"
            )
        while extra.dim() < 4:
            extra = extra.unsqueeze(0)
        per_head = extra.shape[1] > 1
        extra = group_heads(extra, kv_heads) if per_head else extra.unsqueeze(2)  # [B|1, Hkv|1, group|1, Sq|1, P]
        columns = kp.clamp(0, extra.shape[-1] - 1)

    def rows(start: int, stop: int) -> torch.Tensor:
        q_pos = torch.arange(first_query + start, first_query + stop, device=k_pos.device).view(-1, 1)
        allowed = visible(q_pos, kp)  # [B|1, Hkv|1, 1, rows, N]
        if extra is None:
            return allowed.squeeze(2)
        m = extra[..., start:stop, :] if extra.shape[-2] != 1 else extra
        shape = [max(a, b) for a, b in zip(m.shape[:3], kp.shape[:3])]
        m = m.expand(*shape, stop - start, m.shape[-1])
        idx = columns.expand(*shape, stop - start, kp.shape[-1])
        picked = allowed & torch.gather(m, -1, idx)
        return picked if per_head else picked.squeeze(2)

    return rows


def filled_slots(k_pos: torch.Tensor, q_heads: int) -> torch.Tensor:
    """The slots that hold a token (position >= 0; ``k_pos`` ``[B|1, Hkv|1, N]``) as a key mask
    in SDPA's layout, the same for every query row: boolean ``[B|1, Hq|1, 1, N]`` (query head h
    reads KV head h // group)."""
    while k_pos.dim() < 3:
        k_pos = k_pos.unsqueeze(0)
    filled = (k_pos >= 0).unsqueeze(2)  # [B|1, Hkv|1, 1, N]
    kv_heads = filled.shape[1]
    if kv_heads == 1:
        return filled
    return filled.unsqueeze(2).expand(filled.shape[0], kv_heads, q_heads // kv_heads, 1, filled.shape[-1]).reshape(
        filled.shape[0], q_heads, 1, filled.shape[-1]
    )


def bias_at_slots(bias: torch.Tensor, k_pos: torch.Tensor, q_heads: int) -> torch.Tensor:
    """An additive bias over absolute positions (a model's relative-position logits, Inkling)
    ``[B|1, Hq|1, Sq, P]`` picked at each slot's position ``k_pos`` (``[B|1, Hkv|1, N]`` or
    ``[N]``, -1 = empty, masked elsewhere): ``[B|1, Hq|1, Sq, N]``, an additive mask over the slots."""
    while k_pos.dim() < 3:
        k_pos = k_pos.unsqueeze(0)
    if k_pos.shape[1] > 1:  # query head h reads KV head h // group
        k_pos = k_pos.repeat_interleave(q_heads // k_pos.shape[1], dim=1)
    batch, heads = max(bias.shape[0], k_pos.shape[0]), max(bias.shape[1], k_pos.shape[1])
    rows, slots = bias.shape[2], k_pos.shape[2]
    index = k_pos.clamp(0, bias.shape[3] - 1).unsqueeze(2).expand(batch, heads, rows, slots)
    return bias.expand(batch, heads, rows, bias.shape[3]).gather(3, index)
