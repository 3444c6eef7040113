"""Shared-prefix (cascade) decode attention: rows that share prefix blocks read them in one pass
and merge with their own blocks by log-sum-exp; equal to each row's attention over its whole
table (SDPA over the gathered blocks, float64) within float32 rounding, over random ragged
sharing patterns (hypothesis). Through the engine: the tokens of each request's own generate."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_reference import ids, reference, same_or_near_tie
from kvcache import Engine
from kvcache.attention import native
from kvcache.engine import shared_prefix

pytestmark = pytest.mark.skipif(not native.available(), reason="the float decode library is not built on this machine")


def per_row(q, keys, values, tables, lengths, scale):
    """Each row's attention over its own gathered blocks, float64: ``[S, Hkv, R, Dv]``."""
    out = []
    for s, (table, n) in enumerate(zip(tables, lengths)):
        k = keys[list(table)].transpose(0, 1).reshape(keys.shape[1], -1, keys.shape[3])[:, :n].double()
        v = values[list(table)].transpose(0, 1).reshape(values.shape[1], -1, values.shape[3])[:, :n].double()
        out.append(F.scaled_dot_product_attention(q[s].double(), k, v, scale=scale))
    return torch.stack(out).float()


@st.composite
def layouts(draw):
    """Block tables of decode rows in groups that share leading blocks, with ragged own parts."""
    bs = draw(st.sampled_from([4, 8, 16]))
    rows_per_head = draw(st.sampled_from([1, 3, 4]))
    tables, lengths, next_block = [], [], 0
    for _ in range(draw(st.integers(1, 3))):
        shared = draw(st.integers(0, max(1, 96 // bs)))
        prefix = list(range(next_block, next_block + shared))
        next_block += shared
        for _ in range(draw(st.integers(1, 6))):
            own = draw(st.integers(0 if shared else 1, 3))
            table = prefix + list(range(next_block, next_block + own))
            next_block += own
            if not table:
                continue
            # the row's last block may be partly filled (it is the one being written)
            lengths.append((len(table) - 1) * bs + draw(st.integers(1, bs)))
            tables.append(table)
    return bs, rows_per_head, tables, lengths, next_block, draw(st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_shared_prefix_attention_equals_each_rows_own(layout):
    bs, rows, tables, lengths, blocks, seed = layout
    if not tables:
        return
    g = torch.Generator().manual_seed(seed)
    heads, dim = 2, 16
    keys = torch.randn(blocks, heads, bs, dim, generator=g)
    values = torch.randn(blocks, heads, bs, dim, generator=g)
    q = torch.randn(len(tables), heads, rows, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    want = per_row(q, keys, values, tables, lengths, scale)
    plan = shared_prefix.plan(tables, lengths, bs, rows)
    if plan is None:
        return
    for p in plan.passes:  # every shared block is full, read by every row of the pass, written by none
        shared = int(p.length)
        assert shared % bs == 0 and shared >= shared_prefix.MIN_TOKENS and len(p.rows) * rows <= native.PAGED_MAX_ROWS
        for i in p.rows.tolist():
            assert list(tables[i][: shared // bs]) == p.table[0].tolist() and lengths[i] > shared
    got = shared_prefix.attend(plan, q, keys, values, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_bfloat16_blocks_many_rows_at_the_kernels_vector_dims(dim):
    """bfloat16 pools are widened a tile at a time into the float kernel's vector path: the same
    numbers summed in float32, so equal to float64 attention over them within float32 rounding."""
    g = torch.Generator().manual_seed(dim)
    bs, rows, heads = 32, 3, 3
    shared = list(range(34))  # a 1,088-token system prompt
    tables = [shared + [34 + 2 * i, 35 + 2 * i] for i in range(16)]
    lengths = [34 * bs + 33 + i for i in range(16)]
    keys = torch.randn(34 + 32, heads, bs, dim, generator=g).to(torch.bfloat16)
    values = torch.randn(34 + 32, heads, bs, dim, generator=g).to(torch.bfloat16)
    q = torch.randn(16, heads, rows, dim, generator=g)
    scale = 1 / math.sqrt(dim)
    want = per_row(q, keys.float(), values.float(), tables, lengths, scale)
    plan = shared_prefix.plan(tables, lengths, bs, rows)
    assert plan is not None and plan.passes
    torch.testing.assert_close(shared_prefix.attend(plan, q, keys, values, scale), want, rtol=1e-5, atol=1e-5)
    table = torch.tensor(tables, dtype=torch.int32)
    plain = native.paged_decode(q, keys, values, table, torch.tensor(lengths), scale)
    torch.testing.assert_close(plain, want, rtol=1e-5, atol=1e-5)


def test_the_plan_groups_rows_by_their_leading_blocks():
    bs = 16
    prefix = list(range(8))  # 128 tokens
    tables = [prefix + [20], prefix + [21, 22], list(range(30, 38)) + [40], prefix[:2] + [50], prefix[:5] + [60]]
    lengths = [8 * bs + 3, 10 * bs, 8 * bs + 1, 2 * bs + 5, 5 * bs + 2]
    plan = shared_prefix.plan(tables, lengths, bs, group_heads=3)
    # rows 0, 1 and 4 start with the same 4 blocks (MIN_TOKENS); row 4 shares 5 blocks with them;
    # row 2 starts elsewhere (alone), row 3 has too few blocks to share MIN_TOKENS
    assert len(plan.passes) == 1
    assert plan.passes[0].rows.tolist() == [0, 1, 4] and int(plan.passes[0].length) == 5 * bs
    assert plan.lengths.tolist() == [3 * bs + 3, 5 * bs, 8 * bs + 1, 2 * bs + 5, 2]
    assert plan.tables[1, :3].tolist() == [5, 6, 7] and plan.tables[2, :9].tolist() == list(range(30, 38)) + [40]


def test_a_group_below_the_thresholds_reads_row_by_row():
    bs = 16
    prefix = list(range(3))  # 48 tokens < MIN_TOKENS
    assert shared_prefix.plan([prefix + [9], prefix + [10]], [3 * bs + 2, 3 * bs + 4], bs, 3) is None
    long = list(range(8))
    assert shared_prefix.plan([long + [9]], [8 * bs + 2], bs, 3) is None  # one row: no group
    # the block a row writes in this step is never shared: two identical tables ending mid-block
    plan = shared_prefix.plan([long, long], [8 * bs - 3, 8 * bs - 3], bs, 3)
    assert plan is not None and int(plan.passes[0].length) == 7 * bs


def test_large_groups_are_split_into_passes_the_kernel_takes():
    bs, rows = 16, 4
    prefix = list(range(8))
    tables = [prefix + [100 + i] for i in range(40)]
    plan = shared_prefix.plan(tables, [8 * bs + 1] * 40, bs, rows)
    per_pass = native.PAGED_MAX_ROWS // rows
    assert [len(p.rows) for p in plan.passes] == [per_pass] * (40 // per_pass) + ([40 % per_pass] if 40 % per_pass else [])


def test_the_kernel_reports_each_rows_log_sum_exp():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(6, 2, 8, 16, generator=g), torch.randn(6, 2, 8, 16, generator=g)
    q = torch.randn(2, 2, 3, 16, generator=g)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]], dtype=torch.int32)
    lengths = torch.tensor([19, 0])
    out, lse = native.paged_decode(q, keys, values, tables, lengths, 0.25, lse=True)
    k = keys[[0, 1, 2]].transpose(0, 1).reshape(2, 24, 16)[:, :19]
    want = torch.logsumexp(0.25 * q[0] @ k.transpose(1, 2), dim=-1)
    torch.testing.assert_close(lse[0], want, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()


def test_the_engine_reads_a_shared_system_prompt_once_and_answers_as_generate(model):
    bs = 16
    system = ids(5 * bs, 11)  # 80 tokens: 5 shared blocks
    prompts = [system + ids(3 + i, 20 + i) for i in range(5)]
    engine = Engine(model, block_size=bs, blocks=96, max_batch_tokens=512, max_seqs=8)
    handles = [engine.submit(p, max_new_tokens=8, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.stats.shared_prefix_rows > 0
    for i, (p, h) in enumerate(zip(prompts, handles)):
        same_or_near_tie(h.result(), reference(model, p, 8), f"request {i}")
