"""``fused_paged.paged_decode_attention``: a decode step of many sequences over a pool of coded blocks
(each sequence reading its blocks through its table, then an exact tail block), against torch's
SDPA over each sequence's keys and values dequantized with ``quant.py``'s reference formulas
(``dequantize_per_channel`` per block for keys, ``dequantize_per_token`` for values) and
concatenated in table order with the tail.

Tolerance: ``helpers.CODED_TOL``, as for the coded decode (``test_fused_coded_decode.py``).
Both compute in float32 from the same codes; they differ in the order of their sums (scale and
minimum folded into the query and the weights, runs of blocks with an online softmax merged by
log-sum-exp, a polynomial ``exp`` of relative error ~1e-7) and in where the dequantized values are
rounded: a few 1e-6 on outputs of size ~1. A wrong code, scale, channel, block, table entry, run
merge or tail token moves an output by about a quantization step (>= 1e-2) or a token's weight,
far beyond it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.attention import fused, fused_paged
from kvcache.attention.native_build import DISABLE_ENV
from kvcache.formats import quant

from helpers import CODED_TOL

KV_HEADS = 2


@pytest.fixture(autouse=True)
def needs_library(monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    if fused.library() is None:
        pytest.skip("the coded decode library cannot build here (no C++ compiler?)")


class Pool:
    """Coded blocks ``[NB, Hkv, bs, ...]`` of random keys (channels of their own spread and offset,
    so a wrong channel's scale shows) and values, their reference dequantization, and a float
    pool of tail blocks."""

    def __init__(self, bits, blocks, block_size, dim, vdim=None, value_group=32, tail_blocks=8, seed=0):
        vdim = vdim or dim
        gen = torch.Generator().manual_seed(seed)
        spread, offset = torch.rand(dim, generator=gen) * 2.5 + 0.5, torch.randn(dim, generator=gen)
        k = torch.randn(blocks, KV_HEADS, block_size, dim, generator=gen) * spread + offset
        v = torch.randn(blocks, KV_HEADS, block_size, vdim, generator=gen)
        qk, qv = quant.quantize_per_channel(k, bits), quant.quantize_per_token(v, bits, value_group)
        self.bits, self.block_size, self.value_group = bits, block_size, value_group
        self.keys = (qk.codes, qk.scale.squeeze(2), qk.minimum.squeeze(2))
        self.values = (qv.codes, qv.scale, qv.minimum)
        self.ref_keys, self.ref_values = quant.dequantize_per_channel(qk), quant.dequantize_per_token(qv, value_group)
        self.tail_keys = torch.randn(tail_blocks, KV_HEADS, block_size, dim, generator=gen) * spread + offset
        self.tail_values = torch.randn(tail_blocks, KV_HEADS, block_size, vdim, generator=gen)


class Step:
    """A decode step over ``pool``: one entry ``(coded blocks, tail tokens)`` per sequence. Blocks
    are handed out shuffled (tables are not in id order), tables padded with -1 past their blocks,
    and an empty tail's block is out of range (both must be ignored). ``share``: sequence ``b``
    starts with sequence ``a``'s first ``n`` blocks (a shared prefix)."""

    def __init__(self, pool, spec, share=None, seed=1):
        gen = torch.Generator().manual_seed(seed)
        bs = pool.block_size
        ids = torch.randperm(pool.keys[0].shape[0], generator=gen).tolist()
        tables = []
        for blocks, _ in spec:
            assert len(ids) >= blocks, "pool too small for the step"
            tables.append(ids[:blocks])
            ids = ids[blocks:]
        if share is not None:
            a, b, n = share
            tables[b][:n] = tables[a][:n]
        width = max((len(t) for t in tables), default=0) + 2
        self.tables = torch.full((len(spec), width), -1, dtype=torch.int32)
        for s, t in enumerate(tables):
            self.tables[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
        self.coded = torch.tensor([blocks * bs for blocks, _ in spec], dtype=torch.int64)
        self.tail_lengths = torch.tensor([tail for _, tail in spec], dtype=torch.int64)
        nt = pool.tail_keys.shape[0]
        self.tail_blocks = torch.randperm(nt, generator=gen)[: len(spec)].to(torch.int32)
        self.tail_blocks[self.tail_lengths == 0] = nt + 5
        self.pool = pool

    def run(self, query, scale, softcap=None, **changes):
        p = self.pool
        args = {
            "keys": p.keys, "values": p.values, "bits": p.bits, "value_group": p.value_group,
            "tables": self.tables, "coded": self.coded, "tail_keys": p.tail_keys, "tail_values": p.tail_values,
            "tail_blocks": self.tail_blocks, "tail_lengths": self.tail_lengths,
        }  # fmt: skip
        args.update(changes)
        return fused_paged.paged_decode_attention(query, scale=scale, softcap=softcap, **args)

    def reference(self, query, scale, softcap=None):
        """Each sequence's dequantized blocks in table order and its tail, then SDPA (or the cap written out)."""
        p, bs = self.pool, self.pool.block_size
        out = []
        for s in range(query.shape[0]):
            blocks = self.tables[s, : int(self.coded[s]) // bs].tolist()
            keys, values = [p.ref_keys[b] for b in blocks], [p.ref_values[b] for b in blocks]
            tail = int(self.tail_lengths[s])
            if tail:
                keys.append(p.tail_keys[int(self.tail_blocks[s]), :, :tail])
                values.append(p.tail_values[int(self.tail_blocks[s]), :, :tail])
            if not keys:
                out.append(query.new_zeros(KV_HEADS, query.shape[2], p.tail_values.shape[3]))
                continue
            k, v = torch.cat(keys, dim=1), torch.cat(values, dim=1)
            if softcap is None:
                out.append(F.scaled_dot_product_attention(query[s], k, v, scale=scale))
            else:
                scores = torch.tanh(query[s] @ k.transpose(-1, -2) * scale / softcap) * softcap
                out.append(torch.softmax(scores, dim=-1) @ v)
        return torch.stack(out)


def queries(seqs, rows, dim, seed=2):
    return torch.randn(seqs, KV_HEADS, rows, dim, generator=torch.Generator().manual_seed(seed))


def mixed(bs):
    """Sequences of mixed lengths: coded blocks with a partial tail; no coded block, only a tail; a
    full tail (bs tokens); no tail; nothing at all; more tokens than one task (256) with a tail of
    one; a short one (shares its first two blocks with the first, see ``Step``)."""
    long = -(-600 // bs)
    return [(5, 7), (0, 9), (3, bs), (4, 0), (0, 0), (long, 1), (3, 2)]


def pool_for(spec, bits, bs, dim, **options):
    return Pool(bits, sum(blocks for blocks, _ in spec) + 4, bs, dim, **options)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_matches_sdpa_over_each_sequence(bits, group, dim, block_size):
    spec = mixed(block_size)
    step = Step(pool_for(spec, bits, block_size, dim), spec, share=(0, 6, 2))
    query = queries(len(spec), group, dim)
    scale = dim**-0.5
    out = step.run(query, scale)
    assert out.shape == (len(spec), KV_HEADS, group, dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, step.reference(query, scale), **CODED_TOL)
    assert not out[4].any()  # the sequence with nothing


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_softcap(bits):
    spec = mixed(32)
    step = Step(pool_for(spec, bits, 32, 64), spec, share=(0, 6, 2))
    query = queries(len(spec), 3, 64) * 4  # large scores, so the cap bites
    out = step.run(query, 0.3, softcap=5.0)
    torch.testing.assert_close(out, step.reference(query, 0.3, softcap=5.0), **CODED_TOL)
    assert not torch.allclose(out, step.reference(query, 0.3), **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("task_tokens", [256, 16, 48, 4096], ids=["as chosen", "a block a task", "uneven runs", "runs of several tiles"])
def test_long_sequences_in_runs_and_tiles(monkeypatch, bits, task_tokens):
    """Sequences of 1-2K tokens split into many runs (merged at the end: a block a run, runs of 3
    blocks with a shorter last one), or into one run crossing several of the library's tiles (512
    tokens: the running maximum rises, what was summed is rescaled)."""
    monkeypatch.setattr(fused_paged, "_PAGED_TASK_TOKENS", task_tokens)
    spec = [(70, 5), (0, 16), (33, 0), (100, 16)]
    step = Step(pool_for(spec, bits, 16, 64), spec, share=(3, 0, 50))
    query = queries(len(spec), 4, 64) * 3  # spread the scores, so the maximum moves between tiles
    torch.testing.assert_close(step.run(query, 0.125), step.reference(query, 0.125), **CODED_TOL)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize(("dim", "vdim", "value_group"), [(64, 64, 64), (128, 128, 16), (64, 128, 32), (48, 48, 16), (128, 64, 8)])
def test_value_groups_and_head_dims(bits, dim, vdim, value_group):
    """Value groups of one or several registers (the fast paths) or less, a value head dim other
    than the key's, and a head dim the fast paths do not take (48)."""
    spec = mixed(32)
    step = Step(pool_for(spec, bits, 32, dim, vdim=vdim, value_group=value_group), spec, share=(0, 6, 2))
    query = queries(len(spec), 3, dim)
    torch.testing.assert_close(step.run(query, dim**-0.5), step.reference(query, dim**-0.5), **CODED_TOL)


@pytest.mark.parametrize("rows", [2, 5, fused.MAX_ROWS])
def test_rows_per_head(rows):
    """Several decode queries per sequence packed with the group (4 rows at a time, then the rest)."""
    spec = mixed(32)
    step = Step(pool_for(spec, 4, 32, 64), spec)
    query = queries(len(spec), rows, 64)
    torch.testing.assert_close(step.run(query, 0.125), step.reference(query, 0.125), **CODED_TOL)


def test_pool_views_with_their_own_strides():
    """Pools that are views (the upper heads of a pool of twice as many, tail keys padded per
    token): read where they are."""
    spec = mixed(32)
    step = Step(pool_for(spec, 8, 32, 64), spec)
    query = queries(len(spec), 3, 64)

    def upper_heads(t):
        wide = t.new_zeros(t.shape[0], 2 * KV_HEADS, *t.shape[2:])
        wide[:, KV_HEADS:] = t
        return wide[:, KV_HEADS:]

    keys, values = tuple(map(upper_heads, step.pool.keys)), tuple(map(upper_heads, step.pool.values))
    padded = torch.zeros(*step.pool.tail_keys.shape[:3], 80)
    padded[..., :64] = step.pool.tail_keys
    tail_keys = padded[..., :64]
    assert keys[0].stride(0) == 2 * KV_HEADS * keys[0].stride(1) and tail_keys.stride(2) == 80
    out = step.run(query, 0.125, keys=keys, values=values, tail_keys=tail_keys)
    torch.testing.assert_close(out, step.reference(query, 0.125), **CODED_TOL)


def test_a_step_of_no_sequences_and_of_empty_ones():
    pool = Pool(8, 4, 16, 64)
    empty = Step(pool, [])
    assert empty.run(torch.zeros(0, KV_HEADS, 3, 64), 0.125).shape == (0, KV_HEADS, 3, 64)
    nothing = Step(pool, [(0, 0), (0, 0)])
    assert nothing.tables.shape[1] == 2  # only padding
    out = nothing.run(queries(2, 3, 64), 0.125)
    assert out.shape == (2, KV_HEADS, 3, 64) and not out.any()


def test_declines():
    spec = mixed(32)
    step = Step(pool_for(spec, 8, 32, 64), spec)
    query = queries(len(spec), 3, 64)
    p = step.pool
    assert step.run(queries(len(spec), fused.MAX_ROWS + 1, 64), 0.125) is None  # too many rows
    assert step.run(query, 0.125, tail_keys=p.tail_keys.bfloat16(), tail_values=p.tail_values.bfloat16()) is None
    assert step.run(query, 0.125, tail_keys=p.tail_keys.transpose(2, 3).contiguous().transpose(2, 3)) is None
    assert step.run(query, 0.125, bits=4) is None  # codes of another width than bits says
    assert step.run(query, 0.125, value_group=48) is None  # not a divisor of the value head dim
    assert step.run(query[:3], 0.125) is None  # tables for another number of sequences
    assert step.run(query.requires_grad_(), 0.125) is None  # the library computes no gradients
    with torch.no_grad():
        assert step.run(query, 0.125) is not None


def test_library_off_declines(monkeypatch):
    spec = mixed(32)
    step = Step(pool_for(spec, 8, 32, 64), spec)
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert step.run(queries(len(spec), 3, 64), 0.125) is None


@pytest.mark.parametrize(
    "change",
    ["block id past the pool", "negative block id", "coded not whole blocks", "coded past the table", "tail past a block", "tail block past the pool"],
)
def test_out_of_range_raises(change):
    spec = [(3, 4), (2, 0)]
    step = Step(pool_for(spec, 8, 16, 64), spec)
    tables, coded, tail_lengths, tail_blocks = step.tables.clone(), step.coded.clone(), step.tail_lengths.clone(), step.tail_blocks.clone()
    if change == "block id past the pool":
        tables[1, 1] = step.pool.keys[0].shape[0]
    elif change == "negative block id":
        tables[0, 2] = -1
    elif change == "coded not whole blocks":
        coded[0] -= 1
    elif change == "coded past the table":
        coded[0] = 16 * (tables.shape[1] + 1)
    elif change == "tail past a block":
        tail_lengths[1] = 17
    else:
        tail_blocks[0] = step.pool.tail_keys.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        step.run(queries(2, 3, 64), 0.125, tables=tables, coded=coded, tail_lengths=tail_lengths, tail_blocks=tail_blocks)
