"""End-aligned causal attention through fused SDPA without a mask per query row.

A chunk of ``m`` queries after ``P`` earlier keys (a chunked prefill, an eviction layer's kept
slots followed by a prompt) sees, at row ``i``, keys ``0 .. P + i``. As one SDPA call that needs a
dense ``m x (P + m)`` mask, which also keeps SDPA off its unmasked fast path. Split instead:

- the keys before the chunk, which every row sees whole: one call with no mask;
- the chunk's own keys, a square: one call with ``is_causal``.

(Grouped heads are the flash kernel's own: query head ``h`` reads KV head ``h // group``.)

Each part's output is normalised by its own softmax; with each row's log-sum-exp of the scaled
scores (``l1``, ``l2``) the exact result is ``(o1 * exp(l1) + o2 * exp(l2)) / (exp(l1) + exp(l2))``.
torch's CPU flash attention returns that log-sum-exp
(``aten._scaled_dot_product_flash_attention_for_cpu``); other devices keep the masked blocks.

A key mask (the same for every row, e.g. the empty slots of a per-head layout) rides along as an
additive mask on the part it covers; a part in which a row sees no key takes no share of it, and
a row that sees no key at all returns zeros.
"""

from __future__ import annotations

import math

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def can_split(query: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether ``causal_attention`` can run here: torch's CPU flash attention, its dtypes, and
    values as wide as the keys (``[..., D]`` both)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and value.shape[-1] == query.shape[-1]
    )


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, scale: float, past: int, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows ``query`` ``[B, Hq, m, D]`` over ``key`` and ``value`` ``[B, Hkv, T, D]`` (``Hq`` a
    multiple of ``Hkv``; at least ``past + m`` keys, later ones are not read), row ``i`` seeing keys
    ``j <= past + i`` (``past`` may be negative: the first ``-past`` rows then see nothing).
    ``key_mask``: boolean ``[B|1, Hq|1, 1, T']`` (True = attend, ``T' >= past + m``), the same for
    every row, or None. Returns ``[B, Hq, m, D]`` (values as wide as keys: ``can_split``) in
    ``query``'s dtype; a row that sees no key gives zeros."""
    rows = query.shape[2]
    if past < 0:
        blind = min(rows, -past)
        zeros = query.new_zeros(*query.shape[:2], blind, value.shape[-1])
        if blind == rows:
            return zeros
        seeing = causal_attention(query[:, :, blind:], key, value, scale=scale, past=0, key_mask=key_mask)
        return torch.cat([zeros, seeing], dim=2)
    own = key_mask[..., past : past + rows] if key_mask is not None else None
    out2, lse2, seen2 = _own_square(query, key[:, :, past : past + rows], value[:, :, past : past + rows], scale, own)
    if past == 0:
        return out2 if seen2 is None else out2.masked_fill(~seen2.unsqueeze(-1), 0.0)
    before = key_mask[..., :past] if key_mask is not None else None
    mask = _additive(before, query.dtype)
    out1, lse1 = _flash_cpu(query, key[:, :, :past], value[:, :, :past], attn_mask=mask, scale=scale)
    seen1 = None if before is None else before.any(dim=-1)  # [B|1, Hq|1, 1]: the row sees a key
    return _merge(out1, lse1, seen1, out2, lse2, seen2).to(query.dtype)


def _own_square(query, key, value, scale, key_mask):
    """Row ``i`` over the square's keys ``0..i``: ``(out [B, Hq, m, Dv], lse [B, Hq, m], seen)``,
    ``seen`` ``[B|1, Hq|1, m]`` (whether row ``i`` sees a key), None where every row does."""
    if key_mask is None or bool(key_mask.all()):
        out, lse = _flash_cpu(query, key, value, is_causal=True, scale=scale)
        return out, lse, None
    rows = query.shape[2]
    allowed = torch.ones(rows, rows, dtype=torch.bool, device=query.device).tril() & key_mask  # [B|1, Hq|1, m, m]
    out, lse = _flash_cpu(query, key, value, attn_mask=_additive(allowed, query.dtype), scale=scale)
    return out, lse, allowed.any(dim=-1)


def _merge(out1, lse1, seen1, out2, lse2, seen2) -> torch.Tensor:
    """The attention over both parts' keys from each part's own (see the module docstring): the
    second part's share of a row is ``exp(l2) / (exp(l1) + exp(l2)) = sigmoid(l2 - l1)``; few
    operations, since each small one costs a thread synchronisation."""
    masked = seen1 is not None or seen2 is not None
    if seen1 is not None:
        lse1 = lse1.masked_fill(~seen1, -math.inf)  # the kernel reports 0 for a row that saw nothing
    if seen2 is not None:
        lse2 = lse2.masked_fill(~seen2, -math.inf)
    share2 = torch.sigmoid(lse2 - lse1)
    if masked:
        share2 = share2.nan_to_num(0.0)  # a row that saw nothing in either part: zeroed below
    dtype = torch.promote_types(out1.dtype, share2.dtype)  # half-precision outputs merge in float32
    out = torch.lerp(out1.to(dtype), out2.to(dtype), share2.unsqueeze(-1).to(dtype))
    if seen1 is not None and seen2 is not None:
        out = out.masked_fill(~(seen1 | seen2).unsqueeze(-1), 0.0)  # a row that sees no key: zeros
    return out


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the additive one the flash kernel takes (0 or -inf, in the query's dtype)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, -math.inf)
