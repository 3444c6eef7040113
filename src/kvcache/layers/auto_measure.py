"""``auto``'s ``rule=attention``: a case scored by what it does to the observation window's attention.

The window's queries (the pass's last ``window`` rows, ``attention.weights``'s ``"queries:N"``)
attend the layer's candidates three ways, per query head and row:

- ``o``: every candidate, as stored now (the reference the pass itself computed);
- ``o_keep``: only the candidates a case keeps, in their present precision;
- ``o_code``: the same candidates with their keys and values coded in the case's storage.

A case's ``dropped`` is the mean of ``|o_keep - o| / s`` and its ``coding`` the mean of
``|o_code - o| / s`` less ``dropped`` (so ``total`` is the measured error of the case as it would
be stored), where ``s = sum p |v|`` (the softmax-weighted size of the values, which ``o`` cannot
exceed) normalises each row. Keys are coded with the values: their effect on the weights is in the
measure, not estimated. Each query sees the candidates at or before its own position.
"""

from __future__ import annotations

import torch

from .checks import Geometry
from .slots import get_storage


def _outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, R, D]`` (already scaled) over ``k``/``v`` ``[B, H, N, D]`` where
    ``visible`` ``[B, H, R, N]``: the output ``[B, H, R, Dv]`` and ``sum p |v|`` ``[B, H, R]``."""
    logits = (q @ k.transpose(-1, -2)).masked_fill(~visible, float("-inf"))
    p = logits.softmax(dim=-1).nan_to_num(0.0)
    return p @ v, p @ v.norm(dim=-1, keepdim=True)


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, N(, D)]`` at ``index`` ``[B, H, K]`` along dim 2."""
    return x.gather(2, index if x.dim() == 3 else index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))


def measure(storage: str, kept: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            positions: torch.Tensor, seen: int, g: Geometry) -> tuple[float, float]:  # fmt: skip
    """The case of keeping candidates ``kept`` (``[B, Hkv, K]`` into dim 2) in ``storage``, scored
    by ``queries`` ``[B, Hkv, group, W, D]`` (times the pass's scale; the last ``W`` of ``seen``
    tokens) over candidates ``keys``/``values`` ``[B, Hkv, N, D]`` at ``positions`` ``[B, Hkv, N]``
    laid out in geometry ``g``: ``(dropped, coding)`` (the module docstring)."""
    b, h, group, w, d = queries.shape
    q = queries.reshape(b, h, group * w, d).float()
    k, v = keys.float(), values.float()
    row_position = torch.arange(seen - w, seen, device=q.device).repeat(group)  # [R]: group-major rows
    visible = positions.unsqueeze(2) <= row_position.view(1, 1, -1, 1)  # [B, H, R, N]
    o, size = _outputs(q, k, v, visible)
    size = size.squeeze(-1).clamp_min(torch.finfo(torch.float32).tiny)
    k_kept, v_kept, seen_kept = _gather(k, kept), _gather(v, kept), _gather(visible.transpose(2, 3), kept).transpose(2, 3)
    o_keep, _ = _outputs(q, k_kept, v_kept, seen_kept)
    dropped = float(((o_keep - o).norm(dim=-1) / size).mean())
    if storage == "full":
        return dropped, 0.0
    codec = get_storage(storage)
    k_code, v_code = codec.decode(codec.encode(k_kept.to(keys.dtype), v_kept.to(values.dtype)), kept.shape[2], g)
    o_code, _ = _outputs(q, k_code.float(), v_code.float(), seen_kept)
    total = float(((o_code - o).norm(dim=-1) / size).mean())
    return dropped, total - dropped
