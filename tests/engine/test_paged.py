"""``engine.paged_decode``: decode attention over block tables, against torch's SDPA over each
sequence's keys and values written in order (float32: both sum in float32 in different orders, so
1e-5; bfloat16 pools are read exactly and summed in float32 like SDPA's CPU kernel: 1e-2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import native
from kvcache.engine.paged import paged_decode
from kvcache.engine.pool import BlockPool, PoolError


def filled(pool, lengths, seed=0):
    """Tables for ``lengths`` (blocks allocated shuffled, so tables are not in id order) and each
    sequence's keys and values per layer ``[Hkv, L, D]``, written through the pool."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-n // pool.block_size) for n in lengths)
    ids = pool.allocate(need)
    order = torch.randperm(need, generator=gen).tolist()
    ids = [ids[i] for i in order]
    tables, truth = [], []
    for n in lengths:
        count = -(-n // pool.block_size)
        table, ids = ids[:count], ids[count:]
        per_layer = []
        for layer in range(pool.layers):
            k = torch.randn(pool.kv_heads, n, pool.head_dim, generator=gen).to(pool.dtype)
            v = torch.randn(pool.kv_heads, n, pool.value_dim, generator=gen).to(pool.dtype)
            for i, block in enumerate(table):
                lo, hi = i * pool.block_size, min(n, (i + 1) * pool.block_size)
                pool.write(layer, block, 0, k[:, lo:hi], v[:, lo:hi])
            per_layer.append((k, v))
        tables.append(table)
        truth.append(per_layer)
    return tables, truth


def reference(query, truth, layer, scale=None):
    rows = []
    for s, per_layer in enumerate(truth):
        k, v = per_layer[layer]
        if k.shape[1] == 0:
            rows.append(torch.zeros(1, query.shape[1], 1, v.shape[2]))
            continue
        rows.append(F.scaled_dot_product_attention(query[s : s + 1].float(), k[None].float(), v[None].float(), scale=scale, enable_gqa=True))
    return torch.cat(rows)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("lengths", [[1], [5, 16, 33], [0, 7, 64, 1, 100, 3, 16, 17]])
def test_equals_sdpa_over_each_sequence(group, block_size, lengths):
    pool = BlockPool(layers=2, kv_heads=2, head_dim=32, block_size=block_size, blocks=64)
    tables, truth = filled(pool, lengths)
    query = torch.randn(len(lengths), 2 * group, 1, 32, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        out = paged_decode(pool, layer, query, tables, lengths)
        assert out.shape == (len(lengths), 2 * group, 1, 32)
        torch.testing.assert_close(out, reference(query, truth, layer), rtol=1e-5, atol=1e-5)


def test_the_library_runs_and_the_fallback_agrees(monkeypatch):
    pool = BlockPool(layers=1, kv_heads=3, head_dim=64, block_size=16, blocks=40, value_dim=32)
    lengths = [40, 200, 9]
    tables, truth = filled(pool, lengths)
    query = torch.randn(3, 9, 1, 64, generator=torch.Generator().manual_seed(2))
    calls = []
    real = native.paged_decode
    monkeypatch.setattr(native, "paged_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    fast = paged_decode(pool, 0, query, tables, lengths, scale=0.3)
    if native.available():
        assert calls and real(query.reshape(3, 3, 3, 64), pool.storage.layer(0)["keys"], pool.storage.layer(0)["values"],
                              torch.zeros(3, 13, dtype=torch.int32), torch.zeros(3, dtype=torch.int64), 0.3) is not None
    monkeypatch.setattr(native, "paged_decode", lambda *a, **k: None)
    slow = paged_decode(pool, 0, query, tables, lengths, scale=0.3)
    torch.testing.assert_close(fast, reference(query, truth, 0, scale=0.3), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(slow, fast, rtol=1e-5, atol=1e-5)


def test_bfloat16_pool():
    pool = BlockPool(layers=1, kv_heads=2, head_dim=64, block_size=8, blocks=32, dtype=torch.bfloat16)
    lengths = [30, 65]
    tables, truth = filled(pool, lengths)
    query = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = paged_decode(pool, 0, query, tables, lengths)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(query, truth, 0), rtol=0, atol=1e-2)


def test_bad_tables_are_refused():
    pool = BlockPool(layers=1, kv_heads=2, head_dim=16, block_size=4, blocks=8)
    tables, _ = filled(pool, [6])
    query = torch.randn(1, 2, 1, 16)
    with pytest.raises(PoolError, match="cannot hold 9 tokens"):
        paged_decode(pool, 0, query, tables, [9])
    free = next(b for b in range(8) if pool.refcount(b) == 0)
    with pytest.raises(PoolError, match="not an owned block"):
        paged_decode(pool, 0, query, [[tables[0][0], free]], [6])
    with pytest.raises(PoolError, match="2 KV heads of 16"):
        paged_decode(pool, 0, torch.randn(1, 3, 1, 16), tables, [6])
    with pytest.raises(PoolError, match="got 1 and 2"):
        paged_decode(pool, 0, torch.randn(2, 2, 1, 16), tables, [6, 6])
    with pytest.raises(PoolError, match="layer 1"):
        paged_decode(pool, 1, query, tables, [6])


@pytest.mark.skipif(not native.available(), reason="the float decode library did not build here")
@pytest.mark.parametrize("per_task", [1, 3, 1000])
def test_any_split_into_tasks_gives_the_same_result(per_task):
    """A sequence's blocks split into tasks of 1, 3 or all blocks: the tasks' partial softmaxes are
    merged exactly (same tolerance as above)."""
    pool = BlockPool(layers=1, kv_heads=2, head_dim=64, block_size=8, blocks=64)
    lengths = [3, 41, 150, 0, 64]
    tables, truth = filled(pool, lengths)
    query = torch.randn(len(lengths), 6, 1, 64, generator=torch.Generator().manual_seed(4))
    table = torch.zeros(len(lengths), max(len(t) for t in tables), dtype=torch.int32)
    for s, t in enumerate(tables):
        table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    out = native.paged_decode(query.reshape(5, 2, 3, 64), pool.storage.layer(0)["keys"], pool.storage.layer(0)["values"], table,
                              torch.tensor(lengths), 0.125, blocks_per_task=per_task)
    torch.testing.assert_close(out.reshape(5, 6, 1, 64), reference(query, truth, 0, scale=0.125), rtol=1e-5, atol=1e-5)
