"""KIVI-style asymmetric uniform quantization of key/value tensors to 8, 4 or 2 bits.

Each group of values ``x`` is stored as integer codes in ``[0, levels]`` (``levels = 2**bits - 1``)
plus an affine pair, so that ``x ~= codes * scale + minimum``:

- values are grouped per token (``group`` consecutive channels of one token, KIVI's layout for
  values), keys per channel (one pair per channel over a block of tokens: keys have outlier
  channels, so a channel's range is much narrower than a token's);
- codes are uint8; narrower codes are packed ``8 // bits`` a byte, lowest bits first: 4-bit
  element ``2i`` in the low nibble and ``2i + 1`` in the high nibble of byte ``i``, 2-bit element
  ``4i + j`` in bits ``2j .. 2j + 1`` of byte ``i``;
- ``scale`` and ``minimum`` are stored in the input's dtype (fp32, fp16 or bf16).

``minimum`` is the group's minimum itself, so it is stored exactly. ``scale`` is
``(max - min) / levels``, computed in float64 from the (small) per-group statistics and rounded
*up* to the storage dtype, so ``minimum + levels * scale`` always reaches the group's maximum and
no code is clamped: every element is within ``scale / 2`` of its code's value (round to
nearest). The stored scale is at most one storage ulp above the exact ``(max - min) / levels``:
that is all the storage rounding costs. Codes are computed, and values dequantized, in float32.
A constant group has scale 0 and round-trips exactly. :func:`error_bound` adds the float32
arithmetic and the rounding of the dequantized values to their dtype, which for bf16 is as
large as ``scale / 2`` itself.

Non-finite input raises ``ValueError``, as does input of magnitude 2**126 (~8.5e37) or more,
where float32 dequantization could overflow. fp16 results saturate at +-65504: the top code of a
group that reaches 65504 can lie up to ``scale / 2`` beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DTypeError, ShapeError

BITS = (8, 4, 2)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_U32 = 2.0**-24  # float32 unit roundoff
# Unit roundoff and smallest positive (subnormal) value of the dtypes narrower than float32.
_ROUNDING = {
    torch.float16: (2.0**-11, 2.0**-24),
    torch.bfloat16: (2.0**-8, 2.0**-133),
}
# Inputs stay below this in magnitude so that codes * scale + minimum, computed in float32, can
# neither overflow float32 nor round past bf16's largest value (range <= 2**127, top < 2**128).
_LIMIT = 2.0**126
_FP16_MAX = torch.finfo(torch.float16).max
_SAME_WIDTH_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@dataclass
class Quantized:
    """Codes plus the per-group affine parameters: ``x ~= codes * scale + minimum``.

    codes: uint8; last dim ``D * bits // 8`` (``8 // bits`` codes a byte).
    scale, minimum: the input's dtype; ``[..., T, D // group]`` per token, ``[..., 1, D]`` per channel.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    bits: int

    @property
    def nbytes(self) -> int:
        """Bytes of codes, scale and minimum together."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minimum))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes ``[..., D]`` (values < ``2**bits``) into ``[..., D * bits // 8]`` bytes.

    8 bits: the codes themselves, not a copy. Otherwise ``D`` must be a multiple of ``8 // bits``.
    """
    _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise DTypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.dim() < 1:
        raise ShapeError(f"codes need at least one dimension, got a {codes.dim()}-d tensor")
    if bits == 8:
        return codes
    _check_packable(codes.shape[-1], bits)
    if codes.numel() and bool((codes >> bits).any()):
        raise ValueError(f"{bits}-bit codes must be < {2**bits}, got a maximum of {int(codes.max())}")
    return _pack(codes, bits)


def unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack bytes ``[..., dim * bits // 8]`` from :func:`pack` into uint8 codes ``[..., dim]``."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise DTypeError(f"packed codes must be uint8, got {packed.dtype}")
    if packed.dim() < 1:
        raise ShapeError(f"packed codes need at least one dimension, got a {packed.dim()}-d tensor")
    _check_packable(dim, bits)
    expected = dim * bits // 8
    if packed.shape[-1] != expected:
        raise ShapeError(
            f"{bits}-bit codes for dim {dim} need a last dim of {expected} bytes, got {packed.shape[-1]}"
        )
    return _unpack(packed, bits)


def quantize_per_token(x: torch.Tensor, bits: int, group: int) -> Quantized:
    """Quantize ``x`` ``[..., T, D]`` in groups of ``group`` consecutive channels of each token.

    Returns codes ``[..., T, D * bits // 8]``, scale and minimum ``[..., T, D // group]``.
    """
    _check_bits(bits)
    _check_input(x)
    _check_group(x, group)
    d = x.shape[-1]
    _check_packable(d, bits)
    from . import quant_native  # (imported here: it loads the attention package)

    done = quant_native.quantize_per_token(x, bits, int(group))
    if done is not None:
        return Quantized(*done, bits)
    return _quantize_per_token_torch(x, bits, int(group))


def _quantize_per_token_torch(x: torch.Tensor, bits: int, group: int) -> Quantized:
    """:func:`quantize_per_token` in PyTorch operations (any dtype and device; the reference the
    native path is tested against, and the one that raises for values out of range)."""
    d = x.shape[-1]
    grouped = x.reshape(*x.shape[:-1], d // group, group)
    mn, mx = torch.aminmax(grouped, dim=-1, keepdim=True)
    codes, scale = _encode(grouped, mn, mx, bits)
    codes = codes.reshape(x.shape)
    return Quantized(_pack(codes, bits), scale.squeeze(-1), mn.squeeze(-1), bits)


def dequantize_per_token(q: Quantized, group: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values ``[..., T, D]`` of per-token codes, in ``dtype`` (default: the scale's dtype)."""
    _check_bits(q.bits)
    d = q.codes.shape[-1] * 8 // q.bits
    if int(group) < 1 or q.scale.shape[-1] * group != d:
        raise ShapeError(
            f"codes of head dim {d} with {q.scale.shape[-1]} groups a token do not match group size {group}"
        )
    codes = _unpack(q.codes, q.bits)
    grouped = codes.reshape(*codes.shape[:-1], d // group, group)
    out = _decode(grouped, q.scale.unsqueeze(-1), q.minimum.unsqueeze(-1), dtype or q.scale.dtype)
    return out.reshape(codes.shape)


def quantize_per_channel(x: torch.Tensor, bits: int) -> Quantized:
    """Quantize ``x`` ``[..., G, D]`` with one scale and minimum per channel over the G tokens.

    Returns codes ``[..., G, D * bits // 8]``, scale and minimum ``[..., 1, D]``.
    """
    _check_bits(bits)
    _check_input(x)
    if x.shape[-2] == 0:
        raise ShapeError(f"per-channel quantization needs a block of at least one token, got shape {tuple(x.shape)}")
    _check_packable(x.shape[-1], bits)
    mn, mx = torch.aminmax(x, dim=-2, keepdim=True)
    codes, scale = _encode(x, mn, mx, bits)
    return Quantized(_pack(codes, bits), scale, mn, bits)


def dequantize_per_channel(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values ``[..., G, D]`` of per-channel codes, in ``dtype`` (default: the scale's dtype)."""
    _check_bits(q.bits)
    codes = _unpack(q.codes, q.bits)
    if q.scale.shape[-2] != 1 or q.scale.shape[-1] != codes.shape[-1]:
        raise ShapeError(
            f"per-channel scale must be [..., 1, {codes.shape[-1]}] for these codes, got {tuple(q.scale.shape)}"
        )
    return _decode(codes, q.scale, q.minimum, dtype or q.scale.dtype)


def error_bound(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Worst-case ``|dequantize(q) - x|`` per group, float32, shaped like ``q.scale``.

    Holds for either layout, dequantized to ``dtype`` (default: the input's dtype). Per group,
    with ``s``, ``m`` the stored scale and minimum and ``L = 2**bits - 1``:

    - codes: ``x`` lies in ``[m, m + L*s]`` (scale rounded up), so the nearest code is within
      ``s/2``; computing ``(x - m) / s`` in float32 (two roundings, ``|x - m| <= L*s``) can move
      it by ``2*L*u32*s`` and ``code * s`` by ``L*u32*s`` more: ``s * (1/2 + 3.001*L*u32)``;
    - ``+ m`` in float32 rounds by at most ``u32 * Y``, ``Y = max(|m|, |m + L*s|)`` the largest
      magnitude a dequantized value can have;
    - rounding the float32 result to a narrower dtype adds ``u * Y`` (``u`` its unit roundoff:
      2**-11 fp16, 2**-8 bf16) plus half its smallest subnormal.

    The last term is why the bound needs ``m``, not only ``s``: a bf16 value near 3 is only
    known to 2**-7, about ``s/2`` of int8 on N(0, 1) data. A constant group (``s == 0``) is
    exact whenever ``dtype`` can hold its value, and its bound is then 0. For a ``dtype``
    narrower than the input's, the bound assumes the values lie within its finite range.
    """
    _check_bits(q.bits)
    dtype = _check_out_dtype(dtype or q.scale.dtype)
    levels = 2**q.bits - 1
    s = q.scale.double()
    m = q.minimum.double()
    top = m + levels * s * (1 + _U32)
    y = torch.maximum(m.abs(), top.abs())
    bound = s * (0.5 + 3.001 * levels * _U32) + _U32 * y + 2.0**-149
    return finish_bound(bound, y, s, m, dtype)


def finish_bound(bound: torch.Tensor, y: torch.Tensor, s: torch.Tensor, m: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A group's float32 error ``bound`` (float64; dequantized values of magnitude up to ``y``)
    with the rounding to ``dtype`` added, exact for a constant group (scale ``s`` 0: its value ``m``
    as ``dtype`` holds it), as float32 (an error bound of :mod:`quant` or :mod:`fp8` codes)."""
    if dtype not in (torch.float32, torch.float64):
        unit, tiniest = _ROUNDING[dtype]
        bound = bound + unit * y * (1 + _U32) + tiniest / 2
    constant = (m.to(dtype).double() - m).abs()
    bound = torch.where(s == 0, constant, bound)
    # Some slack so that rounding the float64 bound to float32 cannot pull it below the error.
    return (bound * (1 + 2.0**-20)).float()


def _encode(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` (uint8, x's shape) and the stored scale for groups with min/max ``mn``/``mx``.

    ``mn``/``mx`` broadcast against ``x``. The statistics are small, so the scale is computed in
    float64 (exact enough to round up reliably, subnormals included) and then rounded up to x's
    dtype; the codes are computed in float32.
    """
    _check_range(mn, mx)
    levels = 2**bits - 1
    # The 2**-40 margin covers float64's own rounding of max - min and of the division, so that
    # levels * scale >= max - min holds exactly after the upward rounding below.
    exact = (mx.double() - mn.double()) / levels * (1 + 2.0**-40)
    scale = _round_up(exact, x.dtype)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = (x.float() - mn.float()).div_(divisor).round_().clamp_(0, levels)
    return codes.to(torch.uint8), scale


def _check_range(mn: torch.Tensor, mx: torch.Tensor) -> None:
    """Every group's min and max are finite and below ``_LIMIT`` in magnitude (one sync)."""
    if torch.compiler.is_compiling():
        return  # a compiled graph cannot branch on data (the compiled quantized layer, layers/fixed_quantized.py)
    largest = torch.maximum(mn.abs(), mx.abs())
    if bool((largest < _LIMIT).all()):  # False for nan too
        return
    # aminmax propagates nan, and an infinity is a group's max or min: the statistics show them.
    if not bool(torch.isfinite(largest).all()):
        raise ValueError("cannot quantize non-finite values (inf or nan) in the input")
    raise ValueError(
        f"cannot quantize values of magnitude 2**126 (~8.5e37) or more, got {float(largest.max()):.4g}: "
        f"dequantizing them in float32 could overflow"
    )


def _decode(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale + minimum`` in float32 (they broadcast), returned in ``dtype``."""
    _check_out_dtype(dtype)
    out = codes.float().mul_(scale.float()).add_(minimum.float())
    if dtype == torch.float16:
        # The rounded-up scale can put the top code up to scale / 2 past a group's max, and so
        # past 65504 for groups that reach it: saturate instead of overflowing to inf. This only
        # moves values towards the input's range, so it never adds error.
        out.clamp_(-_FP16_MAX, _FP16_MAX)
    return out.to(dtype)


def _round_up(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The smallest ``dtype`` number >= each of the non-negative float64 ``value``."""
    rounded = value.to(dtype)
    # For non-negative finite floats the next representable number up is the next bit pattern.
    ints = _SAME_WIDTH_INT[dtype]
    up = (rounded.view(ints) + 1).view(dtype)
    return torch.where(rounded.double() < value, up, rounded)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` codes < ``2**bits`` -> ``[..., D * bits // 8]`` bytes, lowest bits first."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    out = codes[..., 0::per_byte].clone()
    for j in range(1, per_byte):
        out |= codes[..., j::per_byte] << (bits * j)
    return out


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., n * 8 // bits]`` codes, the inverse of :func:`_pack`."""
    if bits == 8:
        return packed
    mask = 2**bits - 1
    parts = [(packed >> (bits * j)) & mask for j in range(8 // bits)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 8 // bits)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def _check_packable(d: int, bits: int) -> None:
    per_byte = 8 // bits
    if d % per_byte:
        raise ShapeError(f"{bits}-bit codes pack {per_byte} a byte, so the head dim must be a multiple of {per_byte}, got {d}")


def _check_group(x: torch.Tensor, group: int) -> None:
    """``group`` is a positive number of channels that divides ``x``'s last dim."""
    if int(group) < 1:
        raise ValueError(f"group must be a positive number of channels, got {group}")
    if x.shape[-1] % group:
        raise ShapeError(f"head dim {x.shape[-1]} is not a multiple of the group size {group}")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"can quantize {_names(FLOAT_DTYPES)} tensors, got {x.dtype}")
    if x.dim() < 2:
        raise ShapeError(f"expected a [..., T, D] tensor of at least 2 dims, got shape {tuple(x.shape)}")


def _check_out_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in FLOAT_DTYPES + (torch.float64,):
        raise DTypeError(f"can dequantize to {_names(FLOAT_DTYPES + (torch.float64,))}, got {dtype}")
    return dtype


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)
