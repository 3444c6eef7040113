"""Suite ``memory``: process memory, cache bytes and reallocations over a long decode.

A decode loop appends one token to every layer per step. This suite drives a cache exactly that
way, with no model around it, so that 32K tokens run in minutes on a CPU: per step, ``update(k, v,
layer_idx)`` for each layer in turn with ``k``, ``v`` of shape ``[1, 8, 1, 128]`` (fp32, Llama's
per-layer KV shape; 4 layers by default, 256 MiB per layer at 32K tokens).

Contenders (one cache object each, used through its model-level ``update``):

- ``concat``: Hugging Face ``DynamicCache`` (``torch.cat`` per append);
- ``step256``: a buffer grown by a fixed 256 slots when full (mlx-lm's scheme; one
  ``kvcache.apps.bench.update.Step256`` per layer behind a small cache adapter, :class:`Step256Cache`);
- ``growable``: ours, ``make_cache(config)`` (doubling from 256 slots);
- ``static``: ours, ``make_cache(config, "static", capacity=T)``.

Every contender runs in its own fresh process (``multiprocessing``: forked from a ``forkserver`` that
has only imported this module, else spawned), one after another, so that no allocator state or
resident memory carries over. There, after a short warm-up of the same code path, the baseline is
the current RSS and the kernel's peak-RSS mark is reset (:mod:`.rss`). Measured:

- ``peak_rss_bytes``: the largest RSS during the run minus the baseline, the peak of each window of
  ``sample_every`` steps (``rss.PeakRSS``: the kernel's high-water mark, which sees transient peaks
  inside a step; ``ru_maxrss`` of the fresh process where it cannot be reset, ``config.rss_method``).
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

The table has one row per contender, with notes on how each figure was counted; the plot, the cache
bytes held and the process's peak RSS per sample window against the tokens appended.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..contenders import make_contender as make_named
from ..run_options import RunOptions
from .common import cache_config, column_table, figure, human_bytes
from .harness import report, storage_of
from .rss import PeakRSS, current_rss
from .update import Step256

__all__ = ["CONTENDERS", "plot", "run", "table"]

CONTENDERS = ("concat", "step256", "growable", "static")


@dataclass
class Setup:
    """What one contender's run does (picklable, sent to the worker process)."""

    tokens: int
    layers: int = 4
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float32"
    samples: int = 512  # RSS samples over the run (about)
    checkpoints: int = 16  # concat: lengths it is brought to
    window: int = 4  # concat: single-token appends before each checkpoint

    @property
    def sample_every(self) -> int:
        return max(1, self.tokens // self.samples)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values in one layer."""
        return 2 * self.kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


class Step256Cache:
    """``update(k, v, layer_idx)`` over one ``Step256`` per layer, like a model-level cache."""

    def __init__(self, layers: int) -> None:
        self.layers = [Step256() for _ in range(layers)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> None:
        self.layers[layer_idx].update(key, value)


def make_contender(name: str, setup: Setup):
    """A fresh cache and a function giving layer i's storage tensors ``(keys, values)`` (or Nones)."""
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")
    if name == "step256":
        cache = Step256Cache(setup.layers)
    else:  # concat: Hugging Face's DynamicCache, torch.cat on every append
        config = cache_config(setup.layers, setup.kv_heads, setup.head_dim, setup.tokens)
        cache = make_named("dynamic" if name == "concat" else name, config, capacity=setup.tokens)
    if name in ("concat", "step256"):
        return cache, lambda i: (cache.layers[i].keys, cache.layers[i].values)
    return cache, lambda i: cache.kv_layers[i].view()  # views of the buffers: their storage is the whole buffer


class Tracker:
    """A contender's cache, and the storage behind its layers across updates: bytes held, the peak
    while a layer reallocates, reallocations, spikes."""

    def __init__(self, name: str, setup: Setup) -> None:
        self.cache, self.storages = make_contender(name, setup)
        self.layer_storage: list[dict[int, int]] = [{} for _ in range(setup.layers)]
        self.held = self.peak = self.reallocations = self.spikes = 0

    def step(self, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append ``k``, ``v`` to every layer; returns how many layers allocated new storage."""
        changed = 0
        for i, before in enumerate(self.layer_storage):
            self.cache.update(k, v, i)
            now = storage_of(self.storages(i))
            if now.keys() != before.keys():
                fresh = sum(n for ptr, n in now.items() if ptr not in before)
                self.peak = max(self.peak, self.held + fresh)  # old and new alive together while copying
                self.held += sum(now.values()) - sum(before.values())
                self.layer_storage[i] = now
                self.reallocations += 1
                changed += 1
        self.spikes += changed > 0
        return changed


def measure(name: str, setup: Setup, progress: Callable[[int], None] = lambda t: None) -> dict[str, Any]:
    """One contender's run in this process (see the module docstring). ``progress(n)`` gets token counts."""
    dtype = getattr(torch, setup.dtype)
    k = torch.randn(1, setup.kv_heads, 1, setup.head_dim, dtype=dtype)
    v = torch.randn(1, setup.kv_heads, 1, setup.head_dim, dtype=dtype)

    # Warm-up: the same code path on a small throwaway cache (one head of 8), so lazy initialisation
    # is not counted and little freed memory is left for the measured run to reuse.
    warm = Tracker(name, replace(setup, tokens=8, kv_heads=1, head_dim=8))
    wk = torch.randn(1, 1, 1, 8, dtype=dtype)
    for _ in range(8):
        warm.step(wk, wk)
    del warm, wk
    gc.collect()

    tracker = Tracker(name, setup)
    rss = PeakRSS()
    baseline = current_rss()
    rss.start()
    samples: list[tuple[int, int, int, int]] = []  # (tokens, cache bytes held, rss above baseline, window peak)
    bytes_curve: list[tuple[int, int]] = [(0, 0)]  # (tokens, cache bytes held): every change of slope

    def sample(t: int) -> None:
        peak = rss.window_peak() - baseline
        samples.append((t, tracker.held, current_rss() - baseline, peak))

    start = time.perf_counter()
    if name == "concat":
        stepped = done = 0
        marks = sorted({max(1, round(setup.tokens * (j + 1) / setup.checkpoints)) for j in range(setup.checkpoints)})
        for mark in marks:
            jump = max(0, mark - setup.window) - done
            if jump > 0:
                # One chunk append to mark - window: an expanded view of the token, no memory of its own.
                tracker.step(k.expand(-1, -1, jump, -1), v.expand(-1, -1, jump, -1))
                done += jump
                bytes_curve.append((done, tracker.held))
                sample(done)
            while done < mark:
                changed = tracker.step(k, v)
                if changed != setup.layers:
                    raise RuntimeError(
                        f"concat: a single-token append reallocated {changed} of {setup.layers} layers "
                        f"(at {done + 1} tokens); the sampling shortcut assumes every append reallocates"
                    )
                done += 1
                stepped += 1
                bytes_curve.append((done, tracker.held))
                sample(done)
            progress(done)
        reallocations, spikes, extrapolated = setup.tokens * setup.layers, setup.tokens, True
    else:
        stepped = setup.tokens
        for t in range(1, setup.tokens + 1):
            held_before = tracker.held
            if tracker.step(k, v):
                bytes_curve += [(t - 1, held_before), (t, tracker.held)]
            if t % setup.sample_every == 0 or t == setup.tokens:
                sample(t)
                progress(t)
        bytes_curve.append((setup.tokens, tracker.held))
        reallocations, spikes, extrapolated = tracker.reallocations, tracker.spikes, False
    seconds = time.perf_counter() - start

    cache = tracker.cache
    length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else cache.layers[0].length
    if length != setup.tokens:
        raise RuntimeError(f"{name}: the cache holds {length} tokens, expected {setup.tokens}")
    return {
        "contender": name,
        "tokens": setup.tokens,
        "stepped_tokens": stepped,
        "peak_rss_bytes": max(0, *(peak for *_, peak in samples)),
        "final_rss_bytes": current_rss() - baseline,
        "baseline_rss_bytes": baseline,
        "final_cache_bytes": tracker.held,
        "peak_cache_bytes": tracker.peak,
        "reallocations": reallocations,
        "spikes": spikes,
        "counts_extrapolated": extrapolated,
        "reported_reallocations": int(cache.reallocations) if hasattr(cache, "reallocations") else None,
        "reported_nbytes": int(cache.nbytes) if hasattr(cache, "nbytes") else None,
        "seconds": seconds,
        "rss_method": rss.method,
        "bytes_curve": bytes_curve,
        "samples": samples,
    }


def _worker(name: str, setup: Setup, channel) -> None:
    try:
        channel.put(("done", measure(name, setup, progress=lambda t: channel.put(("progress", t)))))
    except BaseException:  # report everything, the parent raises it
        channel.put(("error", traceback.format_exc()))


def measure_isolated(name: str, setup: Setup, progress: Callable[[int], None], timeout=1800.0) -> dict[str, Any]:
    """``measure`` in a fresh process of its own: from a ``forkserver`` that has imported this module
    (and so torch and transformers) but run nothing, without the import time of ``spawn``."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(name, setup, channel), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                kind, payload = channel.get(timeout=1.0)
            except queue.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"memory bench worker for {name!r} died (exit code {proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"memory bench worker for {name!r} ran past {timeout:.0f} s") from None
                continue
            if kind == "error":
                raise RuntimeError(f"memory bench worker for {name!r} failed:\n{payload}")
            progress(payload if kind == "progress" else setup.tokens)
            if kind == "done":
                return payload
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


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
    for i, name in enumerate(contenders):
        advance = lambda t: bar.update(i * setup.tokens + t - bar.n)  # noqa: E731 (t: this contender's tokens so far)
        rows.append((measure_isolated if isolate else measure)(name, setup, advance))
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
    columns = {
        "contender": lambda r: r["contender"] + (" *" if r["counts_extrapolated"] else ""),
        "tokens": "tokens",
        "peak RSS above baseline": lambda r: mib(r["peak_rss_bytes"]),
        "peak RSS / bytes of T tokens": "peak_rss_over_needed",
        "peak cache bytes": lambda r: mib(r["peak_cache_bytes"]),
        "final cache bytes": lambda r: mib(r["final_cache_bytes"]),
        "reallocations": "reallocations",
        "spikes": "spikes",
        "seconds": "seconds",
    }
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
    return column_table(result["rows"], columns) + notes


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    unit = 2**20
    with figure(path, panels=2, size=(6.5, 4.5)) as (held, rss):
        for r in result["rows"]:
            # concat is sampled at few points (see the docstring): dashed with markers, on top.
            style = dict(linestyle="--", marker="o", markersize=3, zorder=3) if r["counts_extrapolated"] else {}
            xs, ys = zip(*r["bytes_curve"])
            held.plot(xs, [y / unit for y in ys], label=r["contender"], **style)
            rss.plot([s[0] for s in r["samples"]], [s[3] / unit for s in r["samples"]], label=r["contender"], **style)
        for ax, ylabel, title in (
            (held, "MiB of storage held by the cache", "Cache bytes held"),
            (rss, "MiB above baseline (peak per sample window)", "Process RSS"),
        ):
            ax.set_xlabel("tokens appended")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {c['layers']} layers x {c['kv_heads']}x{c['head_dim']} {c['dtype']}")
            ax.grid(True, alpha=0.3)
            ax.legend()
