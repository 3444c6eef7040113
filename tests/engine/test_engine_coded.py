"""``Engine(model, "quantized:bits=...")``: coded blocks with one exact open block per request
(``BlockPool`` of ``formats.Codes`` blocks, ``PagedStep`` through ``block_io.OpenBlockIO``), against ``coded_reference.py`` (Hugging Face's ``DynamicCache``
and attention, with the engine's storage rule applied by hand: a block is quantized with
``kvcache.formats.quant`` once the step that filled it is over), run in the same prompt chunks.

Near ties as in ``engine_reference.py``: batched matmuls and the coded kernel round differently
from the reference (~1e-6); a quantization code flips only where an element lies within that of a
rounding boundary, rare enough that the tests below see at most the stated number of divergences,
each at a reference top-2 gap under 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from coded_reference import coded_reference
from engine_reference import ids, reference, same_or_near_tie

from kvcache import Engine
from kvcache.attention import fused_paged
from kvcache.engine import BlockPool, PoolError
from kvcache.errors import SpecError, UnsupportedOperation
from kvcache.formats import Codes, quant
from kvcache.formats.blocks import block_bytes

NEW = 10


def recorded_chunks(engine: Engine) -> dict[int, list[tuple[int, int]]]:
    """Wrap this engine's scheduler (only this instance) to record each request's prompt chunks as
    ``(first token, count)``; a restart after a preemption starts the record again."""
    chunks: dict[int, list[tuple[int, int]]] = {}
    commit = engine.scheduler.commit

    def recording(rows, chosen, kept=None):
        for request, n in rows:
            if request.stats.generated == 0:
                mine = chunks.setdefault(request.rid, [])
                if mine and request.computed <= mine[-1][0]:
                    mine.clear()
                mine.append((request.computed, n))
        return commit(rows, chosen, kept)

    engine.scheduler.commit = recording
    return chunks


def reference_chunks(record: list[tuple[int, int]]) -> list[int]:
    """The reference's chunks: what the request took from the pool (before its first chunk) as one
    chunk, then the chunks it computed. Decode rows of a preempted request's recomputation count as
    prompt chunks too (they are)."""
    first = record[0][0]
    return ([first] if first else []) + [n for _, n in record]


def run(engine: Engine, prompts, new=NEW):
    chunks = recorded_chunks(engine)
    handles = [engine.submit(p, max_new_tokens=new, eos_token_id=[]) for p in prompts]
    while engine.step():
        engine.pool.check()
    assert engine.pool.owned_count == 0 and engine.pool.free_tails == engine.pool.tail_count
    return handles, chunks


def assert_match_coded(model, prompts, handles, chunks, bs, bits, group, new=NEW, most_ties=0, fp8=False):
    ties = 0
    for i, (p, h) in enumerate(zip(prompts, handles)):
        recorded = chunks[h.id]
        if sum(reference_chunks(recorded)) != len(p):  # a recomputation's decode rows: the prompt grew
            extra = sum(reference_chunks(recorded)) - len(p)
            p_ref, out = p + h.result()[:extra], h.result()[extra:]
            expected = coded_reference(model, p_ref, new - extra, bs, bits, group, reference_chunks(recorded), fp8)
        else:
            out, expected = h.result(), coded_reference(model, p, new, bs, bits, group, reference_chunks(recorded), fp8)
        ties += same_or_near_tie(out, expected, f"request {i} ({len(p)} tokens, chunks {recorded})")
    assert ties <= most_ties


def compositions(bs: int) -> list[list[int]]:
    return [ids(max(1, bs // 2 - 1), 1), ids(2 * bs, 2), ids(2 * bs + 1, 3), ids(1, 4), ids(3 * bs + 5, 5), ids(bs - 1, 6)]


# ---- against the reference ------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("bs,budget", [(4, 7), (8, 512), (16, 13)])
def test_every_request_matches_the_coded_reference(model, bits, bs, budget):
    group = 8
    engine = Engine(model, f"quantized:bits={bits},group_size={group}", block_size=bs, blocks=64,
                    max_batch_tokens=budget, max_seqs=4, share_prefixes=False)
    prompts = compositions(bs)
    handles, chunks = run(engine, prompts)
    assert_match_coded(model, prompts, handles, chunks, bs, bits, group)


@pytest.mark.parametrize("bs,budget", [(8, 512), (16, 13)])
def test_fp8_blocks_match_the_coded_reference(model, bs, budget):
    """``quantized:codes=fp8``: e4m3 blocks (``formats/fp8.py``), read by the coded library's fp8 build."""
    group = 8
    engine = Engine(model, f"quantized:codes=fp8,group_size={group}", block_size=bs, blocks=64,
                    max_batch_tokens=budget, max_seqs=4, share_prefixes=False)  # fmt: skip
    assert engine.pool.format.fp8 and engine.pool.format.name == "fp8"
    prompts = compositions(bs)
    handles, chunks = run(engine, prompts)
    assert_match_coded(model, prompts, handles, chunks, bs, 8, group, fp8=True)


