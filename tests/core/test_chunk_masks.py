"""What bounded prefill needs from the bridge: no mask for a chunk after the past, and attention of
such a chunk, causal aligned to the end, against torch's SDPA with the mask written out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import sliding_window_causal_mask_function

from kvcache.hf import causal_after_past, hf_attention_forward, kvcache_mask


def sizes(q_length: int, past: int, **extra) -> dict:
    return dict(batch_size=1, q_length=q_length, kv_length=past + q_length, q_offset=past, kv_offset=0, **extra)


def test_a_plain_causal_chunk_after_the_past_gets_no_mask():
    assert causal_after_past(**sizes(8, 40))
    assert kvcache_mask(**sizes(8, 40)) is None
    assert kvcache_mask(**sizes(8, 40, attention_mask=torch.ones(1, 48, dtype=torch.bool))) is None


@pytest.mark.parametrize(
    "extra",
    [
        dict(attention_mask=torch.arange(48).view(1, 48) >= 3),  # padding: the mask carries it
        dict(local_size=4, mask_function=sliding_window_causal_mask_function(4)),  # a window
        dict(allow_is_causal_skip=False),  # the model needs the mask itself
        dict(q_offset=torch.tensor(40)),  # a fixed-capacity layer's offset (compiled caches)
    ],
)
def test_anything_but_plain_causal_after_the_past_gets_its_mask(extra):
    args = {**sizes(8, 40), **extra}
    assert not causal_after_past(**args)
    mask = kvcache_mask(**args)
    assert mask is not None and mask.shape[-2:] == (8, 48)


def test_a_first_prefill_into_a_fixed_capacity_gets_its_mask():
    """transformers leaves that mask to SDPA's is_causal (queries aligned to the start of the
    capacity); the kvcache attention reads a missing mask as aligned to the end, so it gets one."""
    args = dict(batch_size=1, q_length=5, kv_length=16, q_offset=torch.tensor(0), kv_offset=0)
    mask = kvcache_mask(**args)
    want = torch.ones(5, 16, dtype=torch.bool).tril()
    assert mask is not None and torch.equal(mask[0, 0], want)


@pytest.mark.parametrize(("q_len", "past"), [(7, 30), (64, 200)])
def test_a_chunk_without_a_mask_attends_causally_aligned_to_the_end(q_len, past):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, q_len, 16, generator=g)
    k, v = torch.randn(1, 2, past + q_len, 16, generator=g), torch.randn(1, 2, past + q_len, 16, generator=g)
    out, _ = hf_attention_forward(torch.nn.Module(), q, k, v, None)
    allowed = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(diagonal=past)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
