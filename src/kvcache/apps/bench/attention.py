"""Suite ``attention``: decode attention (one query token) against the memory-bandwidth limit.

Decode attention reads every cached key and value once and does little arithmetic per byte, so
its floor is ``bytes(K) + bytes(V)`` divided by the read bandwidth. The bandwidth is measured in
the same run (summing a 512 MiB tensor, median of 5), and each contender's time is reported as the
fraction of it achieved: ``(bytes(K) + bytes(V)) / time / bandwidth``.

Setting: B=1, 8 KV heads x 128, fp32 (bf16 on CUDA as well as fp32), MHA (8 query heads) and GQA
(32 query heads on 8 KV heads). K/V are views ``[:, :, :T]`` of buffers with room for 256 more
tokens, as a cache holds them. Contenders: ``torch.nn.functional.scaled_dot_product_attention``
(``enable_gqa=True``) and ``kvcache.attend``, alternating within each repeat; medians reported,
with the largest difference between the two outputs.

Then the quantized caches' decode attention beside fp32 (``coded_attention``: SmolLM2 geometry,
batch 1 and 8, 4K and 16K tokens), on the same measured bandwidth.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ...attention import attend
from . import coded_attention
from .common import clock, figure, finish_axes, markdown_table, median, read_bandwidth
from .harness import alternate, report
from ..run_options import RunOptions

CONTENDERS = ("sdpa", "attend")
VARIANTS = {"mha": 8, "gqa": 32}
KV_HEADS, HEAD_DIM = 8, 128


def contender(name: str):
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if name == "attend":
        return attend
    raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")


def run(
    options: RunOptions = RunOptions(),
    *,
    lengths: list[int] | None = None,
    repeats: int | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``attention.json``/``.md``/``.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    if lengths is None:
        top = options.pick(2**7, 2**14, 2**16)
        lengths = [2**i for i in range(6 if options.tiny else 10, top.bit_length())]
    repeats = repeats or options.pick(2, 10, 20)
    dtypes = [torch.float32] + ([torch.bfloat16] if options.device.startswith("cuda") else [])
    bandwidth = read_bandwidth(options.device, mib=16 if options.tiny else 512)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    bar = tqdm(total=len(dtypes) * len(VARIANTS) * len(lengths), desc="attention", disable=not options.progress)
    for dtype in dtypes:
        for variant, q_heads in VARIANTS.items():
            for total in lengths:
                shape = (1, KV_HEADS, total + 256, HEAD_DIM)
                kbuf = torch.randn(shape, generator=gen).to(options.device, dtype)
                vbuf = torch.randn(shape, generator=gen).to(options.device, dtype)
                key, value = kbuf[:, :, :total], vbuf[:, :, :total]
                query = torch.randn(1, q_heads, 1, HEAD_DIM, generator=gen).to(options.device, dtype)
                fns = {name: contender(name) for name in CONTENDERS}
                outputs = {name: fn(query, key, value) for name, fn in fns.items()}  # warm-up + check
                diff = (outputs["attend"].float() - outputs["sdpa"].float()).abs().max().item()
                times = alternate(CONTENDERS, repeats, lambda name: clock(lambda: fns[name](query, key, value), options.device))
                nbytes = key.nbytes + value.nbytes
                for name in CONTENDERS:
                    seconds = median(times[name])
                    rows.append(
                        {
                            "dtype": str(dtype).removeprefix("torch."),
                            "variant": variant,
                            "query_heads": q_heads,
                            "tokens": total,
                            "contender": name,
                            "ms": seconds * 1e3,
                            "kv_bytes": nbytes,
                            "bandwidth_fraction": nbytes / seconds / bandwidth,
                            "max_abs_diff_vs_sdpa": diff if name == "attend" else 0.0,
                            "samples_ms": [t * 1e3 for t in times[name]],
                        }
                    )
                del kbuf, vbuf, key, value
                bar.update()
    bar.close()
    coded_rows = coded_attention.run(options, bandwidth, repeats)
    config = {
        "batch": 1,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "variants": VARIANTS,
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "lengths": lengths,
        "repeats": repeats,
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report(
        "attention", options, config, rows, table, plot, read_bandwidth_bytes_per_s=bandwidth, quantized_rows=coded_rows
    )


def table(result: dict[str, Any]) -> str:
    bw = result["read_bandwidth_bytes_per_s"] / 1e9
    header = ["dtype", "variant", "T", "contender", "ms", "fraction of read bandwidth", "max |attend - sdpa|"]
    body = [
        [
            r["dtype"],
            f"{r['variant']} ({r['query_heads']}q/8kv)",
            r["tokens"],
            r["contender"],
            r["ms"],
            f"{r['bandwidth_fraction']:.0%}",
            f"{r['max_abs_diff_vs_sdpa']:.1e}" if r["contender"] == "attend" else "",
        ]
        for r in result["rows"]
    ]
    coded = coded_attention.table(result["quantized_rows"]) if result.get("quantized_rows") else ""
    return f"Measured read bandwidth: {bw:.1f} GB/s\n\n" + markdown_table(header, body) + coded


def plot(result: dict[str, Any], path: Path) -> None:
    dtypes = result["config"]["dtypes"]
    with figure(path, panels=len(dtypes), size=(7, 4.5)) as axes:
        for ax, dtype in zip(axes, dtypes):
            for variant in result["config"]["variants"]:
                for name in CONTENDERS:
                    pts = [
                        (r["tokens"], 100 * r["bandwidth_fraction"])
                        for r in result["rows"]
                        if (r["dtype"], r["variant"], r["contender"]) == (dtype, variant, name)
                    ]
                    ax.plot(*zip(*pts), marker="o", label=f"{name} {variant}")
            ax.axhline(50, color="grey", linestyle="--", linewidth=1)
            ax.set_ylim(0, 100)
            title = f"decode attention, {dtype}: % of read bandwidth ({result['read_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)"
            finish_axes(ax, "tokens in cache (T)", "% of measured read bandwidth", title)
