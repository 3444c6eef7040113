"""Targeted tests of the storage layers: bad input, zero-copy growth, static limits.

The reference for content is always plain ``torch.cat`` of what was appended.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import layer_fingerprint
from kvcache import CacheFullError, DTypeError, ShapeError, UnsupportedOperation
from kvcache.layers import ConcatLayer, GrowableLayer, WindowLayer, StaticLayer

B, H, D, DV = 2, 3, 4, 5

KINDS = {
    "concat": lambda: ConcatLayer(),
    "growable": lambda: GrowableLayer(initial_capacity=4),
    "static": lambda: StaticLayer(64),
    "window": lambda: WindowLayer(6, sinks=1),
}


def kv(tokens: int, *, batch=B, heads=H, d=D, dv=DV, dtype=torch.float32, seed=0, start=0):
    """Keys/values whose slot s holds position start+s in feature 0 (so order is visible)."""
    g = torch.Generator().manual_seed(seed * 1000 + start)
    k = torch.randn(batch, heads, tokens, d, generator=g)
    v = torch.randn(batch, heads, tokens, dv, generator=g)
    pos = torch.arange(start, start + tokens, dtype=torch.float32).view(1, 1, -1)
    k[..., 0] = pos
    v[..., 0] = pos
    return k.to(dtype), v.to(dtype)


def snapshot(layer) -> tuple:
    """Everything observable about a layer, content cloned."""
    k, v = layer.view()
    content = None if k is None else (k.clone(), v.clone())
    return layer_fingerprint(layer), content, layer.positions().clone()


def assert_same(layer, before) -> None:
    meta, content, pos = before
    now_meta, now_content, now_pos = snapshot(layer)
    assert now_meta == meta
    assert torch.equal(now_pos, pos)
    if content is None:
        assert now_content is None
    else:
        assert torch.equal(now_content[0], content[0]) and torch.equal(now_content[1], content[1])


def has_number(message: str, n: int) -> bool:
    return re.search(rf"(?<![\d.]){n}(?![\d.])", message) is not None


# ---- bad input: every kind raises the right error and changes nothing ---------------------


BAD_ON_ANY = {
    # name: (key, value, error, numbers the message must show)
    "rank3_key": (lambda: (torch.zeros(B, H, D), kv(1)[1]), ShapeError, ()),
    "rank5_value": (lambda: (kv(1)[0], torch.zeros(B, H, 1, DV, 1)), ShapeError, ()),
    "kv_length_mismatch": (lambda: (kv(3)[0], kv(2)[1]), ShapeError, (3, 2)),
    "kv_batch_mismatch": (lambda: (kv(2)[0], kv(2, batch=B + 3)[1]), ShapeError, (B, B + 3)),
    "kv_heads_mismatch": (lambda: (kv(2)[0], kv(2, heads=H + 4)[1]), ShapeError, (H, H + 4)),
    "integer_dtype": (lambda: (torch.zeros(B, H, 1, D, dtype=torch.int64), torch.zeros(B, H, 1, DV, dtype=torch.int64)), DTypeError, ()),
    "kv_dtype_mismatch": (lambda: (kv(1)[0], kv(1)[1].half()), DTypeError, ()),
    "key_not_tensor": (lambda: ([[0.0]], kv(1)[1]), DTypeError, ()),
    "value_not_tensor": (lambda: (kv(1)[0], None), DTypeError, ()),
}

# Only against a layer that already holds a geometry (B, H, D, DV, float32).
BAD_AFTER_FIRST = {
    "heads": (lambda: kv(1, heads=H + 6), ShapeError, (H, H + 6, "head")),
    "key_dim": (lambda: kv(1, d=D + 9), ShapeError, (D, D + 9, "dim")),
    "value_dim": (lambda: kv(1, dv=DV + 9), ShapeError, (DV, DV + 9, "dim")),
    "batch": (lambda: kv(1, batch=B + 4), ShapeError, (B, B + 4, "batch")),
    "dtype": (lambda: kv(1, dtype=torch.float64), DTypeError, ("float32", "float64", "dtype")),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", BAD_ON_ANY)
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "filled"])
def test_bad_input_raises_and_changes_nothing(kind, case, fresh):
    layer = KINDS[kind]()
    if not fresh:
        layer.update(*kv(3))
    make, error, numbers = BAD_ON_ANY[case]
    key, value = make()
    before = snapshot(layer)
    with pytest.raises(error) as info:
        layer.update(key, value)
    assert_same(layer, before)
    message = str(info.value)
    for n in numbers:
        assert has_number(message, n), (n, message)
    if case.startswith("kv_") and case != "kv_dtype_mismatch":
        # Both shapes are named, so the reader sees what disagreed.
        assert str(tuple(key.shape)) in message and str(tuple(value.shape)) in message, message
    if case.startswith("rank"):
        # Says what rank was expected and which shape came.
        assert "4" in message and ("(2, 3, 4)" in message or "(2, 3, 1, 5, 1)" in message), message
    if case.endswith("not_tensor"):
        assert "Tensor" in message and ("list" in message or "NoneType" in message), message
    if case == "integer_dtype":
        assert "int64" in message, message
    if case == "kv_dtype_mismatch":
        assert "float32" in message and "float16" in message, message
    # The layer still works as before.
    if fresh:
        assert not layer.initialized
    k, v = kv(1, start=layer.seen)
    layer.update(k, v)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", BAD_AFTER_FIRST)
def test_geometry_mismatch_raises_and_changes_nothing(kind, case):
    layer = KINDS[kind]()
    first = kv(3)
    layer.update(*first)
    make, error, expected = BAD_AFTER_FIRST[case]
    before = snapshot(layer)
    with pytest.raises(error) as info:
        layer.update(*make())
    assert_same(layer, before)
    message = str(info.value)
    for item in expected:  # expected and got both named
        if isinstance(item, int):
            assert has_number(message, item), (item, message)
        else:
            assert item in message, (item, message)
    # A valid append still lands after the stored tokens.
    k, v = kv(1, start=3)
    got_k, _ = layer.update(k, v)
    assert torch.equal(got_k[:, :, -1:], k)


def test_static_caller_buffers_reject_other_geometry():
    kbuf, vbuf = torch.zeros(B, H, 8, D), torch.zeros(B, H, 8, DV)
    layer = StaticLayer(keys=kbuf, values=vbuf)
    before = snapshot(layer)
    with pytest.raises(ShapeError) as info:
        layer.update(*kv(1, heads=H + 4))
    assert has_number(str(info.value), H) and has_number(str(info.value), H + 4)
    with pytest.raises(DTypeError):
        layer.update(*kv(1, dtype=torch.float64))
    assert_same(layer, before)
    assert torch.count_nonzero(kbuf) == 0 and torch.count_nonzero(vbuf) == 0


def test_bad_buffers_and_options_are_refused():
    with pytest.raises(ShapeError):
        StaticLayer(keys=torch.zeros(B, H, 8, D), values=torch.zeros(B, H, 7, DV))
    with pytest.raises(ShapeError):
        StaticLayer(4, keys=torch.zeros(B, H, 8, D), values=torch.zeros(B, H, 8, DV))
    with pytest.raises(ValueError):
        StaticLayer(keys=torch.zeros(B, H, 8, D))
    with pytest.raises(ValueError):
        StaticLayer(0)
    with pytest.raises(ValueError):
        GrowableLayer(initial_capacity=0)
    with pytest.raises(ValueError):
        GrowableLayer(growth=1.0)
    with pytest.raises(ValueError):
        WindowLayer(0)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_trim_select_reorder_repeat_change_nothing(kind):
    layer = KINDS[kind]()
    layer.update(*kv(3))
    before = snapshot(layer)
    with pytest.raises(ValueError):
        layer.trim(-1)
    with pytest.raises(UnsupportedOperation) as info:
        layer.trim(layer.length + 1)
    assert has_number(str(info.value), layer.length + 1)
    with pytest.raises(ShapeError):
        layer.select(torch.tensor([0, B]))
    with pytest.raises(ShapeError):
        layer.select(torch.ones(B + 1, dtype=torch.bool))
    with pytest.raises(ShapeError):
        layer.select(torch.tensor([0.0, 1.0]))
    with pytest.raises(ShapeError):
        layer.reorder(torch.tensor([0]))
    with pytest.raises(ValueError):
        layer.repeat(0)
    assert_same(layer, before)


# ---- growable: zero-copy views, doubling, the reallocation bound ---------------------------


def test_growable_views_are_zero_copy_and_only_doubling_reallocates():
    initial = 4
    layer = GrowableLayer(initial_capacity=initial)
    ks, vs = [], []
    storage_ptr = None
    for t in range(100):
        k, v = kv(1, start=t)
        ks.append(k)
        vs.append(v)
        cap_before, reallocs_before = layer.capacity, layer.reallocations
        got_k, got_v = layer.update(k, v)
        grew = t == 0 or t + 1 > cap_before
        if grew:
            assert layer.reallocations == reallocs_before + 1
            # Doubling: capacity is initial * 2^j.
            assert layer.capacity == initial * 2 ** round(math.log2(layer.capacity / initial))
            if t:
                assert layer.capacity == 2 * cap_before
        else:
            assert layer.reallocations == reallocs_before
            assert layer.capacity == cap_before
            # Same storage as before: nothing was reallocated or copied.
            assert got_k.untyped_storage().data_ptr() == storage_ptr
        storage_ptr = got_k.untyped_storage().data_ptr()
        # The returned tensors are views into the capacity buffer, starting at its first byte.
        itemsize = got_k.element_size()
        assert got_k.data_ptr() == storage_ptr
        assert got_k.untyped_storage().nbytes() == B * H * layer.capacity * D * itemsize
        assert got_v.untyped_storage().nbytes() == B * H * layer.capacity * DV * got_v.element_size()
        assert got_k.shape == (B, H, t + 1, D) and got_v.shape == (B, H, t + 1, DV)
        # view() returns the same memory as update.
        view_k, view_v = layer.view()
        assert view_k.data_ptr() == got_k.data_ptr() and view_v.data_ptr() == got_v.data_ptr()
        assert view_k.stride() == got_k.stride()
        # The newest token was written inside the buffer, in place.
        last = got_k[:, :, t]
        assert storage_ptr <= last.data_ptr() < storage_ptr + got_k.untyped_storage().nbytes()
    assert torch.equal(layer.view()[0], torch.cat(ks, dim=2))
    assert torch.equal(layer.view()[1], torch.cat(vs, dim=2))
    assert layer.nbytes == B * H * layer.capacity * (D + DV) * 4


def test_growable_reallocation_bound_long_decode():
    initial, total = 256, 16384
    layer = GrowableLayer(initial_capacity=initial)
    k = torch.ones(1, 1, 1, 1)
    v = torch.ones(1, 1, 1, 1)
    for t in range(total):
        k.fill_(t)
        layer.update(k, v)
    bound = math.ceil(math.log2(total / initial)) + 1
    assert layer.reallocations <= bound, (layer.reallocations, bound)
    assert layer.length == layer.seen == total
    assert torch.equal(layer.view()[0].flatten(), torch.arange(total, dtype=torch.float32))
    assert layer.capacity < 2 * total


def test_growable_chunk_larger_than_double_grows_straight_to_fit():
    layer = GrowableLayer(initial_capacity=4)
    k1, v1 = kv(3)
    layer.update(k1, v1)
    assert layer.capacity == 4 and layer.reallocations == 1
    k2, v2 = kv(20, start=3)
    got_k, got_v = layer.update(k2, v2)
    # Straight to fit (one allocation, not 8 then 16 then 32), with at most one initial_capacity
    # of headroom above the 23 slots needed.
    assert 23 <= layer.capacity < 23 + 4 + 1, layer.capacity
    assert layer.reallocations == 2
    assert torch.equal(got_k, torch.cat([k1, k2], dim=2))
    assert torch.equal(got_v, torch.cat([v1, v2], dim=2))
    # A first chunk larger than the initial capacity also fits in one allocation.
    other = GrowableLayer(initial_capacity=4)
    other.update(*kv(9))
    assert 9 <= other.capacity <= 9 + 4 and other.reallocations == 1


@pytest.mark.parametrize("kind", ["growable", "static", "window"])
def test_batch_change_reallocates_once_and_same_batch_keeps_the_buffers(kind):
    """A beam reorder writes in place; another batch size gets new tensors, counted once:
    growing kinds hold just the stored slots then, a static layer keeps its capacity."""
    layer = KINDS[kind]()
    layer.update(*kv(3))
    ptr, reallocs, capacity = layer.view()[0].data_ptr(), layer.reallocations, layer.capacity
    layer.reorder(torch.tensor([1, 0]))
    assert (layer.view()[0].data_ptr(), layer.reallocations, layer.capacity) == (ptr, reallocs, capacity)
    layer.repeat(2)
    assert layer.reallocations == reallocs + 1 and layer.length == 3
    assert layer.capacity == (64 if kind == "static" else 3)
    assert torch.equal(layer.view()[0], kv(3)[0].flip(0).repeat_interleave(2, dim=0))


# ---- static: full, caller-owned buffers, reset keeps buffers -------------------------------


def test_static_cache_full_writes_nothing():
    capacity = 8
    kbuf = torch.full((B, H, capacity, D), -7.0)
    vbuf = torch.full((B, H, capacity, DV), -7.0)
    layer = StaticLayer(keys=kbuf, values=vbuf)
    k1, v1 = kv(6)
    layer.update(k1, v1)
    kbuf_before, vbuf_before = kbuf.clone(), vbuf.clone()
    before = snapshot(layer)
    with pytest.raises(CacheFullError) as info:
        layer.update(*kv(5, start=6))
    message = str(info.value)
    assert has_number(message, capacity), message
    assert has_number(message, 5) or has_number(message, 11), message  # requested tokens / length needed
    assert_same(layer, before)
    # Not one slot written, not even the free ones.
    assert torch.equal(kbuf, kbuf_before) and torch.equal(vbuf, vbuf_before)
    assert torch.equal(kbuf[:, :, 6:], torch.full((B, H, 2, D), -7.0))
    # What still fits can be appended.
    k2, v2 = kv(2, start=6)
    got_k, _ = layer.update(k2, v2)
    assert torch.equal(got_k, torch.cat([k1, k2], dim=2))
    with pytest.raises(CacheFullError):
        layer.update(*kv(1, start=8))
    # An empty append on a full cache is fine.
    layer.update(*kv(0, start=8))
    assert layer.length == capacity


def test_static_first_append_larger_than_capacity():
    layer = StaticLayer(4)
    with pytest.raises(CacheFullError) as info:
        layer.update(*kv(7))
    assert has_number(str(info.value), 4) and has_number(str(info.value), 7), str(info.value)
    assert not layer.initialized and layer.nbytes == 0 and layer.length == 0 and layer.seen == 0
    layer.update(*kv(4))
    assert layer.length == 4


def test_static_caller_owned_buffers_keep_identity():
    capacity = 16
    kbuf = torch.zeros(B, H, capacity, D)
    vbuf = torch.zeros(B, H, capacity, DV)
    kptr, vptr = kbuf.data_ptr(), vbuf.data_ptr()
    layer = StaticLayer(capacity, keys=kbuf, values=vbuf)
    ks, vs = [], []
    for t in range(5):
        k, v = kv(2, start=2 * t)
        ks.append(k)
        vs.append(v)
        got_k, got_v = layer.update(k, v)
        assert got_k.data_ptr() == kptr and got_v.data_ptr() == vptr
        assert layer.view()[0].data_ptr() == kptr
    assert torch.equal(kbuf[:, :, :10], torch.cat(ks, dim=2))
    assert torch.equal(vbuf[:, :, :10], torch.cat(vs, dim=2))
    assert layer.reallocations == 0
    # Beam reorder keeps the batch size, so it keeps the caller's buffers too.
    layer.reorder(torch.tensor([1, 0]))
    assert layer.view()[0].data_ptr() == kptr
    assert torch.equal(kbuf[:, :, :10], torch.cat(ks, dim=2).flip(0))
    # reset keeps the buffers: the next append writes into them again.
    layer.reset()
    assert layer.length == 0 and layer.seen == 0
    k, v = kv(3, start=100)
    got_k, got_v = layer.update(k, v)
    assert got_k.data_ptr() == kptr and got_v.data_ptr() == vptr
    assert torch.equal(kbuf[:, :, :3], k) and torch.equal(vbuf[:, :, :3], v)
    assert layer.reallocations == 0
    assert torch.equal(layer.positions()[0, 0], torch.arange(3))


def test_static_reset_keeps_own_buffers():
    layer = StaticLayer(8)
    got_k, _ = layer.update(*kv(5))
    ptr = got_k.data_ptr()
    layer.reset()
    got_k, _ = layer.update(*kv(2))
    assert got_k.data_ptr() == ptr
    assert layer.reallocations == 1


