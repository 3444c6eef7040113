"""fp8 codes: each value an e4m3 float (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits,
largest 448) of its distance from its group's midpoint, in units of the group's scale.

The same layouts as the integer codes of ``quant.py`` (uint8 codes, one ``scale`` and one
``minimum`` a group, per token or per channel over a block), so that every holder and kernel of
codes takes them; only what a code's byte means differs:

    x ~= e4m3(code) * scale + minimum,   minimum = the group's midpoint (max + min) / 2,
                                          scale = the largest |x - minimum| / 448

(vLLM's fp8 cache is ``e4m3(code) * scale`` with one scale a tensor; a scale and midpoint a group
is that per group, centred, so a channel with an offset keeps its relative precision). The
midpoint is stored in the input's dtype first and the scale computed from the stored midpoint,
in float64, rounded *up* to that dtype, so ``|x - minimum| / scale <= 448`` and no value saturates.
A code then rounds ``(x - minimum) / scale`` to the nearest e4m3 number: a relative error of at
most 2^-4, and at most 2^-10 of the scale among e4m3's subnormals (below 2^-6).
:func:`error_bound` adds the float32 arithmetic and the rounding of the result to its dtype.
"""

from __future__ import annotations

import torch

from ..errors import ShapeError
from .quant import _FP16_MAX, _U32, Quantized, _check_group, _check_input, _check_out_dtype, _check_range, _round_up, finish_bound

#: e4m3's largest finite value.
E4M3_MAX = 448.0
_E4M3 = torch.float8_e4m3fn


def quantize_per_token(x: torch.Tensor, group: int) -> Quantized:
    """``x`` ``[..., T, D]`` as e4m3 codes in groups of ``group`` consecutive channels of each
    token: codes ``[..., T, D]`` uint8, scale and minimum (midpoint) ``[..., T, D // group]``."""
    _check_input(x)
    _check_group(x, group)
    d = x.shape[-1]
    grouped = x.reshape(*x.shape[:-1], d // group, group)
    mn, mx = torch.aminmax(grouped, dim=-1, keepdim=True)
    codes, scale, mid = _encode(grouped, mn, mx)
    return Quantized(codes.reshape(x.shape), scale.squeeze(-1), mid.squeeze(-1), 8)


def dequantize_per_token(q: Quantized, group: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values ``[..., T, D]`` of per-token e4m3 codes, in ``dtype`` (default: the scale's dtype)."""
    d = q.codes.shape[-1]
    if int(group) < 1 or q.scale.shape[-1] * group != d:
        raise ShapeError(f"codes of head dim {d} with {q.scale.shape[-1]} groups a token do not match group size {group}")
    grouped = q.codes.reshape(*q.codes.shape[:-1], d // group, group)
    out = _decode(grouped, q.scale.unsqueeze(-1), q.minimum.unsqueeze(-1), dtype or q.scale.dtype)
    return out.reshape(q.codes.shape)


def quantize_per_channel(x: torch.Tensor) -> Quantized:
    """``x`` ``[..., G, D]`` as e4m3 codes with one scale and midpoint per channel over the G
    tokens: codes ``[..., G, D]``, scale and minimum ``[..., 1, D]``."""
    _check_input(x)
    if x.shape[-2] == 0:
        raise ShapeError(f"per-channel quantization needs a block of at least one token, got shape {tuple(x.shape)}")
    mn, mx = torch.aminmax(x, dim=-2, keepdim=True)
    codes, scale, mid = _encode(x, mn, mx)
    return Quantized(codes, scale, mid, 8)


def dequantize_per_channel(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values ``[..., G, D]`` of per-channel e4m3 codes, in ``dtype`` (default: the scale's dtype)."""
    if q.scale.shape[-2] != 1 or q.scale.shape[-1] != q.codes.shape[-1]:
        raise ShapeError(f"per-channel scale must be [..., 1, {q.codes.shape[-1]}] for these codes, got {tuple(q.scale.shape)}")
    return _decode(q.codes, q.scale, q.minimum, dtype or q.scale.dtype)


def values(codes: torch.Tensor) -> torch.Tensor:
    """What uint8 e4m3 codes stand for, float32 (before scale and midpoint)."""
    return codes.view(_E4M3).float()


def error_bound(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Worst-case ``|dequantize(q) - x|`` per group, float32, shaped like ``q.scale``: with ``s``
    and ``m`` the stored scale and midpoint, ``|x - m| <= 448 s``, so

    - the code: at most ``16 s``, half of e4m3's spacing of 32 in its top binade ``[256, 448]``
      (below it the spacing halves with each binade, down to ``2^-9`` among subnormals);
      computing ``(x - m) / s`` in float32 moves it by ``2 * 448 * u32 * s`` before rounding, and
      ``code * s + m`` rounds by ``u32 * (448 s + Y)`` after, ``Y = |m| + 448 s``;
    - rounding to a narrower dtype adds ``u * Y`` plus half its smallest subnormal.
    A constant group (``s == 0``) is exact whenever ``dtype`` can hold its value."""
    dtype = _check_out_dtype(dtype or q.scale.dtype)
    s, m = q.scale.double(), q.minimum.double()
    y = m.abs() + E4M3_MAX * s * (1 + _U32)
    bound = s * (16.0 + 3.001 * E4M3_MAX * _U32) + _U32 * y + 2.0**-149
    return finish_bound(bound, y, s, m, dtype)


def _encode(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` (uint8, x's shape), the stored scale and the stored midpoint of groups with
    min/max ``mn``/``mx`` (broadcasting against ``x``)."""
    _check_range(mn, mx)
    mid = ((mn.double() + mx.double()) / 2).to(x.dtype)
    half = torch.maximum(mx.double() - mid.double(), mid.double() - mn.double())
    scale = _round_up(half / E4M3_MAX * (1 + 2.0**-40), x.dtype)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    scaled = (x.float() - mid.float()).div_(divisor).clamp_(-E4M3_MAX, E4M3_MAX)
    return scaled.to(_E4M3).view(torch.uint8), scale, mid


def _decode(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``e4m3(codes) * scale + minimum`` in float32 (they broadcast), returned in ``dtype``."""
    _check_out_dtype(dtype)
    out = values(codes).mul_(scale.float()).add_(minimum.float())
    if dtype == torch.float16:  # the rounded-up scale can reach past 65504, as for integer codes
        out.clamp_(-_FP16_MAX, _FP16_MAX)
    return out.to(dtype)
