"""The prompt part of suite ``attention``: prompt chunks over the engine's pool blocks (issue 58).

Setting: SmolLM2-135M's geometry, blocks of 32 tokens handed out shuffled from one pool, each
chunk's past and the chunk itself already in its blocks (as the engine's step holds them); the
cases (``CASES``) are the turns of 16 sessions that share a 1,024-token system prompt, and the
first and the last chunk of a 3.5K prompt. Contenders, alternating within each repeat, in float32
and bfloat16 (blocks and queries alike, as a model in that dtype gives them; bfloat16 chunks run
on AMX tiles where the CPU has them):

- ``paged-prefill``: ``native.paged_prefill``, every chunk in one call (what ``PagedStep`` runs);
- ``gather+sdpa``: each chunk's past gathered out of the blocks, then ``kvcache.attend`` causal
  over the past and the chunk (torch's SDPA flash kernel; the engine's path before issue 58).

Each row: the median time and the useful attention work per second (the causal half of the
chunk's own square counted once), and the largest difference between the two outputs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...attention import attend, native
from ..run_options import RunOptions
from .common import clock, markdown_table, median
from .harness import alternate

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 32  # SmolLM2-135M
CONTENDERS = ("paged-prefill", "gather+sdpa")
#: (name, [(past tokens, chunk tokens) of each chunk]); ``tiny`` runs 4 x 16 after 64.
CASES = [("16 x 64 after 1,024", [(1024, 64)] * 16), ("1 x 512 after 0", [(0, 512)]),
         ("1 x 512 after 3,072", [(3072, 512)])]  # fmt: skip


def run(options: RunOptions, repeats: int) -> list[dict[str, Any]]:
    """Rows, one per case, dtype and contender."""
    cases = options.pick([("4 x 16 after 64", [(64, 16)] * 4)], CASES, CASES)
    dtypes = (torch.float32, torch.bfloat16)
    return [row for name, chunks in cases for dtype in dtypes for row in _one(name, chunks, dtype, repeats)]


def _one(name: str, chunks: list[tuple[int, int]], dtype: torch.dtype, repeats: int) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    need = [math.ceil((past + count) / BLOCK) for past, count in chunks]
    order = torch.randperm(sum(need), generator=gen)
    keys = torch.randn(sum(need), KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    values = torch.randn(sum(need), KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(dtype)
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int32)
    for s, blocks in enumerate(order.split(need)):
        tables[s, : len(blocks)] = blocks
    total = sum(count for _, count in chunks)
    rows_per_head = Q_HEADS // KV_HEADS
    q = torch.randn(KV_HEADS, total, rows_per_head, HEAD_DIM, generator=gen).to(dtype)  # as the model's queries
    starts = torch.tensor([0] + [count for _, count in chunks]).cumsum(0)
    pasts = torch.tensor([past for past, _ in chunks])
    scale = 1 / math.sqrt(HEAD_DIM)

    def call(contender: str) -> torch.Tensor:
        if contender == "paged-prefill":
            return native.paged_prefill(q, keys, values, tables, starts, pasts, scale)
        out = []
        for s, (past, count) in enumerate(chunks):
            blocks = tables[s, : need[s]].long()
            k = keys[blocks].transpose(0, 1).reshape(1, KV_HEADS, -1, HEAD_DIM)[:, :, : past + count]
            v = values[blocks].transpose(0, 1).reshape(1, KV_HEADS, -1, HEAD_DIM)[:, :, : past + count]
            qs = q[:, starts[s] : starts[s + 1]].permute(0, 2, 1, 3).reshape(1, Q_HEADS, count, HEAD_DIM)
            got = attend(qs, k, v, scale=scale, causal=True)  # [1, Hq, count, D]
            out.append(got[0].reshape(KV_HEADS, rows_per_head, count, HEAD_DIM).transpose(1, 2).float())
        return torch.cat(out, dim=1)

    outputs = {c: call(c) for c in CONTENDERS}  # warm-up + check
    diff = (outputs["paged-prefill"] - outputs["gather+sdpa"]).abs().max().item()
    times = alternate(CONTENDERS, repeats, lambda c: clock(lambda: call(c)))  # compute-bound: warm caches
    work = sum(4 * count * (past + (count + 1) / 2) * HEAD_DIM * Q_HEADS for past, count in chunks)
    return [
        {
            "case": name,
            "dtype": str(dtype).removeprefix("torch."),
            "contender": c,
            "ms": median(times[c]) * 1e3,
            "gflops": work / median(times[c]) / 1e9,
            "max_abs_diff": diff,
            "samples_ms": [t * 1e3 for t in times[c]],
        }
        for c in CONTENDERS
    ]


def table(rows: list[dict[str, Any]]) -> str:
    header = ["chunks", "dtype", "contender", "ms", "GFLOP/s", "speed-up", "largest difference"]
    by = {(r["case"], r["dtype"], r["contender"]): r for r in rows}
    body = [
        [r["case"], r["dtype"], r["contender"], r["ms"], f"{r['gflops']:.0f}",
         f"{by[(r['case'], r['dtype'], 'gather+sdpa')]['ms'] / r['ms']:.2f}x", f"{r['max_abs_diff']:.1e}"]
        for r in rows
    ]  # fmt: skip
    title = (f"Prompt chunks over pool blocks (the engine's prefill), SmolLM2 geometry ({Q_HEADS}q/{KV_HEADS}kv x "
             f"{HEAD_DIM}), blocks of {BLOCK} shuffled in the pool; speed-up over gather+sdpa")  # fmt: skip
    return f"\n{title}\n\n" + markdown_table(header, body)
