"""Stateful property tests: one machine, every layer kind, against a reference built on ``torch.cat``.

Hypothesis drives random sequences of appends (valid, malformed, and past a static capacity),
attention with random queries (bounded kinds), trims (valid and refused), snapshots
(``state().clone()``) and ``load_state``, forks, resets, batch select (index or mask), repeat and
beam reorder against one layer (and its forks). The reference keeps every key and value ever
appended with ``torch.cat`` and derives what the layer must hold:

- concat, growable, static: everything (a static reference refuses an append past its capacity);
- window: the positions ``p < sinks`` and ``p >= seen - window``;
- lastrec (``EvictingLayer`` whose score is the position, deterministic without attention) with a
  budget: everything while ``seen <= budget``, else the ``sinks`` first positions and the
  ``budget - sinks`` last ones (once the last update was attended; an unattended update settles at
  the next one).

A query of a bounded kind at position q attends key k iff k <= q and k is visible: for the window,
k > q - window or k < sinks; for lastrec, k was kept before the update or is one of the update's
tokens. Attention is compared with torch's SDPA over the full history with that explicit boolean
mask (in float64).

Checked after every step (bounded kinds: while no attention is pending; between an update and its
attention, stored positions are in range, unique, and hold the history):

- unbounded kinds: tensors returned by ``update``, ``view()``, ``length``, ``seen``,
  ``positions()``, ``initialized``, ``capacity >= length``, ``nbytes >= stored bytes``; growable
  reallocations stay within ``ceil(log2(T / initial)) + 1`` on a pure-append run of ``T`` tokens;
  a static layer never reallocates on append;
- bounded kinds: the stored positions per (row, KV head) are exactly the expected set, ``view()``
  holds the history at those positions, ``length`` and ``seen`` agree, ``nbytes`` stays within the
  bound;
- every kind: a call that raises changes nothing; a state's clone is a copy and a layer built from
  it owns its tensors; a fork shares nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import dtypes_here, layer_fingerprint
from kvcache import CacheFullError, DTypeError, ShapeError, UnsupportedOperation
from kvcache.layers import ConcatLayer, EvictingLayer, GrowableLayer, StaticLayer, WindowLayer

MAX_CHUNK = 10
MAX_PAIRS = 3  # the original layer plus at most two forks
MAX_SNAPSHOTS = 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}
BOUNDED = ("window", "lastrec")


# ---- the reference ------------------------------------------------------------------------


class Ref:
    """The whole history and the rule deciding which positions a layer of ``kind`` keeps.

    ``keys``/``values`` are None while the layer has no geometry (never appended since creation
    or reset); otherwise ``[B, Hkv, seen, D]`` / ``[B, Hkv, seen, Dv]`` tensors (seen may be 0).
    """

    def __init__(self, kind: str, *, capacity: int | None = None, window: int = 0, sinks: int = 0, budget: int = 0):
        self.kind, self.capacity, self.window, self.sinks, self.budget = kind, capacity, window, sinks, budget
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pending: tuple[int, list[int]] | None = None  # (queries, positions they may attend)

    def copy(self) -> Ref:
        out = Ref(self.kind, capacity=self.capacity, window=self.window, sinks=self.sinks, budget=self.budget)
        if self.keys is not None:
            out.keys, out.values = self.keys.clone(), self.values.clone()
        out.pending = None if self.pending is None else (self.pending[0], list(self.pending[1]))
        return out

    @property
    def bounded(self) -> bool:
        return self.kind in BOUNDED

    @property
    def initialized(self) -> bool:
        return self.keys is not None

    @property
    def seen(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def length(self) -> int:
        return len(self.kept())

    @property
    def batch(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]

    @property
    def stored_bytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def max_slots(self) -> int:
        return self.window + self.sinks if self.kind == "window" else self.budget

    def kept(self, seen: int | None = None) -> list[int]:
        """Positions stored after ``seen`` tokens once attention has run (sorted)."""
        seen = self.seen if seen is None else seen
        if self.kind == "window":
            return [p for p in range(seen) if p < self.sinks or p >= seen - self.window]
        if self.kind != "lastrec" or seen <= self.budget:
            return list(range(seen))
        return [p for p in range(seen) if p < self.sinks or p >= seen - (self.budget - self.sinks)]

    def visible(self, first: int, n: int) -> torch.Tensor:
        """``[n, first + n]`` booleans: what the update's queries at ``first..first+n-1`` may attend."""
        q = torch.arange(first, first + n).view(-1, 1)
        k = torch.arange(first + n).view(1, -1)
        causal = k <= q
        if self.kind == "window":
            return causal & ((k > q - self.window) | (k < self.sinks))
        attendable = torch.zeros(first + n, dtype=torch.bool)
        attendable[self.pending[1]] = True
        return causal & attendable

    # -- mutations

    def append_error(self, key: torch.Tensor) -> type[Exception] | None:
        if self.kind == "static" and self.seen + key.shape[2] > self.capacity:
            return CacheFullError
        return None

    def append(self, key, value) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.seen
        before = self.kept(first)  # an unattended update settles now, as if attended
        if self.keys is None:
            self.keys, self.values = key.clone(), value.clone()
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)
        if self.bounded:
            self.pending = (key.shape[2], before + list(range(first, self.seen)))
        return self.keys, self.values

    def trim_error(self, n: int) -> type[Exception] | None:
        if n < 0:
            return ValueError
        if n == 0:
            return None
        stored = self.length
        if n > stored:
            return UnsupportedOperation
        if self.bounded and (
            self.pending is not None or stored < self.seen or (self.kind == "window" and self.seen > self.max_slots)
        ):
            return UnsupportedOperation
        return None

    def trim(self, n: int) -> None:
        if n:
            self.keys, self.values = self.keys[:, :, : self.seen - n], self.values[:, :, : self.seen - n]

    def reset(self) -> None:
        if self.kind == "static" and self.keys is not None:
            # A static layer keeps its buffers, so its geometry (batch, heads, dims, dtype).
            self.keys, self.values = self.keys[:, :, :0], self.values[:, :, :0]
        else:
            self.keys = self.values = None
        self.pending = None

    def rebatch(self, index: list[int]) -> None:
        if self.keys is not None:
            idx = torch.tensor(index, dtype=torch.long)
            self.keys, self.values = self.keys[idx], self.values[idx]

    def repeat(self, n: int) -> None:
        if self.keys is not None:
            self.keys = self.keys.repeat_interleave(n, dim=0)
            self.values = self.values.repeat_interleave(n, dim=0)

    def load(self, other: Ref) -> None:
        """``load_state`` of a state taken (between forward passes) when the reference was ``other``."""
        if other.keys is None:
            self.reset()  # load_state resets, then has nothing to append
        else:
            self.keys, self.values = other.keys.clone(), other.values.clone()
        self.pending = None


