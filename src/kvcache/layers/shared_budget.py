"""One budget shared by the KV heads of a layer: slots stored flat, chosen across heads.

A flat store holds the kept slots of every KV head of a batch row in one run ``[B, 1, N]``, each
slot tagged with the head it belongs to (``heads``) and its absolute position. The functions here
are the pure pieces the adaptive layer (``adaptive.py``) composes:

- ``flatten_heads``: new ``[B, Hkv, n, ...]`` tensors as ``[B, 1, Hkv * n, ...]`` (head-major);
- ``pooled_by_head``: SnapKV's max-pooling (``policies.pooled``) over each head's slots;
- ``keep_across_heads``: which slots a row keeps: the protected recent ones, each head's ``floor``
  best, then the best of the rest whatever their head (Ada-KV's allocation with its safeguard);
- ``moves_in_place``: a decode step's eviction as a few slot moves, where no floor binds;
- ``OwnHeads``: the visibility rule that lets a query head see only its own KV head's slots;
- ``check_flat_state``: the checks a saved flat store must pass (untrusted input).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..attention import CAUSAL
from ..errors import DTypeError, ShapeError, UnsupportedOperation
from .policies import pooled


def flatten_heads(t: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, n, ...]`` as ``[B, 1, Hkv * n, ...]``: head 0's ``n`` slots, then head 1's, ..."""
    return t.reshape(t.shape[0], 1, t.shape[1] * t.shape[2], *t.shape[3:])


