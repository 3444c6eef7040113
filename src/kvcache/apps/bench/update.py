"""Suite ``update``: the cost of appending one token to a cache, no attention.

Contenders (B=1, 8 KV heads x 128, fp32 unless told otherwise):

- ``concat``: Hugging Face ``DynamicLayer`` (``torch.cat`` on every append);
- ``step256``: a buffer grown by a fixed 256 slots when full, the scheme mlx-lm uses;
- ``hf_static``: Hugging Face ``StaticLayer`` (``index_copy_`` into a preallocated buffer);
- ``growable`` and ``static``: ours.

How the cost per token at T is measured: the cache is brought to T/2 tokens through its own
growth path (single-token appends, untimed), then the T/2 appends from T/2 to T are timed, one
token at a time, so every reallocation a scheme makes on the way is in the average. ``concat``
is the exception: its per-append cost is the same at every step (it copies the whole past), so
it is prefilled to 3T/4 in one chunk and 32 appends are timed there, at the midpoint of the window
the others average over. Reallocations and peak bytes come from a separate untimed run from 0 to
T that watches the storage tensors: a reallocation is a change of their address, and the peak
counts the old and new storage alive together during it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer
from transformers.cache_utils import StaticLayer as HFStaticLayer

from ...layers import GrowableLayer, StaticLayer
from .common import clock, column_table, figure, finish_axes, human_bytes, median
from .harness import alternate, report, storage_of
from ..run_options import RunOptions

CONTENDERS = ("concat", "step256", "hf_static", "growable", "static")
CONCAT_WINDOW = 32


class Step256:
    """A buffer grown by a fixed number of slots when full (mlx-lm's scheme), for comparison."""

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def update(self, key: torch.Tensor, value: torch.Tensor) -> None:
        need = self.length + key.shape[2]
        if self.keys is None or need > self.keys.shape[2]:
            grow = math.ceil((need - self.length) / self.step) * self.step
            b, h, _, d = key.shape
            pad = torch.zeros(b, h, grow, d, dtype=key.dtype, device=key.device)
            if self.keys is None:
                self.keys, self.values = pad, pad.clone()
            else:
                kept = slice(0, self.length)
                self.keys = torch.cat([self.keys[:, :, kept], pad], dim=2)
                self.values = torch.cat([self.values[:, :, kept], pad], dim=2)
        self.keys[:, :, self.length : need] = key
        self.values[:, :, self.length : need] = value
        self.length = need


@dataclass
class Shape:
    batch: int = 1
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.float32
    device: str = "cpu"

    def chunk(self, n: int) -> torch.Tensor:
        return torch.randn(self.batch, self.kv_heads, n, self.head_dim, dtype=self.dtype, device=self.device)


def make_contender(name: str, max_tokens: int):
    """A fresh store and a function returning its storage tensors ``(keys, values)``."""
    makers = {
        "concat": DynamicLayer,
        "step256": Step256,
        "hf_static": lambda: HFStaticLayer(max_cache_len=max_tokens),
        "growable": GrowableLayer,
        "static": lambda: StaticLayer(max_tokens),
    }
    if name not in makers:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")
    layer = makers[name]()
    if name in ("growable", "static"):
        return layer, layer.view  # views of the buffers: their storage is the whole buffer
    return layer, lambda: (layer.keys, layer.values)


def _held(tensors) -> tuple[int, int]:
    """(bytes of the storages behind ``(keys, values)``, the keys' storage address; 0 if none)."""
    keys, values = tensors
    if keys is None:
        return 0, 0
    return sum(storage_of((keys, values)).values()), keys.untyped_storage().data_ptr()


def time_per_token(name: str, total: int, shape: Shape, max_tokens: int) -> float:
    """Seconds per appended token around ``total`` tokens (see the module docstring)."""
    layer, _ = make_contender(name, max_tokens)
    k, v = shape.chunk(1), shape.chunk(1)
    if name == "concat":
        start = 3 * total // 4
        layer.update(shape.chunk(start), shape.chunk(start))
        steps = CONCAT_WINDOW
    else:
        start = total // 2
        for _ in range(start):
            layer.update(k, v)
        steps = total - start

    def appends() -> None:
        for _ in range(steps):
            layer.update(k, v)

    return clock(appends, shape.device) / steps


def growth_profile(name: str, total: int, shape: Shape, max_tokens: int) -> dict[str, int]:
    """Reallocations and peak bytes on the way from 0 to ``total`` tokens (untimed)."""
    layer, tensors = make_contender(name, max_tokens)
    k, v = shape.chunk(1), shape.chunk(1)
    if name == "concat":
        # Every torch.cat allocates: check that on the last append, which is also the peak.
        layer.update(shape.chunk(total - 1), shape.chunk(total - 1))
        before, ptr = _held(tensors())
        layer.update(k, v)
        after, new_ptr = _held(tensors())
        assert new_ptr != ptr, "expected torch.cat to allocate new storage"
        return {"reallocations": total, "peak_bytes": before + after, "final_bytes": after}
    reallocs, peak, ptr = 0, 0, None
    for _ in range(total):
        before, _ = _held(tensors())
        layer.update(k, v)
        after, new_ptr = _held(tensors())
        if new_ptr != ptr:
            reallocs += 1
            peak = max(peak, before + after)
            ptr = new_ptr
        peak = max(peak, after)
    return {"reallocations": reallocs, "peak_bytes": peak, "final_bytes": after}


def run(
    options: RunOptions = RunOptions(),
    *,
    repeats: int | None = None,
    lengths: list[int] | None = None,
    shape: Shape | None = None,
) -> dict[str, Any]:
    """Run the suite; write ``update.json``/``update.md``/``update.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    if shape is None:
        shape = Shape(kv_heads=2, head_dim=16, device=options.device) if options.tiny else Shape(device=options.device)
    if lengths is None:
        top = options.pick(512, 4096, 16384)
        lengths = [2**i for i in range(8, int(math.log2(top)) + 1)]
    repeats = repeats or options.pick(1, 3, 5)
    max_tokens = max(lengths)
    bar = tqdm(total=len(lengths) * repeats * len(CONTENDERS), desc="update", disable=not options.progress)
    times = {
        total: alternate(CONTENDERS, repeats, lambda name: time_per_token(name, total, shape, max_tokens), bar)
        for total in lengths
    }
    bar.close()

    us = {(t, name): median(samples) * 1e6 for t in lengths for name, samples in times[t].items()}
    rows = [
        {
            "contender": name,
            "tokens": t,
            "us_per_token": us[t, name],
            "speedup_vs_concat": us[t, "concat"] / us[t, name],
            "samples_us": [s * 1e6 for s in times[t][name]],
            **growth_profile(name, t, shape, max_tokens),
        }
        for t in lengths
        for name in CONTENDERS
    ]
    flat = {name: max(us[t, name] for t in lengths) / min(us[t, name] for t in lengths) for name in CONTENDERS}
    config = {
        "batch": shape.batch,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "dtype": str(shape.dtype),
        "repeats": repeats,
        "lengths": lengths,
        "quick": options.quick,
    }
    return report("update", options, config, rows, table, plot, flatness_max_over_min=flat)


def table(result: dict[str, Any]) -> str:
    columns = {
        "tokens": "tokens",
        "contender": "contender",
        "us/token": "us_per_token",
        "x faster than concat": "speedup_vs_concat",
        "reallocations": "reallocations",
        "peak bytes": lambda r: human_bytes(r["peak_bytes"]),
    }
    flat = ", ".join(f"{k} {v:.2f}x" for k, v in result["flatness_max_over_min"].items())
    return column_table(result["rows"], columns) + f"\nPer-token cost max/min over T: {flat}\n"


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    with figure(path) as (ax,):
        for name in CONTENDERS:
            pts = [(r["tokens"], r["us_per_token"]) for r in result["rows"] if r["contender"] == name]
            ax.plot(*zip(*pts), marker="o", label=name)
        title = f"Append cost per token (B={c['batch']}, {c['kv_heads']} KV heads x {c['head_dim']}, {c['dtype']})"
        finish_axes(ax, "tokens in cache (T)", "microseconds per appended token", title, log_y=True)
