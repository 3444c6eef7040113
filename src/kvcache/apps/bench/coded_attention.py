"""The quantized part of suite ``attention``: decode attention over int8/int4/fp8 caches next to fp32.

Setting: SmolLM2-135M's geometry (3 KV heads x 64, 9 query heads: groups of 3), batch 1 and 8,
4K and 16K tokens (fewer for ``tiny``). Contenders, alternating within each repeat: ``fp32``
(``attend`` over views of a growable buffer), ``int8``/``int4``/``fp8`` (a ``QuantizedLayer``'s store
read by the kernel: the coded decode library where it builds; ``fp8`` its e4m3 build) and
``int8-pytorch``/``int4-pytorch``/``fp8-pytorch`` (the same with the library off: a block
dequantized at a time). Each row reports the bytes the
contender reads (codes, scales and minimums in use, plus the full-precision residual; K and V for
fp32), its median time, that time over fp32's, and the fraction of the read bandwidth
(measured by the suite in the same run) it achieves on those bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any

import torch

from ...attention import DISABLE_ENV, attend, attend_weighted, fused
from ...layers import QuantizedLayer, StoreReader
from ..run_options import RunOptions
from .common import clock_cold, markdown_table, median
from .harness import alternate

KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64  # SmolLM2-135M
#: The coded layers, by name: their options.
CODED = {"int8": {"bits": 8}, "int4": {"bits": 4}, "fp8": {"codes": "fp8"}}
CONTENDERS = ("fp32", *CODED, *(f"{name}-pytorch" for name in CODED))


def run(options: RunOptions, bandwidth: float, repeats: int) -> list[dict[str, Any]]:
    """Rows (one per batch, length and contender) of the quantized decode attention."""
    batches = options.pick([1, 2], [1, 8], [1, 8])
    lengths = options.pick([300, 600], [4096, 16384], [4096, 16384])
    fused.library(), fused.library(fp8=True)  # build them before timing anything
    gen = torch.Generator().manual_seed(0)
    cases = itertools.product(batches, lengths)
    return [row for batch, tokens in cases for row in _one(batch, tokens, gen, options.device, bandwidth, repeats)]


def _one(batch, tokens, gen, device, bandwidth, repeats) -> list[dict[str, Any]]:
    shape = (batch, KV_HEADS, tokens + 256, HEAD_DIM)
    kbuf, vbuf = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    key, value = kbuf[:, :, :tokens], vbuf[:, :, :tokens]
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, generator=gen)
    layers = {name: _filled(options, key, value) for name, options in CODED.items()}
    nbytes = {"fp32": key.nbytes + value.nbytes, **{name: _bytes_read(layer) for name, layer in layers.items()}}

    def call(name: str):
        if name == "fp32":
            return attend(query, key, value)
        coded, _, fallback = name.partition("-")
        with _library_off(bool(fallback)):
            return attend_weighted(query, StoreReader(layers[coded]), None)[0]

    reference = call("fp32")
    diffs = {name: (call(name) - reference).abs().max().item() for name in CONTENDERS}  # warm-up + check
    # from memory, as in a model
    times = alternate(CONTENDERS, repeats, lambda name: clock_cold(lambda: call(name), device))
    seconds = {name: median(times[name]) for name in CONTENDERS}
    read = {name: nbytes[name.partition("-")[0]] for name in CONTENDERS}
    return [
        {
            "batch": batch,
            "tokens": tokens,
            "contender": name,
            "ms": seconds[name] * 1e3,
            "vs_fp32": seconds[name] / seconds["fp32"],
            "bytes_read": read[name],
            "bandwidth_fraction": read[name] / seconds[name] / bandwidth,
            "max_abs_diff_vs_fp32": diffs[name],
            "samples_ms": [t * 1e3 for t in times[name]],
        }
        for name in CONTENDERS
    ]


@contextlib.contextmanager
def _library_off(off: bool):
    """The coded decode library off (``KVCACHE_NO_EXTENSION=1``) or on, for the block; restored after."""
    previous = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1" if off else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = previous


def _filled(options: dict[str, Any], key: torch.Tensor, value: torch.Tensor) -> QuantizedLayer:
    """A quantized layer (default options but ``options``) holding ``key``/``value``: a prefill, then
    one decode step."""
    layer = QuantizedLayer(**options)
    layer.update(key[:, :, :-1].contiguous(), value[:, :, :-1].contiguous())
    layer.settle()
    layer.update(key[:, :, -1:].contiguous(), value[:, :, -1:].contiguous())
    layer.settle()
    return layer


def _bytes_read(layer: QuantizedLayer) -> int:
    """Codes, scales and minimums in use, plus the residual tokens in use."""
    codes = layer.codes
    coded = sum(t.nbytes for store in (codes.keys, codes.values) for t in store.in_use().values())
    exact = (layer.seen - codes.quantized_keys) * codes.exact_keys[:, :, :1].nbytes
    exact += (layer.seen - codes.quantized_values) * codes.exact_values[:, :, :1].nbytes
    return coded + exact


def table(rows: list[dict[str, Any]]) -> str:
    header = ["batch", "T", "contender", "ms", "time / fp32", "MB read", "fraction of read bandwidth", "max |out - fp32|"]
    body = [
        [
            r["batch"],
            r["tokens"],
            r["contender"],
            r["ms"],
            f"{r['vs_fp32']:.2f}",
            f"{r['bytes_read'] / 1e6:.1f}",
            f"{r['bandwidth_fraction']:.0%}",
            f"{r['max_abs_diff_vs_fp32']:.1e}",
        ]
        for r in rows
    ]
    title = f"Quantized decode attention, SmolLM2 geometry ({Q_HEADS}q/{KV_HEADS}kv x {HEAD_DIM}), fp32 queries"
    return f"\n{title}\n\n" + markdown_table(header, body)
