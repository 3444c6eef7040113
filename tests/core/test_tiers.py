"""Mixed precision inside a layer (``fine=``, ``layers/tiers.py``) on an evicting and an Ada-KV layer.

References: the same kind over one full-precision storage fed the same weights (which tokens are
kept must not depend on how they are stored), attention written out in plain torch over the kept
tokens each coded and decoded by its own run's storage (``Slots.encode`` then ``decode``), and the
same layer run uninterrupted (save/load).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.errors import DTypeError, ShapeError, UnsupportedOperation
from kvcache.layers import AdaptiveLayer, EvictingLayer
from kvcache.layers.slots import get_storage
from kvcache.layers.state import LayerState


def inputs(total: int, heads: int = 2, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, total, dim, generator=g)
    k = torch.randn(1, heads, total, dim, generator=g)
    v = torch.randn(1, heads, total, dim, generator=g)
    return q, k, v


def coded(storage: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., D]`` as ``storage`` gives it back (keys and values are coded alike, per token)."""
    s = get_storage(storage)
    y = x.reshape(1, 1, -1, x.shape[-1])
    from kvcache.layers.checks import Geometry

    g = Geometry(1, 1, x.shape[-1], x.shape[-1], x.dtype, x.device)
    return s.decode(s.encode(y, y), y.shape[2], g)[0].reshape(x.shape)


