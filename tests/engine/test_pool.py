"""The paged engine's block pool (``kvcache.engine.BlockPool``): storage, reference counts, prefix
caching by hash chain, copy-on-write, and the invariants ``check`` asserts.

Every refused call is checked to change nothing (counts, refcounts, keys, the LRU order, the free
list and every stored tensor). A hypothesis state machine runs random allocate / retain / release /
register / lookup / write / copy_block sequences against a pure-Python model of the bookkeeping
and of the contents of the slots it wrote.
"""

from __future__ import annotations

import hashlib
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache.engine import BlockPool, PoolError, chain_keys
from kvcache.errors import KVCacheError
from kvcache.prompts import keys as prompt_keys

LAYERS, HEADS, D, DV, BS, BLOCKS = 2, 2, 3, 5, 4, 6


def make(**kw) -> BlockPool:
    geometry = dict(layers=LAYERS, kv_heads=HEADS, head_dim=D, block_size=BS, blocks=BLOCKS, value_dim=DV)
    return BlockPool(**(geometry | kw))


def snapshot(pool: BlockPool):
    """Everything a call could change, bookkeeping and storage."""
    return (
        pool.free_count,
        pool.cached_count,
        pool.owned_count,
        [pool.refcount(b) for b in range(pool.total)],
        [pool.key(b) for b in range(pool.total)],
        list(pool._lru),
        list(pool._reused_lru),
        list(pool._reused),
        list(pool._free),
        [list(w) for w in pool._written],
        [t.clone() for t in pool.storage.tensors.values()],
    )


def same(a, b) -> bool:
    return a[:-1] == b[:-1] and len(a[-1]) == len(b[-1]) and all(torch.equal(x, y) for x, y in zip(a[-1], b[-1]))


def refused(pool: BlockPool, call, match: str):
    before = snapshot(pool)
    with pytest.raises(PoolError, match=match) as caught:
        call()
    assert same(before, snapshot(pool)), "a refused call changed the pool"
    pool.check()
    return caught.value


def slots(n: int, seed: int, dim: int = D, heads: int = HEADS) -> torch.Tensor:
    return torch.randn(heads, n, dim, generator=torch.Generator().manual_seed(seed))


