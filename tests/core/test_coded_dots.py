"""The coded decode library's two products against float64 over the dequantized codes, within the
bounds its integer arithmetic allows (``csrc/coded_decode.cpp``: ``key_scores_words``,
``weighted_words``; the float loops elsewhere are tighter still).

On x86 the library centres each code (``c - 2^(bits-1)``, the difference folded into the minimum)
and multiplies 16-bit integers:

- key scores: per key block and query row, ``q * scale`` is rounded against its largest magnitude
  ``m``, an error of at most ``m / 65534`` a channel, so a score moves by at most
  ``m / 65534 * D * 2^(bits-1)``; keys coded per token (an evicting layer's slots) round the query
  once, against its largest ``|q_d|``, and a score moves by at most that times the token's scale;
- weighted values: per span of tokens and row, ``weight * scale`` is rounded against its largest
  ``w``, so a channel's sum moves by at most ``w / 65534 * T * 2^(bits-1)``.

Both bounds are some 30x the typical error (random roundings add as a square root), and a rounding
to 8 bits instead of 16 would break them by far. The float32 the rest is computed in adds its own
rounding (``FLOAT_SLACK`` of the sum of the terms' magnitudes).
"""

from __future__ import annotations

import pytest
import torch

from kvcache.attention import fused
from kvcache.formats import Codes
from kvcache.layers.quantized import QuantizedLayer

FLOAT_SLACK = 1e-6
G = 64


@pytest.fixture(autouse=True)
def needs_library():
    if fused.library() is None:
        pytest.skip("the coded decode library cannot build here (no C++ compiler?)")


def filled(bits: int, dim: int, tokens: int, seed: int = 0) -> QuantizedLayer:
    """A quantized layer of 2 x 2 heads whose first ``tokens`` (whole blocks) are coded; keys spread
    and offset per channel, as real keys are."""
    gen = torch.Generator().manual_seed(seed)
    spread, offset = torch.rand(dim, generator=gen) * 2.5 + 0.5, torch.randn(dim, generator=gen)
    keys = torch.randn(2, 2, tokens + 40, dim, generator=gen) * spread + offset
    values = torch.randn(2, 2, tokens + 40, dim, generator=gen)
    layer = QuantizedLayer(bits=bits, group_size=G, residual=32)
    layer.update(keys, values)
    layer.settle()
    assert layer.codes.quantized_keys >= tokens and layer.codes.quantized_values >= tokens
    return layer


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [64, 128])
def test_key_scores_within_the_integer_rounding_bound(bits, dim):
    layer, blocks = filled(bits, dim, 5 * G), 5
    k = layer.codes.keys.tensors
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 2, 3, dim, generator=gen) * 3
    got = fused.key_scores(query, k["kcodes"], k["kscale"], k["kmin"], bits, blocks)
    keys = layer.codes.keys_block(layer.geometry, 0, blocks * G).double()  # [B, H, T, D]
    q = query.double()
    want = q @ keys.transpose(-1, -2)
    scale = k["kscale"][:, :, :blocks].double()  # [B, H, n, D]
    largest = (q.unsqueeze(2).abs() * scale.unsqueeze(3)).amax(-1)  # [B, H, n, R]: max_d |q_d s_d|
    bound = largest / 65534 * dim * 2 ** (bits - 1)
    bound = bound.repeat_interleave(G, dim=2).transpose(-1, -2)  # [B, H, R, T]
    bound = bound + FLOAT_SLACK * (q.abs() @ keys.abs().transpose(-1, -2))
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"largest error over its bound: {(error / bound).max():.2f}"


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [64, 128])  # one value group a token (the integer loop), and two
@pytest.mark.parametrize("tokens", [5 * G, 9 * G])  # one span of 256 and more
def test_weighted_values_within_the_integer_rounding_bound(bits, dim, tokens):
    layer = filled(bits, dim, tokens)
    v = layer.codes.values.tensors
    gen = torch.Generator().manual_seed(2)
    weights = torch.softmax(torch.randn(2, 2, 3, tokens, generator=gen) * 4, -1)  # peaked, as attention is
    weights[..., 7] = 0.0  # a masked key
    got = fused.weighted_values(weights, v["vcodes"], v["vscale"], v["vmin"], bits, layer.value_group)
    values = layer.view()[1][:, :, :tokens].double()
    w = weights.double()
    want = w @ values
    scale = v["vscale"][:, :, :tokens].double().amax(-1)  # a token's largest scale ([B, H, T])
    largest = (w * scale.unsqueeze(2)).abs().amax(-1, keepdim=True)  # [B, H, R, 1]
    bound = largest / 65534 * tokens * 2 ** (bits - 1) + FLOAT_SLACK * (w @ values.abs())
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"largest error over its bound: {(error / bound).max():.2f}"


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dim", [64, 128])
def test_per_token_key_scores_within_the_integer_rounding_bound(bits, dim):
    gen = torch.Generator().manual_seed(3)
    spread, offset = torch.rand(dim, generator=gen) * 2.5 + 0.5, torch.randn(dim, generator=gen)
    tokens = 333  # not a multiple of 16 tokens
    codes = Codes(bits, dim)  # one group a token: the integer loop
    parts = codes.encode_keys(torch.randn(2, 2, tokens, dim, generator=gen) * spread + offset)
    query = torch.randn(2, 2, 3, dim, generator=gen) * 3
    got = fused.token_key_scores(query, parts["kcodes"], parts["kscale"], parts["kmin"], bits, dim, tokens)
    keys = codes.decode_keys(parts, torch.float64)
    q = query.double()
    want = q @ keys.transpose(-1, -2)
    largest = q.abs().amax(-1, keepdim=True)  # [B, H, R, 1]
    scale = parts["kscale"][..., 0].double().unsqueeze(2)  # [B, H, 1, T]
    bound = largest * scale / 65534 * dim * 2 ** (bits - 1) + FLOAT_SLACK * (q.abs() @ keys.abs().transpose(-1, -2))
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"largest error over its bound: {(error / bound).max():.2f}"
