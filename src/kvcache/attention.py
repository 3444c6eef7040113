"""Attention over cache views, without copying the cache.

``attend`` takes the SDPA layout and never expands K/V for grouped-query attention: the query heads
that share a KV head are packed into that head's rows (``[B, Hkv, group * Sq, D]``), so each key
and value is read once per KV head. Keys and values laid out as a cache stores them, views
``[:, :, :T]`` of a ``[B, Hkv, C, D]`` buffer, are read in place, never made contiguous. (Other
layouts, e.g. a transposed ``[B, C, Hkv, D]`` buffer with B > 1, may be copied by ``matmul``.)

Long prefills are processed in blocks of query rows, so the score matrix never exceeds about
``_BLOCK_BYTES``; a ``max_len x max_len`` mask is never built (``causal=True`` makes it per block).
"""

from __future__ import annotations

import math

import torch

from .errors import DTypeError, ShapeError

_BLOCK_BYTES = 64 * 2**20  # score bytes per query block
_DECODE_ROWS = 16  # at most this many query rows per KV head (group * Sq) take the decode path


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads, reading K/V in place.

    query ``[B, Hq, Sq, D]``, key ``[B, Hkv, T, D]``, value ``[B, Hkv, T, Dv]`` with ``Hq`` a
    multiple of ``Hkv``; returns ``[B, Hq, Sq, Dv]``. ``mask`` follows SDPA: boolean (True =
    attend) or additive float, broadcastable to ``[B, Hq, Sq, T]``. ``causal`` masks key ``j`` for
    query ``i`` unless ``j <= T - Sq + i`` (aligned to the end, as for queries that follow a cache;
    equal to SDPA's ``is_causal`` when ``Sq == T``). Rows with every key masked return zeros.
    ``softcap`` caps the scaled scores as ``softcap * tanh(score / softcap)`` before the mask
    (gemma2's attention logit softcapping).
    """
    batch, q_heads, q_len, head_dim = _check_inputs(query, key, value, mask)
    kv_heads, kv_len, value_dim = key.shape[1], key.shape[2], value.shape[3]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    # [B, Hq, Sq, D] -> [B, Hkv, group, Sq, D]: query head h reads KV head h // group.
    q5 = query.reshape(batch, kv_heads, group, q_len, head_dim)
    mask5 = _group_mask(mask, batch, kv_heads, group, q_len, kv_len)
    keys_t = key.transpose(-1, -2)  # [B, Hkv, D, T], a view

    row_bytes = batch * q_heads * kv_len * 4
    block = max(1, min(q_len, _BLOCK_BYTES // max(row_bytes, 1)))
    if q_len == 0:
        return query.new_empty(batch, q_heads, 0, value_dim)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap}")
    if group * q_len <= _DECODE_ROWS:
        return _decode(q5, key, value, mask5, causal, scale, softcap).reshape(batch, q_heads, q_len, value_dim)
    outs = []
    for start in range(0, q_len, block):
        stop = min(q_len, start + block)
        rows = stop - start
        q = (q5[:, :, :, start:stop] * scale).reshape(batch, kv_heads, group * rows, head_dim)
        scores = _cap(torch.matmul(q, keys_t), softcap).view(batch, kv_heads, group, rows, kv_len)
        blocked = mask5 is not None or causal
        if mask5 is not None:
            m = mask5[..., start:stop, :] if mask5.shape[-2] != 1 else mask5
            scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m
        if causal:
            offset = kv_len - q_len
            q_pos = torch.arange(start, stop, device=key.device).view(-1, 1) + offset
            future = torch.arange(kv_len, device=key.device).view(1, -1) > q_pos  # [rows, T]
            scores = scores.masked_fill(future, -math.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if blocked:
            probs = probs.nan_to_num(0.0)  # a row with every key masked: zeros, not NaN
        probs = probs.to(value.dtype).view(batch, kv_heads, group * rows, kv_len)
        outs.append(torch.matmul(probs, value).view(batch, kv_heads, group, rows, value_dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(batch, q_heads, q_len, value_dim)


def _cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _decode(q5, key, value, mask5, causal: bool, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Few query rows per KV head (decode): scores computed as ``K @ q^T``.

    With T rows and a handful of columns, that product streams K in its stored order, which BLAS
    does close to memory speed; ``q @ K^T`` (the same numbers, transposed) measured slower on a
    2-core CPU. The scores are then viewed as ``[rows, T]`` for the softmax, whose output is
    contiguous, so ``p @ V`` reads V once in order. Returns ``[B, Hkv, group, Sq, Dv]``.
    """
    batch, kv_heads, group, q_len, head_dim = q5.shape
    kv_len = key.shape[2]
    rows = group * q_len
    q_t = (q5 * scale).reshape(batch, kv_heads, rows, head_dim).transpose(-1, -2)  # [B, Hkv, D, rows]
    scores = _cap(torch.matmul(key, q_t), softcap).transpose(-1, -2)  # [B, Hkv, rows, T], a view
    masked = mask5 is not None or causal
    if mask5 is not None:
        mb, mh = mask5.shape[0], mask5.shape[1]
        m = mask5.expand(mb, mh, group, q_len, kv_len).reshape(mb, mh, rows, kv_len)
        scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m
    if causal:
        q_pos = torch.arange(q_len, device=key.device).repeat(group) + (kv_len - q_len)  # [rows]
        future = torch.arange(kv_len, device=key.device).view(1, -1) > q_pos.view(-1, 1)  # [rows, T]
        scores = scores.masked_fill(future, -math.inf)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if masked:
        probs = probs.nan_to_num(0.0)
    out = torch.matmul(probs.to(value.dtype), value)  # [B, Hkv, rows, Dv]
    return out.view(batch, kv_heads, group, q_len, value.shape[3])


def _check_inputs(query, key, value, mask) -> tuple[int, int, int, int]:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    batch, q_heads, _, head_dim = query.shape
    if key.shape[0] != batch or value.shape[0] != batch:
        raise ShapeError(
            f"batch mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ShapeError(
            f"key and value must agree on [batch, kv_heads, seq]: key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    if key.shape[3] != head_dim:
        raise ShapeError(f"query head dim {head_dim} does not match key head dim {key.shape[3]}")
    if key.shape[1] == 0 or q_heads % key.shape[1]:
        raise ShapeError(
            f"query heads ({q_heads}) must be a multiple of key/value heads ({key.shape[1]})"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise DTypeError(f"query, key and value must share a dtype: {query.dtype}, {key.dtype}, {value.dtype}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise DTypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise DTypeError(f"mask must be boolean (True = attend) or floating (additive), got {mask.dtype}")
    return batch, q_heads, query.shape[2], head_dim


def _group_mask(mask, batch, kv_heads, group, q_len, kv_len) -> torch.Tensor | None:
    """An SDPA mask broadcastable to ``[B, Hq, Sq, T]`` as ``[B|1, Hkv|1, group|1, Sq|1, T]`` (a view)."""
    if mask is None:
        return None
    q_heads = kv_heads * group
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    if mask.dim() != 4:
        raise ShapeError(f"mask must have at most 4 dims [B, H, Sq, T], got shape {tuple(mask.shape)}")
    mb, mh, mq, mt = mask.shape
    if mb not in (1, batch) or mh not in (1, q_heads) or mq not in (1, q_len) or mt not in (1, kv_len):
        raise ShapeError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to [B, Hq, Sq, T] = "
            f"[{batch}, {q_heads}, {q_len}, {kv_len}]"
        )
    if mh == 1:
        return mask.unsqueeze(2)  # [B|1, 1, 1, Sq|1, T]
    return mask.reshape(mb, kv_heads, group, mq, mt)
