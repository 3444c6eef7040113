"""End-aligned causal attention split into the keys before the queries and their own causal square
(``attention/causal.py``), merged by log-sum-exp, against SDPA with an explicit end-aligned mask.

The reference is SDPA in float64 with ``enable_gqa``; a row that sees no key is zeros (as
``attend`` documents), compared apart from SDPA, which gives NaN there.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache.attention.kernel
from kvcache import attend
from kvcache.attention import attend_weighted
from kvcache.attention.causal import can_split, causal_attention


def rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


def end_aligned(q_len: int, kv_len: int) -> torch.Tensor:
    """Query i sees key j iff j <= kv_len - q_len + i: ``[q_len, kv_len]``."""
    return torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)


def reference(q, k, v, allowed, scale=None):
    """SDPA in float64 with the boolean mask ``allowed`` ``[B|1, Hq|1, Sq, T]``; rows that see no key: zeros."""
    allowed = allowed.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)


def per_query_head(key_mask: torch.Tensor, group: int) -> torch.Tensor:
    """A key mask ``[B|1, Hkv|1, 1, T]`` as ``[B|1, Hq|1, 1, T]``."""
    return key_mask.repeat_interleave(group, dim=1) if key_mask.shape[1] > 1 else key_mask


@pytest.fixture
def split_only(monkeypatch):
    """The kernel's SDPA rows must take the split: a block with a mask per row fails the test."""

    def masked_block(*args, **kwargs):
        raise AssertionError("the rows went through masked blocks, not the split")

    monkeypatch.setattr(kvcache.attention.kernel, "_sdpa_block", masked_block)


def close(out, ref, atol=1e-5):
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-5)


def test_runs_where_cpu_flash_attention_does():
    x, wide = torch.zeros(1, 4), torch.zeros(1, 6)
    assert can_split(x, x) and can_split(x.double(), x.double())
    assert not can_split(x.long(), x.long()) and not can_split(x, wide)  # values wider than keys: the masked blocks


@settings(max_examples=120, deadline=None)
@given(
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 3]),
    q_len=st.integers(1, 24),
    kv_len=st.integers(0, 40),
    masked=st.sampled_from(["none", "per batch and head", "shared", "a head sees no past"]),
    seed=st.integers(0, 2**16),
)
def test_split_equals_sdpa_with_an_end_aligned_mask(batch, kv_heads, group, q_len, kv_len, masked, seed):
    """Random shapes, queries more than keys included (the first rows then see nothing), grouped
    heads, batch rows, and key masks over the slots (per row and KV head, shared, or hiding a
    head's whole past)."""
    gen = torch.Generator().manual_seed(seed)
    q_heads, head_dim = kv_heads * group, 8
    q = rand(batch, q_heads, q_len, head_dim, gen=gen)
    k, v = rand(batch, kv_heads, kv_len, head_dim, gen=gen), rand(batch, kv_heads, kv_len, head_dim, gen=gen)
    key_mask = None
    if masked == "per batch and head":
        key_mask = torch.rand(batch, kv_heads, 1, kv_len, generator=gen) > 0.3
    elif masked == "shared":
        key_mask = torch.rand(1, 1, 1, kv_len, generator=gen) > 0.3
    elif masked == "a head sees no past":
        key_mask = torch.ones(batch, kv_heads, 1, kv_len, dtype=torch.bool)
        key_mask[0, 0, :, : max(0, kv_len - q_len)] = False
    key_mask = None if key_mask is None else per_query_head(key_mask, group)
    out = causal_attention(q, k, v, scale=0.3, past=kv_len - q_len, key_mask=key_mask)
    allowed = end_aligned(q_len, kv_len).view(1, 1, q_len, kv_len)
    if key_mask is not None:
        allowed = allowed & key_mask
    close(out, reference(q, k, v, allowed, scale=0.3))


