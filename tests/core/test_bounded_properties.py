"""Stateful property tests of the bounded layers against a reference that keeps the whole history.

Hypothesis drives random sequences of appends (0..10 tokens), attention with random queries,
trims (valid and refused), snapshots (``state().clone()``) and ``load_state``, forks, batch
select / repeat / beam reorder and resets against a ``WindowLayer`` and an ``EvictingLayer`` with
the ``lastrec`` policy (deterministic without attention: the score is the position). The
reference keeps every key and value ever appended with ``torch.cat`` and derives what the layer
must hold:

- window: the positions ``p < sinks`` and ``p >= seen - window``;
- lastrec with a budget: everything while ``seen <= budget``, else the ``sinks`` first positions
  and the ``budget - sinks`` last ones (once the last update was attended; an unattended update
  settles at the next one).

A query at position q attends key k iff k <= q and k is visible: for the window, k > q - window or
k < sinks; for lastrec, k was kept before the update or is one of the update's tokens. Attention
is compared with torch's SDPA over the full history with that explicit boolean mask (in float64).
Checked after every step, while no attention is pending: the stored positions per (row, KV head)
are exactly the expected set, ``view()`` holds the history at those positions, ``length`` and
``seen`` agree, ``nbytes`` stays within the bound. A refused call changes nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import layer_fingerprint
from kvcache import ShapeError, UnsupportedOperation
from kvcache.layers import EvictingLayer, WindowLayer

MAX_CHUNK = 10
MAX_PAIRS = 3  # the layer plus at most two forks
MAX_SNAPSHOTS = 3
STEPS = 25
DTYPES = (torch.float32, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


class RefBounded:
    """The whole history (``[B, Hkv, seen, D]``, appended with ``torch.cat``) and the rule deciding
    which positions a bounded layer keeps."""

    def __init__(self, kind: str, *, window: int = 0, sinks: int = 0, budget: int = 0):
        self.kind, self.window, self.sinks, self.budget = kind, window, sinks, budget
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.pending: tuple[int, list[int]] | None = None  # (queries, positions they may attend)

    def copy(self) -> RefBounded:
        out = RefBounded(self.kind, window=self.window, sinks=self.sinks, budget=self.budget)
        if self.keys is not None:
            out.keys, out.values = self.keys.clone(), self.values.clone()
        out.pending = None if self.pending is None else (self.pending[0], list(self.pending[1]))
        return out

    @property
    def seen(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def batch(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]

    @property
    def max_slots(self) -> int:
        return self.window + self.sinks if self.kind == "window" else self.budget

    def kept(self, seen: int | None = None) -> list[int]:
        """Positions stored after ``seen`` tokens once attention has run (sorted)."""
        seen = self.seen if seen is None else seen
        if self.kind == "window":
            return [p for p in range(seen) if p < self.sinks or p >= seen - self.window]
        if seen <= self.budget:
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

    def append(self, key, value) -> None:
        first = self.seen
        before = self.kept(first)  # an unattended update settles now, as if attended
        if self.keys is None:
            self.keys, self.values = key.clone(), value.clone()
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)
        self.pending = (key.shape[2], before + list(range(first, self.seen)))

    def trim_error(self, n: int) -> type[Exception] | None:
        if n < 0:
            return ValueError
        if n == 0:
            return None
        stored = len(self.kept())
        if self.pending is not None or n > stored or stored < self.seen or (
            self.kind == "window" and self.seen > self.max_slots
        ):
            return UnsupportedOperation
        return None

    def trim(self, n: int) -> None:
        if n:
            self.keys, self.values = self.keys[:, :, : self.seen - n], self.values[:, :, : self.seen - n]

    def reset(self) -> None:
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


def slot_bytes(layer, ref: RefBounded, key_dim: int, value_dim: int, elem: int) -> int:
    per = (key_dim + value_dim) * elem
    if isinstance(layer, EvictingLayer):
        per += 8 + 4  # int64 position, float32 score
    return per


def check_stored(layer, ref: RefBounded, key_dim: int, value_dim: int, elem: int) -> None:
    """The layer holds exactly what the reference says, content included."""
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
    bound = per_row_slots * batch * heads * slot_bytes(layer, ref, key_dim, value_dim, elem)
    assert layer.nbytes <= bound, (layer.nbytes, bound)


def check_pending(layer, ref: RefBounded) -> None:
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


class Pair:
    def __init__(self, layer, ref: RefBounded):
        self.layer, self.ref = layer, ref

    def fork(self) -> Pair:
        return Pair(self.layer.fork(), self.ref.copy())


class BoundedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[Pair] = []
        self.snapshots: list = []
        self.gen = torch.Generator()

    def make(self) -> Pair:
        raise NotImplementedError

    def setup(self, batch, heads, group, key_dim, value_dim, dtype, seed) -> None:
        self.batch, self.heads, self.group = batch, heads, group
        self.key_dim, self.value_dim, self.dtype = key_dim, value_dim, dtype
        self.gen.manual_seed(seed)
        self.pairs = [self.make()]

    def pick(self, i: int) -> Pair:
        return self.pairs[i % len(self.pairs)]

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def batch_of(self, pair: Pair) -> int:
        return pair.ref.batch if pair.ref.batch is not None else self.batch

    def expect_unchanged(self, pair: Pair, exc, fn) -> None:
        before = layer_fingerprint(pair.layer)
        positions = pair.layer.positions().clone()
        with pytest.raises(exc):
            fn()
        assert layer_fingerprint(pair.layer) == before
        assert torch.equal(pair.layer.positions(), positions)

    # -- rules

    def _append(self, pair: Pair, n: int, attend: bool) -> None:
        b = self.batch_of(pair)
        k, v = self.rand(b, self.heads, n, self.key_dim), self.rand(b, self.heads, n, self.value_dim)
        pair.layer.update(k, v)
        pair.ref.append(k, v)
        if attend:
            self._attend(pair, use_scale=False)

    @rule(who=st.integers(0, MAX_PAIRS - 1), n=st.integers(0, MAX_CHUNK), attend=st.booleans())
    def append(self, who, n, attend):
        """Append ``n`` tokens; attend them now (a forward pass) or leave them pending."""
        self._append(self.pick(who), n, attend)

    @rule(who=st.integers(0, MAX_PAIRS - 1), offset=st.integers(-1, 1), attend=st.booleans())
    def append_to_the_bound(self, who, offset, attend):
        """Append up to one token either side of the bound, where the trimming and eviction rules change."""
        pair = self.pick(who)
        n = pair.ref.max_slots + offset - pair.ref.seen
        if 0 <= n <= MAX_CHUNK:
            self._append(pair, n, attend)

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

    @rule(who=st.integers(0, MAX_PAIRS - 1), n=st.integers(-2, MAX_CHUNK + 2))
    def trim(self, who, n):
        pair = self.pick(who)
        err = pair.ref.trim_error(n)
        if err is not None:
            self.expect_unchanged(pair, err, lambda: pair.layer.check_trim(n))
            self.expect_unchanged(pair, err, lambda: pair.layer.trim(n))
            return
        pair.layer.check_trim(n)
        pair.layer.trim(n)
        pair.ref.trim(n)

    @precondition(lambda self: len(self.snapshots) < MAX_SNAPSHOTS)
    @rule(who=st.integers(0, MAX_PAIRS - 1))
    def snapshot(self, who):
        pair = self.pick(who)
        if pair.ref.pending is not None:
            return  # a snapshot is taken between forward passes
        before = layer_fingerprint(pair.layer)
        state = pair.layer.state().clone()
        assert layer_fingerprint(pair.layer) == before
        self.snapshots.append((state, pair.ref.copy()))
        rebuilt = type(pair.layer).from_state(state)
        check_stored(rebuilt, pair.ref, self.key_dim, self.value_dim, self.elem)

    @precondition(lambda self: len(self.snapshots) > 0)
    @rule(who=st.integers(0, MAX_PAIRS - 1), which=st.integers(0, MAX_SNAPSHOTS - 1))
    def restore(self, who, which):
        pair = self.pick(who)
        state, ref = self.snapshots[which % len(self.snapshots)]
        pair.layer.load_state(state)
        pair.ref = ref.copy()

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
        self.pairs.append(child)

    @rule(who=st.integers(0, MAX_PAIRS - 1))
    def reset(self, who):
        pair = self.pick(who)
        pair.layer.reset()
        pair.ref.reset()
        assert pair.layer.seen == 0 and pair.layer.length == 0

    @rule(who=st.integers(0, MAX_PAIRS - 1), data=st.data())
    def batch_work(self, who, data):
        pair = self.pick(who)
        if pair.ref.pending is not None or pair.ref.keys is None:
            return  # batch work happens between forward passes
        b = pair.ref.batch
        how = data.draw(st.sampled_from(["select", "mask", "repeat", "reorder", "bad"]))
        if how == "select":
            rows = data.draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b, unique=True))
            pair.layer.select(torch.tensor(rows, dtype=torch.long))
            pair.ref.rebatch(rows)
        elif how == "mask":
            keep = data.draw(st.lists(st.booleans(), min_size=b, max_size=b).filter(any))
            pair.layer.select(torch.tensor(keep))
            pair.ref.rebatch([i for i, k in enumerate(keep) if k])
        elif how == "repeat":
            n = data.draw(st.integers(1, 2))
            pair.layer.repeat(n)
            pair.ref.repeat(n)
        elif how == "reorder":
            beam = data.draw(st.lists(st.integers(0, b - 1), min_size=b, max_size=b))
            pair.layer.reorder(torch.tensor(beam, dtype=torch.long))
            pair.ref.rebatch(beam)
        else:
            bad = torch.zeros(b + 1, dtype=torch.long)
            self.expect_unchanged(pair, ShapeError, lambda: pair.layer.reorder(bad))

    # -- invariants

    @invariant()
    def matches_reference(self):
        for pair in self.pairs:
            if pair.ref.pending is None:
                check_stored(pair.layer, pair.ref, self.key_dim, self.value_dim, self.elem)
            else:
                check_pending(pair.layer, pair.ref)

    @property
    def elem(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()


GEOMETRY = dict(
    batch=st.integers(1, 3),
    heads=st.integers(1, 2),
    group=st.integers(1, 2),
    key_dim=st.integers(1, 6),
    value_dim=st.integers(1, 6),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
)


class WindowMachine(BoundedMachine):
    @initialize(window=st.integers(1, 6), sinks=st.integers(0, 3), initial=st.integers(1, 4), **GEOMETRY)
    def init(self, window, sinks, initial, **geometry):
        self.window, self.sinks, self.initial = window, sinks, initial
        self.setup(**geometry)

    def make(self) -> Pair:
        layer = WindowLayer(self.window, sinks=self.sinks, initial_capacity=self.initial)
        return Pair(layer, RefBounded("window", window=self.window, sinks=self.sinks))


class LastRecentMachine(BoundedMachine):
    @initialize(budget=st.integers(1, 8), data=st.data(), **GEOMETRY)
    def init(self, budget, data, **geometry):
        self.budget = budget
        self.sinks = data.draw(st.integers(0, budget - 1), label="sinks")
        self.recent = data.draw(st.none() | st.integers(0, budget - 1 - self.sinks), label="recent")
        self.setup(**geometry)

    def make(self) -> Pair:
        layer = EvictingLayer(self.budget, policy="lastrec", recent=self.recent, sinks=self.sinks)
        return Pair(layer, RefBounded("lastrec", sinks=self.sinks, budget=self.budget))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        report_multiple_bugs=False,  # shrink one failure, not every distinct one: keeps a failing run short
    )


TestWindowLayerMachine = WindowMachine.TestCase
TestWindowLayerMachine.settings = _settings(50)
TestLastRecentMachine = LastRecentMachine.TestCase
TestLastRecentMachine.settings = _settings(50)
