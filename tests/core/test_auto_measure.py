"""``auto``'s ``rule=attention`` (``layers/auto_measure.py``): each case's error is the change of the
observation window's attention outputs, measured with its queries, against the same measure
written plainly (float64, one query head and row at a time); and the refusals around it."""

from __future__ import annotations

import pytest
import torch

import kvcache
from kvcache import Engine
from kvcache.errors import UnsupportedOperation
from kvcache.layers import AutoLayer
from kvcache.layers.checks import Geometry
from kvcache.layers.slots import get_storage

from helpers import model_for


def plain_error(q, keys, values, positions, seen, kept, coded):
    """Mean over KV heads, query heads and rows of ``|o_case - o| / sum p |v|``, one row at a time."""
    b, h, group, w, _ = q.shape
    total, rows = 0.0, 0
    for head in range(h):
        for g in range(group):
            for r in range(w):
                at = seen - w + r
                see = [t for t in range(keys.shape[2]) if positions[0, head, t] <= at]
                qr = q[0, head, g, r].double()

                def out(ts, k, v):
                    p = torch.softmax(torch.stack([qr @ k[t].double() for t in ts]), dim=0)
                    return sum(p[i] * v[t].double() for i, t in enumerate(ts)), sum(p[i] * v[t].double().norm() for i, t in enumerate(ts))

                o, size = out(see, keys[0, head], values[0, head])
                mine = [i for i, t in enumerate(kept[0, head].tolist()) if t in see]
                o_case, _ = out(mine, coded[0][0, head], coded[1][0, head])
                total += float((o_case - o).norm() / size)
                rows += 1
    return total / rows


@pytest.mark.parametrize("share,seed", [(0.3, 0), (0.15, 1)])
def test_each_case_is_the_measured_change_of_the_windows_outputs(share, seed):
    g = torch.Generator().manual_seed(seed)
    n, window, group, d = 80, 3, 2, 16
    keys, values = torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)
    keys[:, :, :, 0] *= 1 + 10 * (torch.rand(1, 2, n, generator=g) < 0.1)  # outliers: coding costs something
    weights = torch.rand(1, 2, n, generator=g) ** 6
    queries = torch.randn(1, 2, group, window, d, generator=g)
    layer = AutoLayer(bytes=share, window=window, pool=1, rule="attention")
    layer.append(keys, values)
    layer.settle({f"window:{window}": weights, f"queries:{window}": queries})
    positions = torch.arange(n).expand(1, 2, n)
    geometry = Geometry.of(keys, values)
    assert len(layer.choice.estimates) >= 3
    for e in layer.choice.estimates:
        recent = min(window, e.slots // 2)
        key = weights.masked_fill(positions >= n - recent, float("inf"))
        kept = key.topk(e.slots, dim=-1).indices  # SnapKV's keep with pool 1: the window's weights
        k_kept = keys.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, d))
        v_kept = values.gather(2, kept.unsqueeze(-1).expand(-1, -1, -1, d))
        exact = plain_error(queries, keys, values, positions, n, kept, (k_kept, v_kept))
        coded = (k_kept, v_kept)
        if e.storage != "full":
            codec = get_storage(e.storage)
            coded = codec.decode(codec.encode(k_kept, v_kept), e.slots, geometry)
        measured = plain_error(queries, keys, values, positions, n, kept, coded)
        assert e.dropped == pytest.approx(exact, abs=1e-4), e
        assert e.total == pytest.approx(measured, abs=1e-4), e
    assert layer.choice.storage == min(layer.choice.estimates, key=lambda e: e.total).storage


def test_a_layer_that_measures_asks_for_the_windows_queries_and_refuses_weights_alone():
    layer = AutoLayer(bytes=0.1, window=4, rule="attention")
    assert layer.weights_for(5) == ("window:4", "queries:4")
    assert layer.weights_for(1) is None  # a decode step decides nothing
    layer.append(torch.randn(1, 2, 64, 8), torch.randn(1, 2, 64, 8))
    with pytest.raises(ValueError, match=r"a dict of modes \['queries:4', 'window:4'\]"):
        layer.settle(torch.rand(1, 2, 64))
    with pytest.raises(ValueError, match="a dict of modes"):
        layer.settle({"window:4": torch.rand(1, 2, 64)})
    assert layer.pending is not None  # nothing settled: the pass can still be given its weights
    layer.settle({"window:4": torch.rand(1, 2, 64), "queries:4": torch.randn(1, 2, 1, 4, 8)})
    assert layer.choice is not None


def test_auto_heads_and_the_engine_refuse_the_measured_rule_by_name():
    with pytest.raises(ValueError, match="rule='attention' is auto's only"):
        kvcache.make_cache(model_for("llama"), "auto-heads:bytes=0.1,rule=attention")
    with pytest.raises(UnsupportedOperation, match="queries:32"):
        Engine(model_for("llama"), block_size=8, blocks=64, max_seqs=2, spec="auto:bytes=0.25,rule=attention")