@pytest.mark.parametrize("q_len, kv_len", [(1, 1), (5, 5), (7, 30), (30, 7), (9, 0), (20, 0), (64, 200)])
@pytest.mark.parametrize("group", [1, 3])
def test_attend_causal_is_the_end_aligned_rule(q_len, kv_len, group, request):
    """Through the kernel: ``attend(causal=True)`` and the rows of ``attend_weighted`` whose weights
    nobody asked for take the split (a decode-sized call keeps its one masked block); the weighted
    rows agree with it."""
    if group * q_len > kvcache.attention.kernel.DECODE_ROWS:
        request.getfixturevalue("split_only")
    gen = torch.Generator().manual_seed(q_len * 100 + kv_len)
    q = rand(2, 2 * group, q_len, 16, gen=gen)
    k, v = rand(2, 2, kv_len, 16, gen=gen), rand(2, 2, kv_len, 16, gen=gen)
    ref = reference(q, k, v, end_aligned(q_len, kv_len).view(1, 1, q_len, kv_len))
    close(attend(q, k, v, causal=True), ref)
    out, weights = attend_weighted(q, k, v, causal=True, weights="window:4")
    close(out, ref)
    assert weights.shape == (2, 2, kv_len)


@pytest.mark.parametrize("per", ["kv head", "query head"])
def test_attend_causal_with_a_key_mask(per, split_only):
    """A boolean key mask, one row per batch row and query head (the same within a KV head's group:
    the empty slots of a per-head layout; or not): split with the mask on the keys before the
    queries, a head that sees nothing before them included."""
    gen = torch.Generator().manual_seed(4)
    batch, kv_heads, group, q_len, kv_len = 2, 3, 3, 6, 20
    q = rand(batch, kv_heads * group, q_len, 8, gen=gen)
    k, v = rand(batch, kv_heads, kv_len, 8, gen=gen), rand(batch, kv_heads, kv_len, 8, gen=gen)
    heads = kv_heads if per == "kv head" else kv_heads * group
    key_mask = torch.rand(batch, heads, 1, kv_len, generator=gen) > 0.5
    key_mask[..., kv_len - q_len :] = True
    key_mask[1, 2, :, : kv_len - q_len] = False  # one head has nothing before the queries
    mask = per_query_head(key_mask, group) if per == "kv head" else key_mask
    allowed = end_aligned(q_len, kv_len).view(1, 1, q_len, kv_len) & mask
    ref = reference(q, k, v, allowed)
    close(attend(q, k, v, mask=mask, causal=True), ref)
    out, weights = attend_weighted(q, k, v, mask=mask, causal=True, weights="window:2")
    close(out, ref)
    hidden = ~mask.view(batch, kv_heads, group, kv_len).any(dim=2)  # no query head of the KV head sees the slot
    assert not weights.masked_select(hidden).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_other_dtypes(dtype):
    gen = torch.Generator().manual_seed(9)
    q, k, v = rand(1, 4, 5, 16, gen=gen), rand(1, 2, 33, 16, gen=gen), rand(1, 2, 33, 16, gen=gen)
    out = attend(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)
    assert out.dtype == dtype
    ref = reference(q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), end_aligned(5, 33).view(1, 1, 5, 33))
    tolerance = 1e-9 if dtype == torch.float64 else 3e-2
    torch.testing.assert_close(out.double(), ref, atol=tolerance, rtol=tolerance)


def test_no_score_matrix_and_no_mask_per_row():
    """The split reads the keys through two fused calls: no tensor as large as a score matrix."""
    from helpers import Recorder

    gen = torch.Generator().manual_seed(2)
    q, k, v = rand(1, 4, 64, 16, gen=gen), rand(1, 2, 256, 16, gen=gen), rand(1, 2, 256, 16, gen=gen)
    with Recorder() as rec:
        out = attend(q, k, v, causal=True)
    close(out, reference(q, k, v, end_aligned(64, 256).view(1, 1, 64, 256)))
    biggest = max(n for _, outs, _ in rec.ops for _, n, _ in outs)
    assert biggest < 64 * 256, biggest
    assert math.isfinite(float(out.abs().max()))