def fill(pool: BlockPool, block: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write every slot of ``block`` in every layer; returns what each layer got."""
    out = []
    for layer in range(pool.layers):
        k, v = slots(pool.block_size, seed * 100 + layer), slots(pool.block_size, seed * 100 + layer + 50, pool.value_dim)
        pool.write(layer, block, 0, k, v)
        out.append((k, v))
    return out


# ---- construction ---------------------------------------------------------------------------------


def test_storage_shapes_and_bytes_are_known_up_front():
    pool = make()
    keys, values = pool.storage.tensors["keys"], pool.storage.tensors["values"]
    assert len(keys) == len(values) == LAYERS and set(pool.storage.tensors) == {"keys", "values"}
    for k, v in zip(keys, values):
        assert k.shape == (BLOCKS, HEADS, BS, D) and v.shape == (BLOCKS, HEADS, BS, DV)
        assert k.dtype == v.dtype == torch.float32 and k.device.type == "cpu"
        assert not k.any() and not v.any()  # zeroed: a masked slot read by a matmul is never NaN
    assert pool.nbytes == LAYERS * BLOCKS * HEADS * BS * (D + DV) * 4
    assert (pool.free_count, pool.cached_count, pool.owned_count, pool.total) == (BLOCKS, 0, 0, BLOCKS)
    pool.check()


def test_value_dim_defaults_to_head_dim_and_dtype_is_kept():
    pool = BlockPool(1, 1, 8, 2, 3, dtype=torch.float64)
    values = pool.storage.layer(0)["values"]
    assert pool.value_dim == 8 and values.shape == (3, 1, 2, 8)
    assert values.dtype == torch.float64 and pool.nbytes == 2 * 3 * 2 * 8 * 8


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(layers=0), "layers must be at least 1"),
        (dict(kv_heads=-1), "kv_heads must be at least 1"),
        (dict(head_dim=1.5), "head_dim must be an integer"),
        (dict(block_size=True), "block_size must be an integer"),
        (dict(blocks=0), "blocks must be at least 1"),
        (dict(value_dim=0), "value_dim must be at least 1"),
        (dict(dtype=torch.int32), "floating-point"),
        (dict(dtype="float32"), "floating-point"),
        (dict(device="nowhere"), "device"),
    ],
)
def test_bad_construction_is_refused_by_name(kw, match):
    with pytest.raises(PoolError, match=match):
        make(**kw)


def test_pool_error_is_a_kvcache_error_and_a_value_error():
    assert issubclass(PoolError, KVCacheError) and issubclass(PoolError, ValueError)


# ---- allocate, retain, release ----------------------------------------------------------------------


def test_allocate_hands_out_distinct_blocks_with_one_reference():
    pool = make()
    got = pool.allocate(4)
    assert len(set(got)) == 4 and all(0 <= b < BLOCKS for b in got)
    assert all(pool.refcount(b) == 1 and pool.key(b) is None and pool.writable(b) for b in got)
    assert (pool.free_count, pool.cached_count, pool.owned_count) == (2, 0, 4)
    assert pool.allocate(0) == []
    assert set(pool.allocate(2)) == set(range(BLOCKS)) - set(got)
    pool.check()


def test_allocating_more_than_is_free_names_both_counts_and_changes_nothing():
    pool = make()
    pool.allocate(4)
    error = refused(pool, lambda: pool.allocate(3), "cannot allocate 3 blocks: 2 free of 6")
    assert "2 free, 0 cached, 4 owned" in str(error)


def test_cached_blocks_count_as_free_for_allocation():
    pool = make(blocks=3)
    a, b, c = pool.allocate(3)
    fill(pool, a, 1)
    pool.register(a, "k")
    pool.release(a)
    assert (pool.free_count, pool.cached_count, pool.available) == (0, 1, 1)
    refused(pool, lambda: pool.allocate(2), "cannot allocate 2 blocks: 1 free of 3 \\(0 free, 1 cached, 2 owned\\)")
    assert pool.allocate(1) == [a] and pool.key(a) is None and pool.lookup("k") is None


@pytest.mark.parametrize("n", [-1, 1.0, True, "2", None])
def test_allocate_refuses_a_bad_count(n):
    pool = make()
    refused(pool, lambda: pool.allocate(n), "n must be")


def test_retain_and_release_count_references():
    pool = make()
    (b,) = pool.allocate(1)
    pool.retain(b)
    pool.retain(b)
    assert pool.refcount(b) == 3 and not pool.writable(b)
    pool.release(b)
    pool.release(b)
    assert pool.refcount(b) == 1 and pool.writable(b) and pool.owned_count == 1
    pool.release(b)
    assert pool.refcount(b) == 0 and pool.free_count == BLOCKS and pool.cached_count == 0
    assert not pool.writable(b)
    pool.check()


def test_a_released_unkeyed_block_is_reused():
    pool = make(blocks=2)
    first = pool.allocate(2)
    pool.release(first[1])
    assert pool.allocate(1) == [first[1]]


@pytest.mark.parametrize("verb", ["retain", "release"])
def test_retain_and_release_refuse_blocks_not_owned(verb):
    pool = make()
    (b,) = pool.allocate(1)
    fill(pool, b, 0)
    pool.register(b, "k")
    pool.release(b)
    call = getattr(pool, verb)
    refused(pool, lambda: call(b), f"cannot {verb} block {b}: it is cached \\(lookup its key to use it\\)")
    free = next(x for x in range(BLOCKS) if x != b)
    refused(pool, lambda: call(free), f"cannot {verb} block {free}: it is free")
    refused(pool, lambda: call(BLOCKS), f"block {BLOCKS} is not a block of this pool \\(0 to {BLOCKS - 1}\\)")
    refused(pool, lambda: call(-1), "block -1 is not a block")
    refused(pool, lambda: call("0"), "block must be an integer")


def test_release_past_zero_is_refused():
    pool = make()
    (b,) = pool.allocate(1)
    pool.release(b)
    refused(pool, lambda: pool.release(b), "it is free")


def test_block_ids_may_be_numpy_or_torch_integers():
    pool = make()
    (b,) = pool.allocate(1)
    pool.retain(torch.tensor(b))
    assert pool.refcount(b) == 2


# ---- register and lookup --------------------------------------------------------------------------


def test_register_then_lookup_shares_the_block():
    pool = make()
    (b,) = pool.allocate(1)
    fill(pool, b, 3)
    assert pool.register(b, "key") == b
    assert pool.key(b) == "key" and not pool.writable(b)
    assert pool.lookup("key") == b and pool.refcount(b) == 2
    assert pool.lookup("other") is None and pool.lookup(b"key") is None  # bytes and str never meet
    pool.check()


def test_register_refuses_a_block_that_is_not_full_in_every_layer():
    pool = make()
    (b,) = pool.allocate(1)
    pool.write(0, b, 0, slots(BS - 1, 0), slots(BS - 1, 1, DV))
    refused(pool, lambda: pool.register(b, "k"), f"layer 0 has {BS - 1} of {BS} slots written")
    pool.write(0, b, BS - 1, slots(1, 2), slots(1, 3, DV))
    refused(pool, lambda: pool.register(b, "k"), f"layer 1 has 0 of {BS} slots written")
    # slots written out of order still count once each
    pool.write(1, b, 2, slots(2, 4), slots(2, 5, DV))
    pool.write(1, b, 1, slots(2, 6), slots(2, 7, DV))
    refused(pool, lambda: pool.register(b, "k"), f"layer 1 has 3 of {BS} slots written")
    pool.write(1, b, 0, slots(1, 8), slots(1, 9, DV))
    assert pool.register(b, "k") == b


def test_register_refuses_blocks_not_owned_and_bad_keys():
    pool = make()
    (b,) = pool.allocate(1)
    fill(pool, b, 0)
    refused(pool, lambda: pool.register(b + 1, "k"), "cannot register block .*: it is free")
    for bad in ["", b"", 3, bytearray(b"k"), None]:
        refused(pool, lambda: pool.register(b, bad), "a block key must be non-empty bytes or str")
        refused(pool, lambda: pool.lookup(bad), "a block key must be non-empty bytes or str")


def test_registering_a_present_key_keeps_the_existing_block():
    pool = make()
    a, b = pool.allocate(2)
    fill(pool, a, 0)
    fill(pool, b, 0)
    assert pool.register(a, "k") == a
    before = snapshot(pool)
    assert pool.register(b, "k") == a  # the caller drops b and shares a
    assert same(before, snapshot(pool)) and pool.key(b) is None and pool.refcount(a) == 1
    assert pool.register(a, "k") == a  # registering again is a no-op
    assert same(before, snapshot(pool))
    # also when the holder sits cached: no reference is taken, lookup takes one
    pool.release(a)
    assert pool.register(b, "k") == a and pool.refcount(a) == 0 and pool.cached_count == 1
    assert pool.lookup("k") == a and pool.refcount(a) == 1 and pool.cached_count == 0
    pool.check()


def test_a_block_holds_one_key():
    pool = make()
    (b,) = pool.allocate(1)
    fill(pool, b, 0)
    pool.register(b, "first")
    refused(pool, lambda: pool.register(b, "second"), "already holds 'first'")


def test_lookup_revives_a_cached_block():
    pool = make()
    (b,) = pool.allocate(1)
    fill(pool, b, 0)
    pool.register(b, b"\x01key")
    pool.release(b)
    assert (pool.cached_count, pool.refcount(b)) == (1, 0)
    assert pool.lookup(b"\x01key") == b
    assert (pool.cached_count, pool.owned_count, pool.refcount(b)) == (0, 1, 1)
    pool.release(b)
    assert pool.cached_count == 1 and pool.free_count == BLOCKS - 1
    pool.check()


# ---- write, writable, views, copy_block ---------------------------------------------------------------


def test_write_then_views_across_blocks_and_layers():
    pool = make()
    table = pool.allocate(3)
    table = [table[2], table[0], table[1]]  # a table need not be in id order
    want = {}
    for layer in range(LAYERS):
        ks, vs = [], []
        for i, block in enumerate(table):
            # in pieces: 1 slot, then the rest
            k1, v1 = slots(1, 10 * layer + i), slots(1, 10 * layer + i + 5, DV)
            k2, v2 = slots(BS - 1, 100 + 10 * layer + i), slots(BS - 1, 200 + 10 * layer + i, DV)
            pool.write(layer, block, 0, k1, v1)
            pool.write(layer, block, 1, k2, v2)
            ks += [k1, k2]
            vs += [v1, v2]
        want[layer] = torch.cat(ks, dim=1), torch.cat(vs, dim=1)
    for layer in range(LAYERS):
        k, v = pool.gather(layer, table)
        assert k.shape == (HEADS, 3 * BS, D) and v.shape == (HEADS, 3 * BS, DV)
        assert k.is_contiguous() and v.is_contiguous()
        assert torch.equal(k, want[layer][0]) and torch.equal(v, want[layer][1])
        # one block at a time, and a table naming a block twice
        k1, _ = pool.gather(layer, [table[1]])
        assert torch.equal(k1, want[layer][0][:, BS : 2 * BS])
        k2, v2 = pool.gather(layer, [table[0], table[0]])
        assert torch.equal(k2, want[layer][0][:, :BS].repeat(1, 2, 1))
        assert torch.equal(v2, want[layer][1][:, :BS].repeat(1, 2, 1))
    # the views are copies: changing one leaves the pool alone
    k, _ = pool.gather(0, table)
    k.zero_()
    assert torch.equal(pool.gather(0, table)[0], want[0][0])


def test_views_of_an_empty_table_and_refusals():
    pool = make()
    k, v = pool.gather(1, [])
    assert k.shape == (HEADS, 0, D) and v.shape == (HEADS, 0, DV)
    (b,) = pool.allocate(1)
    refused(pool, lambda: pool.gather(0, [b, b + 1]), f"cannot read block {b + 1}: it is free")
    refused(pool, lambda: pool.gather(LAYERS, [b]), f"layer {LAYERS} is not a layer of this pool")


def test_write_takes_a_batch_of_one():
    pool = make()
    (b,) = pool.allocate(1)
    k, v = slots(2, 0), slots(2, 1, DV)
    pool.write(1, b, 2, k[None], v[None])
    got_k, got_v = pool.gather(1, [b])
    assert torch.equal(got_k[:, 2:], k) and torch.equal(got_v[:, 2:], v)


def test_write_of_zero_slots_changes_nothing():
    pool = make()
    (b,) = pool.allocate(1)
    before = snapshot(pool)
    pool.write(0, b, BS, slots(0, 0), slots(0, 1, DV))
    assert same(before, snapshot(pool))


def write_refusals():
    k, v = slots(2, 0), slots(2, 1, DV)
    return [
        ("shared", lambda p, b: p.write(0, b, 0, k, v), "it is shared \\(refcount 2\\); copy_block it first"),
        ("registered", lambda p, b: p.write(0, b, 0, k, v), "registered under 'k', so immutable"),
        ("cached", lambda p, b: p.write(0, b, 0, k, v), "it is cached"),
        ("free", lambda p, b: p.write(0, b, 0, k, v), "it is free"),
        ("own", lambda p, b: p.write(0, b, BS - 1, k, v), f"slots \\[{BS - 1}, {BS + 1}\\) overflow a block of {BS}"),
        ("own", lambda p, b: p.write(0, b, -1, k, v), "offset must be at least 0"),
        ("own", lambda p, b: p.write(0, b, 0.0, k, v), "offset must be an integer"),
        ("own", lambda p, b: p.write(LAYERS, b, 0, k, v), f"layer {LAYERS} is not a layer"),
        ("own", lambda p, b: p.write(0, BLOCKS, 0, k, v), f"block {BLOCKS} is not a block"),
        ("own", lambda p, b: p.write(0, b, 0, slots(2, 0, heads=HEADS + 1), v), f"keys must be \\[{HEADS}, n, {D}\\]"),
        ("own", lambda p, b: p.write(0, b, 0, slots(2, 0, D + 1), v), f"keys must be \\[{HEADS}, n, {D}\\]"),
        ("own", lambda p, b: p.write(0, b, 0, k, slots(2, 1, D)), f"values must be \\[{HEADS}, n, {DV}\\]"),
        ("own", lambda p, b: p.write(0, b, 0, k, slots(3, 1, DV)), "keys hold 2 slots but values hold 3"),
        ("own", lambda p, b: p.write(0, b, 0, k.expand(2, -1, -1, -1), v), "keys must be"),
        ("own", lambda p, b: p.write(0, b, 0, k[0], v), "keys must be"),
        ("own", lambda p, b: p.write(0, b, 0, k.double(), v), "keys must be torch.float32 on cpu, got torch.float64"),
        ("own", lambda p, b: p.write(0, b, 0, k, v.half()), "values must be torch.float32"),
        ("own", lambda p, b: p.write(0, b, 0, k.tolist(), v), "keys must be a tensor"),
    ]


@pytest.mark.parametrize("state, call, match", write_refusals())
def test_write_refusals_change_nothing(state, call, match):
    pool = make()
    a, b = pool.allocate(2)
    fill(pool, a, 0)
    fill(pool, b, 1)
    if state == "shared":
        pool.retain(b)
    elif state in ("registered", "cached"):
        pool.register(b, "k")
        if state == "cached":
            pool.release(b)
    elif state == "free":
        pool.release(b)
    assert pool.writable(b) == (state == "own")
    refused(pool, lambda: call(pool, b), match)


def test_writable_refuses_a_bad_id():
    pool = make()
    with pytest.raises(PoolError, match="is not a block"):
        pool.writable(BLOCKS)


def test_copy_block_is_copy_on_write():
    pool = make()
    (src,) = pool.allocate(1)
    written = fill(pool, src, 7)
    pool.register(src, "k")
    pool.retain(src)  # shared and registered: not writable
    dst = pool.copy_block(src)
    assert dst != src and pool.refcount(dst) == 1 and pool.key(dst) is None and pool.writable(dst)
    assert pool.refcount(src) == 2 and pool.key(src) == "k"
    for layer, (k, v) in enumerate(written):
        got_k, got_v = pool.gather(layer, [dst])
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    pool.write(1, dst, 0, slots(BS, 99), slots(BS, 98, DV))
    assert torch.equal(pool.gather(1, [src])[0], written[1][0])  # the source is untouched
    # the copy is full, so it can be registered under its own key
    assert pool.register(dst, "k2") == dst
    pool.check()


def test_copy_block_of_a_partial_block_copies_what_was_written():
    pool = make()
    (src,) = pool.allocate(1)
    pool.write(0, src, 0, slots(2, 0), slots(2, 1, DV))
    dst = pool.copy_block(src)
    refused(pool, lambda: pool.register(dst, "k"), f"layer 0 has 2 of {BS} slots written")
    assert torch.equal(pool.gather(0, [dst])[0][:, :2], slots(2, 0))


def test_copy_block_refusals_change_nothing():
    pool = make(blocks=2)
    a, b = pool.allocate(2)
    fill(pool, a, 0)
    refused(pool, lambda: pool.copy_block(a), "cannot allocate 1 blocks: 0 free of 2")
    pool.release(b)
    refused(pool, lambda: pool.copy_block(b), f"cannot copy block {b}: it is free")
    refused(pool, lambda: pool.copy_block(7), "block 7 is not a block")


def test_copy_block_may_evict_a_cached_block_but_never_its_source():
    pool = make(blocks=2)
    a, b = pool.allocate(2)
    fill(pool, a, 0)
    fill(pool, b, 1)
    pool.register(b, "old")
    pool.release(b)
    assert pool.copy_block(a) == b and pool.lookup("old") is None
    pool.check()


# ---- prefix caching -------------------------------------------------------------------------------


def content(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in keys and values that depend on the token and the layer, [HEADS, len, D/DV]."""
    t = torch.tensor(tokens, dtype=torch.float32)
    k = (t[None, :, None] + torch.arange(HEADS)[:, None, None] * 0.5 + layer * 1000).expand(HEADS, -1, D)
    return k.contiguous(), (-k[..., :1]).expand(-1, -1, DV).contiguous()


def prefill(pool: BlockPool, tokens: list[int], salt: str) -> list[int]:
    """What the engine will do: reuse cached full blocks, compute and register the rest."""
    keys = chain_keys(tokens, BS, salt)
    table = []
    for key in keys:
        hit = pool.lookup(key)
        if hit is None:
            break
        table.append(hit)
    start = len(table) * BS
    table += pool.allocate(-(-(len(tokens) - start) // BS))
    for i in range(start // BS, len(table)):
        piece = tokens[i * BS : (i + 1) * BS]
        for layer in range(LAYERS):
            pool.write(layer, table[i], 0, *content(piece, layer))
        if i < len(keys):
            assert pool.register(table[i], keys[i]) == table[i]
    return table


def test_two_sequences_sharing_full_blocks_get_the_same_blocks():
    pool = make(blocks=12)
    a_tokens = list(range(10, 24))  # 3 full blocks and 2 tokens
    b_tokens = a_tokens[: 2 * BS] + [99, 98, 97, 96, 95]  # shares the first 2 blocks, then differs
    a = prefill(pool, a_tokens, "model")
    b = prefill(pool, b_tokens, "model")
    assert b[:2] == a[:2] and set(b[2:]).isdisjoint(a)
    assert [pool.refcount(x) for x in a] == [2, 2, 1, 1]
    for layer in range(LAYERS):
        k, v = pool.gather(layer, b)
        want_k, want_v = content(b_tokens, layer)
        assert torch.equal(k[:, : len(b_tokens)], want_k) and torch.equal(v[:, : len(b_tokens)], want_v)
    # another salt (another model) shares nothing
    c = prefill(pool, a_tokens[: 2 * BS], "another model")
    assert set(c).isdisjoint(a + b)
    pool.check()

    for block in a + b + c:
        pool.release(block)
    # registered full blocks are cached, partial tails are free
    assert pool.owned_count == 0 and pool.cached_count == 3 + 1 + 2
    assert pool.free_count == 12 - 6
    pool.check()

    # a later request revives them, contents intact
    again = prefill(pool, a_tokens, "model")
    assert again[:3] == a[:3] and pool.cached_count == 3
    for layer in range(LAYERS):
        k, v = pool.gather(layer, again[:3])
        want_k, want_v = content(a_tokens[: 3 * BS], layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_allocation_pressure_evicts_cached_blocks_oldest_first():
    pool = make(blocks=5, protect=0)  # one plain LRU (the reused one is tested below)
    blocks = pool.allocate(5)
    keys = [f"k{i}" for i in range(4)]
    for block, key in zip(blocks, keys):
        fill(pool, block, 0)
        pool.register(block, key)
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for block in order:
        pool.release(block)
    assert list(pool._lru) == order
    # a lookup hit leaves the LRU; released again, it becomes the newest
    assert pool.lookup("k2") == blocks[2]
    pool.release(blocks[2])
    order = [blocks[0], blocks[3], blocks[1], blocks[2]]
    assert list(pool._lru) == order
    # a free block goes out before any cached one
    pool.release(blocks[4])
    assert pool.allocate(1) == [blocks[4]] and pool.cached_count == 4
    assert pool.allocate(2) == order[:2]
    assert pool.lookup("k0") is None and pool.lookup("k3") is None
    assert pool.key(order[0]) is None and pool.key(order[1]) is None
    assert pool.allocate(1) == [order[2]]
    assert pool.lookup("k1") is None
    assert pool.lookup("k2") == blocks[2] and pool.cached_count == 0
    pool.check()


def test_blocks_found_again_outlive_newer_blocks_nobody_reused():
    """A shared prefix (found by a second request) survives a stream of one-off blocks released
    after it; plain LRU (``protect=0``) evicts it first."""
    for protect, survives in ((0.5, True), (0.0, False)):
        pool = make(blocks=6, protect=protect)
        shared = pool.allocate(2)
        for i, block in enumerate(shared):
            fill(pool, block, i)
            pool.register(block, f"system{i}")
        assert [pool.lookup(f"system{i}") for i in range(2)] == shared  # a second request shares it
        for block in shared * 2:
            pool.release(block)
        for one_off in range(3):  # later requests' own tails, each released once
            (block,) = pool.allocate(1)
            fill(pool, block, 10 + one_off)
            pool.register(block, f"tail{one_off}")
            pool.release(block)
        pool.allocate(pool.free_count + 2)  # pressure: two cached blocks must go
        assert (pool.lookup("system0") is not None) == survives and (pool.lookup("system1") is not None) == survives
        assert (pool.lookup("tail0") is None) == survives and (pool.lookup("tail2") is not None)
        pool.check()


def test_the_reused_lru_is_bounded_and_its_oldest_counts_as_new_again():
    pool = make(blocks=5, protect=0.4)  # at most 2 reused blocks cached
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        fill(pool, block, i)
        pool.register(block, f"k{i}")
        assert pool.lookup(f"k{i}") == block
    for block in blocks:  # each released twice: its two references
        pool.release(block)
        pool.release(block)
    assert (list(pool._reused_lru), list(pool._lru)) == (blocks[1:], blocks[:1])
    pool.allocate(pool.free_count + 1)
    assert pool.lookup("k0") is None and pool.lookup("k1") == blocks[1]
    pool.check()


@pytest.mark.parametrize("protect", [-0.1, 1.5, "half", True, None])
def test_a_protect_share_outside_0_1_is_refused(protect):
    with pytest.raises(PoolError, match="protect must be a share of the blocks in \\[0, 1\\]"):
        make(protect=protect)


# ---- chain_keys -----------------------------------------------------------------------------------


def reference_chain(tokens: list[int], size: int, salt: bytes) -> list[str]:
    digest, out = hashlib.sha256(salt).digest(), []
    for start in range(0, len(tokens) - size + 1, size):
        block = b"".join(t.to_bytes(8, sys.byteorder, signed=True) for t in tokens[start : start + size])
        digest = hashlib.sha256(digest + block).digest()
        out.append(digest.hex())
    return out


def test_chain_keys_is_a_salted_hash_chain_over_full_blocks():
    tokens = [5, 1, 70000, 3, 9, 2, 8]
    got = chain_keys(tokens, 3, b"salt")
    assert got == reference_chain(tokens, 3, b"salt") and len(got) == 2  # the partial block has no key
    assert got == prompt_keys.chain(b"salt", tokens, 3)  # the prompt store's chain at block granularity
    assert chain_keys(torch.tensor(tokens), 3, "salt") == got  # a tensor of ids; a str salt as UTF-8
    assert chain_keys(tokens[:2], 3, b"salt") == [] and chain_keys([], 1, b"s") == []
    # a key names the whole prefix: a change in block 1 leaves key 0, changes key 1
    changed = chain_keys([5, 1, 70000, 3, 9, 4], 3, b"salt")
    assert changed[0] == got[0] and changed[1] != got[1]
    changed = chain_keys([6, 1, 70000, 3, 9, 2], 3, b"salt")
    assert changed[0] != got[0] and changed[1] != got[1]
    assert set(chain_keys(tokens, 3, b"pepper")).isdisjoint(got)


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2], 0, b"s"), "block_size must be at least 1"),
        (([1, 2], 1, 3), "salt must be bytes or str"),
        (([1.0, 2], 1, b"s"), "a token id must be an integer"),
        (([-1, 2], 1, b"s"), "non-negative 64-bit"),
        (([2**63], 1, b"s"), "non-negative 64-bit"),
        ((torch.ones(2, 2, dtype=torch.long), 1, b"s"), "1-D integer tensor"),
        ((torch.ones(2), 1, b"s"), "1-D integer tensor"),
        ((5, 1, b"s"), "tokens must be a sequence"),
    ],
)
def test_chain_keys_refuses_bad_input(args, match):
    with pytest.raises(PoolError, match=match):
        chain_keys(*args)


