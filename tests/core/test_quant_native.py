"""The native per-token quantizer (``kvcache.formats.quant_native``, ``csrc/quantize.cpp``) gives the PyTorch
path's codes, scales and minimums bit for bit, so ``quantize_per_token`` may take either: random
float32 data over many magnitudes (subnormals to 1e30), constant groups, exact ties at halves
(round half to even), every bit width and group size; and it declines what it does not take, so
the PyTorch path raises its errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.attention.native_build import DISABLE_ENV
from kvcache.formats import quant, quant_native


@pytest.fixture(autouse=True)
def needs_library(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    if quant_native.library() is None:
        pytest.skip("the quantize library cannot build here (no C++ compiler?)")


def assert_bitwise_equal(x, bits, group):
    native = quant_native.quantize_per_token(x, bits, group)
    assert native is not None
    reference = quant._quantize_per_token_torch(x, bits, group)
    for got, want in zip(native, (reference.codes, reference.scale, reference.minimum)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from((2, 4, 8)),
    group=st.sampled_from((4, 8, 16, 64)),
    tokens=st.integers(1, 9),
    exponent=st.integers(-40, 30),
    seed=st.integers(0, 2**16),
    constant=st.booleans(),
)
def test_native_codes_equal_the_pytorch_path_bit_for_bit(bits, group, tokens, exponent, seed, constant):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens, 64, generator=gen) * 10.0**exponent
    if constant:
        x[0, 0, :group] = x[0, 0, 0]
    assert_bitwise_equal(x, bits, group)


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_ties_at_halves_and_subnormals_round_as_torch_does(bits):
    halves = torch.arange(-64, 64, dtype=torch.float32).reshape(2, 64) / 2
    assert_bitwise_equal(halves, bits, 16)
    tiny = torch.full((1, 64), torch.finfo(torch.float32).tiny) * torch.linspace(0.01, 1, 64)
    assert_bitwise_equal(tiny, bits, 64)


def test_many_tokens_split_across_threads_equal_the_pytorch_path():
    x = torch.randn(3, 4096, 64, generator=torch.Generator().manual_seed(1))  # above the threading threshold
    assert_bitwise_equal(x, 4, 32)


def test_a_strided_input_is_read_as_its_values():
    x = torch.randn(4, 64, 6, generator=torch.Generator().manual_seed(2)).transpose(1, 2)  # [4, 6, 64], not contiguous
    assert_bitwise_equal(x, 8, 64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**127])
def test_values_out_of_range_are_declined_and_the_public_call_raises(bad):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    assert quant_native.quantize_per_token(x, 4, 32) is None
    with pytest.raises(ValueError, match="cannot quantize"):
        quant.quantize_per_token(x, 4, 32)


def test_what_it_does_not_take_goes_to_the_pytorch_path():
    assert quant_native.quantize_per_token(torch.randn(2, 64, dtype=torch.bfloat16), 4, 32) is None
    assert quant_native.quantize_per_token(torch.randn(2, 64, requires_grad=True), 4, 32) is None
    assert quant_native.quantize_per_token(torch.randn(0, 64), 4, 32) is None
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    q = quant.quantize_per_token(x, 4, 32)  # still quantized, by the PyTorch path
    assert q.scale.dtype == torch.bfloat16


def test_with_the_library_off_the_public_call_is_the_pytorch_path(monkeypatch):
    x = torch.randn(2, 5, 64)
    native = quant.quantize_per_token(x, 4, 16)
    monkeypatch.setenv(DISABLE_ENV, "1")
    off = quant.quantize_per_token(x, 4, 16)
    assert torch.equal(native.codes, off.codes) and torch.equal(native.scale, off.scale) and torch.equal(native.minimum, off.minimum)
