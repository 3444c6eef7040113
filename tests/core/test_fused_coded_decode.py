"""A decode step over a quantized layer in one call of the coded library (``fused.decode_attention``,
``StoreReader.decode_attention``), against today's two-product path and against torch's SDPA over
the layer's dequantized content (``QuantizedLayer.view``: ``quant.py``'s reference dequantization
plus the exact residual).

The fused call covers the tokens whose keys and values are both coded; the rest (the tail: the
exact residual, or, from a loaded state, exact keys beside coded values or coded keys beside exact
values) is attended in the same call or in PyTorch and merged by log-sum-exp. A layer's keys and
values leave the residual together, a block at a time; states saved before 2026-11-29 hold values
coded one token at a time, ahead of the keys (``filled_layer(old_values=True)`` makes one). The
cases below pick lengths that leave each kind of tail, and check which one they got.

Tolerance: ``helpers.CODED_TOL`` (``rtol = atol = 1e-3``). All three compute from the same codes in
float32 but for the library's integer products: on x86 it rounds each key block's ``q * scale`` and
each span's ``weights * scale`` to 16-bit integers against their largest (``test_coded_dots.py``
checks those bounds), which moves a score by up to ~1e-3 of a logit on the spread queries below
(typically ~1e-5) and an output (a convex combination of values up to ~4) by about that; the
largest difference seen is 4.8e-4. They differ besides in the order of their sums and in a
polynomial ``exp`` (relative error ~1e-7). Any wrong code, scale, block, chunk merge or tail moves
an output by about a quantization step (>= 1e-2) or a token's weight, beyond it.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import DECODE_ROWS, attend_weighted, fused
from kvcache.attention.kernel import Settings, route
from kvcache.attention.native_build import DISABLE_ENV
from kvcache.layers.quantized import QuantizedLayer, StoreReader
from kvcache.layers.state import LayerState

from helpers import CODED_TOL

G, RESIDUAL = 32, 8


@pytest.fixture(autouse=True)
def needs_library(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    if fused.library() is None:
        pytest.skip("the coded decode library cannot build here (no C++ compiler?)")


def filled_layer(
    bits, batch, kv_heads, seen, dim, *, group_size=G, residual=RESIDUAL, dtype=torch.float32, seed=0, old_values=False
):
    """A quantized layer that has seen ``seen`` tokens: a prefill of all but one, then a decode step.
    With ``old_values``, loaded from a state whose values are coded up to the last ``residual``
    (as layers kept them before 2026-11-29: one value left the residual a token at a time)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, seen, dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, seen, dim, generator=gen).to(dtype)
    layer = QuantizedLayer(bits=bits, group_size=group_size, residual=residual, block=64)
    if seen > 1:
        layer.update(keys[:, :, :-1], values[:, :, :-1])
        layer.settle()
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    if not old_values:
        return layer
    layer.settle()
    coded = seen - min(seen, residual)
    t = dict(layer.state().tensors)
    t.update(layer.codes.format.encode_values(values[:, :, :coded]), residual_values=values[:, :, coded:])
    old = QuantizedLayer(bits=bits, group_size=group_size, residual=residual, block=64)
    old.load_state(LayerState(old.kind, old.options(), seen, t))
    return old


def queries(batch, kv_heads, group, q_len, dim, dtype=torch.float32, seed=1):
    return torch.randn(batch, kv_heads * group, q_len, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def sdpa_over_dequantized(query, layer, mask=None, scale=None):
    keys, values = layer.view()
    return F.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )


def capped_reference(query, layer, scale, softcap):
    """Attention with a softcap, written out (SDPA has no cap)."""
    keys, values = layer.view()
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = query.float() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores, dim=-1) @ values


def todays_path(monkeypatch, query, layer, **options):
    """``attend_weighted`` with the fused decode declined: the blockwise path over the two products."""
    with monkeypatch.context() as patch:
        patch.setattr(StoreReader, "decode_attention", lambda self, query, scale, softcap: None)
        return attend_weighted(query, StoreReader(layer), None, **options)


class Calls:
    """Counts calls of ``fused.decode_attention`` (and of ``fused.key_scores``, today's first product)."""

    def __init__(self, monkeypatch):
        self.fused = self.scores = 0
        decode, scores = fused.decode_attention, fused.key_scores

        def counted_decode(*args, **kwargs):
            self.fused += 1
            return decode(*args, **kwargs)

        def counted_scores(*args, **kwargs):
            self.scores += 1
            return scores(*args, **kwargs)

        monkeypatch.setattr(fused, "decode_attention", counted_decode)
        monkeypatch.setattr(fused, "key_scores", counted_scores)