# ---- comparisons ----------------------------------------------------------------------------


def assert_matches(layer, ref: Ref) -> None:
    """An unbounded layer holds the whole history, in order."""
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


def slot_bytes(layer, key_dim: int, value_dim: int, elem: int) -> int:
    per = (key_dim + value_dim) * elem
    if isinstance(layer, EvictingLayer):
        per += 8 + 4  # int64 position, float32 score
    return per


def check_stored(layer, ref: Ref, key_dim: int, value_dim: int, elem: int) -> None:
    """A bounded layer holds exactly what the reference says, content included."""
    assert layer.seen == ref.seen, (layer.seen, ref.seen)
    if ref.keys is None:
        assert layer.length == 0
        k, _ = layer.view()
        assert k is None or k.shape[2] == 0
        return
    want = ref.kept()
    assert layer.length == len(want), (layer.length, want)
    pos = layer.positions()
    batch, heads = ref.keys.shape[:2]
    assert tuple(pos.shape) == (batch, heads, len(want)), (tuple(pos.shape), want)
    keys, values = layer.view()
    for b in range(batch):
        for h in range(heads):
            got = pos[b, h].tolist()
            assert sorted(got) == want, f"row {b} head {h}: stored {sorted(got)}, expected {want}"
            idx = pos[b, h].long()
            assert torch.equal(keys[b, h], ref.keys[b, h, idx]), f"row {b} head {h}: keys differ"
            assert torch.equal(values[b, h], ref.values[b, h, idx]), f"row {b} head {h}: values differ"
    per_row_slots = ref.max_slots + (1 if isinstance(layer, EvictingLayer) else 0)
    bound = per_row_slots * batch * heads * slot_bytes(layer, key_dim, value_dim, elem)
    assert layer.nbytes <= bound, (layer.nbytes, bound)