# ---- check ----------------------------------------------------------------------------------------


def busy_pool() -> tuple[BlockPool, list[int]]:
    """Two free blocks, two cached, two owned (one registered)."""
    pool = make()
    blocks = pool.allocate(4)
    for i, block in enumerate(blocks[:3]):
        fill(pool, block, i)
        pool.register(block, f"k{i}")
    pool.release(blocks[0])
    pool.release(blocks[1])
    pool.check()
    return pool, blocks


def corrupt_negative(pool, blocks):
    pool._refs[blocks[3]] = -1


def corrupt_two_sets(pool, blocks):
    pool._lru[pool._free[0]] = None


def corrupt_lru_owned(pool, blocks):
    pool._refs[blocks[0]] = 1


def corrupt_lru_no_key(pool, blocks):
    del pool._block_of[pool._key_of.pop(blocks[0])]


def corrupt_free_with_key(pool, blocks):
    pool._lru.pop(blocks[0])
    pool._free.append(blocks[0])


def corrupt_maps(pool, blocks):
    pool._block_of["k0"] = blocks[1]


def corrupt_map_sizes(pool, blocks):
    pool._block_of["ghost"] = blocks[2]


def corrupt_unplaced(pool, blocks):
    pool._refs[blocks[3]] = 0


def corrupt_not_full(pool, blocks):
    pool._written[1][blocks[2]] = 1


