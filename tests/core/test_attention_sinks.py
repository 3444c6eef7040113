"""Learned attention sinks and per-head masks, against plain float64 references.

A sink (gpt-oss, granite_swa, ...) is one extra logit per query head: it joins the softmax's
normalisation and contributes no value. The reference concatenates it to the scores and drops its
column after the softmax, as the models' own eager attention does.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvcache.attention import attend, attend_weighted
from kvcache.errors import ShapeError
from kvcache.layers import EvictingLayer, QuantizedLayer, WindowLayer

TOL = 1e-5  # float32 kernel against a float64 reference: one attention, no amplification


def reference(q, k, v, sinks=None, mask=None, causal=False, softcap=None):
    """float64 attention with repeated K/V heads; ``mask`` boolean [B|1, Hq|1, Sq, T] (True = attend)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    t, s = k.shape[2], q.shape[2]
    if causal:
        allowed = torch.arange(t).view(1, -1) <= torch.arange(s).view(-1, 1) + (t - s)
        scores = scores.masked_fill(~allowed, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs @ v, probs


def tensors(b, hq, hkv, s, t, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, s), (hkv, t), (hkv, t)))
    sinks = torch.randn(hq, generator=g) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("s,t", [(1, 37), (5, 40), (40, 40)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_sinks_match_the_reference(s, t, hq, hkv, softcap):
    q, k, v, sinks = tensors(2, hq, hkv, s, t)
    causal = s > 1
    out = attend(q, k, v, sinks=sinks, causal=causal, softcap=softcap)
    want, _ = reference(q, k, v, sinks, causal=causal, softcap=softcap)
    torch.testing.assert_close(out.double(), want, rtol=TOL, atol=TOL)
    # The sink takes real weight: without it the output differs.
    assert not torch.allclose(attend(q, k, v, causal=causal, softcap=softcap).double(), want, atol=1e-3)


def test_sinks_with_masks_and_fully_masked_rows():
    q, k, v, sinks = tensors(2, 8, 2, 3, 20)
    mask = torch.rand(2, 1, 3, 20, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[1, :, 2] = False  # a row with every key masked attends only its sink: zeros
    out = attend(q, k, v, sinks=sinks, mask=mask)
    want, _ = reference(q, k, v, sinks, mask=mask)
    torch.testing.assert_close(out.double(), want, rtol=TOL, atol=TOL)
    assert torch.equal(out[1, :, 2], torch.zeros_like(out[1, :, 2]))
    additive = torch.zeros(2, 1, 3, 20).masked_fill(~mask, -math.inf)
    torch.testing.assert_close(attend(q, k, v, sinks=sinks, mask=additive), out, rtol=0, atol=0)


@pytest.mark.parametrize("weights", ["sum", "last"])
def test_weights_reported_with_sinks_are_the_keys_real_probabilities(weights):
    q, k, v, sinks = tensors(1, 8, 2, 6, 30)
    _, got = attend_weighted(q, k, v, causal=True, sinks=sinks, weights=weights)
    _, probs = reference(q, k, v, sinks, causal=True)  # [B, Hq, Sq, T], without the sink's share
    per_kv = probs.view(1, 2, 4, 6, 30)
    want = per_kv.sum(dim=(2, 3)) if weights == "sum" else per_kv[:, :, :, -1].sum(dim=2)
    torch.testing.assert_close(got.double(), want, rtol=TOL, atol=TOL)
    assert (got.sum(-1) < (24 if weights == "sum" else 4) - 1e-3).all()  # the sinks took a share


def test_sinks_of_the_wrong_size_are_refused():
    q, k, v, sinks = tensors(1, 8, 2, 1, 10)
    with pytest.raises(ShapeError, match="one logit per query head"):
        attend(q, k, v, sinks=sinks[:4])


def test_per_head_masks_match_the_reference():
    q, k, v, _ = tensors(2, 8, 2, 4, 25)
    mask = torch.rand(2, 8, 4, 25, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[..., 0] = True
    out = attend(q, k, v, mask=mask)
    want, _ = reference(q, k, v, mask=mask)
    torch.testing.assert_close(out.double(), want, rtol=TOL, atol=TOL)


# ---- bounded layers: sinks and per-head masks over slots kept by position ----------------------


def _layer(kind: str):
    return {
        "window": lambda: WindowLayer(window=12, sinks=2),
        "h2o": lambda: EvictingLayer(policy="h2o", budget=14),
        "quantized": lambda: QuantizedLayer(bits=8, group_size=8, residual=4),
    }[kind]()


@pytest.mark.parametrize("kind", ["window", "h2o", "quantized"])
def test_bounded_layers_take_sinks_and_per_head_masks_by_absolute_position(kind):
    """Feed 30 tokens, then one decode step with sinks and a per-head mask over absolute
    positions 0..30: the output equals attention over exactly the tokens the layer kept (found by
    position), with the same sinks and the mask's columns at those positions."""
    layer = _layer(kind)
    q, k, v, sinks = tensors(1, 8, 2, 1, 31, seed=3)
    layer.update(k[:, :, :30], v[:, :, :30])
    layer.settle()
    kept = _kept_positions(layer, 31)  # [Hkv, N] absolute positions each KV head attends next
    layer.update(k[:, :, 30:], v[:, :, 30:])
    mask = torch.rand(1, 8, 1, 31, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 30] = True
    out = layer.attend(q, mask=mask, sinks=sinks)

    for h in range(8):
        pos = kept[h // 4]
        keys, values = k[:, h // 4 : h // 4 + 1, pos], v[:, h // 4 : h // 4 + 1, pos]
        want, _ = reference(q[:, h : h + 1], keys, values, sinks[h : h + 1], mask=mask[:, h : h + 1][..., pos])
        tol = 2e-2 if kind == "quantized" else TOL  # int8 keys: within the quantization step
        torch.testing.assert_close(out[:, h : h + 1].double(), want, rtol=tol, atol=tol)


def _kept_positions(layer, total) -> list[torch.Tensor]:
    """Absolute positions each KV head of ``layer`` attends when token ``total - 1`` arrives
    (asked before it does: an evicting layer then holds what it kept, and the new token joins)."""
    if isinstance(layer, WindowLayer):
        pos = torch.tensor([p for p in range(total) if p < layer.sinks or p > total - 1 - layer.window])
        return [pos, pos]
    if isinstance(layer, QuantizedLayer):
        return [torch.arange(total)] * 2
    positions = layer.state().tensors["positions"][0]  # [Hkv, N] (-1 = empty)
    return [torch.cat([torch.sort(p[p >= 0]).values, torch.tensor([total - 1])]) for p in positions]
