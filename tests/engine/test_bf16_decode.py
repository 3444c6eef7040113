"""``native.paged_decode`` with bfloat16 queries over bfloat16 blocks, of many rows (a shared
prefix's pass: several sequences' grouped heads stacked; packed blocks) and of few (a sequence's
own grouped heads; read in place): on AMX tiles or ``vdpbf16ps``
(``csrc/bf16_attention.cpp``'s ``kv_bf16_decode``; ``native.bf16_attention_kernel()`` says which), against float64 softmax attention over each sequence's gathered keys, within what
rounding the weights to bfloat16 allows; the log-sum-exps a merge needs; empty sequences; thread
and split invariance; unwritten slots never read; float32 queries and a softcap keep the float kernel."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bf16_checks import assert_generate_but_near_ties, count_calls
from kvcache.attention import native

BF16 = native.available() and native.bf16_attention_kernel() != "none"
pytestmark = pytest.mark.skipif(not BF16, reason="neither AMX tiles nor AVX-512 BF16 here (CPU, OS grant or KVCACHE_ISA): bfloat16 rows take the float kernel")


def layout(lengths, heads, rows, dim, vdim, bs, seed):
    """Shuffled bfloat16 blocks holding each sequence's keys and values, queries ``[S, Hkv, R, D]``,
    int32 tables (unused entries -1 past each sequence's blocks), int64 lengths."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lengths]
    blocks = sum(need) + 2
    keys = torch.randn(blocks, heads, bs, dim, generator=g).bfloat16()
    values = torch.randn(blocks, heads, bs, vdim, generator=g).bfloat16()
    order = torch.randperm(blocks, generator=g).tolist()
    tables = torch.full((len(lengths), max(1, *need)), -1, dtype=torch.int32)
    for s, count in enumerate(need):
        tables[s, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    q = (torch.randn(len(lengths), heads, rows, dim, generator=g) * 2).bfloat16()
    return q, keys, values, tables, torch.tensor(lengths, dtype=torch.int64)


def reference(q, keys, values, tables, lengths, scale):
    """float64 attention of every row over its sequence's gathered keys: ``[S, Hkv, R, Dv]`` and the
    log-sum-exps ``[S, Hkv, R]`` (zeros and -inf for an empty sequence)."""
    heads, bs = keys.shape[1], keys.shape[2]
    outs, sums = [], []
    for s, n in enumerate(lengths.tolist()):
        if n == 0:
            outs.append(torch.zeros(heads, q.shape[2], values.shape[3], dtype=torch.float64))
            sums.append(torch.full((heads, q.shape[2]), float("-inf"), dtype=torch.float64))
            continue
        table = tables[s, : -(-n // bs)].long()
        k = keys[table].transpose(0, 1).reshape(heads, -1, keys.shape[3])[:, :n].double()
        v = values[table].transpose(0, 1).reshape(heads, -1, values.shape[3])[:, :n].double()
        scores = torch.einsum("hrd,htd->hrt", q[s].double(), k) * scale
        outs.append(torch.einsum("hrt,htd->hrd", scores.softmax(-1), v))
        sums.append(scores.logsumexp(-1))
    return torch.stack(outs), torch.stack(sums)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([0, 1, 31, 32, 33, 100, 128, 129, 300, 600]), min_size=1, max_size=3),
    rows=st.sampled_from([1, 3, 4, 8, 15, 16, 21, 48, 64]),
    dims=st.sampled_from([(32, 32), (64, 64), (128, 128), (64, 16), (32, 48), (64, 80)]),
    bs=st.sampled_from([32, 64]),
    per_task=st.sampled_from([None, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_many_bfloat16_rows_take_the_bfloat16_library_within_the_weights_rounding(lengths, rows, dims, bs, per_task, seed):
    dim, vdim = dims
    q, keys, values, tables, lens = layout(lengths, 2, rows, dim, vdim, bs, seed)
    scale = 1 / math.sqrt(dim)
    got, lse = native.paged_decode(q, keys, values, tables, lens, scale, blocks_per_task=per_task, lse=True)
    want, want_lse = reference(q, keys, values, tables, lens, scale)
    bound = reference(q, keys, values.abs(), tables, lens, scale)[0] * 2.0**-8 + 1e-5  # the weights' bfloat16 rounding
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"off by up to {excess.max():.2e} past the weights' rounding"
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [3, 48], ids=["in place", "packed"])
def test_threads_and_splits_change_no_bit_and_unwritten_slots_are_not_read(rows):
    """One thread gives the bits of two; slots past each sequence (never written: here NaN) change
    nothing. (Splits into tasks round each run's weights against its own maximum: the test above
    holds every split to the rounding bound.)"""
    q, keys, values, tables, lens = layout([300, 45, 0, 129], 3, rows, 64, 64, 32, 7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_decode(q, keys, values, tables, lens, 0.125, lse=True)
        torch.set_num_threads(2)
        two = native.paged_decode(q, keys, values, tables, lens, 0.125, lse=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    written = torch.zeros(keys.shape[:3], dtype=torch.bool)
    for s, n in enumerate(lens.tolist()):
        for position in range(n):
            written[tables[s, position // 32], :, position % 32] = True
    poisoned = keys.masked_fill(~written[..., None], float("nan")), values.masked_fill(~written[..., None], float("nan"))
    again = native.paged_decode(q, *poisoned, tables, lens, 0.125, lse=True)
    assert torch.equal(again[0], one[0]) and torch.equal(again[1], one[1])


def test_bfloat16_rows_take_the_bfloat16_library_and_float32_or_a_softcap_the_float_kernel(monkeypatch):
    """bfloat16 queries of 15 rows (read in place) and 16 (packed) go to ``kv_bf16_decode``; float32
    queries and a softcap do not, and float32 queries stay exact (1e-5)."""
    calls = count_calls(monkeypatch, "kv_bf16_decode", 9)  # rows
    for rows in (15, 16):
        q, keys, values, tables, lens = layout([70], 2, rows, 64, 64, 32, rows)
        native.paged_decode(q, keys, values, tables, lens, 0.125)
        exact = native.paged_decode(q.float(), keys, values, tables, lens, 0.125)
        torch.testing.assert_close(exact.double(), reference(q.float(), keys, values, tables, lens, 0.125)[0], rtol=1e-5, atol=1e-5)
        native.paged_decode(q, keys, values, tables, lens, 0.125, softcap=30.0)
    assert calls == [15, 16]


@pytest.mark.half_precision
def test_a_bfloat16_engine_reads_a_shared_prefix_in_bfloat16_and_answers_as_generate(monkeypatch):
    """Eight requests continuing one 96-token prompt in a bfloat16 engine (a tiny Llama, head dim
    32): their decode rows read the shared blocks in one pass of at least 16 rows and their own in
    place, all in the bfloat16 library, and the greedy tokens are generate's but where its two best
    bfloat16 logits lie within 0.1."""
    import copy

    from engine_reference import ids
    from helpers import model_for

    from kvcache import Engine

    model = copy.deepcopy(model_for("llama", num_hidden_layers=2, head_dim=32)).to(torch.bfloat16)
    calls = count_calls(monkeypatch, "kv_bf16_decode", 9)  # rows a sequence
    shared = ids(96, 1)
    prompts = [shared + ids(5, 10 + i) for i in range(8)]
    got = Engine(model, max_batch_tokens=256).generate_batch(prompts, max_new_tokens=6, eos_token_id=[])
    assert calls and max(calls) >= 16
    assert_generate_but_near_ties(model, prompts, got, 6)