def new_slot_tags(batch: int, kv_heads: int, first: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Head and absolute position of ``n`` new tokens at ``first...`` flattened as ``flatten_heads``
    does: int16 heads and int32 positions, each ``[B, 1, Hkv * n]``."""
    heads = torch.arange(kv_heads, device=device, dtype=torch.int16).repeat_interleave(n)
    positions = torch.arange(first, first + n, device=device, dtype=torch.int32).repeat(kv_heads)
    return heads.expand(batch, 1, kv_heads * n), positions.expand(batch, 1, kv_heads * n)


def head_counts(heads: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """How many slots each head holds: ``heads`` ``[B, 1, N]`` -> int64 ``[B, Hkv]``."""
    counts = torch.zeros(heads.shape[0], kv_heads, dtype=torch.long, device=heads.device)
    return counts.scatter_add_(1, heads[:, 0].long(), torch.ones_like(heads[:, 0], dtype=torch.long))


def _rank_in_head(key: torch.Tensor, heads: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Each slot's rank within its head by ``key``, best (largest) first: ``key`` float ``[B, N]``,
    ``heads`` ``[B, N]`` -> int64 ``[B, N]`` (0 for each head's best slot)."""
    order = key.argsort(dim=-1, descending=True, stable=True)
    order = order.gather(-1, heads.gather(-1, order).argsort(dim=-1, stable=True))  # by head, best first
    sorted_heads = heads.gather(-1, order)
    counts = head_counts(heads.unsqueeze(1), kv_heads)
    starts = (counts.cumsum(-1) - counts).gather(-1, sorted_heads)  # [B, N]: where each head's run begins
    rank_sorted = torch.arange(key.shape[-1], device=key.device) - starts
    return torch.empty_like(rank_sorted).scatter_(-1, order, rank_sorted)


def keep_across_heads(
    scores: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor, keep: int, kv_heads: int, floor: int, recent_from: int
) -> torch.Tensor:
    """The slots a row keeps, as an index ``[B, 1, keep]`` in slot order, of ``N >= keep`` slots
    (``scores`` float ``[B, 1, N]``, ``heads`` and ``positions`` ``[B, 1, N]``).

    Kept first: every slot at a position ``>= recent_from`` (the observation window) and each
    head's ``floor`` best other slots (fewer if it has fewer); then the best of the rest by score,
    whatever their head, up to ``keep``. The caller sees to it that the first two fit in ``keep``."""
    s, h, p = scores[:, 0], heads[:, 0].long(), positions[:, 0]
    protected = p >= recent_from
    floored = _rank_in_head(s.masked_fill(protected, -torch.inf), h, kv_heads) < floor
    key = s.masked_fill(protected | floored, torch.inf)
    return key.topk(keep, dim=-1).indices.sort(dim=-1).values.unsqueeze(1)


def gather_slots(slots: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The slots ``index`` ``[B, 1, K]`` of every tensor ``[B, 1, N(, X)]``: ``[B, 1, K(, X)]`` (copies)."""
    out = {}
    for name, t in slots.items():
        out[name] = t.gather(2, index if t.dim() == 3 else index.unsqueeze(-1).expand(*index.shape, t.shape[-1]))
    return out


def pooled_by_head(scores: torch.Tensor, heads: torch.Tensor, positions: torch.Tensor, kv_heads: int, kernel: int) -> torch.Tensor:
    """``scores`` ``[B, 1, N]`` max-pooled ``kernel`` slots wide over each head's slots in position
    order (``policies.pooled`` per head): the flat slots are laid out as ``[B, Hkv, widest head]``,
    padded with ``-inf`` scores at positions after every real one, pooled, and read back."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    b, n = scores.shape[0], scores.shape[-1]
    h = heads[:, 0].long()
    width = int(head_counts(heads, kv_heads).max())
    column = _rank_in_head(torch.zeros_like(scores[:, 0]), h, kv_heads)  # any distinct column within the head
    flat_index = h * width + column  # [B, N]
    pos = positions[:, 0].long()
    pad_from = int(pos.max()) + 1
    rect_pos = (pad_from + torch.arange(kv_heads * width, device=pos.device)).expand(b, -1).clone()
    rect_pos.scatter_(-1, flat_index, pos)
    rect = torch.full((b, kv_heads * width), -torch.inf, dtype=scores.dtype, device=scores.device)
    rect.scatter_(-1, flat_index, scores[:, 0])
    out = pooled(rect.view(b, kv_heads, width), rect_pos.view(b, kv_heads, width), kernel)
    return out.view(b, -1).gather(-1, flat_index).view(b, 1, n)


class OwnHeads:
    """Causal visibility by position where query head ``i`` sees only the slots of KV head
    ``i // (Hq / Hkv)``, for a flat store read as one KV head: ``heads`` ``[B, 1, N]`` is each
    slot's KV head. ``for_query_heads(Hq)`` gives the rule a pass with ``Hq`` query heads applies:
    called with ``q_pos`` ``[rows, 1]`` and the slots' positions ``[B|1, 1, 1, 1, N]`` (as
    ``attention.position_rows`` hands them), it returns a per-query-head mask ``[B, 1, Hq, rows, N]``."""

    def __init__(self, heads: torch.Tensor, kv_heads: int, query_heads: int | None = None) -> None:
        self.heads, self.kv_heads = heads, kv_heads
        self.own: torch.Tensor | None = None  # [B, 1, Hq, 1, N]: set for a known query head count
        if query_heads is not None:
            if query_heads <= 0 or query_heads % kv_heads:
                raise ShapeError(f"query heads ({query_heads}) must be a multiple of key/value heads ({kv_heads})")
            owner = torch.arange(query_heads, device=heads.device) // (query_heads // kv_heads)
            self.own = heads.long().view(heads.shape[0], 1, 1, 1, heads.shape[-1]) == owner.view(1, 1, -1, 1, 1)

    def for_query_heads(self, query_heads: int) -> OwnHeads:
        return OwnHeads(self.heads, self.kv_heads, query_heads)

    def __call__(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        if self.own is None:
            raise UnsupportedOperation("OwnHeads: call for_query_heads(Hq) first, for the rule of a pass with Hq query heads")
        return CAUSAL(q_pos, k_pos) & self.own


def moves_in_place(live: dict[str, torch.Tensor], kv_heads: int, keep: int, recent_from: int, floor: int):
    """A decode step's eviction without rewriting the store: of ``live``'s ``N = keep + extra``
    slots (``extra <= N - keep`` new ones at the end), the ``extra`` weakest unprotected slots of each
    row go, and the survivors among the last ``extra`` move into their places. Returns ``(target,
    source)``, slot indices ``[B, 1, extra]`` (copy ``source`` onto ``target``; a row with fewer
    places to fill copies a leaving tail slot onto itself), or None where that would take a head
    below ``floor`` (or a protected slot would go): ``keep_across_heads`` decides then."""
    positions, heads, scores = live["positions"][:, 0], live["heads"][:, 0], live["scores"][:, 0]
    extra = positions.shape[-1] - keep
    protected = positions >= recent_from
    drop = scores.masked_fill(protected, torch.inf).topk(extra, dim=-1, largest=False).indices
    if bool(protected.gather(-1, drop).any()):
        return None
    free = head_counts((heads + kv_heads * protected).unsqueeze(1), 2 * kv_heads)[:, :kv_heads]  # unprotected per head
    left = free - head_counts(heads.gather(-1, drop).unsqueeze(1), kv_heads)
    if bool((left < torch.clamp(free, max=floor)).any()):
        return None
    dropped = torch.zeros_like(protected).scatter_(-1, drop, True)
    holes = (~dropped[:, :keep]).to(torch.int8).argsort(dim=-1, stable=True)[:, :extra]  # leaving slots first
    movers = dropped[:, keep:].to(torch.int8).argsort(dim=-1, stable=True)[:, :extra] + keep  # staying slots first
    filling = torch.arange(extra, device=drop.device) < dropped[:, :keep].sum(-1, keepdim=True)
    return torch.where(filling, holes, movers).unsqueeze(1), movers.unsqueeze(1)


def check_flat_state(t: dict[str, torch.Tensor], storage, store, seen: int, budget: int, compressed: int = 0) -> None:
    """Raise unless ``t`` is a flat store's content ``seen`` tokens in, at most ``budget`` slots per
    head on average (+1 spare) besides ``compressed``: the codec's tensors ``[B, 1, N, ...]``, ``positions``/``heads``/
    ``scores`` ``[B, 1, N]`` (``store``'s dtypes), int64 ``head_lengths`` ``[B, Hkv]`` agreeing with
    ``heads``, positions in ``[0, seen)``, none twice in one head. Untrusted input: changes nothing."""
    tags = ("positions", "heads", "scores")
    missing = [name for name in (*storage.names, *tags, "head_lengths") if name not in t]
    if missing:
        raise ValueError(f"adakv layer state lacks {missing}")
    counts = t["head_lengths"]
    if (
        any(t[name].dim() != 3 or t[name].shape[1] != 1 for name in tags)
        or any(t[name].dim() != 4 or t[name].shape[1] != 1 for name in storage.names)
        or counts.dim() != 2
        or counts.dtype != torch.long
    ):
        shapes = ", ".join(f"{name} {tuple(t[name].shape)}" for name in (*tags, *storage.names, "head_lengths"))
        raise ShapeError(f"adakv layer state needs {tags} [B, 1, slots], {storage.names} [B, 1, slots, ...] and int64 head_lengths [B, Hkv], got {shapes}")
    batch, _, n = t["positions"].shape
    kv_heads = counts.shape[1]
    g = storage.geometry(t)
    if not g.dtype.is_floating_point:
        raise DTypeError(f"adakv layer state: keys or scales must be floating-point, got {g.dtype}")
    if kv_heads < 1 or counts.shape[0] != batch:
        raise ShapeError(f"adakv layer state: head_lengths should be [{batch}, Hkv >= 1], got {tuple(counts.shape)}")
    store.check("adakv layer", t, replace(g, batch=batch, heads=1), n)
    check_flat_tags(t["positions"], t["heads"], counts, seen, budget, compressed)


def check_flat_tags(positions: torch.Tensor, heads: torch.Tensor, counts: torch.Tensor, seen: int, budget: int, compressed: int = 0) -> None:
    """Raise unless a flat store's tags ``positions``/``heads`` ``[B, 1, N]`` fit ``budget`` per head
    (+1 spare) besides ``compressed`` after ``seen`` tokens, agree with ``counts`` (int64 ``[B, Hkv]``),
    and hold no position twice in one head."""
    if counts.dim() != 2 or counts.dtype != torch.long or counts.shape[0] != positions.shape[0] or counts.shape[1] < 1:
        raise ShapeError(f"adakv layer state: head_lengths should be int64 [{positions.shape[0]}, Hkv >= 1], got {counts.dtype} {tuple(counts.shape)}")
    n, kv_heads = positions.shape[2], counts.shape[1]
    pos, heads = positions.long(), heads.long()
    if n > min(kv_heads * seen, kv_heads * (budget + 1) + compressed):
        raise ValueError(
            f"adakv layer state holds {n} slots for {kv_heads} heads after {seen} tokens, budget {budget} per head"
            + (f" and {compressed} compressed" if compressed else "")
        )
    if n and (int(pos.min()) < 0 or int(pos.max()) >= seen or int(heads.min()) < 0 or int(heads.max()) >= kv_heads):
        raise ValueError(f"adakv layer state has positions outside [0, {seen}) or heads outside [0, {kv_heads})")
    if not torch.equal(head_counts(heads, kv_heads), counts):
        raise ValueError("adakv layer state: head_lengths disagree with the slots' heads")
    if n > 1 and not bool(((heads * (seen + 1) + pos).sort(dim=-1).values.diff(dim=-1) > 0).all()):
        raise ValueError("adakv layer state holds a position twice in one head")
