"""Decode attention straight from int8/int4/int2 codes (``attention/fused.py``, the coded decode
library) against ``torch.nn.functional.scaled_dot_product_attention`` over the dequantized content:
the codes dequantized by ``quant.py``'s reference functions (``QuantizedLayer.view``) plus the
full-precision residual. Every case runs twice: with the library, and with it turned off
(``KVCACHE_NO_EXTENSION=1``, the pure PyTorch path that dequantizes a block at a time).

Tolerance: ``helpers.CODED_TOL`` (``rtol = atol = 1e-3``). The library folds scale and minimum into
the query (``(q * s) . c + q . z``) and the weights, so it rounds differently from
dequantize-then-multiply, and on x86 it multiplies 16-bit integers: each key block's ``q * s`` and each
span's ``weights * scale`` rounded against their largest (``test_coded_dots.py``), a score moved by
~1e-5 typically. Any wrong code, scale, group or slot moves an output by about a quantization step
(>= 1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import attend_weighted, fused
from kvcache.attention.fused import library
from kvcache.attention.native_build import DISABLE_ENV
from kvcache.layers.quantized import QuantizedLayer, StoreReader

from helpers import CODED_TOL


@pytest.fixture(params=["library", "pytorch"])
def path(request, monkeypatch):
    """Run a case with the coded decode library (skipped where it cannot build) or without it."""
    if request.param == "pytorch":
        monkeypatch.setenv(DISABLE_ENV, "1")
    else:
        monkeypatch.delenv(DISABLE_ENV, raising=False)
        if library() is None:
            pytest.skip("the coded decode library cannot build here (no C++ compiler?)")
    return request.param


def filled_layer(bits, batch, kv_heads, tokens, dim, *, group_size=32, residual=8, dtype=torch.float32, seed=0):
    """A quantized layer that has seen ``tokens`` tokens: a prefill, then one decode step."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, tokens, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, tokens, dim, generator=gen).to(dtype)
    layer = QuantizedLayer(bits=bits, group_size=group_size, residual=residual, block=64)
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    layer.settle()
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    return layer


def padding_mask(batch: int, tokens: int) -> torch.Tensor:
    """Boolean ``[B, 1, 1, T]``: row b has its first ``17 * b`` slots padded (a left-padded batch)."""
    mask = torch.ones(batch, 1, 1, tokens, dtype=torch.bool)
    for b in range(batch):
        mask[b, ..., : 17 * b] = False
    return mask


def reference(query, layer, mask=None):
    keys, values = layer.view()  # quant.py's dequantization, plus the residual
    return F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True)


def uses_library(layer, query) -> bool:
    reader = StoreReader(layer)
    rows = query.reshape(query.shape[0], layer.geometry.heads, -1, query.shape[-1])
    return reader.decode_scores(rows) is not None


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dim", [64, 48])  # 64: the library's vector path; 48: its plain loops
def test_decode_matches_sdpa_over_dequantized(path, bits, batch, group, dim):
    kv_heads, tokens = 2, 203  # 203: neither a multiple of the group size (32 or 16) nor of the block (64)
    layer = filled_layer(bits, batch, kv_heads, tokens, dim, group_size=32 if dim == 64 else 16)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=torch.Generator().manual_seed(1))
    mask = padding_mask(batch, tokens)
    expected = reference(query, layer, mask)
    assert uses_library(layer, query) == (path == "library")
    out = layer.attend(query, mask=mask)
    torch.testing.assert_close(out, expected, **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_value_groups_narrower_than_a_vector(path, bits):
    """group_size 8: several value groups a token, 4 bytes each at 2 bits (the plain loops)."""
    layer = filled_layer(bits, 2, 3, 150, 64, group_size=8)
    query = torch.randn(2, 9, 1, 64, generator=torch.Generator().manual_seed(2))
    out, _ = attend_weighted(query, StoreReader(layer), None)
    torch.testing.assert_close(out, reference(query, layer), **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4])
def test_two_query_chunk_is_causal(path, bits):
    """Two tokens appended at once (rows = group * 2 = 6: a chunk of 4 rows and one of 2): each sees the past and itself."""
    batch, kv_heads, dim, tokens = 2, 2, 64, 180
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(batch, kv_heads, tokens, dim, generator=gen), torch.randn(batch, kv_heads, tokens, dim, generator=gen)
    layer = QuantizedLayer(bits=bits, group_size=32, residual=8, block=64)
    layer.update(keys[:, :, :-2], values[:, :, :-2])
    layer.settle()
    layer.update(keys[:, :, -2:], values[:, :, -2:])
    query = torch.randn(batch, kv_heads * 3, 2, dim, generator=gen)
    causal = torch.ones(2, tokens, dtype=torch.bool)
    causal[0, -1] = False
    torch.testing.assert_close(layer.attend(query), reference(query, layer, causal), **CODED_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries(path, dtype):
    """The library works in float32 and rounds its result to the query's dtype; the reference
    dequantizes to that dtype (quant.py) and attends in float32. Both round the output (2**-9
    relative for bf16) and the kernel rounds the weights to the dtype before the value product:
    2e-2 absolute on outputs of size ~1 covers those roundings, and not a wrong code or scale."""
    layer = filled_layer(4, 2, 2, 130, 64, dtype=dtype)
    query = torch.randn(2, 6, 1, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    out = layer.attend(query)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(query, layer), rtol=0, atol=2e-2)


def test_softcap_sinks_and_weights_agree_with_the_pytorch_path(monkeypatch):
    """Softcap, sinks and the reported weights go through the kernel's own steps between the two
    products: with the library they match the pure PyTorch path."""
    if library() is None:
        pytest.skip("the coded decode library cannot build here")
    layer = filled_layer(8, 3, 2, 170, 64)
    gen = torch.Generator().manual_seed(5)
    query = torch.randn(3, 6, 1, 64, generator=gen)
    sinks = torch.randn(6, generator=gen)
    options = {"softcap": 5.0, "sinks": sinks, "weights": "sum"}
    out, weights = attend_weighted(query, StoreReader(layer), None, **options)
    monkeypatch.setenv(DISABLE_ENV, "1")
    out_ref, weights_ref = attend_weighted(query, StoreReader(layer), None, **options)
    torch.testing.assert_close(out, out_ref, **CODED_TOL)
    torch.testing.assert_close(weights, weights_ref, **CODED_TOL)


def test_shapes_beyond_the_library_fall_back():
    """More than MAX_ROWS rows or a head dim over MAX_DIM: None, so the caller dequantizes instead."""
    codes = torch.zeros(1, 1, 2, 4, 8, dtype=torch.uint8)
    scale = minimum = torch.ones(1, 1, 2, 8)
    assert fused.key_scores(torch.ones(1, 1, fused.MAX_ROWS + 1, 8), codes, scale, minimum, 8, 2) is None
    weights = torch.ones(1, 1, 1, 3)
    wide = torch.zeros(1, 1, 3, fused.MAX_DIM + 8, dtype=torch.uint8)
    assert fused.weighted_values(weights, wide, torch.ones(1, 1, 3, 1), torch.ones(1, 1, 3, 1), 8, fused.MAX_DIM + 8) is None