def tail_kind(layer) -> str:
    """What follows the tokens whose keys and values are both coded (what the fused call covers)."""
    codes = layer.codes
    tk, tv = codes.quantized_keys, codes.quantized_values
    covered = min(tk, tv // layer.group_size * layer.group_size)
    if covered == layer.seen:
        return "empty"
    if tk == tv == covered:
        return "exact"
    return "exact keys, coded values" if tv > tk else "coded keys, exact values"


# (residual, seen) and the tail each leaves with group size 32 (a prefill of seen - 1, then a decode
# step; "exact keys, coded values" from an old state).
LENGTHS = [
    (0, 128, "empty"),  # no residual, whole blocks: every token coded
    (RESIDUAL, RESIDUAL + 96, "exact"),  # the residual only: keys and values coded up to the same block
    (RESIDUAL, RESIDUAL + 95, "exact keys, coded values"),  # one below: the last block's keys still exact
    (RESIDUAL, RESIDUAL + 97, "exact keys, coded values"),  # one above
    (RESIDUAL, 150, "exact keys, coded values"),
]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(("residual", "seen", "tail"), LENGTHS)
def test_fused_decode_matches_todays_path_and_sdpa(monkeypatch, bits, group, batch, dim, residual, seen, tail):
    layer = filled_layer(bits, batch, 2, seen, dim, residual=residual, old_values=tail == "exact keys, coded values")
    assert tail_kind(layer) == tail
    query = queries(batch, 2, group, 1, dim)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert (calls.fused, calls.scores) == (1, 0)
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer)[0], **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group_size", [8, 32, 200])  # tiles of 16 blocks, of 4, and of one block wider than a tile
@pytest.mark.parametrize("split", ["as chosen", "a block a task", "uneven chunks"])
def test_long_sequences_in_tiles_and_chunks(monkeypatch, bits, group_size, split):
    """A long sequence crosses many tiles of a task (the running maximum rises, what was summed is
    rescaled) and, forced by smaller chunks, many tasks per (batch, head) (merged at the end)."""
    if split == "a block a task":
        monkeypatch.setattr(fused, "_MIN_CHUNK", 1)
        monkeypatch.setattr(fused, "_TASKS_PER_THREAD", 10_000)
    elif split == "uneven chunks":
        monkeypatch.setattr(fused, "_MIN_CHUNK", 3 * group_size)  # 3 blocks a task, the last one shorter
        monkeypatch.setattr(fused, "_TASKS_PER_THREAD", 10_000)
    layer = filled_layer(bits, 2, 2, 1300, 64, group_size=group_size)
    query = queries(2, 2, 4, 1, 64) * 3  # spread the scores, so the maximum moves between tiles
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 1
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer)[0], **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("group", "q_len"), [(4, 4), (3, 2), (1, 16)])
def test_several_queries_without_causal(monkeypatch, bits, group, q_len):
    """Up to 16 rows per KV head (4 queries x 4 grouped heads): every row sees every key."""
    layer = filled_layer(bits, 2, 2, 150, 64)
    query = queries(2, 2, group, q_len, 64)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 1
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer)[0], **CODED_TOL)


def test_more_rows_than_the_library_takes_go_blockwise(monkeypatch):
    layer = filled_layer(8, 1, 2, 150, 64)
    query = queries(1, 2, 4, DECODE_ROWS // 4 + 1, 64)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 0
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)