def check_pending(layer, ref: Ref) -> None:
    """Between an update and its attention: positions are in range, unique, and hold the history."""
    assert layer.seen == ref.seen
    pos = layer.positions()
    if pos.numel() == 0:
        return
    assert (pos >= 0).all() and (pos < ref.seen).all()
    keys, values = layer.view()
    for b in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            row = pos[b, h]
            assert len(set(row.tolist())) == row.numel()
            assert torch.equal(keys[b, h], ref.keys[b, h, row.long()])
            assert torch.equal(values[b, h], ref.values[b, h, row.long()])
    assert layer.length <= ref.max_slots + 1


def growable_bound(tokens: int, initial: int) -> int:
    if tokens <= 0:
        return 1
    return max(0, math.ceil(math.log2(tokens / initial))) + 1


class Pair:
    """A layer under test, its reference, and what the reallocation bound needs."""

    def __init__(self, layer, ref: Ref):
        self.layer = layer
        self.ref = ref
        self.pure_append = True  # only appends since creation or the last reset
        self.realloc_base = layer.reallocations

    def fork(self) -> Pair:
        out = Pair(self.layer.fork(), self.ref.copy())
        out.pure_append, out.realloc_base = self.pure_append, self.realloc_base
        return out


# ---- the kinds ------------------------------------------------------------------------------

GEOMETRY = dict(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    group=st.just(1),
    key_dim=st.integers(1, 8),
    value_dim=st.integers(1, 8),
    dtype=st.sampled_from(dtypes_here(torch.float32, torch.bfloat16, torch.float16)),
    seed=st.integers(0, 2**31 - 1),
)
#: Bounded kinds attend (GQA groups; dtypes SDPA compares within TOLERANCE).
BOUNDED_GEOMETRY = dict(
    GEOMETRY,
    heads=st.integers(1, 2),
    group=st.integers(1, 2),
    key_dim=st.integers(1, 6),
    value_dim=st.integers(1, 6),
    dtype=st.sampled_from(dtypes_here(torch.float32, torch.bfloat16)),
)
STATIC_LARGE = 30 * MAX_CHUNK + 10  # more than any run appends


def make_concat(m, data) -> Pair:
    return Pair(ConcatLayer(), Ref("concat"))


def make_growable(m, data) -> Pair:
    initial = data.draw(st.integers(1, 8), label="initial_capacity")
    growth = data.draw(st.sampled_from([2.0, 2.0, 1.5, 3.0]), label="growth")
    return Pair(GrowableLayer(initial_capacity=initial, growth=growth), Ref("growable"))


def make_static_large(m, data) -> Pair:
    """Capacity large enough for any run: appends never fail. Optionally caller-owned buffers."""
    ref = Ref("static", capacity=STATIC_LARGE)
    if data.draw(st.booleans(), label="caller-owned buffers"):  # initialized (geometry fixed) from the start
        kbuf = torch.full((m.batch, m.heads, STATIC_LARGE, m.key_dim), 7.0, dtype=m.dtype)
        vbuf = torch.full((m.batch, m.heads, STATIC_LARGE, m.value_dim), 7.0, dtype=m.dtype)
        ref.keys, ref.values = kbuf[:, :, :0].clone(), vbuf[:, :, :0].clone()
        return Pair(StaticLayer(STATIC_LARGE, keys=kbuf, values=vbuf), ref)
    return Pair(StaticLayer(STATIC_LARGE), ref)


def make_static_small(m, data) -> Pair:
    """Small capacities: many appends hit CacheFullError, which must write nothing."""
    capacity = data.draw(st.integers(1, 24), label="capacity")
    return Pair(StaticLayer(capacity), Ref("static", capacity=capacity))


def make_window(m, data) -> Pair:
    window = data.draw(st.integers(1, 6), label="window")
    sinks = data.draw(st.integers(0, 3), label="sinks")
    initial = data.draw(st.integers(1, 4), label="initial_capacity")
    layer = WindowLayer(window, sinks=sinks, initial_capacity=initial)
    return Pair(layer, Ref("window", window=window, sinks=sinks))


def make_lastrec(m, data) -> Pair:
    budget = data.draw(st.integers(1, 8), label="budget")
    sinks = data.draw(st.integers(0, budget - 1), label="sinks")
    recent = data.draw(st.none() | st.integers(0, budget - 1 - sinks), label="recent")
    layer = EvictingLayer(budget, policy="lastrec", recent=recent, sinks=sinks)
    return Pair(layer, Ref("lastrec", sinks=sinks, budget=budget))