def corrupt_free_owned(pool, blocks):
    pool._refs[pool._free[0]] = 2


def corrupt_reused_unmarked(pool, blocks):
    block = next(iter(pool._lru))
    del pool._lru[block]
    pool._reused_lru[block] = None


def corrupt_marked_not_reused(pool, blocks):
    pool._reused[next(iter(pool._lru))] = True


def corrupt_reused_over_limit(pool, blocks):
    pool._reused_limit = -1


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (corrupt_negative, "has refcount -1"),
        (corrupt_two_sets, "is in the free list and the cached LRU"),
        (corrupt_lru_owned, "in the cached LRU has refcount 1"),
        (corrupt_lru_no_key, "in the cached LRU has no key"),
        (corrupt_free_with_key, "in the free list has key"),
        (corrupt_maps, "key 'k0' maps to block"),
        (corrupt_map_sizes, "keys map to blocks but"),
        (corrupt_unplaced, "has refcount 0 but is neither free nor cached"),
        (corrupt_not_full, "registered block .* is not full"),
        (corrupt_free_owned, "in the free list has refcount 2"),
        (corrupt_reused_unmarked, "is not marked reused but is in the reused LRU"),
        (corrupt_marked_not_reused, "is marked reused but is in the cached LRU"),
        (corrupt_reused_over_limit, "the reused LRU holds 0 blocks, over its -1"),
    ],
)
def test_check_names_the_first_broken_invariant(corrupt, match):
    pool, blocks = busy_pool()
    corrupt(pool, blocks)
    with pytest.raises(PoolError, match="block pool invariant broken: .*(" + match + ")"):
        pool.check()