def keys_ahead_layer(bits):
    """A layer loaded from a state with more coded keys than values (no residual keys, a residual
    of values): 96 keys coded, 88 values coded and 8 exact."""
    source = filled_layer(bits, 2, 2, 96, 64, residual=0)  # 96 keys and 96 values coded
    state = source.state()
    t = dict(state.tensors)
    exact_values = source.view()[1][:, :, 88:]  # the last 8 values kept exact instead
    t["vcodes"], t["vscale"], t["vmin"] = (t[name][:, :, :88] for name in ("vcodes", "vscale", "vmin"))
    t["residual_values"] = exact_values
    layer = QuantizedLayer(bits=bits, group_size=G, residual=RESIDUAL, block=64)
    layer.load_state(LayerState(layer.kind, layer.options(), 96, t))
    return layer


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_loaded_state_with_coded_keys_beyond_the_coded_values(monkeypatch, bits):
    """A saved state may hold more coded keys than values: the fused call stops at the last whole
    key block the values cover, and the tail starts with coded keys beside coded, then exact, values."""
    layer = keys_ahead_layer(bits)
    assert tail_kind(layer) == "coded keys, exact values"
    query = queries(2, 2, 3, 1, 64)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 1
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer)[0], **CODED_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
def test_half_precision_layers(monkeypatch, dtype, bits):
    """The library works in float32 and the result is rounded to the query's dtype. The references
    differ in their roundings: SDPA reads the codes dequantized to the layer's dtype (bf16: 2**-9
    relative), today's path rounds the scaled query and the softmax weights to it. 2e-2 absolute on
    outputs of size ~1 covers those roundings, and not a wrong code, scale or token."""
    layer = filled_layer(bits, 2, 2, 150, 64, dtype=dtype)
    query = queries(2, 2, 3, 1, 64, dtype=dtype)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 1 and out.dtype == dtype
    torch.testing.assert_close(out.float(), sdpa_over_dequantized(query, layer), rtol=0, atol=2e-2)
    torch.testing.assert_close(out.float(), todays_path(monkeypatch, query, layer)[0].float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_softcap_and_scale(monkeypatch, bits):
    layer = filled_layer(bits, 3, 2, 150, 64)
    query = queries(3, 2, 3, 1, 64) * 4  # large scores, so the cap bites
    options = {"softcap": 5.0, "scale": 0.3}
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None, **options)
    assert calls.fused == 1
    torch.testing.assert_close(out, capped_reference(query, layer, 0.3, 5.0), **CODED_TOL)
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer, **options)[0], **CODED_TOL)


def test_a_layers_decode_step_takes_the_fused_call(monkeypatch):
    """The real flow: ``layer.attend`` on a decode step (the record's reader, no mask) takes it."""
    layer = QuantizedLayer(bits=4, group_size=G, residual=RESIDUAL, block=64)
    gen = torch.Generator().manual_seed(7)
    layer.update(torch.randn(2, 2, 140, 64, generator=gen), torch.randn(2, 2, 140, 64, generator=gen))
    layer.settle()
    calls = Calls(monkeypatch)
    for _ in range(3):
        layer.update(torch.randn(2, 2, 1, 64, generator=gen), torch.randn(2, 2, 1, 64, generator=gen))
        query = torch.randn(2, 8, 1, 64, generator=gen)
        expected = sdpa_over_dequantized(query, layer)
        torch.testing.assert_close(layer.attend(query), expected, **CODED_TOL)
    assert (calls.fused, calls.scores) == (3, 0)


def test_a_mask_declines(monkeypatch):
    layer = filled_layer(8, 3, 2, 150, 64)
    query = queries(3, 2, 3, 1, 64)
    mask = torch.ones(3, 1, 1, 150, dtype=torch.bool)
    mask[1, ..., :17] = False
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None, mask=mask)
    assert calls.fused == 0 and calls.scores == 1
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer, mask), **CODED_TOL)
    # The layer's own padding mask comes as mask rows by position: declined too.
    layer.settle()
    layer.update(torch.randn(3, 2, 1, 64), torch.randn(3, 2, 1, 64))
    mask = torch.ones(3, 1, 1, 151, dtype=torch.bool)
    mask[2, ..., :5] = False
    out = layer.attend(queries(3, 2, 3, 1, 64, seed=2), mask=mask)
    assert calls.fused == 0
    torch.testing.assert_close(out, sdpa_over_dequantized(queries(3, 2, 3, 1, 64, seed=2), layer, mask), **CODED_TOL)


@pytest.mark.parametrize("weights", ["sum", "last", ("max", "window:1")])
def test_weights_asked_for_decline(monkeypatch, weights):
    layer = filled_layer(4, 2, 2, 150, 64)
    query = queries(2, 2, 3, 1, 64)
    calls = Calls(monkeypatch)
    out, got = attend_weighted(query, StoreReader(layer), None, weights=weights)
    assert calls.fused == 0 and got is not None
    expected, expected_weights = todays_path(monkeypatch, query, layer, weights=weights)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(got, expected_weights)
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)


def test_causal_over_several_queries_declines(monkeypatch):
    layer = filled_layer(8, 2, 2, 150, 64)
    query = queries(2, 2, 2, 2, 64)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None, causal=True)
    assert calls.fused == 0
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer, causal=True)[0])