# ---- the machine ----------------------------------------------------------------------------


class LayerMachine(RuleBasedStateMachine):
    """Subclasses (``machine``) set ``kind``, ``geometry`` and ``make``."""

    kind = ""
    make = None

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[Pair] = []
        self.snapshots: list[tuple] = []  # (cloned LayerState, reference copy)
        self.gen = torch.Generator()

    @property
    def bounded(self) -> bool:
        return self.kind in BOUNDED

    @property
    def elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    # -- helpers

    def setup(self, data, batch, heads, group, key_dim, value_dim, dtype, seed) -> None:
        self.batch, self.heads, self.group = batch, heads, group
        self.key_dim, self.value_dim, self.dtype = key_dim, value_dim, dtype
        self.gen.manual_seed(seed)
        self.pairs = [type(self).make(self, data)]

    def pick(self, i: int) -> Pair:
        return self.pairs[i % len(self.pairs)]

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def chunk(self, batch: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.rand(batch, self.heads, tokens, self.key_dim)
        v = self.rand(batch, self.heads, tokens, self.value_dim)
        return k, v

    def current_batch(self, pair: Pair) -> int:
        return pair.ref.batch if pair.ref.initialized else self.batch

    def check(self, pair: Pair) -> None:
        if not self.bounded:
            assert_matches(pair.layer, pair.ref)
        elif pair.ref.pending is None:
            check_stored(pair.layer, pair.ref, self.key_dim, self.value_dim, self.elem)
        else:
            check_pending(pair.layer, pair.ref)

    def expect_unchanged(self, pair: Pair, exc: type[Exception], fn) -> None:
        before = layer_fingerprint(pair.layer)
        positions = pair.layer.positions().clone()
        with pytest.raises(exc):
            fn()
        assert layer_fingerprint(pair.layer) == before
        assert torch.equal(pair.layer.positions(), positions)
        self.check(pair)

    # -- appends and attention

    def _append(self, pair: Pair, n: int, attend: bool) -> None:
        k, v = self.chunk(self.current_batch(pair), n)
        err = pair.ref.append_error(k)
        if err is not None:
            self.expect_unchanged(pair, err, lambda: pair.layer.update(k, v))
            return
        was_initialized = pair.layer.initialized
        reallocs = pair.layer.reallocations
        got_k, got_v = pair.layer.update(k, v)
        want_k, want_v = pair.ref.append(k, v)
        if not self.bounded:  # bounded kinds return what attention reads (checked by attending)
            assert got_k.shape == want_k.shape and got_v.shape == want_v.shape
            assert torch.equal(got_k, want_k)
            assert torch.equal(got_v, want_v)
        if self.kind == "static" and was_initialized:
            assert pair.layer.reallocations == reallocs, "a static layer reallocated on append"
        if attend and self.bounded:
            self._attend(pair, use_scale=False)

    @rule(who=st.integers(0, MAX_PAIRS - 1), n=st.integers(0, MAX_CHUNK), attend=st.booleans())
    def append(self, who, n, attend):
        """Append ``n`` tokens; a bounded kind attends them now (a forward pass) or leaves them pending."""
        self._append(self.pick(who), n, attend)

    @precondition(lambda self: self.bounded)
    @rule(who=st.integers(0, MAX_PAIRS - 1), offset=st.integers(-1, 1), attend=st.booleans())
    def append_to_the_bound(self, who, offset, attend):
        """Append up to one token either side of the bound, where the trimming and eviction rules change."""
        pair = self.pick(who)
        n = pair.ref.max_slots + offset - pair.ref.seen
        if 0 <= n <= MAX_CHUNK:
            self._append(pair, n, attend)

    @precondition(lambda self: not self.bounded)
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
            v = self.rand(b, self.heads, tokens + 1, self.value_dim)
            err = ShapeError
        else:
            k, err = k[0], ShapeError
        self.expect_unchanged(pair, err, lambda: pair.layer.update(k, v))

    @precondition(lambda self: any(p.ref.pending is not None for p in self.pairs))
    @rule(who=st.integers(0, MAX_PAIRS - 1), use_scale=st.booleans())
    def attend(self, who, use_scale):
        pending = [p for p in self.pairs if p.ref.pending is not None]
        self._attend(pending[who % len(pending)], use_scale)

    def _attend(self, pair: Pair, use_scale: bool) -> None:
        n = pair.ref.pending[0]
        b, first = pair.ref.batch, pair.ref.seen - n
        q = self.rand(b, self.heads * self.group, n, self.key_dim)
        scale = 0.3 if use_scale else None
        out = pair.layer.attend(q, scale=scale)
        assert out.shape == (b, self.heads * self.group, n, self.value_dim)
        mask = pair.ref.visible(first, n)
        ref = F.scaled_dot_product_attention(
            q.double(), pair.ref.keys.double(), pair.ref.values.double(), attn_mask=mask, scale=scale, enable_gqa=True
        )
        tol = TOLERANCE[self.dtype]
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        pair.ref.pending = None
        with pytest.raises(UnsupportedOperation):  # one attention per update
            pair.layer.attend(q)

    # -- trims, states, forks, resets

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
        if pair.ref.pending is not None:
            return  # a snapshot is taken between forward passes
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
        self.check(Pair(rebuilt, pair.ref))
        if rebuilt.initialized and rebuilt.length:
            k, _ = rebuilt.view()
            assert k.untyped_storage().data_ptr() != state.tensors["keys"].untyped_storage().data_ptr()

    @precondition(lambda self: len(self.snapshots) > 0)
    @rule(who=st.integers(0, MAX_PAIRS - 1), which=st.integers(0, MAX_SNAPSHOTS - 1))
    def restore(self, who, which):
        pair = self.pick(who)
        state, ref = self.snapshots[which % len(self.snapshots)]
        # The cloned state is unaffected by everything that happened since it was taken.
        if not self.bounded and ref.initialized and "keys" in state.tensors:
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
        assert pair.layer.seen == 0 and pair.layer.length == 0
        pair.pure_append = True
        pair.realloc_base = pair.layer.reallocations

    # -- batch work (between forward passes)

    @rule(who=st.integers(0, MAX_PAIRS - 1), data=st.data())
    def select(self, who, data):
        pair = self.pick(who)
        if pair.ref.pending is not None:
            return
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
        if pair.ref.pending is not None:
            return
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
        if pair.ref.pending is not None:
            return
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
            self.check(pair)
            if self.kind == "growable" and pair.pure_append:
                got = pair.layer.reallocations - pair.realloc_base
                bound = growable_bound(pair.ref.length, pair.layer.initial_capacity)
                if pair.layer.growth == 2.0:
                    assert got <= bound, (got, bound, pair.ref.length, pair.layer.initial_capacity)
                if pair.ref.length == 0 and not pair.layer.initialized:
                    assert got == 0


def machine(kind: str, make, geometry: dict, examples: int, steps: int):
    """The machine for one kind: its layer (``make``), its geometry strategies, its budget of runs."""

    class KindMachine(LayerMachine):
        @initialize(data=st.data(), **geometry)
        def init(self, data, **drawn):
            self.setup(data, **drawn)

    KindMachine.kind = kind
    KindMachine.make = make
    KindMachine.__name__ = KindMachine.__qualname__ = f"{make.__name__.removeprefix('make_').title().replace('_', '')}Machine"
    test = KindMachine.TestCase
    test.settings = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        report_multiple_bugs=False,  # shrink one failure, not every distinct one: keeps a failing run short
    )
    return test


TestConcatLayer = machine("concat", make_concat, GEOMETRY, 120, 30)
TestGrowableLayer = machine("growable", make_growable, GEOMETRY, 200, 30)
TestStaticLayerLarge = machine("static", make_static_large, GEOMETRY, 120, 30)
TestStaticLayerFull = machine("static", make_static_small, GEOMETRY, 120, 30)
TestWindowLayerMachine = machine("window", make_window, BOUNDED_GEOMETRY, 50, 25)
TestLastRecentMachine = machine("lastrec", make_lastrec, BOUNDED_GEOMETRY, 50, 25)


# ---- a pure-append run: the growable reallocation bound at every length --------------------


@settings(max_examples=150, deadline=None)
@given(
    initial=st.integers(1, 8),
    chunks=st.lists(st.integers(0, MAX_CHUNK), min_size=1, max_size=60),
)
def test_growable_pure_append_reallocation_bound(initial, chunks):
    layer, ref = GrowableLayer(initial_capacity=initial), Ref("growable")
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