# ---- random operations against a reference model ----------------------------------------------------

M_BLOCKS, M_BS, M_LAYERS, M_HEADS, M_D, M_DV = 5, 2, 2, 2, 3, 2
KEYS = st.sampled_from(["a", "b", "c", b"a"])  # "a" and b"a" are two keys


class PoolMachine(RuleBasedStateMachine):
    """The pool against a model: refcounts, keys, the two LRUs' order (reused or not, at three
    ``protect`` shares) and the free set in dicts and lists,
    and a tag per written slot (slot ``s`` of a write tagged ``t`` holds keys ``16 t + s`` and values
    ``-(16 t + s)``). Rules act on owned blocks; ``misuse`` tries every verb on one that is not."""

    @initialize(protect=st.sampled_from([0.0, 0.4, 1.0]))
    def start(self, protect):
        self.pool = BlockPool(M_LAYERS, M_HEADS, M_D, M_BS, M_BLOCKS, value_dim=M_DV, protect=protect)
        self.refs = {b: 0 for b in range(M_BLOCKS)}
        self.keys: dict[int, object] = {}
        self.lru: list[int] = []  # cached, never found by a lookup since allocated; least recently released first
        self.reused_lru: list[int] = []  # cached, found again
        self.reused: set[int] = set()
        self.limit = int(protect * M_BLOCKS)
        self.free = set(range(M_BLOCKS))
        self.slots: dict[tuple[int, int, int], float] = {}  # (layer, block, slot) -> what it holds
        self.tag = 0

    # -- the model

    def owned(self) -> list[int]:
        return [b for b, r in self.refs.items() if r > 0]

    def cached(self) -> list[int]:
        """In eviction order: the blocks not reused, then the reused ones."""
        return self.lru + self.reused_lru

    def found(self, block: int) -> None:
        """Book a lookup's hit on ``block``."""
        if self.refs[block] == 0:
            (self.reused_lru if block in self.reused else self.lru).remove(block)
        self.reused.add(block)
        self.refs[block] += 1

    def holder(self, key) -> int | None:
        return next((b for b, k in self.keys.items() if type(k) is type(key) and k == key), None)

    def full(self, block) -> bool:
        return all((layer, block, s) in self.slots for layer in range(M_LAYERS) for s in range(M_BS))

    def take(self, n: int, got: list[int]) -> None:
        """Check an allocation of ``n`` blocks against the model and book it."""
        assert len(got) == n == len(set(got))
        evicted = [b for b in got if b not in self.free]
        assert len(evicted) == max(0, n - len(self.free))
        assert evicted == self.cached()[: len(evicted)]  # least recently released first, not reused first
        for block in got:
            self.free.discard(block)
            if block in evicted:
                (self.reused_lru if block in self.reused else self.lru).remove(block)
                del self.keys[block]
            self.reused.discard(block)
            self.refs[block] = 1
            for where in [w for w in self.slots if w[1] == block]:
                del self.slots[where]

    def put(self, layer, block, offset, n):
        self.tag += 1
        base = torch.arange(n, dtype=torch.float32)[None, :, None] + self.tag * 16
        k = base.expand(M_HEADS, n, M_D).contiguous()
        self.pool.write(layer, block, offset, k, -k[..., :M_DV])
        for s in range(n):
            self.slots[layer, block, offset + s] = float(self.tag * 16 + s)

    def register_as(self, block, key):
        holder = self.holder(key)
        if not self.full(block) or (holder is None and block in self.keys):
            with pytest.raises(PoolError):
                self.pool.register(block, key)
        elif holder is not None:
            assert self.pool.register(block, key) == holder
        else:
            assert self.pool.register(block, key) == block
            self.keys[block] = key

    # -- rules

    @rule(data=st.data())
    def allocate(self, data):
        available = len(self.free) + len(self.cached())
        n = data.draw(st.integers(0, available + 1), label="n")
        if n > available:
            with pytest.raises(PoolError, match=f"cannot allocate {n} blocks: {available} free"):
                self.pool.allocate(n)
        else:
            self.take(n, self.pool.allocate(n))

    @precondition(lambda self: self.cached())
    @rule(extra=st.integers(1, M_BLOCKS))
    def evict(self, extra):
        """An allocation that needs cached blocks: at least one is evicted."""
        n = len(self.free) + min(extra, len(self.cached()))
        self.take(n, self.pool.allocate(n))

    @rule()
    def forget(self):
        """``forget_cached``: every cached block freed and unkeyed; owned blocks keep their keys."""
        cached = self.cached()
        assert self.pool.forget_cached() == len(cached)
        for block in cached:
            del self.keys[block]
            self.reused.discard(block)
            self.free.add(block)
        self.lru, self.reused_lru = [], []

    @precondition(lambda self: self.owned())
    @rule(data=st.data())
    def retain(self, data):
        block = data.draw(st.sampled_from(self.owned()), label="block")
        self.pool.retain(block)
        self.refs[block] += 1

    @precondition(lambda self: self.owned())
    @rule(data=st.data())
    def release(self, data):
        self.drop(data.draw(st.sampled_from(self.owned()), label="block"))

    def drop(self, block):
        self.pool.release(block)
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block not in self.keys:
                self.free.add(block)
            elif block not in self.reused:
                self.lru.append(block)
            else:
                self.reused_lru.append(block)
                if len(self.reused_lru) > self.limit:  # the oldest reused block counts as not reused again
                    oldest = self.reused_lru.pop(0)
                    self.reused.discard(oldest)
                    self.lru.append(oldest)

    @precondition(lambda self: self.owned())
    @rule(data=st.data(), layer=st.integers(0, M_LAYERS - 1), offset=st.integers(0, M_BS), n=st.integers(1, M_BS))
    def write(self, data, layer, offset, n):
        locked = [b for b in self.owned() if self.refs[b] > 1 or b in self.keys]
        among = locked if locked and data.draw(st.booleans(), label="a shared or registered block") else self.owned()
        block = data.draw(st.sampled_from(among), label="block")
        writable = self.refs[block] == 1 and block not in self.keys
        assert self.pool.writable(block) == writable
        if writable and offset + n <= M_BS:
            self.put(layer, block, offset, n)
        else:
            with pytest.raises(PoolError):
                self.put(layer, block, offset, n)

    @precondition(lambda self: any(r == 1 and b not in self.keys for b, r in self.refs.items()))
    @rule(data=st.data())
    def fill(self, data):
        block = data.draw(st.sampled_from([b for b, r in self.refs.items() if r == 1 and b not in self.keys]))
        for layer in range(M_LAYERS):
            self.put(layer, block, 0, M_BS)

    @precondition(lambda self: self.owned())
    @rule(data=st.data(), key=KEYS)
    def register(self, data, key):
        self.register_as(data.draw(st.sampled_from(self.owned()), label="block"), key)

    @precondition(lambda self: self.free or self.cached())
    @rule(key=KEYS, finish=st.booleans())
    def compute(self, key, finish):
        """What a prefill does with a block it computes: allocate, fill, register; a duplicate is
        dropped for the block already holding the key; a finished request releases it."""
        (block,) = self.pool.allocate(1)
        self.take(1, [block])
        for layer in range(M_LAYERS):
            self.put(layer, block, 0, M_BS)
        holder = self.holder(key)
        assert self.pool.register(block, key) == (block if holder is None else holder)
        if holder is None:
            self.keys[block] = key
        else:
            self.drop(block)
            block = self.pool.lookup(key)
            assert block == holder
            self.found(block)
        if finish:
            self.drop(block)

    @rule(data=st.data())
    def lookup(self, data):
        known = sorted(self.keys.values(), key=repr)
        if known and data.draw(st.booleans(), label="a registered key"):
            key = data.draw(st.sampled_from(known), label="key")
        else:
            key = data.draw(KEYS, label="key")
        holder = self.holder(key)
        assert self.pool.lookup(key) == holder
        if holder is not None:
            self.found(holder)

    @precondition(lambda self: self.owned())
    @rule(data=st.data())
    def copy_block(self, data):
        src = data.draw(st.sampled_from(self.owned()), label="block")
        if not (self.free or self.cached()):
            with pytest.raises(PoolError, match="cannot allocate 1 blocks"):
                self.pool.copy_block(src)
            return
        dst = self.pool.copy_block(src)
        self.take(1, [dst])
        for (layer, block, s), value in list(self.slots.items()):
            if block == src:
                self.slots[layer, dst, s] = value

    @precondition(lambda self: self.owned())
    @rule(data=st.data(), layer=st.integers(0, M_LAYERS - 1))
    def views(self, data, layer):
        table = data.draw(st.lists(st.sampled_from(self.owned()), max_size=4), label="table")
        k, v = self.pool.gather(layer, table)
        assert k.shape == (M_HEADS, len(table) * M_BS, M_D) and v.shape == (M_HEADS, len(table) * M_BS, M_DV)
        for i, block in enumerate(table):
            for s in range(M_BS):
                value = self.slots.get((layer, block, s))
                if value is not None:
                    assert bool((k[:, i * M_BS + s] == value).all()) and bool((v[:, i * M_BS + s] == -value).all())

    @precondition(lambda self: len(self.owned()) < M_BLOCKS)
    @rule(data=st.data(), verb=st.sampled_from(["retain", "release", "write", "register", "copy_block", "views"]))
    def misuse(self, data, verb):
        """Every verb that needs an owned block refuses a free or cached one."""
        block = data.draw(st.sampled_from([b for b, r in self.refs.items() if r == 0]), label="block")
        assert not self.pool.writable(block)
        calls = {
            "retain": lambda: self.pool.retain(block),
            "release": lambda: self.pool.release(block),
            "write": lambda: self.put(0, block, 0, 1),
            "register": lambda: self.pool.register(block, "a"),
            "copy_block": lambda: self.pool.copy_block(block),
            "views": lambda: self.pool.gather(0, [block]),
        }
        with pytest.raises(PoolError, match=f"block {block}: it is (free|cached)"):
            calls[verb]()

    # -- invariants

    @invariant()
    def matches_model(self):
        pool = self.pool
        pool.check()
        assert (pool.free_count, pool.cached_count, pool.owned_count) == (len(self.free), len(self.cached()), len(self.owned()))
        assert [pool.refcount(b) for b in range(M_BLOCKS)] == [self.refs[b] for b in range(M_BLOCKS)]
        assert [pool.key(b) for b in range(M_BLOCKS)] == [self.keys.get(b) for b in range(M_BLOCKS)]
        assert (list(pool._lru), list(pool._reused_lru)) == (self.lru, self.reused_lru)
        # which slots count as written (what register's fullness rule reads)
        for layer in range(M_LAYERS):
            want = [sum(1 << s for s in range(M_BS) if (layer, b, s) in self.slots) for b in range(M_BLOCKS)]
            assert pool._written[layer] == want

    @invariant()
    def slots_hold_what_was_written(self):
        for (layer, block, s), value in self.slots.items():
            k = self.pool.storage.layer(layer)["keys"][block, :, s]
            v = self.pool.storage.layer(layer)["values"][block, :, s]
            assert bool((k == value).all()) and bool((v == -value).all()), (layer, block, s)

    def teardown(self):
        pool = self.pool
        for block in range(M_BLOCKS):
            for _ in range(pool.refcount(block)):
                pool.release(block)
        pool.check()
        assert pool.owned_count == 0 and pool.free_count + pool.cached_count == M_BLOCKS
        assert pool.cached_count == len(self.keys)  # every registered block is cached, none leaked


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=75,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
