"""Stateful property tests: every storage layer against a reference built on plain ``torch.cat``.

Hypothesis drives random sequences of appends, trims (valid and invalid), snapshots/restores,
forks, resets, batch selects, repeats and beam reorders against one layer (and its forks), and
after every step compares the layer with a reference model that knows nothing of buffers:

- the reference keeps keys/values as plain tensors and appends with ``torch.cat``;
- a static reference refuses an append that would pass its capacity.

Checked after every step: tensors returned by ``update``, ``view()``, ``length``, ``seen``,
``positions()``, ``initialized``, ``capacity >= length``, ``nbytes >= stored bytes``; a call that
raises changes nothing; growable reallocations stay within ``ceil(log2(T / initial)) + 1`` on a
pure-append run of ``T`` tokens; a static layer never reallocates on append.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import layer_fingerprint
from kvcache import CacheFullError, DTypeError, ShapeError, UnsupportedOperation
from kvcache.layers import ConcatLayer, GrowableLayer, StaticLayer

MAX_CHUNK = 10
MAX_PAIRS = 3  # the original layer plus at most two forks
MAX_SNAPSHOTS = 4
STEPS = 30

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- the reference ------------------------------------------------------------------------


class RefLayer:
    """What a layer should hold, computed with nothing but ``torch.cat`` and slicing.

    ``keys``/``values`` are None while the layer has no geometry (never appended since creation
    or reset); otherwise ``[B, Hkv, L, D]`` / ``[B, Hkv, L, Dv]`` tensors (L may be 0).
    """

    def __init__(self, kind: str, *, window: int | None = None, capacity: int | None = None):
        self.kind = kind
        self.window = window
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.seen = 0

    def copy(self) -> RefLayer:
        out = RefLayer(self.kind, window=self.window, capacity=self.capacity)
        if self.keys is not None:
            out.keys, out.values = self.keys.clone(), self.values.clone()
        out.seen = self.seen
        return out

    @property
    def initialized(self) -> bool:
        return self.keys is not None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def batch(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]

    @property
    def stored_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    # -- appends

    def append_error(self, key: torch.Tensor) -> type[Exception] | None:
        if self.kind == "static" and self.length + key.shape[2] > self.capacity:
            return CacheFullError
        return None

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            full_k, full_v = key.clone(), value.clone()
        else:
            full_k = torch.cat([self.keys, key], dim=2)
            full_v = torch.cat([self.values, value], dim=2)
        self.seen += key.shape[2]
        self.keys, self.values = full_k, full_v
        return full_k, full_v

    # -- trims

    def trim_error(self, n: int) -> type[Exception] | None:
        if n < 0:
            return ValueError
        if n > self.length:
            return UnsupportedOperation
        return None

    def trim(self, n: int) -> None:
        if n:
            self.keys = self.keys[:, :, : self.length - n]
            self.values = self.values[:, :, : self.values.shape[2] - n]
            self.seen -= n

    # -- reset / batch work / state

    def reset(self) -> None:
        if self.kind == "static" and self.keys is not None:
            # A static layer keeps its buffers, so its geometry (batch, heads, dims, dtype).
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        else:
            self.keys = self.values = None
        self.seen = 0

    def rebatch(self, idx: list[int]) -> None:
        if self.keys is not None:
            index = torch.tensor(idx, dtype=torch.long)
            self.keys, self.values = self.keys[index], self.values[index]

    def repeat(self, n: int) -> None:
        if self.keys is not None:
            self.keys = self.keys.repeat_interleave(n, dim=0)
            self.values = self.values.repeat_interleave(n, dim=0)

    def load(self, other: RefLayer) -> None:
        """``load_state`` of a state taken when the reference was ``other``."""
        if other.keys is None:
            self.reset()  # load_state resets, then has nothing to append
        else:
            self.keys, self.values = other.keys.clone(), other.values.clone()
        self.seen = other.seen


# ---- comparisons ----------------------------------------------------------------------------


def assert_matches(layer, ref: RefLayer) -> None:
    assert layer.initialized == ref.initialized
    assert layer.length == ref.length, (layer.length, ref.length)
    assert layer.seen == ref.seen, (layer.seen, ref.seen)
    assert layer.capacity >= layer.length
    assert layer.nbytes >= ref.stored_bytes, (layer.nbytes, ref.stored_bytes)
    k, v = layer.view()
    pos = layer.positions()
    if not ref.initialized:
        assert k is None and v is None
        assert pos.numel() == 0
        return
    assert k is not None and v is not None
    assert k.dtype == ref.keys.dtype and v.dtype == ref.values.dtype
    assert k.shape == ref.keys.shape, (tuple(k.shape), tuple(ref.keys.shape))
    assert v.shape == ref.values.shape, (tuple(v.shape), tuple(ref.values.shape))
    assert torch.equal(k, ref.keys)
    assert torch.equal(v, ref.values)
    b, h, length = ref.keys.shape[:3]
    expected = torch.arange(ref.seen - length, ref.seen).expand(b, h, length)
    assert pos.shape == (b, h, length), tuple(pos.shape)
    assert torch.equal(pos.to(torch.long), expected)


def growable_bound(tokens: int, initial: int) -> int:
    if tokens <= 0:
        return 1
    return max(0, math.ceil(math.log2(tokens / initial))) + 1


class Pair:
    """A layer under test, its reference, and what the reallocation bound needs."""

    def __init__(self, layer, ref: RefLayer):
        self.layer = layer
        self.ref = ref
        self.pure_append = True  # only appends since creation or the last reset
        self.realloc_base = layer.reallocations

    def fork(self) -> Pair:
        out = Pair(self.layer.fork(), self.ref.copy())
        out.pure_append, out.realloc_base = self.pure_append, self.realloc_base
        return out


# ---- the machine ----------------------------------------------------------------------------


class LayerMachine(RuleBasedStateMachine):
    """Subclasses set ``kind`` and build the layer in ``make``."""

    kind: str = ""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[Pair] = []
        self.snapshots: list[tuple] = []  # (cloned LayerState, reference copy)
        self.gen = torch.Generator()

    # -- helpers

    def make(self, option: int):
        raise NotImplementedError

    def setup_pairs(self, batch, heads, key_dim, value_dim, dtype, seed, option) -> None:
        self.batch, self.heads, self.key_dim, self.value_dim, self.dtype = batch, heads, key_dim, value_dim, dtype
        self.gen.manual_seed(seed)
        layer, ref = self.make(option)
        self.pairs = [Pair(layer, ref)]

    def pick(self, i: int) -> Pair:
        return self.pairs[i % len(self.pairs)]

    def chunk(self, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(batch, self.heads, tokens, self.key_dim, generator=self.gen).to(self.dtype)
        v = torch.randn(batch, self.heads, tokens, self.value_dim, generator=self.gen).to(self.dtype)
        return k, v

    def current_batch(self, pair: Pair) -> int:
        return pair.ref.batch if pair.ref.initialized else self.batch

    def expect_unchanged(self, pair: Pair, exc: type[Exception], fn) -> None:
        before = layer_fingerprint(pair.layer)
        with pytest.raises(exc):
            fn()
        assert layer_fingerprint(pair.layer) == before
        assert_matches(pair.layer, pair.ref)

    # -- rules

    @rule(who=st.integers(0, MAX_PAIRS - 1), tokens=st.integers(0, MAX_CHUNK))
    def append(self, who, tokens):
        pair = self.pick(who)
        k, v = self.chunk(self.current_batch(pair), tokens)
        err = pair.ref.append_error(k)
        if err is not None:
            self.expect_unchanged(pair, err, lambda: pair.layer.update(k, v))
            return
        was_initialized = pair.layer.initialized
        reallocs = pair.layer.reallocations
        got_k, got_v = pair.layer.update(k, v)
        want_k, want_v = pair.ref.append(k, v)
        assert got_k.shape == want_k.shape and got_v.shape == want_v.shape
        assert torch.equal(got_k, want_k)
        assert torch.equal(got_v, want_v)
        if self.kind == "static" and was_initialized:
            assert pair.layer.reallocations == reallocs, "a static layer reallocated on append"

    @rule(who=st.integers(0, MAX_PAIRS - 1), data=st.data())
    def bad_append(self, who, data):
        pair = self.pick(who)
        if not pair.layer.initialized:
            return
        b, tokens = self.current_batch(pair), data.draw(st.integers(0, 3))
        k, v = self.chunk(b, tokens)
        which = data.draw(st.sampled_from(["heads", "key_dim", "value_dim", "batch", "dtype", "length", "rank"]))
        if which == "heads":
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
            err = ShapeError
        elif which == "key_dim":
            k, err = torch.cat([k, k[..., :1]], dim=-1), ShapeError
        elif which == "value_dim":
            v, err = torch.cat([v, v[..., :1]], dim=-1), ShapeError
        elif which == "batch":
            k, v, err = torch.cat([k, k[:1]]), torch.cat([v, v[:1]]), ShapeError
        elif which == "dtype":
            other = torch.float64
            k, v, err = k.to(other), v.to(other), DTypeError
        elif which == "length":  # value has one token more than key
            v = torch.randn(b, self.heads, tokens + 1, self.value_dim, generator=self.gen).to(self.dtype)
            err = ShapeError
        else:
            k, err = k[0], ShapeError
        self.expect_unchanged(pair, err, lambda: pair.layer.update(k, v))

    @rule(who=st.integers(0, MAX_PAIRS - 1), n=st.integers(-2, MAX_CHUNK + 2))
    def trim(self, who, n):
        pair = self.pick(who)
        err = pair.ref.trim_error(n)
        if err is not None:
            self.expect_unchanged(pair, err, lambda: pair.layer.check_trim(n))
            self.expect_unchanged(pair, err, lambda: pair.layer.trim(n))
            if err is ValueError:  # a negative count is bad input, not an unsupported trim
                with pytest.raises(ValueError) as info:
                    pair.layer.trim(n)
                assert not isinstance(info.value, UnsupportedOperation)
            return
        pair.layer.check_trim(n)
        pair.layer.trim(n)
        pair.ref.trim(n)
        if n:
            pair.pure_append = False

    @precondition(lambda self: len(self.snapshots) < MAX_SNAPSHOTS)
    @rule(who=st.integers(0, MAX_PAIRS - 1))
    def snapshot(self, who):
        pair = self.pick(who)
        before = layer_fingerprint(pair.layer)
        state = pair.layer.state().clone()
        assert layer_fingerprint(pair.layer) == before  # taking a state changes nothing
        k, v = pair.layer.view()
        if k is not None and k.numel():  # the clone is a copy, not a view of the store
            assert state.tensors["keys"].untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
        if v is not None and v.numel():
            assert state.tensors["values"].untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
        self.snapshots.append((state, pair.ref.copy()))
        # from_state builds an equal, independent layer.
        rebuilt = type(pair.layer).from_state(state)
        assert_matches(rebuilt, pair.ref)
        if rebuilt.initialized and rebuilt.length:
            k, _ = rebuilt.view()
            assert k.untyped_storage().data_ptr() != state.tensors["keys"].untyped_storage().data_ptr()

    @precondition(lambda self: len(self.snapshots) > 0)
    @rule(who=st.integers(0, MAX_PAIRS - 1), which=st.integers(0, MAX_SNAPSHOTS - 1))
    def restore(self, who, which):
        pair = self.pick(who)
        state, ref = self.snapshots[which % len(self.snapshots)]
        # The cloned state is unaffected by everything that happened since it was taken.
        if ref.initialized and "keys" in state.tensors:
            assert torch.equal(state.tensors["keys"], ref.keys)
            assert torch.equal(state.tensors["values"], ref.values)
            assert state.seen == ref.seen
        pair.layer.load_state(state)
        pair.ref.load(ref)
        pair.pure_append = False

    @precondition(lambda self: len(self.pairs) < MAX_PAIRS)
    @rule(who=st.integers(0, MAX_PAIRS - 1))
    def fork(self, who):
        pair = self.pick(who)
        before = layer_fingerprint(pair.layer)
        child = pair.fork()
        assert layer_fingerprint(pair.layer) == before
        k0, _ = pair.layer.view()
        k1, _ = child.layer.view()
        if k0 is not None and k0.numel():
            assert k0.untyped_storage().data_ptr() != k1.untyped_storage().data_ptr()
        self.pairs.append(child)  # later steps mutate either; the invariant checks both

    @rule(who=st.integers(0, MAX_PAIRS - 1))
    def reset(self, who):
        pair = self.pick(who)
        pair.layer.reset()
        pair.ref.reset()
        pair.pure_append = True
        pair.realloc_base = pair.layer.reallocations

    @rule(who=st.integers(0, MAX_PAIRS - 1), data=st.data())
    def select(self, who, data):
        pair = self.pick(who)
        b = self.current_batch(pair)
        mode = data.draw(st.sampled_from(["long", "bool", "negative", "bad_range", "bad_mask"]))
        if mode in ("bad_range", "bad_mask"):
            if not pair.layer.initialized:
                return  # an uninitialized layer has no batch to check against
            if mode == "bad_range":
                index = torch.tensor([0, b], dtype=torch.long)
            else:
                index = torch.ones(b + 1, dtype=torch.bool)
            self.expect_unchanged(pair, ShapeError, lambda: pair.layer.select(index))
            return
        rows = data.draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b, unique=True))
        if mode == "bool":
            keep = sorted(rows)
            mask = torch.zeros(b, dtype=torch.bool)
            mask[keep] = True
            pair.layer.select(mask)
            pair.ref.rebatch(keep)
        else:
            index = [r - b if mode == "negative" and r % 2 else r for r in rows]
            pair.layer.select(torch.tensor(index, dtype=torch.long))
            pair.ref.rebatch(rows)
        pair.pure_append = False

    @rule(who=st.integers(0, MAX_PAIRS - 1), n=st.integers(-1, 3))
    def repeat(self, who, n):
        pair = self.pick(who)
        if n < 1:
            self.expect_unchanged(pair, ValueError, lambda: pair.layer.repeat(n))
            return
        if pair.ref.initialized and pair.ref.batch * n > 6:
            n = 1  # keep batches small
        pair.layer.repeat(n)
        pair.ref.repeat(n)
        if n > 1:
            pair.pure_append = False

    @rule(who=st.integers(0, MAX_PAIRS - 1), data=st.data())
    def reorder(self, who, data):
        pair = self.pick(who)
        b = self.current_batch(pair)
        if pair.layer.initialized and data.draw(st.booleans().map(lambda x: x and b > 0), label="invalid"):
            bad = torch.zeros(b + 1, dtype=torch.long)
            self.expect_unchanged(pair, ShapeError, lambda: pair.layer.reorder(bad))
            return
        beam = data.draw(
            st.one_of(st.permutations(list(range(b))), st.lists(st.integers(0, b - 1), min_size=b, max_size=b))
        )
        pair.layer.reorder(torch.tensor(beam, dtype=torch.long))
        pair.ref.rebatch(beam)
        pair.pure_append = False

    # -- invariants

    @invariant()
    def matches_reference(self):
        for pair in self.pairs:
            assert_matches(pair.layer, pair.ref)
            if self.kind == "growable" and pair.pure_append:
                got = pair.layer.reallocations - pair.realloc_base
                bound = growable_bound(pair.ref.length, pair.layer.initial_capacity)
                if pair.layer.growth == 2.0:
                    assert got <= bound, (got, bound, pair.ref.length, pair.layer.initial_capacity)
                if pair.ref.length == 0 and not pair.layer.initialized:
                    assert got == 0


GEOMETRY = dict(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    key_dim=st.integers(1, 8),
    value_dim=st.integers(1, 8),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)


class ConcatMachine(LayerMachine):
    kind = "concat"

    @initialize(option=st.just(0), **GEOMETRY)
    def init(self, batch, heads, key_dim, value_dim, dtype, seed, option):
        self.setup_pairs(batch, heads, key_dim, value_dim, dtype, seed, option)

    def make(self, option):
        return ConcatLayer(), RefLayer("concat")


class GrowableMachine(LayerMachine):
    kind = "growable"

    @initialize(option=st.integers(1, 8), growth=st.sampled_from([2.0, 2.0, 1.5, 3.0]), **GEOMETRY)
    def init(self, batch, heads, key_dim, value_dim, dtype, seed, option, growth):
        self.growth = growth
        self.setup_pairs(batch, heads, key_dim, value_dim, dtype, seed, option)

    def make(self, option):
        return GrowableLayer(initial_capacity=option, growth=self.growth), RefLayer("growable")


class StaticLargeMachine(LayerMachine):
    """Capacity large enough for any run: appends never fail. Optionally caller-owned buffers."""

    kind = "static"

    @initialize(option=st.integers(0, 1), **GEOMETRY)
    def init(self, batch, heads, key_dim, value_dim, dtype, seed, option):
        self.setup_pairs(batch, heads, key_dim, value_dim, dtype, seed, option)

    def make(self, option):
        capacity = STEPS * MAX_CHUNK + 10
        ref = RefLayer("static", capacity=capacity)
        if option:  # caller-owned buffers: initialized (geometry fixed) from the start
            kbuf = torch.full((self.batch, self.heads, capacity, self.key_dim), 7.0, dtype=self.dtype)
            vbuf = torch.full((self.batch, self.heads, capacity, self.value_dim), 7.0, dtype=self.dtype)
            ref.keys, ref.values = kbuf[:, :, :0].clone(), vbuf[:, :, :0].clone()
            return StaticLayer(capacity, keys=kbuf, values=vbuf), ref
        return StaticLayer(capacity), ref


class StaticSmallMachine(LayerMachine):
    """Small capacities: many appends hit CacheFullError, which must write nothing."""

    kind = "static"

    @initialize(option=st.integers(1, 24), **GEOMETRY)
    def init(self, batch, heads, key_dim, value_dim, dtype, seed, option):
        self.setup_pairs(batch, heads, key_dim, value_dim, dtype, seed, option)

    def make(self, option):
        return StaticLayer(option), RefLayer("static", capacity=option)


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


TestConcatLayer = ConcatMachine.TestCase
TestConcatLayer.settings = _settings(120)
TestGrowableLayer = GrowableMachine.TestCase
TestGrowableLayer.settings = _settings(200)
TestStaticLayerLarge = StaticLargeMachine.TestCase
TestStaticLayerLarge.settings = _settings(120)
TestStaticLayerFull = StaticSmallMachine.TestCase
TestStaticLayerFull.settings = _settings(120)


# ---- a pure-append run: the growable reallocation bound at every length --------------------


@settings(max_examples=150, deadline=None)
@given(
    initial=st.integers(1, 8),
    chunks=st.lists(st.integers(0, MAX_CHUNK), min_size=1, max_size=60),
)
def test_growable_pure_append_reallocation_bound(initial, chunks):
    layer, ref = GrowableLayer(initial_capacity=initial), RefLayer("growable")
    gen = torch.Generator().manual_seed(len(chunks))
    for tokens in chunks:
        k = torch.randn(1, 2, tokens, 3, generator=gen)
        v = torch.randn(1, 2, tokens, 5, generator=gen)
        got_k, got_v = layer.update(k, v)
        want_k, want_v = ref.append(k, v)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        bound = growable_bound(ref.length, initial)
        assert 1 <= layer.reallocations <= bound, (layer.reallocations, bound, ref.length, initial)
        assert layer.capacity >= layer.length
    assert_matches(layer, ref)
