"""Whether the engine can serve a model: a probe of two short rows packed in one step, and one of
them decoded over its blocks, against each row run alone; and the count of attention calls a step
saw (a model whose layers do not pass the step down to their attention runs fewer)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..errors import UnsupportedOperation
from ..hf.bridge import FORWARD_STEP, use_kvcache_attention
from .pool import BlockPool
from .pool_setup import PoolShape
from .scheduler import blocks_for
from .rows import Row
from .step import PagedStep


def check_packing(model: Any, shape: PoolShape, block_size: int, keeps_logits: bool, linears: Any = None) -> None:
    """Refuse a model that does not compute a packed row as it computes the row alone: one that
    numbers positions by the row's place in the batch instead of its ``position_ids`` (learned
    absolute positions), mixes tokens across rows, or reads its past otherwise. Runs two short
    rows as one prefill step, then one of them as a decode step, and compares each last token's
    logits with the row run alone (short rows, so a model's sliding window never binds), in a small
    full-precision pool of its own whatever the engine's block format. ``keeps_logits``: the
    model's forward takes ``logits_to_keep``; ``linears``: the engine's ``PackedLinears`` or None."""
    first, second, extra = [3, 4], [5, 6, 7], 8
    g, bs = shape, block_size
    pool = BlockPool(g.layers, g.kv_heads, g.head_dim, bs, 2 * blocks_for(len(second) + 1, bs), g.dtype, g.device)
    tables = (pool.allocate(blocks_for(len(first), bs)), pool.allocate(blocks_for(len(second) + 1, bs)))
    prefill = [Row(0, len(first), 0, tuple(tables[0])), Row(len(first), len(second), 0, tuple(tables[1]))]
    packed = _probe(model, pool, first + second, [0, 1, 0, 1, 2], prefill, keeps_logits, linears)
    decode = _probe(model, pool, [extra], [len(second)], [Row(0, 1, len(second), tuple(tables[1]))], keeps_logits, linears)
    tolerance = 1e-3 if g.dtype == torch.float32 else 3e-2
    for got, row in ((packed, second), (decode, second + [extra])):
        with torch.inference_mode():
            alone = model(input_ids=torch.tensor([row], device=g.device), use_cache=False).logits[0, -1].float()
        if not torch.allclose(got, alone, rtol=tolerance, atol=tolerance * float(alone.abs().max())):
            raise UnsupportedOperation(
                "this model computes a row packed after another, or a decode step over its blocks, differently "
                "from the row alone (it numbers positions by place in the batch, not by position_ids, or mixes "
                "rows): the engine cannot serve it"
            )


def _probe(model: Any, pool: BlockPool, ids: list[int], positions: list[int], rows: list[Row], keeps_logits: bool,
           linears: Any) -> torch.Tensor:  # fmt: skip
    """The last token's logits of one forward pass of ``rows`` over ``pool`` (claiming their slots first)."""
    bs = pool.block_size
    for row in rows:
        for t in range(row.past, row.length):
            pool.claim(row.table[t // bs], t % bs, 1)
    step = PagedStep(pool, rows)
    device = pool.device
    keep = {"logits_to_keep": torch.tensor([len(ids) - 1], device=device)} if keeps_logits else {}
    packing = linears.active() if linears is not None else contextlib.nullcontext()
    with torch.inference_mode(), use_kvcache_attention(model), packing:
        out = model(
            input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([positions], device=device),
            use_cache=False, **{FORWARD_STEP: step}, **keep,
        )  # fmt: skip
    check_layers_run(step, pool.layers)
    return out.logits[0, -1].float()


def check_layers_run(step: PagedStep, layers: int) -> None:
    """Refuse a model whose forward pass did not reach the step once per layer."""
    if step.layers_run != layers:
        raise UnsupportedOperation(
            f"the model ran {step.layers_run} attention calls through the engine's step for {layers} "
            "layers: its layers do not pass attention keywords down, so the engine cannot serve it"
        )
