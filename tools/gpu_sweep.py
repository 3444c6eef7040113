"""Sweep the Triton decode kernel's launch (tokens a tile, warps, pipeline stages, product precision)
on a CUDA device, for each way in that ``kvcache bench gpu`` measures, against torch's SDPA over the
same views. Writes ``OUT/sweep.json`` and ``OUT/sweep.md`` after every shape, so a run cut short
still leaves what it measured. Each row: the median time, the bytes it reads, their share of the device's copy
bandwidth, the speed-up over float paged blocks at the default launch (same rows and tokens), and
the largest difference from a reference output (SDPA for the float ways, the default launch for
the coded ones, whose codes SDPA does not read).

    OUT=benchmarks/results/gpu python tools/gpu_sweep.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from kvcache.apps.bench import gpu
from kvcache.apps.bench.common import clock, markdown_table, median
from kvcache.attention.triton_decode import LAUNCH, Launch

SHAPES = [(1, 1024), (1, 32768), (16, 4096), (64, 4096), (16, 32768)]


def launches(kind: str) -> list[Launch]:
    """Tiles, warps and stages around the defaults, and the product precisions (``dot`` sets the
    float32 products: the coded ways' and a float32 cache's; see ``triton_decode._precision``)."""
    if kind == "float":
        grid = [Launch(64, 4, 2), Launch(64, 4, 3), Launch(128, 4, 2), Launch(64, 8, 2), Launch(32, 4, 2)]
        return grid + [Launch(64, 4, 2, "ieee")]
    grid = [Launch(64, 4, 1), Launch(64, 4, 2), Launch(128, 4, 1), Launch(64, 8, 1), Launch(128, 8, 1), Launch(32, 4, 1)]
    return grid + [Launch(64, 4, 1, "tf32")]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="two shapes only")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "benchmarks/results/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    bandwidth = gpu.copy_bandwidth(device)
    rows: list[dict] = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    for batch, tokens in shapes:
        gen = torch.Generator().manual_seed(0)
        calls = gpu._kernel_calls(device, dtype, batch, tokens, gen)
        reference = {"float": calls["sdpa"][0]().float().reshape(batch, gpu.KV_HEADS, -1, gpu.HEAD_DIM)}
        sdpa_s = median([clock(calls["sdpa"][0], device) for _ in range(6)][1:])
        rows.append({"batch": batch, "tokens": tokens, "way": "sdpa", "launch": "-", "ms": sdpa_s * 1e3, "bytes": calls["sdpa"][1],
                     "share": calls["sdpa"][1] / sdpa_s / bandwidth, "error": 0.0})  # fmt: skip
        for way in ("views", "paged", "paged-int8", "paged-int4", "paged-fp8"):
            kind = "float" if way in ("views", "paged") else "coded"
            for launch in launches(kind):
                kernel, nbytes = calls[way]
                call = lambda kernel=kernel, launch=launch: kernel(launch)  # noqa: E731
                row = {"batch": batch, "tokens": tokens, "way": way, "launch": "/".join(map(str, launch)), "bytes": nbytes}
                try:
                    started = time.perf_counter()
                    result = call()
                    torch.cuda.synchronize(device)
                    row["first_s"] = time.perf_counter() - started
                    ref = reference["float"] if kind == "float" else reference.setdefault(way, result)
                    row["error"] = float((result - ref).abs().max())
                    seconds = median([clock(call, device) for _ in range(6)][1:])
                    row.update(ms=seconds * 1e3, share=nbytes / seconds / bandwidth, default=launch == LAUNCH[kind])
                except Exception as e:  # noqa: BLE001 (a row says why a launch could not run)
                    row["reason"] = repr(e)[:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
            gpu._free(device)
        del calls
        gpu._free(device)
        write(out, rows, bandwidth)
    return 0


def over_float(rows: list[dict]) -> dict[tuple[int, int], float]:
    """(batch, tokens) -> the milliseconds of float paged blocks at their default launch: what each
    row's speed-up is over (the same rows and tokens)."""
    return {(r["batch"], r["tokens"]): r["ms"] for r in rows if r["way"] == "paged" and r.get("default") and "ms" in r}


def write(out: Path, rows: list[dict], bandwidth: float, gpu_name: str | None = None) -> None:
    gpu_name = gpu_name or torch.cuda.get_device_name()
    (out / "sweep.json").write_text(json.dumps({"gpu": gpu_name, "copy_bandwidth": bandwidth, "rows": rows}, indent=1))
    floats = over_float(rows)

    def speedup(r: dict) -> str:
        base = floats.get((r["batch"], r["tokens"]))
        return f"{base / r['ms']:.2f}x" if base and "ms" in r else ""

    body = [[r["batch"], r["tokens"], r["way"], r["launch"], f"{r['ms']:.3f}" if "ms" in r else r.get("reason", ""),
             f"{r['bytes'] / 1e6:.1f}" if "bytes" in r else "", f"{r['share']:.0%}" if "share" in r else "", speedup(r),
             f"{r['error']:.1e}" if "error" in r else ""] for r in rows]  # fmt: skip
    title = f"Triton decode launches on {gpu_name}; copy bandwidth {bandwidth / 1e9:.0f} GB/s\n\n"
    header = ["batch", "tokens", "way", "block/warps/stages/dot", "ms", "MB read", "share of copy bandwidth", "x paged float", "max error"]
    (out / "sweep.md").write_text(title + markdown_table(header, body))


if __name__ == "__main__":
    sys.exit(main())
