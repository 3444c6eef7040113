"""Ada-KV (``adakv``): one budget shared by the KV heads of a layer, against a plain-torch reference.

The reference (``simulate_adakv``) follows the paper's description (Feng et al., 2024) with loops
over rows, heads and positions in float64: each pass's queries attend, causally, the kept positions
of their own KV head plus the new tokens; a pass of several tokens rescores every slot it attended
by the softmax weights of its last ``window`` queries summed over the KV head's query heads, max-
pooled ``pool`` positions wide within the head (SnapKV's scores); a decode step scores its token 0.
Then a row keeps ``Hkv * budget`` slots: the observation window of every head, each head's
``floor`` best others, then the best of the rest whatever their head.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.errors import ShapeError, UnsupportedOperation
from kvcache.layers import AdaptiveLayer, EvictingLayer
from kvcache.layers.state import LayerState


def pooled_reference(weights: dict[int, float], pool: int) -> dict[int, float]:
    """Max over the ``pool`` neighbouring slots (in position order) of one head's slots."""
    order = sorted(weights)
    half = pool // 2
    return {p: max(weights[order[j]] for j in range(max(0, i - half), min(len(order), i + half + 1))) for i, p in enumerate(order)}


def simulate_adakv(q, k, v, chunks, budget, window, pool, floor_share):
    """Plain-torch Ada-KV over one row: q ``[Hq, T, D]``, k/v ``[Hkv, T, D]`` (float64).

    Returns per pass: (kept positions per head, scores per head, attention output ``[Hq, n, Dv]``,
    the smallest gap between a kept score and a dropped one in the shared choice)."""
    heads, group = k.shape[0], q.shape[0] // k.shape[0]
    scale = 1.0 / math.sqrt(k.shape[-1])
    kept = [[] for _ in range(heads)]
    scores = [dict() for _ in range(heads)]
    steps, start = [], 0
    for n in chunks:
        stop = start + n
        out = torch.zeros(q.shape[0], n, v.shape[-1], dtype=torch.float64)
        for h in range(heads):
            attended = kept[h] + list(range(start, stop))
            pos = torch.tensor(attended)
            window_weights = torch.zeros(len(attended), dtype=torch.float64)
            for g in range(h * group, (h + 1) * group):
                logits = (q[g, start:stop] @ k[h, pos].T) * scale
                visible = pos.view(1, -1) <= torch.arange(start, stop).view(-1, 1)
                probs = torch.softmax(logits.masked_fill(~visible, -math.inf), dim=-1)
                out[g] = probs @ v[h, pos]
                window_weights += probs[max(0, n - window) :].sum(0)
            if n > 1:
                scores[h] = pooled_reference({p: float(w) for p, w in zip(attended, window_weights)}, pool)
            else:
                scores[h][stop - 1] = 0.0
            kept[h] = attended
        margin = math.inf
        if sum(len(s) for s in kept) > heads * budget:
            recent = min(window, budget // 2)
            floor = max(1, int(floor_share * (budget - recent)))
            protected = {(h, p) for h in range(heads) for p in kept[h] if p >= stop - recent}
            floored = set()
            for h in range(heads):
                free = sorted((p for p in kept[h] if (h, p) not in protected), key=lambda p: -scores[h][p])
                floored |= {(h, p) for p in free[:floor]}
            rest = sorted(
                ((h, p) for h in range(heads) for p in kept[h] if (h, p) not in protected | floored),
                key=lambda hp: -scores[hp[0]][hp[1]],
            )
            take = heads * budget - len(protected) - len(floored)
            chosen = protected | floored | set(rest[:take])
            if 0 < take < len(rest):
                margin = scores[rest[take - 1][0]][rest[take - 1][1]] - scores[rest[take][0]][rest[take][1]]
            kept = [[p for p in kept[h] if (h, p) in chosen] for h in range(heads)]
            scores = [{p: s for p, s in scores[h].items() if (h, p) in chosen} for h in range(heads)]
        steps.append(([set(x) for x in kept], [dict(s) for s in scores], out, margin))
        start = stop
    return steps


FOCUS = (2, 9)  # where KV head 1 of row 0 looks


def crafted_inputs(total: int, recent: int, seed: int = 3, dim: int = 16, prefill: int | None = None):
    """Two rows, 2 KV heads, 4 query heads. Row 0: KV head 0's queries attend almost uniformly
    (spread), KV head 1's attend positions ``FOCUS`` (focused). Row 1: KV head 0 spread, KV head 1
    attends only the last ``recent`` positions of the prefill (``prefill`` tokens, default all):
    its observation window, so it is starved outside it."""
    prefill = total if prefill is None else prefill
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(2, 4, total, dim, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(2, 2, total, dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, total, dim, generator=g, dtype=torch.float64)
    q[:, 2:, :, 0] += 4.0  # KV head 1's query heads look along e0
    for p in FOCUS:
        k[0, 1, p, 0] += 5.0
    k[1, 1, prefill - recent : prefill, 0] += 5.0
    return q, k, v


def run_layer(layer, q, k, v, chunks):
    """Feed ``chunks`` through ``layer``; yields (tokens so far, attention output) after each."""
    start = 0
    for n in chunks:
        stop = start + n
        layer.update(k[:, :, start:stop].float(), v[:, :, start:stop].float())
        yield stop, layer.attend(q[:, :, start:stop].float())
        start = stop


def kept_sets(layer) -> list[list[set[int]]]:
    pos, heads = layer.positions(), layer.heads()
    return [[set(pos[b, 0][heads[b, 0] == h].tolist()) for h in range(layer.kv_heads)] for b in range(pos.shape[0])]


def assert_step_matches(layer, out, refs, step, label):
    """Each row's output, kept slots and their scores after ``step`` equal the reference's
    (``simulate_adakv``; float32 against float64: 1e-5)."""
    got = kept_sets(layer)
    for b in range(len(refs)):
        kept, scores, want_out, margin = refs[b][step]
        assert margin > 1e-5, f"test data too close to a tie at step {step}, row {b} ({margin})"
        torch.testing.assert_close(out[b].double(), want_out, rtol=1e-5, atol=1e-5)
        assert got[b] == kept, f"{label}, row {b}: kept {got[b]}, reference {kept}"
        pos, heads, sc = layer.positions()[b, 0], layer.heads()[b, 0], layer.scores()[b, 0]
        want = torch.tensor([scores[h][p] for p, h in zip(pos.tolist(), heads.tolist())], dtype=torch.float32)
        torch.testing.assert_close(sc, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("floor_share", [0.2, 0.5])
def test_kept_slots_per_row_and_head_match_the_papers_rule(floor_share):
    budget, window, pool = 16, 8, 1
    chunks = [40] + [1] * 12 + [5] + [1] * 4
    total = sum(chunks)
    q, k, v = crafted_inputs(total=total, recent=window, prefill=40)
    refs = [simulate_adakv(q[b], k[b], v[b], chunks, budget, window, pool, floor_share) for b in range(2)]
    layer = AdaptiveLayer(budget, window=window, pool=pool, floor=floor_share)
    for step, (stop, out) in enumerate(run_layer(layer, q, k, v, chunks)):
        assert_step_matches(layer, out, refs, step, f"step {step} ({stop} tokens)")
        assert layer.length == min(2 * budget, 2 * stop)
    counts = layer.head_lengths()
    floor = max(1, int(floor_share * (budget - window)))
    # Row 0: the spread head gets more than its uniform share; the focused one keeps its focus.
    assert counts[0, 0] > budget and FOCUS[0] in kept_sets(layer)[0][1] and FOCUS[1] in kept_sets(layer)[0][1]
    # Row 1: the starved head keeps its window and exactly its floor; the other takes the rest.
    after_prefill = refs[1][0][0]
    assert len(after_prefill[1]) == window + floor and len(after_prefill[0]) == 2 * budget - window - floor


@pytest.mark.parametrize("chunks", [[40, 6, 1, 9, 5], [30, 12, 11]])
def test_passes_of_several_tokens_read_the_slots_per_head(chunks):
    """A pass of several tokens reads the flat slots laid out per KV head (``by_head.py``); after
    an eviction the heads hold different counts and the layout's empty cells are hidden. Outputs,
    kept slots and scores stay the reference's."""
    budget, window, pool = 16, 4, 1  # (pooling ties neighbours' scores: the choice among them is arbitrary)
    q, k, v = crafted_inputs(total=sum(chunks), recent=window, prefill=chunks[0])
    refs = [simulate_adakv(q[b], k[b], v[b], chunks, budget, window, pool, 0.2) for b in range(2)]
    layer = AdaptiveLayer(budget, window=window, pool=pool)
    start, padded = 0, []
    for step, n in enumerate(chunks):
        layer.update(k[:, :, start : start + n].float(), v[:, :, start : start + n].float())
        if n > 1:
            assert layer.pending.keys.shape[1] == 2  # per KV head, not one flat run
            padded.append(layer.pending.padded)
        out = layer.attend(q[:, :, start : start + n].float())
        start += n
        assert_step_matches(layer, out, refs, step, f"step {step}")
    assert padded[0] is False and any(padded[1:])


def test_window_scores_are_max_pooled_within_each_head():
    """Within the budget nothing is evicted: every slot's score is the pooled window weight."""
    q, k, v = crafted_inputs(total=30, recent=8)
    refs = [simulate_adakv(q[b], k[b], v[b], [24, 6], 64, 8, 5, 0.2) for b in range(2)]
    layer = AdaptiveLayer(64, window=8, pool=5)
    for step, _ in enumerate(run_layer(layer, q, k, v, [24, 6])):
        for b in range(2):
            pos, heads, sc = layer.positions()[b, 0], layer.heads()[b, 0], layer.scores()[b, 0]
            want = torch.tensor([refs[b][step][1][h][p] for p, h in zip(pos.tolist(), heads.tolist())], dtype=torch.float32)
            torch.testing.assert_close(sc, want, rtol=1e-5, atol=1e-6)
    assert layer.length == 2 * 30


def test_budget_above_the_sequence_is_full_causal_attention():
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 6, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g), torch.randn(2, 2, 30, 8, generator=g)
    layer = AdaptiveLayer(32, window=4)
    outs = [out for _, out in run_layer(layer, q, k, v, [10, 7, 1, 1, 11])]
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    torch.testing.assert_close(torch.cat(outs, dim=2), ref, rtol=1e-5, atol=1e-5)
    assert layer.length == 60 and (layer.head_lengths() == 30).all()


def test_memory_is_the_layer_budget_and_no_more_than_a_rectangular_store():
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(1, 4, 80, 16, generator=g), torch.randn(1, 2, 80, 16, generator=g), torch.randn(1, 2, 80, 16, generator=g)
    chunks = [50] + [1] * 30
    ada, rect = AdaptiveLayer(20, window=4), EvictingLayer(20, policy="h2o", recent=4)
    for (_, _), (_, _) in zip(run_layer(ada, q, k, v, chunks), run_layer(rect, q, k, v, chunks)):
        assert ada.length == 2 * 20
        assert ada.nbytes == 2 * 21 * (2 * 16 * 4 + 4 + 2 + 4)  # keys, values, position, head, score
        assert ada.nbytes <= rect.nbytes
    assert ada.reallocations == rect.reallocations == 1


def test_int8_storage_keeps_the_same_slots_in_fewer_bytes():
    q, k, v = crafted_inputs(total=48, recent=8)
    chunks = [40] + [1] * 8
    full, coded = AdaptiveLayer(16, window=8, pool=1), AdaptiveLayer(16, window=8, pool=1, storage="int8")
    for (_, a), (_, b) in zip(run_layer(full, q, k, v, chunks), run_layer(coded, q, k, v, chunks)):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)
    assert kept_sets(full) == kept_sets(coded)
    assert coded.nbytes < full.nbytes / 2


def test_state_round_trip_continues_exactly():
    q, k, v = crafted_inputs(total=48, recent=8)
    layer = AdaptiveLayer(12, window=4, pool=3)
    list(run_layer(layer, q[..., :44, :], k[..., :44, :], v[..., :44, :], [40, 1, 1, 1, 1]))
    state = layer.state().clone()
    assert state.tensors["head_lengths"].shape == (2, 2)
    copy = AdaptiveLayer.from_state(state)
    assert copy.options() == layer.options() and copy.seen == layer.seen
    assert kept_sets(copy) == kept_sets(layer) and torch.equal(copy.scores(), layer.scores())
    for layer_ in (layer, copy):
        layer_.update(k[:, :, 44:].float(), v[:, :, 44:].float())
    torch.testing.assert_close(copy.attend(q[:, :, 44:].float()), layer.attend(q[:, :, 44:].float()), rtol=0, atol=0)
    assert kept_sets(copy) == kept_sets(layer)


def _damaged(state: LayerState, name: str, fn) -> LayerState:
    out = state.clone()
    out.tensors[name] = fn(out.tensors[name])
    return out


def test_crafted_states_are_refused_and_change_nothing():
    q, k, v = crafted_inputs(total=44, recent=8)
    layer = AdaptiveLayer(12, window=4)
    list(run_layer(layer, q, k, v, [40, 1, 1, 1, 1]))
    good = layer.state().clone()
    target = AdaptiveLayer(12, window=4)
    list(run_layer(target, q[..., :20, :], k[..., :20, :], v[..., :20, :], [20]))
    before = target.state().clone()

    def twice(p):
        p = p.clone()
        p[:, :, 1] = p[:, :, 0]
        return p

    def swap_head(h):
        h = h.clone()
        h[:, :, 0] = 1 - h[:, :, 0]
        return h

    bad = [
        _damaged(good, "positions", lambda p: p + 100),
        _damaged(good, "positions", lambda p: p.long()),
        _damaged(good, "heads", lambda h: h + 2),
        _damaged(good, "heads", swap_head),
        _damaged(good, "head_lengths", lambda c: c.flip(-1) + 1),
        _damaged(good, "head_lengths", lambda c: c[:, :1]),
        _damaged(good, "keys", lambda t: t[:, :, :5]),
        _damaged(good, "keys", lambda t: t.repeat(1, 2, 1, 1)),
        LayerState("adakv", good.options, 3, good.tensors),  # more slots than 3 tokens allow
        LayerState("evicting", good.options, good.seen, good.tensors),
    ]
    same_head_twice = good.clone()
    same_head_twice.tensors["heads"] = torch.zeros_like(good.tensors["heads"])
    same_head_twice.tensors["head_lengths"] = torch.tensor([[good.tensors["heads"].shape[-1], 0]] * 2)
    same_head_twice.tensors["positions"] = twice(good.tensors["positions"])
    bad.append(same_head_twice)
    for state in bad:
        with pytest.raises((ValueError, ShapeError)):
            target.load_state(state)
        after = target.state()
        assert after.seen == before.seen and all(torch.equal(after.tensors[n], t) for n, t in before.tensors.items())


def test_batch_ops_move_rows_with_their_own_head_split():
    q, k, v = crafted_inputs(total=44, recent=8)
    layer = AdaptiveLayer(12, window=4, pool=1)
    list(run_layer(layer, q, k, v, [40, 1, 1, 1, 1]))
    rows = kept_sets(layer)
    assert rows[0] != rows[1]
    counts = layer.head_lengths()
    flipped = layer.fork()
    flipped.reorder(torch.tensor([1, 0]))
    assert kept_sets(flipped) == [rows[1], rows[0]] and torch.equal(flipped.head_lengths(), counts.flip(0))
    picked = layer.fork()
    picked.select([1])
    assert kept_sets(picked) == [rows[1]] and picked.geometry.batch == 1
    assert picked.nbytes == layer.nbytes // 2
    repeated = layer.fork()
    repeated.repeat(2)
    assert kept_sets(repeated) == [rows[0], rows[0], rows[1], rows[1]]
    # The row carries on as it would have alone.
    alone = AdaptiveLayer(12, window=4, pool=1)
    list(run_layer(alone, q[1:], k[1:], v[1:], [40, 1, 1, 1, 1]))
    assert kept_sets(alone) == kept_sets(picked)


def test_trim_while_nothing_was_evicted_then_refused():
    g = torch.Generator().manual_seed(8)
    q, k, v = torch.randn(1, 4, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    layer, fresh = AdaptiveLayer(32, window=4), AdaptiveLayer(32, window=4)
    list(run_layer(layer, q, k, v, [10, 6, 1, 1]))
    layer.trim(5)
    list(run_layer(fresh, q[..., :13, :], k[..., :13, :], v[..., :13, :], [10, 3]))
    assert layer.seen == 13 and kept_sets(layer) == kept_sets(fresh)
    a, b = layer.view(), fresh.view()
    order_a, order_b = (layer.heads() * 100 + layer.positions()).argsort(-1), (fresh.heads() * 100 + fresh.positions()).argsort(-1)
    assert torch.equal(a[0][0, 0, order_a[0, 0]], b[0][0, 0, order_b[0, 0]])
    with pytest.raises(UnsupportedOperation):
        layer.trim(14)
    small = AdaptiveLayer(4, window=2)
    list(run_layer(small, q, k, v, [10]))
    with pytest.raises(UnsupportedOperation, match="evicted"):
        small.trim(1)
    assert small.seen == 10 and small.length == 8


def test_spec_options_and_errors():
    from kvcache.apps.tiny import tiny_config

    spec = kvcache.parse_spec("adakv:budget=0.25,window=32,pool=7,floor=0.2")
    assert spec.options == {"budget": 0.25, "window": 32, "pool": 7, "floor": 0.2}
    cache = kvcache.make_cache(tiny_config("llama"), spec)
    assert all(isinstance(s, AdaptiveLayer) and s.budget == 0.25 and s.floor == 0.2 for s in cache.kv_layers)
    for bad in ("adakv", "adakv:budget=0", "adakv:budget=8,window=0", "adakv:budget=8,recent=3", "adakv:budget=8,pool=x"):
        with pytest.raises(kvcache.SpecError):
            kvcache.parse_spec(bad)
    for kwargs in ({"budget": 8, "floor": 1.5}, {"budget": 1.5}, {"budget": 8, "storage": "int3"}):
        with pytest.raises(ValueError):
            AdaptiveLayer(**kwargs)


def test_query_heads_must_split_under_the_kv_heads():
    layer = AdaptiveLayer(8)
    layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
    with pytest.raises(ShapeError, match="multiple"):
        layer.attend(torch.randn(1, 3, 3, 8))
    assert layer.attend(torch.randn(1, 4, 3, 8)).shape == (1, 4, 3, 8)


# ---- a compressed context held beside the budget (KVzip's choice across the cache) ------------


def _compressed_layer(kept: list[list[bool]], room: int, dim: int = 4, seed: int = 0) -> AdaptiveLayer:
    """A layer holding ``kept[h][t]`` slots of a ``len(kept[0])``-token context as compressed slots."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(kept)
    head, position = mask.nonzero(as_tuple=True)
    n = head.numel()
    state = LayerState("adakv", {"budget": room, "window": 32, "pool": 7, "floor": 0.0, "storage": "full", "compressed": n}, mask.shape[1], {
        "keys": torch.randn(1, 1, n, dim, generator=g), "values": torch.randn(1, 1, n, dim, generator=g),
        "positions": position.to(torch.int32).view(1, 1, n), "heads": head.to(torch.int16).view(1, 1, n),
        "scores": torch.rand(1, 1, n, generator=g), "head_lengths": mask.sum(-1).view(1, -1),
    })  # fmt: skip
    return AdaptiveLayer.from_state(state)


def _slots(layer) -> set[tuple[int, int]]:
    return set(zip(layer.heads()[0, 0].tolist(), layer.positions()[0, 0].tolist()))


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 3), length=st.integers(2, 12), room=st.integers(1, 4), steps=st.integers(0, 7), seed=st.integers(0, 99),
    data=st.data(),
)
def test_a_compressed_context_stays_until_the_room_is_used_then_the_layer_keeps_its_count(heads, length, room, steps, seed, data):
    kept = [data.draw(st.lists(st.booleans(), min_size=length, max_size=length)) for _ in range(heads)]
    kept[0][0] = True  # a context keeps at least one slot
    layer = _compressed_layer(kept, room, seed=seed)
    compressed = _slots(layer)
    assert layer.compressed == len(compressed) and layer.seen == length
    g = torch.Generator().manual_seed(seed + 1)
    for step in range(1, steps + 1):
        layer.append(torch.randn(1, heads, 1, 4, generator=g), torch.randn(1, heads, 1, 4, generator=g))
        layer.settle(None)
        if step <= room:  # nothing evicted: the context and every new token
            assert _slots(layer) == compressed | {(h, length + i) for h in range(heads) for i in range(step)}
        else:  # Ada-KV's rule keeps the compressed count plus the room
            assert layer.length == layer.compressed + heads * room
        copy = AdaptiveLayer.from_state(layer.state())
        assert copy.compressed == layer.compressed and _slots(copy) == _slots(layer)
        assert torch.equal(copy.view()[0], layer.view()[0])


def test_a_compressed_state_is_checked_against_its_own_count():
    layer = _compressed_layer([[True, False, True], [True, True, True]], room=1)
    state = layer.state()
    state.options = {**state.options, "compressed": 0}  # 5 slots after 3 tokens cannot fit 2 * (1 + 1)
    with pytest.raises(ValueError, match="holds 5 slots"):
        AdaptiveLayer(budget=1).check_state(state)
    state.options = {**state.options, "compressed": -1}
    with pytest.raises(ValueError, match="compressed"):
        AdaptiveLayer(budget=1).check_state(state)
    fresh = AdaptiveLayer(budget=1, compressed=4)
    fresh.reset()
    assert fresh.compressed == 0  # an emptied layer holds nothing beside its budget
