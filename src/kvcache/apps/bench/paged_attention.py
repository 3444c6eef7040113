"""The paged part of suite ``attention``: the engine's decode attention over block tables.

Setting: SmolLM2-135M's geometry, 16 sequences of mixed lengths (seeded, uniform in 512-3,903
tokens; fewer and shorter for ``tiny``), their blocks handed out shuffled from one pool (as a
long-running engine's tables are). Contenders per block size (16, 32, 64, 256 tokens),
alternating within each repeat, every call after ``evict_caches``:

- ``paged``: ``native.paged_decode`` over float32 blocks (what ``PagedStep`` runs);
- ``paged-bf16``: the same over bfloat16 blocks with bfloat16 queries (a bfloat16 engine's own
  rows: ``csrc/bf16_attention.cpp`` reads blocks of 32 tokens and more in place where the CPU has
  AVX-512 BF16, else the float kernel widens them);
- ``paged-int8``: ``fused_paged.paged_decode_attention`` over int8 blocks with an exact open block
  per sequence (what ``PagedStep`` runs over a coded pool); ``paged-fp8`` the same over e4m3 blocks;
- ``dense``: ``kvcache.attend`` over one padded contiguous batch ``[S, Hkv, longest, D]`` with a
  padding mask, the layout of a batched ``generate`` (a reference point: it reads the padding's
  keys too, not its values).

Each row: the bytes the contender must read, its median time, and the fraction of the read
bandwidth (measured by the suite in the same run). Target (issue 24): ``paged`` >= 60% at 16
sequences of mixed lengths.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...attention import attend, fused_paged, native
from ...engine import BlockPool
from ...formats import Codes
from ..run_options import RunOptions
from .common import clock_cold, markdown_table, median
from .harness import alternate

KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64  # SmolLM2-135M
CONTENDERS = ("paged", "paged-bf16", "paged-int8", "paged-fp8", "dense")


def run(options: RunOptions, bandwidth: float, repeats: int) -> list[dict[str, Any]]:
    """Rows (one per block size and contender)."""
    sequences = options.pick(4, 16, 16)
    low, high = options.pick((40, 200), (512, 3903), (512, 3903))
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(low, high + 1, (sequences,), generator=gen).tolist()
    block_sizes = options.pick([16], [32, 256], [16, 32, 64, 256])
    return [row for bs in block_sizes for row in _one(bs, lengths, gen, bandwidth, repeats)]


def _one(bs: int, lengths: list[int], gen: torch.Generator, bandwidth: float, repeats: int) -> list[dict[str, Any]]:
    seqs = len(lengths)
    need = [math.ceil(n / bs) for n in lengths]
    total = sum(need)
    tables = [blocks.tolist() for blocks in torch.randperm(total, generator=gen).split(need)]
    table = torch.zeros(seqs, max(need), dtype=torch.int32)
    for s, t in enumerate(tables):
        table[s, : len(t)] = torch.tensor(t, dtype=torch.int32)
    pool = BlockPool(1, KV_HEADS, HEAD_DIM, bs, total)
    pool.allocate(total)
    keys = torch.randn(total, KV_HEADS, bs, HEAD_DIM, generator=gen)
    values = torch.randn(total, KV_HEADS, bs, HEAD_DIM, generator=gen)
    pool.storage.write_blocks(0, torch.arange(total), keys, values)
    blocks = pool.storage.layer(0)
    half = {name: blocks[name].bfloat16() for name in ("keys", "values")}
    coded, coded_bytes = _coded(keys, values, table, lengths, bs)
    fp8, fp8_bytes = _coded(keys, values, table, lengths, bs, fp8=True)
    query = torch.randn(seqs, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM, generator=gen)
    lens = torch.tensor(lengths, dtype=torch.int64)
    dense_k, dense_v, mask = _dense(pool, tables, lengths)
    scale = 1 / math.sqrt(HEAD_DIM)
    q4 = query.reshape(seqs, Q_HEADS, 1, HEAD_DIM)
    query_bf16 = query.bfloat16()
    calls = {
        "paged": lambda: native.paged_decode(query, blocks["keys"], blocks["values"], table, lens, scale),
        "paged-bf16": lambda: native.paged_decode(query_bf16, half["keys"], half["values"], table, lens, scale),
        "paged-int8": lambda: coded(query, scale),
        "paged-fp8": lambda: fp8(query, scale),
        "dense": lambda: attend(q4, dense_k, dense_v, mask=mask, scale=scale),
    }

    def call(name: str) -> torch.Tensor:
        return calls[name]().reshape(seqs, Q_HEADS, HEAD_DIM)

    reference = call("dense")
    diffs = {name: (call(name) - reference).abs().max().item() for name in CONTENDERS}  # warm-up + check
    live = sum(lengths) * KV_HEADS * HEAD_DIM  # keys (or values) in use
    # codes: codes, scales, minimums and the open blocks; dense: every key row, value rows of live tokens only
    read = {"paged": 2 * live * 4, "paged-bf16": 2 * live * 2, "paged-int8": coded_bytes, "paged-fp8": fp8_bytes}
    read["dense"] = dense_k.nbytes + live * 4
    times = alternate(CONTENDERS, repeats, lambda name: clock_cold(lambda: call(name)))
    seconds = {name: median(times[name]) for name in CONTENDERS}
    return [
        {
            "block_size": bs,
            "sequences": seqs,
            "tokens": sum(lengths),
            "contender": name,
            "ms": seconds[name] * 1e3,
            "bytes_read": read[name],
            "bandwidth_fraction": read[name] / seconds[name] / bandwidth,
            "max_abs_diff_vs_dense": diffs[name],
            "samples_ms": [t * 1e3 for t in times[name]],
        }
        for name in CONTENDERS
    ]


def _dense(pool: BlockPool, tables: list[list[int]], lengths: list[int]):
    """One padded batch ``[S, Hkv, longest, D]`` of every sequence's keys and values, and its mask."""
    longest = max(lengths)
    k = torch.zeros(len(lengths), KV_HEADS, longest, HEAD_DIM)
    v = torch.zeros_like(k)
    mask = torch.zeros(len(lengths), 1, 1, longest, dtype=torch.bool)
    for s, (t, n) in enumerate(zip(tables, lengths)):
        ks, vs = pool.gather(0, t)
        k[s, :, :n], v[s, :, :n] = ks[:, :n], vs[:, :n]
        mask[s, ..., :n] = True
    return k, v, mask


