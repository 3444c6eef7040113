"""KIVI-style 8/4-bit quantization: packing, round-trip error bounds, exact constants, errors.

Measured magnitudes (seed 0, N(0, 1) data [1, 8, 1024, 128], see test_error_magnitudes):
int8 max abs error < 0.02 (mean ~0.0045 per token, ~0.0064 per channel), int4 < 0.3 (mean
~0.076 / ~0.11), in every dtype but bf16 per channel int8 (< 0.035: bf16 rounding of the output).
"""

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.errors import DTypeError, ShapeError
from kvcache.formats.quant import (
    BITS,
    Quantized,
    dequantize_per_channel,
    dequantize_per_token,
    error_bound,
    pack,
    quantize_per_channel,
    quantize_per_token,
    unpack,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("token", "channel")
GROUP = 16
UNIT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def randn(shape, seed=0, dtype=torch.float32, scale=1.0, loc=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + loc).to(dtype)


def with_outliers(shape, seed=0, dtype=torch.float32):
    """N(0, 1) with a few channels 30x wider or shifted by 20, as keys have."""
    x = randn(shape, seed, torch.float64)
    x[..., 3] *= 30
    x[..., -2] += 20
    return x.to(dtype)


def round_trip(x, bits, layout, group=GROUP, dtype=None):
    """(dequantized, Quantized, elementwise bound, elementwise stored scale) for one layout."""
    if layout == "token":
        q = quantize_per_token(x, bits, group)
        y = dequantize_per_token(q, group, dtype)
        spread = lambda t: t.unsqueeze(-1).expand(*t.shape, group).reshape(x.shape)  # noqa: E731
    else:
        q = quantize_per_channel(x, bits)
        y = dequantize_per_channel(q, dtype)
        spread = lambda t: t.expand(x.shape)  # noqa: E731
    return y, q, spread(error_bound(q, dtype).double()), spread(q.scale.double())


def abs_error(y, x):
    return (y.double() - x.double()).abs()


# --- packing ------------------------------------------------------------------------------------


def reference_pack(row, bits):
    """Byte i holds codes i * k .. i * k + k - 1 (k = 8 // bits), the first in the lowest bits."""
    k = 8 // bits
    return [sum(row[i + j] << (bits * j) for j in range(k)) for i in range(0, len(row), k)]


@settings(max_examples=60, deadline=None)
@given(
    lead=st.lists(st.integers(0, 3), max_size=3),
    quarter=st.integers(0, 5),
    bits=st.sampled_from(BITS),
    seed=st.integers(0, 2**16),
)
def test_pack_unpack_round_trip(lead, quarter, bits, seed):
    d = 4 * quarter
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, d), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, d * bits // 8)
    assert torch.equal(unpack(packed, bits, d), codes)
    if bits < 8:
        n = math.prod(lead)
        rows, packed_rows = codes.reshape(n, d).tolist(), packed.reshape(n, d * bits // 8).tolist()
        assert packed_rows == [reference_pack(r, bits) for r in rows]


def test_pack4_nibble_order():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack(codes, 4).tolist() == [[0x21, 0x0F]]
    assert unpack(torch.tensor([0xA5], dtype=torch.uint8), 4, 2).tolist() == [5, 10]


def test_pack2_bit_order():
    codes = torch.tensor([[1, 2, 3, 0, 3, 3, 3, 3]], dtype=torch.uint8)
    assert pack(codes, 2).tolist() == [[0b00111001, 0xFF]]
    assert unpack(torch.tensor([0b01101100], dtype=torch.uint8), 2, 4).tolist() == [0, 3, 2, 1]


def test_pack_checks():
    with pytest.raises(ShapeError, match="multiple of 2, got 5"):
        pack(torch.zeros(2, 5, dtype=torch.uint8), 4)
    with pytest.raises(ShapeError, match="2-bit codes pack 4 a byte.*multiple of 4, got 6"):
        pack(torch.zeros(2, 6, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="< 4, got a maximum of 4"):
        pack(torch.tensor([4, 0, 0, 0], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="< 16, got a maximum of 16"):
        pack(torch.tensor([16, 0], dtype=torch.uint8), 4)
    with pytest.raises(DTypeError, match="uint8.*int64"):
        pack(torch.zeros(4, dtype=torch.int64), 8)
    with pytest.raises(ShapeError, match="need a last dim of 3 bytes, got 4"):
        unpack(torch.zeros(4, dtype=torch.uint8), 4, 6)
    with pytest.raises(ValueError, match=r"one of \(8, 4, 2\), got 3"):
        unpack(torch.zeros(4, dtype=torch.uint8), 3, 16)


# --- against a straightforward reference --------------------------------------------------------


def reference_groups(x, layout, group):
    """Every group of x as a list of float64 values, token groups or channel groups, in the order
    of the flattened scale/minimum."""
    x = x.double()
    if layout == "token":
        return x.reshape(-1, group).tolist()
    flat = x.reshape(-1, *x.shape[-2:])
    return [flat[b, :, c].tolist() for b in range(flat.shape[0]) for c in range(flat.shape[2])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference(dtype, bits, layout):
    """min is stored exactly; scale is (max - min) / levels rounded up to dtype (covers the group,
    at most one ulp above); codes are round((x - min) / scale); dequantized = codes * scale + min."""
    x = with_outliers((2, 3, 8, 32), seed=1, dtype=dtype)
    levels = 2**bits - 1
    y, q, _, _ = round_trip(x, bits, layout, dtype=torch.float64)
    codes = unpack(q.codes, bits, x.shape[-1])
    groups = reference_groups(x, layout, GROUP)
    code_groups = reference_groups(codes, layout, GROUP)
    out_groups = reference_groups(y, layout, GROUP)
    scales, minima = q.scale.double().flatten().tolist(), q.minimum.double().flatten().tolist()
    assert len(groups) == len(scales)
    for values, cs, outs, s, m in zip(groups, code_groups, out_groups, scales, minima):
        lo, hi = min(values), max(values)
        assert m == lo
        exact = (Fraction(hi) - Fraction(lo)) / levels
        assert Fraction(s) >= exact  # so lo + levels * s >= hi: no code is clamped
        assert s <= float(exact) * (1 + 2 * UNIT[dtype]) + 1e-30
        for v, c, out in zip(values, cs, outs):
            ideal = (v - m) / s
            if abs(ideal - int(ideal) - 0.5) > 1e-3:  # away from ties, float32 must agree
                assert c == round(ideal), (v, m, s)
            assert abs(c - ideal) <= 0.5 + 1e-3
            assert out == pytest.approx(c * s + m, abs=1e-6 * (abs(m) + levels * s))


# --- error bounds -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("data", ("normal", "outliers"))
def test_error_within_bound(dtype, bits, layout, data):
    make = randn if data == "normal" else with_outliers
    x = make((2, 4, 64, 64), seed=2, dtype=dtype)
    y, q, bound, scale = round_trip(x, bits, layout)
    assert y.dtype == dtype and y.shape == x.shape
    err = abs_error(y, x)
    assert (err <= bound).all(), (err - bound).max()
    # The bound is tight: the worst element comes close to it.
    assert (err / bound).max() > 0.85
    # It is scale / 2 plus arithmetic: for float32 nothing else is visible.
    if dtype == torch.float32:
        assert (bound <= scale * 0.501).all()


@pytest.mark.half_precision
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_output_rounding_is_in_the_bound(bits, layout):
    """scale / 2 alone is not a bound for bf16: rounding the result to bf16 adds up to half a
    bf16 ulp of the value, for int8 about as much again. Dequantized to float32 it is scale / 2."""
    x = randn((2, 4, 64, 64), seed=3, dtype=torch.bfloat16)
    y, _, bound, scale = round_trip(x, bits, layout)
    err = abs_error(y, x)
    assert (err <= bound).all()
    if bits == 8:
        assert (err / scale).max() > 0.6
    y32, _, bound32, scale = round_trip(x, bits, layout, dtype=torch.float32)
    assert y32.dtype == torch.float32
    assert (abs_error(y32, x) <= bound32).all()
    assert (bound32 <= scale * 0.501).all()


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from(BITS),
    layout=st.sampled_from(LAYOUTS),
    tokens=st.integers(1, 9),
    log_std=st.floats(-7, 3),
    loc=st.sampled_from([0.0, 1.0, -3.0, 100.0, -1e4]),
    seed=st.integers(0, 2**16),
)
def test_error_within_bound_any_scale(dtype, bits, layout, tokens, log_std, loc, seed):
    """Narrow groups far from zero (std down to 1e-7 at 1e4), where the float32 arithmetic and
    the storage dtype, not scale / 2, dominate the error."""
    if dtype == torch.float16:
        loc = max(min(loc, 6e4), -6e4)
    x = randn((2, tokens, 32), seed, dtype, scale=10.0**log_std, loc=loc)
    y, _, bound, _ = round_trip(x, bits, layout)
    assert (abs_error(y, x) <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_ranges(dtype):
    """The largest values allowed (fp16: its largest finite value, whose top code lies past it)
    and subnormals; float32 and bf16 refuse magnitudes of 2**126 and more."""
    info = torch.finfo(dtype)
    big = info.max if dtype == torch.float16 else 2.0**126 * (1 - info.eps)
    tiny = info.smallest_normal * info.eps  # the smallest subnormal
    x = torch.tensor([[big, -big, 0.0, 1.0], [tiny, 0.0, 3 * tiny, -tiny]], dtype=dtype)
    for bits in BITS:
        for layout in LAYOUTS:
            y, q, bound, _ = round_trip(x, bits, layout, group=2)
            assert torch.isfinite(q.scale).all() and torch.isfinite(y).all()
            assert (abs_error(y, x) <= bound).all()
            if dtype == torch.float16:  # the top code is past 65504: saturated, not inf
                assert y.abs().max() == big
    if dtype != torch.float16:
        x[0, 0] = 2.0**126
        with pytest.raises(ValueError, match=r"magnitude 2\*\*126.*got 8.507e\+37"):
            quantize_per_token(x, 8, 2)


def test_error_magnitudes():
    """The numbers in the module docstring: N(0, 1), 8 heads x 1024 tokens x 128 channels."""
    limits = {8: 0.02, 4: 0.3, 2: 1.5}
    for dtype in DTYPES:
        x = randn((1, 8, 1024, 128), seed=0, dtype=dtype)
        for bits in BITS:
            err = abs_error(dequantize_per_token(quantize_per_token(x, bits, 64), 64), x)
            assert err.max() < limits[bits], (dtype, bits)
            err = abs_error(dequantize_per_channel(quantize_per_channel(x, bits)), x)
            limit = 0.035 if (dtype, bits) == (torch.bfloat16, 8) else limits[bits]
            assert err.max() < limit, (dtype, bits)
    x = randn((1, 8, 1024, 128), seed=0)
    int8 = abs_error(dequantize_per_token(quantize_per_token(x, 8, 64), 64), x).mean()
    int4 = abs_error(dequantize_per_token(quantize_per_token(x, 4, 64), 64), x).mean()
    int2 = abs_error(dequantize_per_token(quantize_per_token(x, 2, 64), 64), x).mean()
    assert 0.003 < int8 < 0.006 and 0.06 < int4 < 0.09 and 0.3 < int2 < 0.45


# --- exact cases, shapes, sizes -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_exact(dtype, bits):
    x = randn((2, 4, 64), seed=4, dtype=torch.float64)
    x[:, 1, :GROUP] = 0.0  # a constant token group next to varying ones
    x[:, 2, GROUP : 2 * GROUP] = -1234.5
    x[..., -1] = 0.1  # a constant channel
    x = x.to(dtype)
    big = torch.full((1, 3, GROUP), min(torch.finfo(dtype).max, 2.0**125), dtype=dtype)
    for values in (x, torch.zeros(2, 4, 16, dtype=dtype), big):
        q = quantize_per_token(values, bits, GROUP)
        y = dequantize_per_token(q, GROUP)
        constant = (q.scale == 0).unsqueeze(-1).expand(*q.scale.shape, GROUP).reshape(values.shape)
        assert constant.any()
        assert torch.equal(y[constant], values[constant])
        assert (error_bound(q)[q.scale == 0] == 0).all()
        q = quantize_per_channel(values, bits)
        y = dequantize_per_channel(q)
        assert torch.equal(y[..., -1], values[..., -1])
        assert not torch.isnan(y).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_shapes_dtypes_and_nbytes(dtype, bits):
    x = randn((2, 3, 10, 64), dtype=dtype)
    q = quantize_per_token(x, bits, GROUP)
    assert q.bits == bits
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 10, 64 * bits // 8)
    assert q.scale.dtype == q.minimum.dtype == dtype
    assert q.scale.shape == q.minimum.shape == (2, 3, 10, 64 // GROUP)
    width = x.element_size()
    assert q.nbytes == 2 * 3 * 10 * (64 * bits // 8 + 2 * (64 // GROUP) * width)
    assert error_bound(q).shape == q.scale.shape and error_bound(q).dtype == torch.float32

    q = quantize_per_channel(x, bits)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (2, 3, 10, 64 * bits // 8)
    assert q.scale.dtype == q.minimum.dtype == dtype
    assert q.scale.shape == q.minimum.shape == (2, 3, 1, 64)
    assert q.nbytes == 2 * 3 * (10 * 64 * bits // 8 + 2 * 64 * width)


def test_int4_codes_take_half_the_bytes():
    x = randn((1, 2, 128, 64))
    for quantize in (lambda b: quantize_per_token(x, b, 32), lambda b: quantize_per_channel(x, b)):
        q8, q4 = quantize(8), quantize(4)
        assert q4.codes.numel() * 2 == q8.codes.numel() == x.numel()
        assert q4.nbytes < q8.nbytes < x.numel() * x.element_size()


def test_uses_full_code_range():
    x = randn((1, 1, 64, 64))
    for bits in BITS:
        codes = unpack(quantize_per_token(x, bits, 64).codes, bits, 64)
        assert codes.min() == 0 and codes.max() == 2**bits - 1


def test_empty_tokens():
    x = torch.zeros(1, 2, 0, 8)
    q = quantize_per_token(x, 4, 4)
    assert q.codes.shape == (1, 2, 0, 4) and q.scale.shape == (1, 2, 0, 2)
    assert dequantize_per_token(q, 4).shape == x.shape


# --- errors -------------------------------------------------------------------------------------


def test_head_dims_that_cannot_be_packed():
    x = torch.zeros(1, 4, 7)
    with pytest.raises(ShapeError, match="multiple of 2, got 7"):
        quantize_per_channel(x, 4)
    with pytest.raises(ShapeError, match="multiple of 2, got 7"):
        quantize_per_token(x, 4, 7)
    with pytest.raises(ShapeError, match="multiple of 4, got 6"):
        quantize_per_channel(torch.zeros(1, 4, 6), 2)
    assert quantize_per_token(x, 8, 7).codes.shape == (1, 4, 7)


def test_head_dim_not_a_multiple_of_group():
    with pytest.raises(ShapeError, match="head dim 48 is not a multiple of the group size 32"):
        quantize_per_token(torch.zeros(2, 48), 8, 32)
    with pytest.raises(ValueError, match="positive.*got 0"):
        quantize_per_token(torch.zeros(2, 48), 8, 0)
    q = quantize_per_token(torch.zeros(2, 48), 8, 16)
    with pytest.raises(ShapeError, match="do not match group size 32"):
        dequantize_per_token(q, 32)


@pytest.mark.parametrize("bits", (0, 1, 3, 16, "8"))
def test_bad_bits(bits):
    x = torch.zeros(2, 8)
    for call in (lambda: quantize_per_token(x, bits, 4), lambda: quantize_per_channel(x, bits)):
        with pytest.raises(ValueError, match=r"bits must be one of \(8, 4, 2\)"):
            call()
    with pytest.raises(ValueError, match=r"bits must be one of \(8, 4, 2\)"):
        error_bound(Quantized(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(1, 8), torch.zeros(1, 8), bits))


@pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input(bad, dtype):
    x = randn((1, 2, 8, 16), dtype=dtype)
    x[0, 1, 5, 9] = bad
    with pytest.raises(ValueError, match="non-finite"):
        quantize_per_token(x, 8, 4)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_per_channel(x, 4)


def test_bad_input_types_and_ranks():
    with pytest.raises(DTypeError, match="float32, float16, bfloat16.*int64"):
        quantize_per_channel(torch.zeros(2, 4, dtype=torch.int64), 8)
    with pytest.raises(DTypeError, match="float64"):
        quantize_per_token(torch.zeros(2, 4, dtype=torch.float64), 8, 4)
    with pytest.raises(ShapeError, match=r"at least 2 dims, got shape \(8,\)"):
        quantize_per_token(torch.zeros(8), 8, 4)
    with pytest.raises(ShapeError, match="at least one token"):
        quantize_per_channel(torch.zeros(2, 0, 8), 8)
    with pytest.raises(DTypeError, match="dequantize to.*int32"):
        dequantize_per_channel(quantize_per_channel(torch.zeros(2, 8), 8), torch.int32)


# --- devices ------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_matches_cpu(dtype, bits, layout):
    x = with_outliers((2, 4, 256, 128), seed=5, dtype=dtype)
    y, q, bound, _ = round_trip(x, bits, layout)
    yc, qc, boundc, _ = round_trip(x.cuda(), bits, layout)
    assert qc.codes.is_cuda and yc.is_cuda
    assert torch.equal(qc.scale.cpu(), q.scale) and torch.equal(qc.minimum.cpu(), q.minimum)
    # Codes may differ by one at near-ties if the devices round the division differently.
    diff = (unpack(qc.codes, bits, 128).cpu().int() - unpack(q.codes, bits, 128).int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 1e-3
    assert (abs_error(yc.cpu(), x) <= boundc.cpu()).all()
