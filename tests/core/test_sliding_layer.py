"""``SlidingLayer`` against Hugging Face's ``DynamicSlidingWindowLayer``, the layer it stands in for.

Random sequences of appends (decode steps and chunks longer than the window), trims, recording
on and off, and batch operations, applied to both: after every operation the keys and values an
update returns, the mask sizes and the kept tokens must be the ones Hugging Face's layer has.
Hugging Face's crop refuses outright once its window is full and it is not recording; ours may
take back what its buffer still holds, so a trim is checked against the full history instead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvcache.errors import UnsupportedOperation
from kvcache.layers import SlidingLayer, WindowLayer

from helpers import layer_fingerprint


def chunk(g: torch.Generator, batch: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 2, n, 4, generator=g), torch.randn(batch, 2, n, 3, generator=g)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("append"), st.integers(4, 40)),  # past the window, and past the spare room
        st.tuples(st.just("trim"), st.integers(0, 6)),
        st.tuples(st.just("record"), st.booleans()),
        st.tuples(st.just("reorder"), st.integers(0, 1)),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(window=st.integers(1, 9), spare=st.integers(1, 5), script=ops, seed=st.integers(0, 2**16))
def test_sliding_layer_against_hugging_faces_sliding_layer_and_the_history(window, spare, script, seed):
    g = torch.Generator().manual_seed(seed)
    ours = SlidingLayer(window, spare=spare)
    hist_k, hist_v = torch.empty(2, 2, 0, 4), torch.empty(2, 2, 0, 3)
    for op, arg in script:
        if op == "append":
            k, v = chunk(g, 2, arg)
            want_sizes = (min(hist_k.shape[2], window - 1) + arg, max(hist_k.shape[2] - window + 1, 0))
            assert ours.mask_sizes(arg) == want_sizes  # Hugging Face's get_mask_sizes, from its formula
            hist_k, hist_v = torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2)
            got_k, got_v = ours.update(k, v)
            visible = want_sizes[0]  # the keys the queries see: the window less one, then the new ones
            assert torch.equal(got_k, hist_k[:, :, -visible:]) and torch.equal(got_v, hist_v[:, :, -visible:])
        elif op == "trim":
            if arg <= ours.rollback_tokens:
                ours.trim(arg)
                hist_k, hist_v = hist_k[:, :, : hist_k.shape[2] - arg], hist_v[:, :, : hist_v.shape[2] - arg]
            else:
                before = layer_fingerprint(ours)
                with pytest.raises(UnsupportedOperation, match="can take back"):
                    ours.trim(arg)
                assert layer_fingerprint(ours) == before
        elif op == "record":
            ours.activate_past_recording(arg)
        else:
            index = torch.tensor([arg, 1 - arg])
            ours.reorder(index)
            hist_k, hist_v = hist_k.index_select(0, index), hist_v.index_select(0, index)
        # What it keeps: at least the window less one, in order, ending at the last token.
        keys, values = ours.view()
        seen = hist_k.shape[2]
        assert ours.seen == seen and ours.length >= min(seen, window - 1)
        if keys is not None:
            assert torch.equal(keys, hist_k[:, :, seen - ours.length :]) and torch.equal(values, hist_v[:, :, seen - ours.length :])
            assert ours.nbytes <= 2 * (max(window - 1, ours.length) + spare) * 2 * 2 * (4 + 3) * 4  # bounded by what it keeps
        # While it records, every token since the last trim (or the switch) can be taken back.


def test_returns_what_dynamic_sliding_window_layer_returns_step_by_step():
    """The same sequence through both, directly: prompt past the window, decode past the spare room."""
    g = torch.Generator().manual_seed(0)
    ours, theirs = SlidingLayer(6, spare=3), DynamicSlidingWindowLayer(sliding_window=6)
    for n in (11, 1, 1, 4, 1, 1, 1, 1, 1, 9, 1, 1):
        k, v = chunk(g, 1, n)
        assert ours.mask_sizes(n) == theirs.get_mask_sizes(n)
        want = theirs.update(k, v)
        got = ours.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(ours.view()[0], theirs.keys)
    assert ours.nbytes == (5 + 3) * 2 * (4 + 3) * 4 and ours.reallocations == 1


def test_decode_moves_the_kept_run_once_per_spare_room():
    """A decode step writes in place; the window less one moves to the front once every ``spare`` steps."""
    g = torch.Generator().manual_seed(1)
    layer = SlidingLayer(8, spare=4)
    layer.update(*chunk(g, 1, 7))
    moved = []
    for _ in range(16):  # the spare room fills after 4 steps; then a move every 4th: steps 5, 9, 13
        before = layer.head
        layer.update(*chunk(g, 1, 1))
        moved.append(layer.head < before)
    assert sum(moved) == 3 and layer.reallocations == 1


def test_recording_keeps_every_token_since_the_last_trim():
    g = torch.Generator().manual_seed(2)
    layer = SlidingLayer(4, spare=2)
    layer.update(*chunk(g, 1, 10))
    assert layer.rollback_tokens == 0
    layer.activate_past_recording()
    for n in (3, 5, 1):
        layer.update(*chunk(g, 1, n))
    assert layer.rollback_tokens == 9  # all since recording began
    layer.trim(7)
    assert layer.seen == 12 and layer.length == 3
    layer.activate_past_recording(False)
    layer.update(*chunk(g, 1, 20))
    assert layer.length == 3 and layer.nbytes == (3 + 2) * 2 * (4 + 3) * 4  # the long recording's buffer given back


def test_state_round_trip_and_checks():
    g = torch.Generator().manual_seed(3)
    layer = SlidingLayer(5)
    layer.update(*chunk(g, 2, 12))
    state = layer.state().clone()
    twin = SlidingLayer.from_state(state)
    assert twin.seen == 12 and torch.equal(twin.view()[0], layer.view()[0])
    assert twin.mask_sizes(1) == layer.mask_sizes(1)
    short = state.clone()
    short.tensors = {n: t[:, :, 1:] for n, t in short.tensors.items()}  # fewer than the window less one
    with pytest.raises(ValueError, match="holds 3 slots after 12 tokens"):
        SlidingLayer(5).load_state(short)


def test_state_of_a_ring_is_the_window_less_one_in_order():
    """Files of kvcache <= 0.1.0 hold a model's sliding layers beside unbounded kinds as rings."""
    g = torch.Generator().manual_seed(4)
    ring, ours = WindowLayer(6), SlidingLayer(6)
    k, v = chunk(g, 1, 15)
    ring.update(k, v)
    ring.settle()
    ours.update(k, v)
    state = SlidingLayer.state_of_ring(ring, ours.options())
    assert torch.equal(state.tensors["keys"], ours.view()[0]) and state.seen == 15
    assert torch.equal(SlidingLayer.from_state(state).view()[1], ours.view()[1])