def _coded(keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor, lengths: list[int], bs: int, fp8: bool = False):
    """An int8 (``fp8``: e4m3) pool of the same blocks: every full block coded, each sequence's last
    partial block in its open block; the call and the bytes it reads."""
    seqs = len(lengths)
    format = Codes(8, HEAD_DIM, key_block=bs, fp8=fp8)
    pool = BlockPool(1, KV_HEADS, HEAD_DIM, bs, keys.shape[0], format=format, tails=seqs)
    pool.allocate(keys.shape[0])
    pool.storage.write_blocks(0, torch.arange(keys.shape[0]), keys, values)
    tail = pool.open.layer(0)
    coded = torch.tensor([n // bs * bs for n in lengths], dtype=torch.int64)
    open_ = torch.tensor([n % bs for n in lengths], dtype=torch.int64)
    tails = torch.arange(seqs, dtype=torch.int32)
    for s, n in enumerate(lengths):
        if n % bs:
            last = int(table[s, n // bs])
            tail["keys"][s] = keys[last]
            tail["values"][s] = values[last]
    nbytes = int(sum(n // bs for n in lengths) * pool.block_nbytes + sum(open_.tolist()) * KV_HEADS * HEAD_DIM * 8)

    def call(query: torch.Tensor, scale: float) -> torch.Tensor:
        c = pool.storage.layer(0)
        return fused_paged.paged_decode_attention(
            query, (c["kcodes"], c["kscale"], c["kmin"]), (c["vcodes"], c["vscale"], c["vmin"]), 8, HEAD_DIM,
            table, coded, tail["keys"], tail["values"], tails, open_, scale, fp8=fp8,
        )  # fmt: skip

    return call, nbytes


def table(rows: list[dict[str, Any]]) -> str:
    header = ["block size", "sequences", "tokens", "contender", "ms", "MB read", "fraction of read bandwidth", "max |out - dense|"]
    body = [
        [r["block_size"], r["sequences"], r["tokens"], r["contender"], r["ms"], f"{r['bytes_read'] / 1e6:.1f}",
         f"{r['bandwidth_fraction']:.0%}", f"{r['max_abs_diff_vs_dense']:.1e}"]
        for r in rows
    ]  # fmt: skip
    title = (f"Paged decode attention (the engine's), SmolLM2 geometry ({Q_HEADS}q/{KV_HEADS}kv x {HEAD_DIM}), "
             "sequences of mixed lengths, blocks shuffled in the pool")  # fmt: skip
    return f"\n{title}\n\n" + markdown_table(header, body)
