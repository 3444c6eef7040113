"""The one-pass float decode library (``attention/native.py``) against torch's SDPA.

Tolerances: float32 sums of up to a few thousand products in another order than SDPA's, so
outputs agree to about 1e-6 absolute (values are N(0, 1)); bfloat16 keys and values are widened
exactly and summed in float32, so the reference is SDPA in float32 over the same bfloat16 numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import attend, native
from kvcache.attention.native_build import DISABLE_ENV

pytestmark = pytest.mark.skipif(not native.available(), reason="the float decode library did not build here (no C++ compiler)")


def _case(batch, kv_heads, group, dim, length, dtype, room=37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, length + room, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, length + room, dim, generator=gen).to(dtype)
    query = torch.randn(batch, kv_heads * group, 1, dim, generator=gen).to(dtype)
    return query, keys[:, :, :length], values[:, :, :length]  # views of capacity buffers, as a cache holds them


def _sdpa(query, key, value, keep=None):
    mask = None if keep is None else keep[:, None, None, :]
    return F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True)


def _native(query, key, value, keep=None, softcap=None):
    batch, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = (query.float() / math.sqrt(dim)).reshape(batch, kv_heads, q_heads // kv_heads, dim)
    out = native.decode_attention(q, key, value, keep, softcap)
    assert out is not None
    return out.reshape(batch, q_heads, 1, value.shape[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,kv_heads,group,dim,length",
    [(1, 1, 1, 64, 1), (1, 3, 3, 64, 1000), (3, 2, 4, 32, 777), (2, 3, 3, 64, 5000), (1, 2, 16, 128, 2049), (2, 1, 1, 8, 600)],
)
def test_matches_sdpa(batch, kv_heads, group, dim, length, dtype):
    query, key, value = _case(batch, kv_heads, group, dim, length, dtype)
    torch.testing.assert_close(_native(query, key, value), _sdpa(query, key, value), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_mask_and_a_row_with_every_key_masked(dtype):
    query, key, value = _case(3, 3, 3, 64, 1500, dtype)
    keep = torch.rand(3, 1500, generator=torch.Generator().manual_seed(1)) > 0.4
    keep[0, :700] = False  # left padding
    keep[2] = False  # nothing to attend: zeros, as `attend` promises
    out = _native(query, key, value, keep)
    torch.testing.assert_close(out[:2], _sdpa(query[:2], key[:2], value[:2], keep[:2]), atol=2e-6, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_softcap_matches_attend_without_the_library(monkeypatch):
    query, key, value = _case(2, 3, 3, 64, 900, torch.float32)
    ours = attend(query, key, value, softcap=5.0)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert native.decode_attention(query.reshape(2, 3, 3, 64), key, value, None, None) is None
    torch.testing.assert_close(ours, attend(query, key, value, softcap=5.0), atol=2e-6, rtol=1e-5)


def test_attend_takes_the_library_for_decode_and_agrees_with_the_pytorch_path(monkeypatch):
    query, key, value = _case(2, 3, 3, 64, 3000, torch.float32)
    mask = torch.ones(2, 1, 1, 3000, dtype=torch.bool)
    mask[1, ..., :1000] = False
    calls = []
    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: calls.append(1) or real(*a))
    with_library = attend(query, key, value, mask=mask)
    assert calls, "a decode call with a padding mask should take the library"
    monkeypatch.setenv(DISABLE_ENV, "1")
    torch.testing.assert_close(with_library, attend(query, key, value, mask=mask), atol=2e-6, rtol=1e-5)


def test_shapes_beyond_it_are_declined():
    query, key, value = _case(1, 1, 1, 64, 10, torch.float32)
    q = query.reshape(1, 1, 1, 64)
    assert native.decode_attention(q.expand(1, 1, native.MAX_ROWS + 1, 64), key, value, None, None) is None
    assert native.decode_attention(q, key.half(), value.half(), None, None) is None
    assert native.decode_attention(q, key[:, :, :0], value[:, :, :0], None, None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,kv_heads,group,dim,length", [(1, 3, 3, 64, 1000), (2, 8, 4, 128, 300), (3, 2, 1, 32, 77)])
def test_attend_takes_decode_one_for_a_plain_decode_call(monkeypatch, batch, kv_heads, group, dim, length, dtype):
    query, key, value = _case(batch, kv_heads, group, dim, length, dtype)
    calls = []
    real = native.decode_one
    monkeypatch.setattr(native, "decode_one", lambda *a: calls.append(1) or real(*a))
    out = attend(query, key, value, scale=0.3)
    assert calls and out.dtype == dtype and out.shape == (batch, kv_heads * group, 1, dim)
    reference = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), scale=0.3, enable_gqa=True)
    # bfloat16: the output is rounded to bfloat16 once (relative 2**-8)
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out.float(), reference, **tolerance)


def test_decode_one_declines_what_the_general_path_must_check_or_run():
    query, key, value = _case(2, 3, 3, 64, 50, torch.float32)
    assert native.decode_one(torch.cat([query, query], dim=2), key, value, None) is None  # two query rows
    assert native.decode_one(query, key.double(), value.double(), None) is None  # dtype mismatch
    assert native.decode_one(query[:1], key, value, None) is None  # batch mismatch
    assert native.decode_one(query[:, :8], key, value, None) is None  # heads not a multiple
    assert native.decode_one(query, key[..., :32], value, None) is None  # head dims differ
    with pytest.raises(Exception, match="batch mismatch"):
        attend(query[:1], key, value)  # the general path names the problem
