"""The attention weights ``attend_weighted`` reports, reduced per KV head and key: the modes, the
first query row each needs, and the fold of one block of rows' softmax into the running result;
and, for a layer that measures what its choices do to the attention itself, the pass's last query
rows (``"queries:N"``)."""

from __future__ import annotations

import torch

from .readers import BlockReader

#: What ``attend_weighted`` can report about the attention weights, per KV head and key (each
#: summed over the query heads of the group): ``"sum"`` over every query row, ``"last"`` for the
#: last query only, ``"max"`` the largest weight any query row gave the key, and ``"window:N"``
#: summed over the last N query rows (SnapKV's observation window). ``"queries:N"`` is no weight:
#: the last N query rows themselves, times the pass's scale, float32 ``[B, Hkv, group, min(N, Sq), D]``
#: (query head ``h`` is KV head ``h // group``'s row ``h % group``).
WEIGHTS = ("sum", "last", "max", "window:N", "queries:N")

Weights = str | tuple[str, ...] | None


def weight_modes(weights: Weights) -> tuple[str, ...]:
    """The modes asked for, each checked: ``"sum"``, ``"last"``, ``"max"``, ``"window:N"`` or
    ``"queries:N"`` (N >= 1)."""
    if weights is None:
        return ()
    modes = (weights,) if isinstance(weights, str) else tuple(weights)
    for mode in modes:
        if mode in ("sum", "last", "max"):
            continue
        if isinstance(mode, str) and mode.partition(":")[0] in ("window", "queries") and _count(mode) >= 1:
            continue
        raise ValueError(f"weights must be None or one of {WEIGHTS} (N a whole number >= 1), or a tuple of them; got {mode!r}")
    return modes


def _count(mode: str) -> int:
    """N of ``"window:N"``/``"queries:N"``; 0 if it is not a whole number."""
    n = mode.partition(":")[2]
    return int(n) if n.isdigit() else 0


def is_queries(mode: str) -> bool:
    """Whether ``mode`` asks for query rows (``"queries:N"``) rather than weights."""
    return mode.startswith("queries:")


def last_queries(query: torch.Tensor, mode: str, scale: float, kv_heads: int) -> torch.Tensor:
    """``"queries:N"`` of a pass's ``query`` ``[B, Hq, Sq, D]``: ``[B, Hkv, group, min(N, Sq), D]``
    float32, times ``scale``."""
    b, hq, sq, d = query.shape
    rows = query[:, :, sq - min(_count(mode), sq) :].float() * scale
    return rows.reshape(b, kv_heads, hq // kv_heads, rows.shape[2], d)


def first_weighted_row(modes: tuple[str, ...], q_len: int) -> int:
    """The first query row whose softmax weights a mode needs (``q_len``: none does)."""
    first = q_len
    for mode in modes:
        if is_queries(mode):
            continue
        if mode in ("sum", "max"):
            return 0
        first = min(first, q_len - (1 if mode == "last" else min(q_len, _count(mode))))
    return first


def reduce_into(acc: torch.Tensor, mode: str, probs: torch.Tensor, start: int, q_len: int) -> None:
    """Fold the weights ``[B, Hkv, group, rows, T']`` of query rows ``start...`` into ``acc`` ``[B, Hkv, T']``."""
    rows = probs.shape[3]
    if mode == "sum":
        acc += probs.sum(dim=(2, 3))
    elif mode == "max":
        torch.maximum(acc, probs.sum(dim=2).amax(dim=2).to(acc.dtype), out=acc)
    else:
        first = q_len - (1 if mode == "last" else min(q_len, int(mode[7:])))
        lo = max(first - start, 0)
        if lo < rows:
            acc += probs[:, :, :, lo:].sum(dim=(2, 3))


def zeros(reader: BlockReader) -> torch.Tensor:
    return torch.zeros(reader.shape[0], reader.shape[1], reader.shape[2], dtype=torch.float32, device=reader.device)


def reduced(weights: Weights, modes: tuple[str, ...], reader: BlockReader, by_mode: dict | None = None):
    """The weights in the form asked for: None, one tensor (one mode) or a dict (a tuple of modes);
    a mode ``by_mode`` lacks is zeros."""
    if not modes:
        return None
    by_mode = {**{mode: zeros(reader) for mode in modes}, **(by_mode or {})}
    return by_mode[modes[0]] if isinstance(weights, str) else by_mode