def runs_of(layer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each run's positions and (Ada-KV) heads ``[B, H, n]``."""
    out = {}
    for name, store in layer.store.runs.items():
        t = store.in_use()
        out[name] = (t["positions"].long(), t["heads"].long() if "heads" in t else None)
    return out


@pytest.mark.parametrize("fine, coarse", [("int8", "int4"), ("full", "int2")])
def test_a_decode_step_attends_each_kept_token_as_its_runs_storage_gives_it_back(fine, coarse):
    q, k, v = inputs(31)
    layer = EvictingLayer(12, policy="snapkv", window=4, storage=coarse, fine=fine, fine_share=0.25)
    plain = EvictingLayer(12, policy="snapkv", window=4)
    for each in (layer, plain):
        each.update(k[:, :, :30], v[:, :, :30])
    # The prompt's pass reads its own tokens in full precision: the same as one full storage.
    torch.testing.assert_close(layer.attend(q[:, :, :30]), plain.attend(q[:, :, :30]), rtol=0, atol=0)
    runs = runs_of(layer)
    assert [r[0].shape[2] for r in runs.values()] == [3, 9]
    for h in range(2):
        kept = set(torch.cat([runs["fine"][0][0, h], runs["coarse"][0][0, h]]).tolist())
        assert kept == set(plain.positions()[0, h].tolist())
        score = dict(zip(plain.positions()[0, h].tolist(), plain.scores()[0, h].tolist()))
        recent = set(range(30 - plain.recent_now(), 30))
        rank = lambda p: math.inf if p in recent else score[p]  # noqa: E731
        assert min(rank(p) for p in runs["fine"][0][0, h].tolist()) >= max(rank(p) for p in runs["coarse"][0][0, h].tolist())
    fine_pos, coarse_pos = runs["fine"][0][0], runs["coarse"][0][0]
    layer.update(k[:, :, 30:31], v[:, :, 30:31])
    out = layer.attend(q[:, :, 30:31])
    for h in range(2):
        keys = torch.cat([coded(fine, k[0, h, fine_pos[h]]), coded(coarse, k[0, h, coarse_pos[h]]), k[0, h, 30:31]])
        values = torch.cat([coded(fine, v[0, h, fine_pos[h]]), coded(coarse, v[0, h, coarse_pos[h]]), v[0, h, 30:31]])
        weights = torch.softmax(q[0, h, 30] @ keys.T / math.sqrt(16), dim=-1)
        torch.testing.assert_close(out[0, h, 0], weights @ values, rtol=1e-5, atol=1e-5)


def test_an_adakv_layer_splits_its_row_across_heads_by_rank():
    q, k, v = inputs(40, heads=2)
    layer = AdaptiveLayer(10, window=4, pool=3, storage="int4", fine="int8", fine_share=0.3)
    plain = AdaptiveLayer(10, window=4, pool=3)
    for each in (layer, plain):
        each.update(k[:, :, :36], v[:, :, :36])
        each.attend(q[:, :, :36])
    runs = runs_of(layer)
    assert runs["fine"][0].shape[2] == round(0.3 * 20) and runs["coarse"][0].shape[2] == 20 - 6
    key = lambda pos, heads: {(int(h), int(p)) for p, h in zip(pos[0, 0], heads[0, 0])}  # noqa: E731
    both = key(*runs["fine"]) | key(*runs["coarse"])
    assert both == key(plain.positions(), plain.heads())
    score = {(int(h), int(p)): float(s) for p, h, s in zip(plain.positions()[0, 0], plain.heads()[0, 0], plain.scores()[0, 0])}
    rank = lambda hp: math.inf if hp[1] >= 36 - plain.recent_now() else score[hp]  # noqa: E731
    assert min(map(rank, key(*runs["fine"]))) >= max(map(rank, key(*runs["coarse"])))
    for _ in range(5):  # decode steps keep the row's count and split
        n = layer.seen
        layer.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
        layer.attend(q[:, :, n : n + 1])
        assert layer.length == 2 * 10 and layer.store.runs["fine"].length == 6


def test_a_slot_that_stays_in_its_run_keeps_its_codes():
    q, k, v = inputs(60)
    layer = EvictingLayer(16, policy="h2o", storage="int4", fine="int8", fine_share=0.5)
    layer.update(k[:, :, :30], v[:, :, :30])
    layer.attend(q[:, :, :30])

    def codes():
        return {
            run: {(h, int(p)): tuple(t[name][0, h, i].clone() for name in sorted(t) if name not in ("positions", "scores"))
                  for h in range(2) for i, p in enumerate(t["positions"][0, h])}
            for run, t in ((run, s.in_use()) for run, s in layer.store.runs.items())
        }  # fmt: skip

    moved = stayed = 0
    for n in range(30, 60):
        before = codes()
        layer.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
        layer.attend(q[:, :, n : n + 1])
        after = codes()
        for run in before:
            for slot, tensors in before[run].items():
                if slot in after[run]:
                    stayed += 1
                    assert all(torch.equal(a, b) for a, b in zip(tensors, after[run][slot])), (run, slot)
                else:
                    moved += 1
    assert stayed > 100 and moved > 0


def test_bytes_are_each_runs_slots_at_its_storage_size_plus_tags():
    q, k, v = inputs(50, dim=32)
    layer = EvictingLayer(20, policy="snapkv", storage="int4", fine="int8", fine_share=0.25)
    layer.update(k[:, :, :50], v[:, :, :50])
    layer.attend(q[:, :, :50])
    from kvcache.layers.auto import slot_bytes
    from kvcache.layers.checks import Geometry

    g = Geometry(1, 2, 32, 32, torch.float32, torch.device("cpu"))
    assert layer.nbytes == 2 * (5 * slot_bytes("int8", g) + 15 * slot_bytes("int4", g))
    ones = []
    for storage in ("int4", "int8"):
        one = EvictingLayer(20, policy="snapkv", storage=storage)
        one.update(k[:, :, :50], v[:, :, :50])
        one.attend(q[:, :, :50])
        ones.append(one.nbytes)
    assert ones[0] < layer.nbytes < ones[1]


@pytest.mark.parametrize("kind", ["evicting", "adakv"])
def test_state_round_trip_continues_exactly(kind):
    q, k, v = inputs(48)
    make = {
        "evicting": lambda: EvictingLayer(12, policy="snapkv", window=4, storage="int2", fine="int8", fine_share=0.25),
        "adakv": lambda: AdaptiveLayer(12, window=4, pool=3, storage="int4", fine="full", fine_share=0.4),
    }[kind]
    layer = make()
    for start, stop in ((0, 40), (40, 41), (41, 42)):
        layer.update(k[:, :, start:stop], v[:, :, start:stop])
        layer.attend(q[:, :, start:stop])
    state = layer.state().clone()
    assert any(name.startswith("fine.") for name in state.tensors) and any(name.startswith("coarse.") for name in state.tensors)
    copy = type(layer).from_state(state)
    assert copy.options() == layer.options() and copy.seen == layer.seen and copy.nbytes == layer.nbytes
    for n in range(42, 48):
        outs = []
        for each in (layer, copy):
            each.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
            outs.append(each.attend(q[:, :, n : n + 1]))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _damaged(state: LayerState, name: str, fn) -> LayerState:
    out = state.clone()
    out.tensors[name] = fn(out.tensors[name])
    return out


@pytest.mark.parametrize("kind", ["evicting", "adakv"])
def test_crafted_states_are_refused_and_change_nothing(kind):
    q, k, v = inputs(30)
    make = {
        "evicting": lambda: EvictingLayer(8, policy="snapkv", window=4, storage="int4", fine="int8"),
        "adakv": lambda: AdaptiveLayer(8, window=4, storage="int4", fine="int8"),
    }[kind]
    layer = make()
    layer.update(k, v)
    layer.attend(q)
    state = layer.state()
    before = layer.state().clone()
    fine_pos = "fine.positions"
    bad = [
        LayerState(state.kind, state.options, state.seen, {n: t for n, t in state.tensors.items() if not n.startswith("coarse.")}),
        LayerState(state.kind, state.options, state.seen, {**state.tensors, "extra": state.tensors[fine_pos]}),
        _damaged(state, fine_pos, lambda t: t + 100),
        _damaged(state, "fine.kcodes", lambda t: t[..., :-1]),
        _damaged(state, "coarse.kscale", lambda t: t.to(torch.int32)),
        # one slot moved from the fine run's count: not the split fine_share keeps
        LayerState(state.kind, state.options, state.seen, {n: (t[:, :, :-1] if n.startswith("fine.") else t) for n, t in state.tensors.items()}),
    ]
    for crafted in bad:
        with pytest.raises((ValueError, ShapeError, DTypeError)):
            layer.load_state(crafted)
        after = layer.state()
        assert all(torch.equal(after.tensors[n], before.tensors[n]) for n in before.tensors)


def test_options_are_checked_and_kept():
    with pytest.raises(ValueError, match="finer than"):
        EvictingLayer(8, policy="h2o", storage="int8", fine="int4")
    with pytest.raises(ValueError, match="finer than"):
        AdaptiveLayer(8, storage="int4", fine="int4")
    with pytest.raises(ValueError, match="give fine="):
        EvictingLayer(8, policy="h2o", storage="int4", fine_share=0.5)
    for share in (0, 1, 1.5):
        with pytest.raises(ValueError, match="fine_share"):
            AdaptiveLayer(8, storage="int4", fine="int8", fine_share=share)
    with pytest.raises(ValueError, match="unknown slot storage"):
        EvictingLayer(8, policy="h2o", storage="int4", fine="int9")
    layer = EvictingLayer(8, policy="h2o", storage="int4", fine="int8")
    assert layer.options()["fine"] == "int8" and layer.options()["fine_share"] == 0.25 and layer.options()["storage"] == "int4"
    assert not layer.exact


def test_nothing_can_be_trimmed():
    q, k, v = inputs(6)
    layer = EvictingLayer(8, policy="h2o", storage="int4", fine="int8")
    layer.update(k, v)
    layer.attend(q)
    with pytest.raises(UnsupportedOperation, match="fine=int8"):
        layer.trim(1)
    assert layer.seen == 6 and layer.length == 6


@settings(max_examples=25, deadline=None)
@given(
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    budget=st.integers(2, 10),
    share=st.sampled_from([0.1, 0.25, 0.5, 0.75]),
    policy=st.sampled_from(["h2o", "tova"]),  # every step reports weights: no ties to break
    seed=st.integers(0, 2**16),
)
def test_the_kept_set_is_the_kinds_own_and_the_split_follows_the_rank(chunks, budget, share, policy, seed):
    """Fed the same weights (a fixed weight per head and position, so no two slots tie), a mixed
    layer keeps what the kind keeps over one full storage, its fine run holds ``round(share * kept)`` slots per head,
    none ranked below a coarse one, and no position twice."""
    total = sum(chunks)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(1, 2, total, 8, generator=g), torch.randn(1, 2, total, 8, generator=g)
    table = torch.rand(1, 2, total, generator=g)
    mixed = EvictingLayer(budget, policy=policy, storage="int4", fine="int8", fine_share=share)
    plain = EvictingLayer(budget, policy=policy)
    start = 0
    for n in chunks:
        for layer in (mixed, plain):
            reads = layer.append(k[:, :, start : start + n], v[:, :, start : start + n])
            if reads.weights is None:
                layer.settle(None)
                continue
            pos = reads.slot_positions().expand(1, 2, -1)
            w = table.gather(2, pos.clamp(0, total - 1))
            w = w / w.sum(dim=-1, keepdim=True)
            modes = reads.weights if isinstance(reads.weights, tuple) else (reads.weights,)
            layer.settle(w if len(modes) == 1 else {m: w for m in modes})
        start += n
        runs = runs_of(mixed)
        kept = mixed.length
        for h in range(2):
            f, c = runs["fine"][0][0, h].tolist(), runs["coarse"][0][0, h].tolist()
            assert sorted(f + c) == sorted(plain.positions()[0, h].tolist())
            assert len(set(f + c)) == len(f + c)
            assert len(f) == min(len(f + c), round(share * len(f + c)))
            rank = mixed._rank(mixed.store.in_use())[0, h]
            assert bool((rank[: len(f)].min() >= rank[len(f) :].max()) if f and c else True)
        assert kept == plain.length


def test_make_cache_takes_the_options_on_a_model():
    from helpers import attention_for, model_for, prompt

    model = model_for("llama")
    cache = kvcache.make_cache(model, "adakv:budget=16,storage=int4,fine=int8,fine_share=0.25")
    ids = prompt(40, seed=1)
    with attention_for(model, cache):
        model.generate(ids, **kvcache.cache_kwargs(model, cache), max_new_tokens=4, do_sample=False)
    layer = cache.kv_layers[0]
    assert layer.tiered and layer.options()["fine"] == "int8"
    heads = model.config.num_key_value_heads
    assert layer.store.runs["fine"].length == round(0.25 * heads * 16)


@pytest.mark.parametrize("kind", ["evicting", "adakv"])
def test_batch_rows_move_with_both_runs(kind):
    q, k, v = inputs(40, seed=3)
    q2, k2, v2 = (torch.cat([x, y]) for x, y in zip(inputs(40, seed=4), (q, k, v)))  # row 1 is the single row
    make = {
        "evicting": lambda: EvictingLayer(10, policy="h2o", storage="int4", fine="int8", fine_share=0.3),
        "adakv": lambda: AdaptiveLayer(10, window=4, storage="int4", fine="int8", fine_share=0.3),
    }[kind]
    single, batch = make(), make()
    for layer, (qq, kk, vv) in ((single, (q, k, v)), (batch, (q2, k2, v2))):
        layer.update(kk[:, :, :30], vv[:, :, :30])
        layer.attend(qq[:, :, :30])
    batch.select([1])
    batch.repeat(2)  # two copies of the row, as beams would
    fork = batch.fork()
    for n in range(30, 40):
        single.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
        want = single.attend(q[:, :, n : n + 1])
        for layer in (batch, fork):
            layer.update(k[:, :, n : n + 1].expand(2, -1, -1, -1), v[:, :, n : n + 1].expand(2, -1, -1, -1))
            got = layer.attend(q[:, :, n : n + 1].expand(2, -1, -1, -1))
            torch.testing.assert_close(got, want.expand(2, -1, -1, -1), rtol=1e-5, atol=1e-5)
    assert fork.nbytes == batch.nbytes == 2 * single.nbytes


@pytest.mark.parametrize("kind", ["evicting", "adakv"])
def test_of_equally_ranked_slots_the_newest_are_the_fine_ones(kind):
    """The recent tokens all rank first (they are never evicted); when they outnumber the fine run,
    the newest of them are the ones kept finer."""
    q, k, v = inputs(60)
    layer = {
        "evicting": lambda: EvictingLayer(20, policy="snapkv", window=4, recent=16, storage="int4", fine="int8", fine_share=0.25),
        "adakv": lambda: AdaptiveLayer(20, window=16, storage="int4", fine="int8", fine_share=0.25),
    }[kind]()
    layer.update(k[:, :, :50], v[:, :, :50])
    layer.attend(q[:, :, :50])
    for n in range(50, 60):
        layer.update(k[:, :, n : n + 1], v[:, :, n : n + 1])
        layer.attend(q[:, :, n : n + 1])
        fine = layer.store.runs["fine"].in_use()["positions"]
        assert int(fine.min()) >= n + 1 - fine.shape[2] // (2 if kind == "adakv" else 1)