def with_sinks(query, layer, sinks, scale):
    """Attention with sinks, written out: each row's softmax gets one more logit (its head's sink,
    or its row's) whose weight goes to no value."""
    keys, values = layer.view()
    batch, heads, q_len, _ = query.shape
    group = heads // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, 1), values.float().repeat_interleave(group, 1)
    scores = query.float() @ keys.transpose(-1, -2) * scale
    sink = sinks.reshape(1, heads, 1, 1) if sinks.dim() == 1 else sinks
    weights = torch.softmax(torch.cat([scores, sink.expand(batch, heads, q_len, 1)], dim=-1), dim=-1)
    return weights[..., :-1] @ values


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("form", ["per head", "per row"])
@pytest.mark.parametrize("tail", ["exact", "coded keys, exact values"])
def test_sinks_join_the_one_call_through_its_log_sum_exp(monkeypatch, bits, form, tail):
    """Attention sinks (gpt-oss's per head, or one per query row) over a quantized store take the
    one library call: the output over the keys times sigmoid(lse - sink), equal to today's blockwise
    path and to the softmax with the sink written out; also where the tail is merged in PyTorch."""
    layer = filled_layer(bits, 2, 2, 150, 64) if tail == "exact" else keys_ahead_layer(bits)
    assert tail_kind(layer) == tail
    group, q_len = 3, 2
    query = queries(2, 2, group, q_len, 64)
    gen = torch.Generator().manual_seed(5)
    sinks = torch.randn(6, generator=gen) if form == "per head" else torch.randn(2, 6, q_len, 1, generator=gen)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None, sinks=sinks)
    assert calls.fused == 1
    torch.testing.assert_close(out, todays_path(monkeypatch, query, layer, sinks=sinks)[0], **CODED_TOL)
    torch.testing.assert_close(out, with_sinks(query, layer, sinks, 1 / math.sqrt(64)), **CODED_TOL)


def test_nothing_fully_coded_declines(monkeypatch):
    """A short sequence (no key block coded yet) has nothing for the library: today's path answers."""
    layer = filled_layer(8, 2, 2, 30, 64)
    assert StoreReader(layer).decode_attention(queries(2, 2, 3, 1, 64).reshape(2, 2, 3, 64), 0.125, None) is None
    query = queries(2, 2, 3, 1, 64)
    torch.testing.assert_close(attend_weighted(query, StoreReader(layer), None)[0], sdpa_over_dequantized(query, layer), **CODED_TOL)


def test_library_off_declines(monkeypatch):
    layer = filled_layer(8, 2, 2, 150, 64)
    query = queries(2, 2, 3, 1, 64)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert StoreReader(layer).decode_attention(query.reshape(2, 2, 3, 64), 0.125, None) is None
    torch.testing.assert_close(attend_weighted(query, StoreReader(layer), None)[0], sdpa_over_dequantized(query, layer), **CODED_TOL)


def test_a_query_that_needs_gradients_declines():
    """The library computes no gradients: such a query keeps today's path."""
    layer = filled_layer(8, 2, 2, 150, 64)
    query = queries(2, 2, 3, 1, 64).reshape(2, 2, 3, 64).requires_grad_()
    assert StoreReader(layer).decode_attention(query, 0.125, None) is None
    with torch.no_grad():
        assert StoreReader(layer).decode_attention(query, 0.125, None) is not None


