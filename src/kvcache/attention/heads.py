"""Grouped query heads: the query heads that share a KV head packed under it (``[B, Hkv, group,
...]``), with their masks and attention sinks grouped the same way, the softmax over them, and the
checks of an attention call's inputs."""

from __future__ import annotations

import torch

from ..errors import DTypeError, ShapeError
from .readers import BlockReader


def softmax(scores: torch.Tensor, sinks5: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``[B, Hkv, group, rows, T]`` scores, in float32 (float64
    scores stay float64); with sinks ``[1, Hkv, group, 1, 1]`` (see ``attend``), one more logit
    per row joins the normalisation and is dropped from the result (``[B|1, Hkv, group, rows|1,
    1]``: one per row)."""
    dtype = torch.promote_types(scores.dtype, torch.float32)
    if sinks5 is None:
        return torch.softmax(scores, dim=-1, dtype=dtype)
    sink = sinks5.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores.to(dtype), sink.to(dtype)], dim=-1), dim=-1)[..., :-1]


def group_sinks(sinks: torch.Tensor | None, kv_heads: int, group: int) -> torch.Tensor | None:
    """Sinks as float32 ``[B|1, Hkv, group, Sq|1, 1]`` (query head h sits under KV head h // group):
    learned ones, one logit per query head ``[Hq]`` (gpt-oss), or one per query row
    ``[B|1, Hq, Sq|1, 1]``, computed from each query's own state (Inkling 2)."""
    if sinks is None:
        return None
    q_heads = kv_heads * group
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 and sinks.numel() == q_heads:
        return sinks.detach().float().reshape(1, kv_heads, group, 1, 1)
    if isinstance(sinks, torch.Tensor) and sinks.dim() == 4 and sinks.shape[1] == q_heads and sinks.shape[3] == 1:
        return sinks.detach().float().reshape(sinks.shape[0], kv_heads, group, sinks.shape[2], 1)
    shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
    raise ShapeError(f"sinks must be one logit per query head [{q_heads}] or per query row [B, {q_heads}, Sq, 1], got {shape}")


def sink_rows(sinks5: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    """The sinks of query rows ``start:stop`` (all of them when they are the same for every row)."""
    return sinks5 if sinks5 is None or sinks5.shape[3] == 1 else sinks5[:, :, :, start:stop]


def group_heads(mask: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A mask ``[B|1, H|1, S, T]`` as ``[B|1, Hkv|1, group|1, S, T]``: per query head masks (H = Hq)
    split under their KV head, a mask shared by every head kept broadcastable (a view)."""
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)
    if mask.shape[1] % kv_heads:
        raise ShapeError(f"a mask over {mask.shape[1]} heads does not split under {kv_heads} key/value heads")
    return mask.reshape(mask.shape[0], kv_heads, mask.shape[1] // kv_heads, *mask.shape[2:])


def check_inputs(query: torch.Tensor, reader: BlockReader, plain, mask) -> tuple[int, int, int, int, int, int, int]:
    """Check the call's inputs (``plain``: ``reader.tensors()``); returns ``B, Hq, Sq, D, Hkv, T, Dv``."""
    named = (("query", query),) if plain is None else (("query", query), ("key", plain[0]), ("value", plain[1]))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ShapeError(f"{name} must be [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    key, value = plain if plain is not None else (reader, reader)
    batch, q_heads, q_len, head_dim = q_shape = query.shape
    k_shape, v_shape = reader.shape, reader.value_shape
    if k_shape[0] != batch or v_shape[0] != batch:
        raise ShapeError(
            f"batch mismatch: query {tuple(q_shape)}, key {tuple(k_shape)}, value {tuple(v_shape)}"
        )
    if k_shape[1] != v_shape[1] or k_shape[2] != v_shape[2]:
        raise ShapeError(
            f"key and value must agree on [batch, kv_heads, seq]: key {tuple(k_shape)}, value {tuple(v_shape)}"
        )
    if k_shape[3] != head_dim:
        raise ShapeError(f"query head dim {head_dim} does not match key head dim {k_shape[3]}")
    if k_shape[1] == 0 or q_heads % k_shape[1]:
        raise ShapeError(
            f"query heads ({q_heads}) must be a multiple of key/value heads ({k_shape[1]})"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise DTypeError(f"query, key and value must share a dtype: {query.dtype}, {key.dtype}, {value.dtype}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise DTypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise DTypeError(f"mask must be boolean (True = attend) or floating (additive), got {mask.dtype}")
    return batch, q_heads, q_len, head_dim, k_shape[1], k_shape[2], v_shape[3]


def group_mask(mask, batch, kv_heads, group, q_len, kv_len) -> torch.Tensor | None:
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
    return group_heads(mask, kv_heads)