def test_shared_coded_blocks_match_the_reference_and_are_computed_once(model):
    bs, shared = 8, ids(24, 11)
    prompts = [shared + ids(5, 20 + i) for i in range(4)]
    engine = Engine(model, "quantized:bits=8,group_size=8", block_size=bs, blocks=64, max_batch_tokens=512, max_seqs=4)
    first = engine.submit(prompts[0], max_new_tokens=NEW, eos_token_id=[])
    engine.step()  # the first computes the shared blocks alone, in one chunk
    chunks = recorded_chunks(engine)
    chunks[first.id] = [(0, len(prompts[0]))]
    handles = [first] + [engine.submit(p, max_new_tokens=NEW, eos_token_id=[]) for p in prompts[1:]]
    while engine.step():
        engine.pool.check()
    assert [h.stats.reused_pool for h in handles] == [0, 24, 24, 24]
    assert_match_coded(model, prompts, handles, chunks, bs, 8, 8)


def test_a_coded_pool_too_small_for_all_preempts_and_every_request_completes(model):
    bs = 4
    prompts = [ids(9 + 3 * i, 30 + i) for i in range(5)]
    longest = max(len(p) for p in prompts) + NEW - 1
    engine = Engine(model, "quantized:bits=8,group_size=8", block_size=bs, blocks=-(-longest // bs) + 2,
                    max_batch_tokens=64, max_seqs=5, share_prefixes=False)
    handles, chunks = run(engine, prompts)
    assert engine.stats.preemptions > 0
    assert_match_coded(model, prompts, handles, chunks, bs, 8, 8)


def test_the_torch_path_gives_what_the_coded_library_gives(model, monkeypatch):
    prompts = compositions(8)
    spec = "quantized:bits=4,group_size=8"
    fast, _ = run(Engine(model, spec, block_size=8, blocks=64, max_batch_tokens=64, max_seqs=4), prompts)
    calls = []
    monkeypatch.setattr(fused_paged, "paged_decode_attention", lambda *a, **k: calls.append(1))  # returns None: declined
    slow, _ = run(Engine(model, spec, block_size=8, blocks=64, max_batch_tokens=64, max_seqs=4), prompts)
    assert calls, "the library path was not asked"
    ties = sum(same_or_near_tie(s.result(), (f.result(), [0.0] * NEW)) for f, s in zip(fast, slow))
    assert ties == 0


def test_int8_blocks_mostly_give_the_full_precision_tokens(model):
    prompts = compositions(8)
    handles, _ = run(Engine(model, "quantized:bits=8", block_size=8, blocks=64, max_seqs=4), prompts)
    agree = sum(h.result() == reference(model, p, NEW)[0] for p, h in zip(prompts, handles))
    assert agree >= len(prompts) // 2, "int8 blocks changed most requests' greedy tokens"


# ---- the pool -------------------------------------------------------------------------------------


def coded_pool(bits=4, value_group=4, **kw) -> BlockPool:
    geometry = dict(layers=2, kv_heads=2, head_dim=8, block_size=4, blocks=5, tails=2) | kw
    return BlockPool(**geometry, format=Codes(bits, value_group, key_block=geometry["block_size"]))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_written_block_reads_back_as_quant_dequantizes_it(bits):
    pool = coded_pool(bits=bits)
    (block,) = pool.allocate(1)
    g = torch.Generator().manual_seed(bits)
    k, v = torch.randn(2, 4, 8, generator=g) * 3 + 1, torch.randn(2, 4, 8, generator=g)
    pool.write(1, block, 0, k, v)
    got_k, got_v = pool.gather(1, [block])
    expected_k = quant.dequantize_per_channel(quant.quantize_per_channel(k, bits))
    expected_v = quant.dequantize_per_token(quant.quantize_per_token(v, bits, 4), 4)
    assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    copy = pool.copy_block(block)
    assert all(torch.equal(a, b) for a, b in zip(pool.gather(1, [copy]), (got_k, got_v)))
    with pytest.raises(PoolError, match="layer 0 has 0 of 4"):
        pool.register(block, "prefix")
    pool.write(0, block, 0, k, v)
    assert pool.register(block, "prefix") == block
    with pytest.raises(PoolError, match="registered"):
        pool.write(0, block, 0, k, v)
    pool.check()


def test_a_partial_write_to_a_coded_block_is_refused_and_changes_nothing():
    pool = coded_pool()
    (block,) = pool.allocate(1)
    before = [t.clone() for t in pool.storage.tensors.values()]
    with pytest.raises(PoolError, match="written whole"):
        pool.write(0, block, 0, torch.zeros(2, 3, 8), torch.zeros(2, 3, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, pool.storage.tensors.values()))
    with pytest.raises(PoolError, match="only full blocks"):
        pool.register(block, "partial")


def test_open_blocks_are_handed_out_once_and_counted_in_the_bytes():
    pool = coded_pool(tails=2)
    a, b = pool.take_tail(), pool.take_tail()
    assert a != b and pool.free_tails == 0
    with pytest.raises(PoolError, match="all 2 open blocks"):
        pool.take_tail()
    pool.give_tail(a)
    with pytest.raises(PoolError, match="not taken"):
        pool.give_tail(a)
    per_head = 4 * (8 + 8) * 4 // 8 + 2 * 4 * 8 + 2 * 4 * 4 * 8 // 4  # codes, key scale/min per channel, value per group
    assert block_bytes(pool.format, 2, 2, 4, 8, 8, torch.float32) == pool.block_nbytes == 2 * 2 * per_head
    coded = pool.block_nbytes * pool.total
    assert pool.storage.nbytes == coded
    assert pool.nbytes == coded + 2 * 2 * 2 * 2 * 4 * 8 * 4  # k and v, layers, tails, heads, bs, D, float32


@pytest.mark.parametrize("bits,shape", [(3, {}), (4, {"head_dim": 7}), (4, {"value_group": 3}), (8, {"tails": 0})])
def test_bad_coded_pools_are_refused(bits, shape):
    with pytest.raises(ValueError):  # PoolError from the pool, ValueError from the format (bits)
        coded_pool(bits=bits, **shape)


# ---- the engine's spec ----------------------------------------------------------------------------


def test_max_bytes_counts_codes_scales_and_open_blocks(model):
    budget = 3 * 2**20
    full = Engine(model, block_size=16, max_bytes=budget, max_seqs=4)
    int8 = Engine(model, "quantized:bits=8", block_size=16, max_bytes=budget, max_seqs=4)
    int4 = Engine(model, "quantized:bits=4", block_size=16, max_bytes=budget, max_seqs=4)
    for engine in (full, int8, int4):
        assert engine.pool.nbytes <= budget
    assert full.pool.total < int8.pool.total < int4.pool.total
    assert int8.pool.total >= 2 * full.pool.total


@pytest.mark.parametrize(
    "spec,error,match",
    [
        ("quantized:bits=8,residual=4", UnsupportedOperation, "residual"),
        ("kvzip:budget=64", UnsupportedOperation, "does not serve .kvzip. caches"),
        ("quantized:bits=3", (SpecError, ValueError, PoolError), "bits"),
        ("quantized:bits=8,group_size=7", PoolError, "group_size 7"),
        ("nonsense", SpecError, "unknown cache kind"),
    ],
)
def test_specs_the_engine_cannot_hold_are_refused(model, spec, error, match):
    with pytest.raises(error, match=match):
        Engine(model, spec, block_size=8, blocks=8)
