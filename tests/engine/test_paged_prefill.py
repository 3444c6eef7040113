"""``native.paged_prefill``: causal attention of prompt chunks over the pool blocks that hold their
past and themselves, against float64 softmax attention over each chunk's keys and values gathered
in order (float32 sums in another order: 1e-5), over random ragged layouts (hypothesis); and the
engine's route: every plain chunk of a step in one call, giving the tokens of the gathered path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bf16_checks import assert_generate_but_near_ties, count_calls
from engine_reference import ids, reference as generate_reference, same_or_near_tie
from kvcache import Engine
from kvcache.attention import device_kernels, native

pytestmark = pytest.mark.skipif(not native.available(), reason="the float decode library is not built on this machine")


def layout(chunks, heads, rows, dim, bs, dtype, seed):
    """Shuffled pool blocks holding each chunk's ``past + count`` keys and values, the queries
    ``[Hkv, N, R, D]``, int32 tables, int64 starts and pasts."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // bs) for p, n in chunks]
    blocks = sum(need) + 2
    keys = torch.randn(blocks, heads, bs, dim, generator=g).to(dtype)
    values = torch.randn(blocks, heads, bs, dim, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g).tolist()
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int32)
    for s, count in enumerate(need):
        tables[s, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    q = torch.randn(heads, sum(n for _, n in chunks), rows, dim, generator=g)
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    return q, keys, values, tables, starts, torch.tensor([p for p, _ in chunks])


def reference(q, keys, values, tables, starts, pasts, scale):
    """Each chunk's causal attention over its gathered keys and values, float64: ``[Hkv, N, R, Dv]``."""
    heads, bs = q.shape[0], keys.shape[2]
    out = []
    for s in range(len(pasts)):
        past, n = int(pasts[s]), int(starts[s + 1] - starts[s])
        seen = past + n
        table = tables[s, : -(-seen // bs)].long()
        k = keys[table].transpose(0, 1).reshape(heads, -1, keys.shape[3])[:, :seen].double()
        v = values[table].transpose(0, 1).reshape(heads, -1, values.shape[3])[:, :seen].double()
        scores = torch.einsum("hnrd,htd->hnrt", q[:, starts[s] : starts[s + 1]].double(), k) * scale
        visible = torch.arange(seen)[None, :] <= (past + torch.arange(n))[:, None]
        scores = scores.masked_fill(~visible[None, :, None, :], float("-inf"))
        out.append(torch.einsum("hnrt,htd->hnrd", scores.softmax(-1), v))
    return torch.cat(out, dim=1).float()


@settings(max_examples=40, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 150)), min_size=1, max_size=4),
    rows=st.sampled_from([1, 3, 4, 7]),
    dim=st.sampled_from([16, 32, 64, 128]),
    bs=st.sampled_from([4, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_prefill_equals_causal_attention_over_the_gathered_chunk(chunks, rows, dim, bs, dtype, seed):
    case = layout(chunks, 2, rows, dim, bs, dtype, seed)
    scale = 1 / math.sqrt(dim)
    got = native.paged_prefill(*case, scale)
    assert got is not None and got.shape == (2, case[0].shape[1], rows, dim)
    torch.testing.assert_close(got, reference(*case, scale), rtol=1e-5, atol=1e-5)


def test_threads_split_the_tasks_without_changing_a_bit():
    """The suite runs one thread a process; the kernels' tasks split over several give the same bits
    (each task is computed whole by one thread)."""
    case = layout([(100, 70), (0, 130), (33, 1)], 2, 3, 64, 16, torch.float32, 5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_prefill(*case, 0.125)
        torch.set_num_threads(2)
        two = native.paged_prefill(*case, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_bad_starts_are_refused_and_other_inputs_declined():
    q, keys, values, tables, starts, pasts = layout([(5, 10), (0, 3)], 2, 3, 64, 8, torch.float32, 0)
    with pytest.raises(ValueError, match="starts must rise from 0"):
        native.paged_prefill(q, keys, values, tables, torch.tensor([0, 10, 14]), pasts, 0.125)
    with pytest.raises(ValueError, match="starts must rise from 0"):
        native.paged_prefill(q, keys, values, tables, torch.tensor([0, 9, 8]), pasts, 0.125)
    assert native.paged_prefill(q, keys.half(), values.half(), tables, starts, pasts, 0.125) is None  # dtype
    assert native.paged_prefill(q[:1], keys, values, tables, starts, pasts, 0.125) is None  # heads
    assert native.paged_prefill(q, keys, values, tables, starts[:2], pasts, 0.125) is None  # one start short
    too_short = torch.zeros(2, 1, dtype=torch.int32)  # the tables must cover past + count
    assert native.paged_prefill(q, keys, values, too_short, starts, pasts, 0.125) is None


def test_the_engine_attends_its_chunks_in_one_call_and_answers_as_generate(model, monkeypatch):
    prompts = [ids(70, s) for s in range(3)] + [ids(5, 9)]
    calls = []
    real = device_kernels.paged_prefill
    monkeypatch.setattr(device_kernels, "paged_prefill", lambda *a: calls.append(a[4].numel() - 1) or real(*a))
    kernel = Engine(model, block_size=8, max_batch_tokens=48).generate_batch(prompts, max_new_tokens=6, eos_token_id=[])
    assert calls and max(calls) >= 2  # several chunks of a step in one call
    monkeypatch.setattr(device_kernels, "paged_prefill", lambda *a: None)  # each chunk over its gathered past
    gathered = Engine(model, block_size=8, max_batch_tokens=48).generate_batch(prompts, max_new_tokens=6, eos_token_id=[])
    for i, (a, b, p) in enumerate(zip(kernel, gathered, prompts)):
        want = generate_reference(model, p, 6)
        assert same_or_near_tie(list(map(int, a)), want, f"request {i}, kernel") == 0
        assert same_or_near_tie(list(map(int, b)), want, f"request {i}, gathered") == 0


BF16 = native.bf16_attention_kernel() != "none"
NO_BF16 = "neither AMX tiles nor AVX-512 BF16 here (CPU, OS grant or KVCACHE_ISA): bfloat16 chunks take the float kernel, tested above"


def rounding_bound(q, keys, values, tables, starts, pasts, scale):
    """Per output element, what rounding the softmax weights to bfloat16 (relative 2^-9, counted as
    2^-8) can move it: 2^-8 times the weights' average of |v|, plus float32 sums' 1e-5."""
    return reference(q, keys, values.abs(), tables, starts, pasts, scale) * 2.0**-8 + 1e-5


@pytest.mark.skipif(not BF16, reason=NO_BF16)
@settings(max_examples=30, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 150)), min_size=1, max_size=4),
    rows=st.sampled_from([1, 3, 4, 7, 16]),
    dims=st.sampled_from([(32, 32), (64, 64), (128, 128), (64, 16), (32, 48)]),
    bs=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**16),
)
def test_bfloat16_queries_take_the_bfloat16_library_within_the_weights_rounding(chunks, rows, dims, bs, seed):
    """bfloat16 queries over bfloat16 blocks (a bfloat16 model's step) multiply in bfloat16 (AMX
    tiles or ``vdpbf16ps``, ``native.bf16_attention_kernel()``): scores
    exact in float32, the weights rounded to bfloat16 before they multiply the values (as a bfloat16
    attention rounds them), so each output is within that rounding of float64 attention."""
    dim, vdim = dims
    q, keys, values, tables, starts, pasts = layout(chunks, 2, rows, dim, bs, torch.bfloat16, seed)
    values = torch.randn(*values.shape[:3], vdim, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q = q.bfloat16()
    scale = 1 / math.sqrt(dim)
    got = native.paged_prefill(q, keys, values, tables, starts, pasts, scale)
    want = reference(q.float(), keys, values, tables, starts, pasts, scale)
    assert got is not None and got.shape == want.shape
    excess = (got - want).abs() - rounding_bound(q.float(), keys, values, tables, starts, pasts, scale)
    assert excess.max() <= 0, f"off by up to {excess.max():.2e} past the weights' rounding"


@pytest.mark.skipif(not BF16, reason=NO_BF16)
def test_bfloat16_tasks_split_over_threads_without_changing_a_bit_and_unwritten_slots_are_not_read():
    """Several threads give the bits of one; slots past each chunk (never written: here NaN) change
    nothing, the way a pool's free slots hold whatever was there."""
    q, keys, values, tables, starts, pasts = layout([(100, 70), (0, 130), (33, 1), (40, 31)], 2, 3, 64, 32,
                                                    torch.bfloat16, 5)  # fmt: skip
    q = q.bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.paged_prefill(q, keys, values, tables, starts, pasts, 0.125)
        torch.set_num_threads(2)
        two = native.paged_prefill(q, keys, values, tables, starts, pasts, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    written = torch.zeros(keys.shape[:3], dtype=torch.bool)
    for s in range(len(pasts)):
        for position in range(int(pasts[s] + starts[s + 1] - starts[s])):
            written[tables[s, position // 32], :, position % 32] = True
    poisoned = keys.masked_fill(~written[..., None], float("nan")), values.masked_fill(~written[..., None], float("nan"))
    assert torch.equal(native.paged_prefill(q, *poisoned, tables, starts, pasts, 0.125), one)


@pytest.mark.skipif(not BF16, reason=NO_BF16)
@pytest.mark.parametrize("rows", [1, 3, 15])
def test_a_bfloat16_decode_row_beside_prompt_chunks_reads_its_blocks_as_paged_decode_does(rows):
    """A chunk of one position with fewer rows than a tile (a decode row in a prompt step) is read in
    place, as ``paged_decode``'s rows are: the same bits as that kernel's (one task over the row's
    keys), and within the weights' rounding of float64 attention; the prompt chunks beside it keep
    theirs."""
    chunks = [(70, 40), (300, 1), (0, 1), (129, 1)]
    q, keys, values, tables, starts, pasts = layout(chunks, 2, rows, 64, 32, torch.bfloat16, 7)
    q, scale = q.bfloat16(), 0.125
    got = native.paged_prefill(q, keys, values, tables, starts, pasts, scale)
    want = reference(q.float(), keys, values, tables, starts, pasts, scale)
    excess = (got - want).abs() - rounding_bound(q.float(), keys, values, tables, starts, pasts, scale)
    assert excess.max() <= 0, f"off by up to {excess.max():.2e} past the weights' rounding"
    at = starts[1:].tolist()[:3]  # the one-position chunks' queries
    decoded = native.paged_decode(q[:, at].transpose(0, 1).contiguous(), keys, values, tables[1:], pasts[1:] + 1,
                                  scale, blocks_per_task=tables.shape[1])  # fmt: skip
    assert torch.equal(got[:, at].transpose(0, 1), decoded)
    alone = native.paged_prefill(q[:, :40], keys, values, tables[:1], starts[:2], pasts[:1], scale)
    assert torch.equal(got[:, :40], alone)


def test_float32_queries_over_bfloat16_blocks_keep_the_float_kernel():
    """Only bfloat16 queries round the weights: float32 ones over bfloat16 blocks stay exact (1e-5)."""
    case = layout([(40, 50)], 2, 3, 64, 32, torch.bfloat16, 1)
    torch.testing.assert_close(native.paged_prefill(*case, 0.125), reference(*case, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not BF16, reason=NO_BF16)
@pytest.mark.half_precision
def test_a_bfloat16_engine_attends_its_chunks_in_bfloat16_and_answers_as_generate(monkeypatch):
    """A bfloat16 model (head dim 32) through the engine: its chunks go to the bfloat16 library, and its
    greedy tokens are generate's, but where generate's own two best bfloat16 logits lie within a
    bfloat16 rounding of each other (``bf16_checks.BF16_NEAR_TIE``)."""
    import copy

    from helpers import model_for

    model = copy.deepcopy(model_for("llama", num_hidden_layers=2, head_dim=32)).to(torch.bfloat16)
    calls = count_calls(monkeypatch, "kv_bf16_prefill", 7)  # chunks in the call
    prompts = [ids(70, s) for s in range(3)] + [ids(5, 9)]
    got = Engine(model, max_batch_tokens=64).generate_batch(prompts, max_new_tokens=6, eos_token_id=[])
    assert calls and max(calls) >= 2
    assert_generate_but_near_ties(model, prompts, got, 6)