def test_route_offers_a_reader_the_whole_decode_step():
    plain = Settings(scale=0.25, softcap=None, causal=False, mask=None, mask_rows=None, sinks=None)
    one_row = torch.ones(2, 1, 1, 1, 9, dtype=torch.bool)
    assert route(False, plain, 4, 1, 1, coded=True) == (True, 0)
    assert route(False, plain._replace(softcap=5.0), 4, 1, 1, coded=True) == (True, 0)
    assert route(False, plain._replace(causal=True), 4, 1, 1, coded=True) == (True, 0)
    assert route(False, plain, 4, 4, 4, coded=True) == (True, 0)
    # Sinks: a reader's decode takes them (through its log-sum-exp), the plain one-pass decode not.
    sinks = torch.zeros(1, 2, 4, 1, 1)
    assert route(False, plain._replace(sinks=sinks), 4, 1, 1, coded=True) == (True, 0)
    assert route(True, plain._replace(sinks=sinks), 4, 1, 1) == (False, 0)
    # Declined: any mask, mask rows, weights, causal over several queries, too many rows.
    assert route(False, plain._replace(mask=one_row), 4, 1, 1, coded=True) == (False, 0)
    assert route(False, plain._replace(mask_rows=lambda start, stop: None), 4, 1, 1, coded=True) == (False, 0)
    assert route(False, plain, 4, 1, 0, coded=True) == (False, 0)
    assert route(False, plain._replace(causal=True), 4, 2, 2, coded=True) == (False, 0)
    assert route(False, plain, 4, DECODE_ROWS // 4 + 1, DECODE_ROWS // 4 + 1, coded=True) == (False, 0)


def test_merge_by_log_sum_exp_is_exact():
    """Attention over two halves of the keys, merged, is the attention over all of them."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 3, 5, 16, generator=gen), torch.randn(2, 3, 40, 16, generator=gen), torch.randn(2, 3, 40, 8, generator=gen)

    def part(keys, values):
        scores = q @ keys.transpose(-1, -2)
        return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)

    merged = fused.merge_attention(*part(k[:, :, :13], v[:, :, :13]), *part(k[:, :, 13:], v[:, :, 13:]))
    torch.testing.assert_close(merged, part(k, v)[0], **CODED_TOL)


def test_random_sizes(monkeypatch):
    """Sizes drawn at random (bits, block size, residual, head dims, grouping, queries, length, cap):
    the fused path, where it runs, against the written-out reference; where it declines (nothing
    fully coded, value groups narrower than a byte of codes), the same answer from today's path."""
    rng = random.Random(11)
    calls = Calls(monkeypatch)
    taken = 0
    for case in range(40):
        bits = rng.choice([8, 4, 2])
        group_size = rng.choice([2, 4, 8, 16, 32, 48, 64, 200])
        residual = rng.choice([0, 1, 3, 8, 20])
        dim = rng.choice([16, 32, 48, 64, 96, 128])
        group = rng.choice([1, 2, 3, 4, 8])
        q_len = rng.choice([q for q in (1, 2, 3, 4) if q * group <= DECODE_ROWS])
        batch, kv_heads = rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        seen = rng.randint(1, 400)
        softcap = rng.choice([None, None, 3.0])
        value_group = min(group_size, dim)
        if dim % value_group:
            continue  # the layer refuses such a value head dim
        old_values = rng.random() < 0.5
        layer = filled_layer(
            bits, batch, kv_heads, seen, dim, group_size=group_size, residual=residual, seed=case, old_values=old_values
        )
        query = queries(batch, kv_heads, group, q_len, dim, seed=1000 + case)
        before = calls.fused
        scale = 1 / math.sqrt(dim)
        out, _ = attend_weighted(query, StoreReader(layer), None, softcap=softcap)
        covered = min(layer.codes.quantized_keys, layer.codes.quantized_values // group_size * group_size)
        expect_fused = covered > 0 and value_group % (8 // bits) == 0
        assert (calls.fused > before) == (covered > 0)
        reader_took = StoreReader(layer).decode_attention(
            query.reshape(batch, kv_heads, group * q_len, dim), scale, softcap
        ) is not None
        assert reader_took == expect_fused, (case, bits, group_size, dim)
        taken += expect_fused
        msg = f"case {case}: bits {bits} G {group_size} R {residual} D {dim} group {group} q {q_len} seen {seen}"
        torch.testing.assert_close(out, capped_reference(query, layer, scale, softcap), **CODED_TOL, msg=msg)
        torch.testing.assert_close(out, todays_path(monkeypatch, query, layer, softcap=softcap)[0], **CODED_TOL, msg=msg)
    assert taken >= 10  # the draws above exercise the fused path, not only its refusals


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("seen", [700, 733, 801])
def test_a_long_exact_tail_runs_in_the_same_call(monkeypatch, bits, seen):
    """A residual longer than the library's tile (512 tokens) makes a tail of several tiles, with
    exact keys beside both coded and exact values: one library call, equal to SDPA over the layer's
    dequantized keys and values (same tolerance as above)."""
    layer = filled_layer(bits, 2, 3, seen, 64, residual=600, old_values=True)
    codes = layer.codes
    assert codes.quantized_keys < codes.quantized_values < layer.seen and layer.seen - codes.quantized_keys > 512
    query = queries(2, 3, 4, 1, 64)
    calls = Calls(monkeypatch)
    out, _ = attend_weighted(query, StoreReader(layer), None)
    assert calls.fused == 1 and calls.scores == 0
    torch.testing.assert_close(out, sdpa_over_dequantized(query, layer), **CODED_TOL)
