"""Suite ``attention``: decode attention (one query token) against the memory-bandwidth limit.

Decode attention reads every cached key and value once and does little arithmetic per byte, so
its floor is ``bytes(K) + bytes(V)`` divided by the read bandwidth. The bandwidth is measured in
the same run (summing a 512 MiB tensor, median of 5), and each contender's time is reported as the
fraction of it achieved: ``(bytes(K) + bytes(V)) / time / bandwidth``. Every timed call follows
``evict_caches`` (96 MiB read), so its keys and values come from memory as in a model's decode
step (where the weights stream through between layers), not from an L3 warmed by the last call:
without it a SmolLM2 layer's K/V (a few MiB) would be read from cache and beat the bandwidth.

Setting: B=1, 8 KV heads x 128, fp32 (bf16 on CUDA as well as fp32), MHA (8 query heads) and GQA
(32 query heads on 8 KV heads), then SmolLM2's geometry (9 query heads on 3 KV heads x 64) at
batch 1 x 8K and batch 8 x 4K; ``--shapes`` runs only the shapes given
(``Hq/HkvxD@BxT``, e.g. ``32/8x128@1x16384,9/3x64@8x4096``: a reproducible kernel A/B). K/V are views
``[:, :, :T]`` of buffers with room for 256 more tokens, as a cache holds them. Contenders:
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa=True``) and ``kvcache.attend``,
alternating within each repeat; medians reported, with the largest difference between the two outputs.

Then, on the same measured bandwidth, the quantized caches' decode attention beside fp32
(:mod:`.coded_attention`) and the engine's paged decode over block tables (:mod:`.paged_attention`);
and prompt chunks over the pool's blocks by work per second (:mod:`.prefill_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...attention import attend
from ...errors import KVCacheError
from ..run_options import RunOptions
from . import coded_attention, paged_attention, prefill_attention
from .common import clock_cold, column_table, figure, finish_axes, machine_line, median, read_bandwidth
from .harness import alternate, report

#: The contenders, each a function ``(query, key, value) -> output``.
FUNCTIONS = {"sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), "attend": attend}
CONTENDERS = tuple(FUNCTIONS)
VARIANTS = {"mha": 8, "gqa": 32}
KV_HEADS, HEAD_DIM = 8, 128


@dataclass(frozen=True)
class Shape:
    """One decode attention call: ``batch`` x ``query_heads`` query rows over ``tokens`` keys and
    values of ``kv_heads`` x ``head_dim``."""

    query_heads: int
    kv_heads: int
    head_dim: int
    batch: int
    tokens: int
    variant: str = ""

    @property
    def name(self) -> str:
        return self.variant or f"{self.query_heads}/{self.kv_heads}x{self.head_dim}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``Hq/HkvxD@BxT`` (``32/8x128@1x16384``)."""
        try:
            heads, _, where = text.strip().partition("@")
            q_heads, _, rest = heads.partition("/")
            kv_heads, _, dim = rest.partition("x")
            batch, _, tokens = where.partition("x")
            shape = cls(int(q_heads), int(kv_heads), int(dim), int(batch), int(tokens))
        except ValueError:
            raise KVCacheError(f"a shape is Hq/HkvxD@BxT, e.g. 32/8x128@1x16384; got {text!r}") from None
        if min(shape.query_heads, shape.kv_heads, shape.head_dim, shape.batch, shape.tokens) < 1 or shape.query_heads % shape.kv_heads:
            raise KVCacheError(f"shape {text!r}: every number must be positive and Hq a multiple of Hkv")
        return shape


def parse_shapes(text: str) -> list[Shape]:
    """Comma-separated ``Shape.parse`` forms."""
    return [Shape.parse(part) for part in text.split(",") if part.strip()]


#: The model geometries the issue judges beside the lengths sweep: SmolLM2-135M's own.
SMOLLM2_SHAPES = (Shape(9, 3, 64, 1, 8192, "smollm2"), Shape(9, 3, 64, 8, 4096, "smollm2"))


