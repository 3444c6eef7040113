"""Suite ``memory``: process memory, cache bytes and reallocations over a long decode.

A decode loop appends one token to every layer per step. This suite drives a cache exactly that
way, with no model around it, so that 32K tokens run in minutes on a CPU: per step, ``update(k, v,
layer_idx)`` for each layer in turn with ``k``, ``v`` of shape ``[1, 8, 1, 128]`` (fp32, Llama's
per-layer KV shape; 4 layers by default, 256 MiB per layer at 32K tokens).

Contenders (one cache object each, used through its model-level ``update``):

- ``concat``: Hugging Face ``DynamicCache`` (``torch.cat`` per append);
- ``step256``: a buffer grown by a fixed 256 slots when full (mlx-lm's scheme; one
  ``kvcache.apps.bench.update.Step256`` per layer behind a small cache adapter);
- ``growable``: ours, ``make_cache(config)`` (doubling from 256 slots);
- ``static``: ours, ``make_cache(config, "static", capacity=T)``.

Every contender runs in its own fresh process (``multiprocessing``: forked from a ``forkserver`` that
has only imported the measuring module, else spawned), one after another, so that no allocator state or
resident memory carries over. In that process, after imports and a
short warm-up of the same code path, the baseline is the current RSS (``/proc/self/statm``) and the
kernel's peak-RSS mark is reset (``/proc/self/clear_refs`` = 5). Measured:

- ``peak_rss_bytes``: the largest RSS during the run minus the baseline. Every ``sample_every``
  steps ``VmHWM`` (``/proc/self/status``, the kernel's high-water mark, which sees transient peaks
  that happen inside a step) is read and reset, so each sample is the peak of its window. Where
  the mark cannot be reset, ``ru_maxrss`` of the fresh process is used instead (``config.rss_method``).
- ``final_cache_bytes`` and the cache-bytes curve: storage the cache holds, counted as distinct
  storages (``untyped_storage().nbytes()``) of every layer's key and value tensors, after each step.
- ``peak_cache_bytes``: the largest, over all layer updates, of the bytes held before the update
  plus the bytes of storage the update newly allocated (old and new storage of the reallocating
  layer counted alive together, which they are while the past is copied).
- ``reallocations``: changes of a layer's storage pointer, summed over layers, the first allocation
  included (the convention of ``KVCache.reallocations``, which is also recorded for ours as a check).
- ``spikes``: decode steps (tokens) in which at least one layer allocated new storage, the first
  allocation included; mlx-lm counts 128 for +256 growth against 7 doublings (first allocation not
  counted) by 32K tokens.

``concat`` is the exception, because stepping it token by token to T copies O(T²) bytes (about
4 TiB per layer at 32K tokens: hours on a CPU). Its state after t single-token appends is one
storage of t tokens per layer, whatever the path, so it is brought to each of ``checkpoints``
evenly spaced lengths by one chunk append (an expanded view of the token: no extra memory), and the
last ``window`` tokens before each checkpoint, the final length T included, are appended one at a
time and measured like the others. Its peak RSS and peak cache bytes come from those stepped
appends (the last one, at T, is the largest). Every stepped append is checked to reallocate every
layer; its ``reallocations`` (T per layer) and ``spikes`` (T) are then given by that rule and the
row says ``counts_extrapolated``.

The pieces: :mod:`.memory_measure` (the sizes, the contender caches and one contender's run, in its
own process) and :mod:`.rss` (the process's resident memory); this module runs them and writes the
result, its table (one row per contender, with notes on how each figure was counted) and its plot
(the cache bytes held and the process's peak RSS per sample window against the tokens appended).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..run_options import RunOptions
from .common import figure, human_bytes, markdown_table
from .harness import report
from .memory_measure import CONTENDERS, Setup, measure, measure_isolated

__all__ = ["CONTENDERS", "plot", "run", "table"]


def run(
    options: RunOptions = RunOptions(),
    *,
    tokens: int | None = None,
    layers: int | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
    isolate: bool = True,
) -> dict[str, Any]:
    """Run the suite; write ``memory.json``/``memory.md``/``memory.png`` into ``options.out`` if given.

    CPU only (process RSS is what is measured). ``isolate=False`` runs every contender in this
    process (faster, for debugging; memory freed by one contender may then be reused by the next).
    """
    from tqdm.auto import tqdm

    if torch.device(options.device).type != "cpu":
        raise ValueError(f"the memory suite measures process RSS on the CPU; got device={options.device!r}")
    if options.tiny:
        setup = Setup(tokens=tokens or 320, layers=layers or 2, kv_heads=2, head_dim=16, samples=64, checkpoints=4, window=2)
    else:
        setup = Setup(tokens=tokens or (4096 if options.quick else 32768), layers=layers or 4)
    bar = tqdm(total=setup.tokens * len(contenders), desc="memory", unit="tok", disable=not options.progress)
    rows = []
    for name in contenders:
        if isolate:
            row = measure_isolated(name, setup, bar)
        else:
            last = [0]

            def tick(t: int) -> None:
                bar.update(t - last[0])
                last[0] = t

            row = measure(name, setup, tick)
        rows.append(row)
    bar.close()

    needed = setup.token_bytes * setup.layers * setup.tokens
    for r in rows:
        r["peak_rss_over_needed"] = r["peak_rss_bytes"] / needed
    config = {
        **asdict(setup),
        "sample_every": setup.sample_every,
        "token_bytes_per_layer": setup.token_bytes,
        "needed_bytes": needed,
        "isolated_processes": isolate,
        "rss_method": rows[0]["rss_method"] if rows else None,
        "quick": options.quick,
        "tiny": options.tiny,
        "model": f"llama-shaped: {setup.layers} layers x {setup.kv_heads} KV heads x {setup.head_dim}, {setup.dtype}, batch 1",
    }
    return report("memory", options, config, rows, table, plot)


def mib(n: float) -> str:
    """``n`` bytes for the table: in MiB from 16 MiB up, else in the unit that suits."""
    return human_bytes(n) if abs(n) < 16 * 2**20 else f"{n / 2**20:,.0f} MiB"


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    header = [
        "contender",
        "tokens",
        "peak RSS above baseline",
        "peak RSS / bytes of T tokens",
        "peak cache bytes",
        "final cache bytes",
        "reallocations",
        "spikes",
        "seconds",
    ]
    body = [
        [
            r["contender"] + (" *" if r["counts_extrapolated"] else ""),
            r["tokens"],
            mib(r["peak_rss_bytes"]),
            r["peak_rss_over_needed"],
            mib(r["peak_cache_bytes"]),
            mib(r["final_cache_bytes"]),
            r["reallocations"],
            r["spikes"],
            r["seconds"],
        ]
        for r in result["rows"]
    ]
    notes = (
        f"\n{c['model']}; one token appended to every layer per step; T tokens need {mib(c['needed_bytes'])}. "
        f"Reallocations are summed over the {c['layers']} layers (first allocation included); spikes are steps in "
        "which any layer allocated. Peak RSS: the kernel's high-water mark in a fresh process per contender, minus "
        "its RSS before the run; buffer capacity never written is not resident, so it can be below the cache bytes.\n"
    )
    if any(r["counts_extrapolated"] for r in result["rows"]):
        stepped = next(r["stepped_tokens"] for r in result["rows"] if r["counts_extrapolated"])
        notes += (
            f"\n\\* concat was stepped one token at a time for {stepped} of its tokens (the last {c['window']} before each of "
            f"{c['checkpoints']} checkpoints, T included) and brought between them by one chunk append, since stepping "
            "all of them copies O(T²) bytes. Each stepped append reallocated every layer, so its counts are T per layer "
            "and T spikes; its seconds are not comparable.\n"
        )
    return markdown_table(header, body) + notes


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    unit = 2**20
    with figure(path, panels=2, size=(6.5, 4.5)) as (held, rss):
        for r in result["rows"]:
            # concat is sampled at few points (see the docstring): dashed with markers, on top.
            style = dict(linestyle="--", marker="o", markersize=3, zorder=3) if r["counts_extrapolated"] else {}
            xs, ys = zip(*r["bytes_curve"])
            held.plot(xs, [y / unit for y in ys], label=r["contender"], **style)
            pts = [(t, peak) for t, _, _, peak in r["samples"]]
            rss.plot([t for t, _ in pts], [p / unit for _, p in pts], label=r["contender"], **style)
        for ax, ylabel, title in (
            (held, "MiB of storage held by the cache", "Cache bytes held"),
            (rss, "MiB above baseline (peak per sample window)", "Process RSS"),
        ):
            ax.set_xlabel("tokens appended")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {c['layers']} layers x {c['kv_heads']}x{c['head_dim']} {c['dtype']}")
            ax.grid(True, alpha=0.3)
            ax.legend()
