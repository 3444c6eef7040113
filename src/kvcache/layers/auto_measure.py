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
measure, not estimated. Each query sees the candidates at or before its own position. ``o`` is
computed once a decision (:func:`window`), the cases against it (:func:`measure`).
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Window:
    """What every case of one decision is measured against: the window's scaled queries ``q``
    ``[B, Hkv, R, D]`` (``R = group * W``, group-major), the candidates ``k``/``v`` ``[B, Hkv, N, D]``
    in float32 (and the dtypes they are coded from), which candidate each row sees ``visible``
    ``[B, Hkv, R, N]``, and their attention over every candidate: ``o`` ``[B, Hkv, R, Dv]`` and
    ``size = sum p |v|`` ``[B, Hkv, R]``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dtypes: tuple[torch.dtype, torch.dtype]
    visible: torch.Tensor
    o: torch.Tensor
    size: torch.Tensor


def window(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, seen: int) -> Window:
    """The reference for ``queries`` ``[B, Hkv, group, W, D]`` (times the pass's scale; the last
    ``W`` of ``seen`` tokens) over candidates ``keys``/``values`` ``[B, Hkv, N, D]`` at ``positions``
    ``[B, Hkv, N]``."""
    b, h, group, w, d = queries.shape
    q = queries.reshape(b, h, group * w, d).float()
    k, v = keys.float(), values.float()
    row_position = torch.arange(seen - w, seen, device=q.device).repeat(group)  # [R]: group-major rows
    visible = positions.unsqueeze(2) <= row_position.view(1, 1, -1, 1)  # [B, H, R, N]
    o, size = _outputs(q, k, v, visible)
    return Window(q, k, v, (keys.dtype, values.dtype), visible, o, size.squeeze(-1).clamp_min(torch.finfo(torch.float32).tiny))


def measure(storage: str, kept: torch.Tensor, ref: Window, g: Geometry) -> tuple[float, float]:
    """The case of keeping candidates ``kept`` (``[B, Hkv, K]`` into dim 2) in ``storage``, measured
    against ``ref`` (the candidates laid out in geometry ``g``): ``(dropped, coding)`` (the module
    docstring)."""
    k_kept, v_kept = _gather(ref.k, kept), _gather(ref.v, kept)
    seen_kept = _gather(ref.visible.transpose(2, 3), kept).transpose(2, 3)
    o_keep, _ = _outputs(ref.q, k_kept, v_kept, seen_kept)
    dropped = float(((o_keep - ref.o).norm(dim=-1) / ref.size).mean())
    if storage == "full":
        return dropped, 0.0
    codec = get_storage(storage)
    k_code, v_code = codec.decode(codec.encode(k_kept.to(ref.dtypes[0]), v_kept.to(ref.dtypes[1])), kept.shape[2], g)
    o_code, _ = _outputs(ref.q, k_code.float(), v_code.float(), seen_kept)
    total = float(((o_code - ref.o).norm(dim=-1) / ref.size).mean())
    return dropped, total - dropped