def run(
    options: RunOptions = RunOptions(),
    *,
    lengths: list[int] | None = None,
    repeats: int | None = None,
    shapes: list[Shape] | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``attention.json``/``.md``/``.png`` into ``options.out`` if given.
    ``shapes``: only these calls (no lengths sweep, no quantized part)."""
    from tqdm.auto import tqdm

    if lengths is None:
        top = options.pick(2**7, 2**14, 2**16)
        lengths = [2**i for i in range(6 if options.tiny else 10, top.bit_length())]
    coded = shapes is None
    if coded:
        sweep = [Shape(q, KV_HEADS, HEAD_DIM, 1, t, variant) for variant, q in VARIANTS.items() for t in lengths]
        shapes = sweep + ([] if options.tiny else list(SMOLLM2_SHAPES))
    repeats = repeats or options.pick(2, 10, 20)
    dtypes = [torch.float32] + ([torch.bfloat16] if options.device.startswith("cuda") else [])
    bandwidth = read_bandwidth(options.device, mib=16 if options.tiny else 512)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    bar = tqdm(total=len(dtypes) * len(shapes), desc="attention", disable=not options.progress)
    for dtype in dtypes:
        for shape in shapes:
            rows += _measure(shape, dtype, gen, options.device, bandwidth, repeats)
            bar.update()
    bar.close()
    coded_rows = coded_attention.run(options, bandwidth, repeats) if coded else []
    paged_rows = paged_attention.run(options, bandwidth, repeats) if coded else []
    prefill_rows = prefill_attention.run(options, repeats) if coded else []
    config = {
        "shapes": [f"{s.query_heads}/{s.kv_heads}x{s.head_dim}@{s.batch}x{s.tokens}" for s in shapes],
        "timing": "each call after evict_caches (96 MiB read): keys and values come from memory",
        "variants": VARIANTS,
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "lengths": lengths,
        "repeats": repeats,
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report(
        "attention", options, config, rows, table, plot, read_bandwidth_bytes_per_s=bandwidth, quantized_rows=coded_rows,
        paged_rows=paged_rows, prefill_rows=prefill_rows,
    )


def _measure(shape: Shape, dtype: torch.dtype, gen: torch.Generator, device: str, bandwidth: float, repeats: int) -> list[dict[str, Any]]:
    """The rows (one per contender) of one shape: medians of alternated cold calls."""
    buffer = (shape.batch, shape.kv_heads, shape.tokens + 256, shape.head_dim)
    kbuf, vbuf = (torch.randn(buffer, generator=gen).to(device, dtype) for _ in range(2))
    key, value = kbuf[:, :, : shape.tokens], vbuf[:, :, : shape.tokens]
    query = torch.randn(shape.batch, shape.query_heads, 1, shape.head_dim, generator=gen).to(device, dtype)
    outputs = {name: fn(query, key, value) for name, fn in FUNCTIONS.items()}  # warm-up + check
    diff = (outputs["attend"].float() - outputs["sdpa"].float()).abs().max().item()
    times = alternate(CONTENDERS, repeats, lambda name: clock_cold(lambda: FUNCTIONS[name](query, key, value), device))
    nbytes = key.nbytes + value.nbytes
    seconds = {name: median(samples) for name, samples in times.items()}
    return [
        {
            "dtype": str(dtype).removeprefix("torch."),
            "variant": shape.name,
            "query_heads": shape.query_heads,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "batch": shape.batch,
            "tokens": shape.tokens,
            "contender": name,
            "ms": seconds[name] * 1e3,
            "kv_bytes": nbytes,
            "bandwidth_fraction": nbytes / seconds[name] / bandwidth,
            "max_abs_diff_vs_sdpa": diff if name == "attend" else 0.0,
            "samples_ms": [t * 1e3 for t in times[name]],
        }
        for name in CONTENDERS
    ]


def table(result: dict[str, Any]) -> str:
    bw = result["read_bandwidth_bytes_per_s"] / 1e9
    columns = {
        "dtype": "dtype",
        "variant": lambda r: (
            f"{r['variant']} ({r['query_heads']}q/{r.get('kv_heads', KV_HEADS)}kv x {r.get('head_dim', HEAD_DIM)})"
        ),
        "B": lambda r: r.get("batch", 1),
        "T": "tokens",
        "contender": "contender",
        "ms": "ms",
        "fraction of read bandwidth": lambda r: f"{r['bandwidth_fraction']:.0%}",
        "max |attend - sdpa|": lambda r: f"{r['max_abs_diff_vs_sdpa']:.1e}" if r["contender"] == "attend" else "",
    }
    parts = ((coded_attention, "quantized_rows"), (paged_attention, "paged_rows"), (prefill_attention, "prefill_rows"))
    coded = "".join(part.table(result[key]) for part, key in parts if result.get(key))
    timing = result["config"].get("timing", "")
    head = f"{machine_line(result.get('machine', {}))}\n\nMeasured read bandwidth: {bw:.1f} GB/s; {timing}\n\n"
    return head + column_table(result["rows"], columns) + coded


def plot(result: dict[str, Any], path: Path) -> None:
    dtypes = result["config"]["dtypes"]
    with figure(path, panels=len(dtypes), size=(7, 4.5)) as axes:
        for ax, dtype in zip(axes, dtypes):
            series: dict[tuple[str, int, str], list[tuple[int, float]]] = {}
            for r in result["rows"]:
                if r["dtype"] == dtype:
                    key = (r["variant"], r.get("batch", 1), r["contender"])
                    series.setdefault(key, []).append((r["tokens"], 100 * r["bandwidth_fraction"]))
            for (variant, batch, name), pts in series.items():
                ax.plot(*zip(*pts), marker="o", label=f"{name} {variant}" + (f" B={batch}" if batch > 1 else ""))
            ax.axhline(50, color="grey", linestyle="--", linewidth=1)
            ax.set_ylim(0, 100)
            title = f"decode attention, {dtype}: % of read bandwidth ({result['read_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)"
            finish_axes(ax, "tokens in cache (T)", "% of measured read bandwidth", title)
