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
has only imported this module, else spawned), one after another, so that no allocator state or
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
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import resource
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..contenders import make_contender as make_named
from .common import cache_config, figure, human_bytes, markdown_table
from .harness import report, storage_of
from ..run_options import RunOptions
from .update import Step256

CONTENDERS = ("concat", "step256", "growable", "static")
PAGE = os.sysconf("SC_PAGE_SIZE")


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


# ---- contenders ---------------------------------------------------------------------------


class Step256Cache:
    """``update(k, v, layer_idx)`` over one ``Step256`` per layer, like a model-level cache."""

    def __init__(self, layers: int) -> None:
        self.layers = [Step256() for _ in range(layers)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int):
        layer = self.layers[layer_idx]
        layer.update(key, value)
        return layer.keys[:, :, : layer.length], layer.values[:, :, : layer.length]


def make_contender(name: str, setup: Setup):
    """A fresh cache and a function giving layer i's storage tensors ``(keys, values)`` (or Nones)."""
    config = cache_config(setup.layers, setup.kv_heads, setup.head_dim, setup.tokens)
    if name == "step256":
        cache = Step256Cache(setup.layers)
        return cache, lambda i: (cache.layers[i].keys, cache.layers[i].values)
    if name not in CONTENDERS:
        raise ValueError(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}")
    cache = make_named("dynamic" if name == "concat" else name, config, capacity=setup.tokens)
    if name == "concat":  # Hugging Face's DynamicCache: torch.cat on every append
        return cache, lambda i: (getattr(cache.layers[i], "keys", None), getattr(cache.layers[i], "values", None))
    return cache, lambda i: cache.stores[i].view()  # views of the buffers: their storage is the whole buffer


# ---- process memory -----------------------------------------------------------------------


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak RSS per window: the kernel's high-water mark, read and reset at each sample."""

    def __init__(self) -> None:
        self.method = "VmHWM reset per sample window (/proc/self/clear_refs)"
        try:
            self._reset()
            self._hwm()
        except OSError:
            self.method = "ru_maxrss of a fresh process (high-water mark not resettable)"

    @property
    def resettable(self) -> bool:
        return self.method.startswith("VmHWM")

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise OSError("no VmHWM in /proc/self/status")

    def window_peak(self) -> int:
        """Peak RSS since the previous call (or since ``start``), and start a new window."""
        if not self.resettable:
            return max(current_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        peak = self._hwm()
        self._reset()
        return peak

    start = window_peak


# ---- one contender's run (in its own process) ---------------------------------------------


class Tracker:
    """Watches a cache's storage across layer updates: bytes held, peaks, reallocations, spikes."""

    def __init__(self, storages, layers: int) -> None:
        self.storages = storages
        self.layer_storage: list[dict[int, int]] = [{} for _ in range(layers)]
        self.held = 0
        self.peak = 0
        self.reallocations = 0
        self.spikes = 0

    def after_update(self, i: int) -> bool:
        """Record layer i's storage after an update; True if it allocated new storage."""
        now, before = storage_of(self.storages(i)), self.layer_storage[i]
        if now.keys() == before.keys():
            return False
        fresh = sum(n for ptr, n in now.items() if ptr not in before)
        self.peak = max(self.peak, self.held + fresh)  # old and new alive together while copying
        self.held += sum(now.values()) - sum(before.values())
        self.layer_storage[i] = now
        self.reallocations += 1
        return True

    def step(self, cache, k: torch.Tensor, v: torch.Tensor, layers: int) -> int:
        """Append one step (``k``, ``v`` to every layer); returns how many layers reallocated."""
        changed = 0
        for i in range(layers):
            cache.update(k, v, i)
            changed += self.after_update(i)
        if changed:
            self.spikes += 1
        return changed


def measure(name: str, setup: Setup, progress=None) -> dict[str, Any]:
    """One contender's run in this process (see the module docstring). ``progress(n)`` gets token counts."""
    dtype = getattr(torch, setup.dtype)
    k = torch.randn(1, setup.kv_heads, 1, setup.head_dim, dtype=dtype)
    v = torch.randn(1, setup.kv_heads, 1, setup.head_dim, dtype=dtype)

    # Warm-up: the same code path on a small throwaway cache (one head of 8), so lazy initialisation
    # is not counted and little freed memory is left for the measured run to reuse.
    small = Setup(**{**asdict(setup), "tokens": 8, "kv_heads": 1, "head_dim": 8})
    warm, warm_storages = make_contender(name, small)
    warm_tracker = Tracker(warm_storages, setup.layers)
    wk = torch.randn(1, 1, 1, 8, dtype=dtype)
    for _ in range(small.tokens):
        warm_tracker.step(warm, wk, wk, setup.layers)
    del warm, warm_storages, warm_tracker, wk
    gc.collect()

    cache, storages = make_contender(name, setup)
    tracker = Tracker(storages, setup.layers)
    rss = PeakRSS()
    baseline = current_rss()
    rss.start()
    samples: list[tuple[int, int, int, int]] = []  # (tokens, cache bytes held, rss above baseline, window peak)
    window_peaks: list[int] = []

    def sample(t: int) -> None:
        peak = rss.window_peak() - baseline
        window_peaks.append(peak)
        samples.append((t, tracker.held, current_rss() - baseline, peak))

    bytes_curve: list[tuple[int, int]] = [(0, 0)]  # (tokens, cache bytes held): every change of slope
    start = time.perf_counter()
    extrapolated = False
    if name == "concat":
        stepped, done = 0, 0
        marks = sorted({max(1, round(setup.tokens * (j + 1) / setup.checkpoints)) for j in range(setup.checkpoints)})
        for mark in marks:
            jump = max(0, mark - setup.window) - done
            if jump > 0:
                # One chunk append to mark - window: an expanded view of the token, no memory of its own.
                for i in range(setup.layers):
                    cache.update(k.expand(-1, -1, jump, -1), v.expand(-1, -1, jump, -1), i)
                    tracker.after_update(i)
                done += jump
                bytes_curve.append((done, tracker.held))
                sample(done)
            while done < mark:
                changed = tracker.step(cache, k, v, setup.layers)
                if changed != setup.layers:
                    raise RuntimeError(
                        f"concat: a single-token append reallocated {changed} of {setup.layers} layers "
                        f"(at {done + 1} tokens); the sampling shortcut assumes every append reallocates"
                    )
                done += 1
                stepped += 1
                bytes_curve.append((done, tracker.held))
                sample(done)
            if progress:
                progress(done)
        reallocations, spikes, extrapolated = setup.tokens * setup.layers, setup.tokens, True
    else:
        stepped = setup.tokens
        for t in range(1, setup.tokens + 1):
            held_before = tracker.held
            if tracker.step(cache, k, v, setup.layers):
                bytes_curve += [(t - 1, held_before), (t, tracker.held)]
            if t % setup.sample_every == 0 or t == setup.tokens:
                sample(t)
                if progress:
                    progress(t)
        bytes_curve.append((setup.tokens, tracker.held))
        reallocations, spikes = tracker.reallocations, tracker.spikes
    seconds = time.perf_counter() - start

    length = cache.get_seq_length() if hasattr(cache, "get_seq_length") else cache.layers[0].length
    if length != setup.tokens:
        raise RuntimeError(f"{name}: the cache holds {length} tokens, expected {setup.tokens}")
    return {
        "contender": name,
        "tokens": setup.tokens,
        "stepped_tokens": stepped,
        "peak_rss_bytes": max(0, *window_peaks),
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
        result = measure(name, setup, progress=lambda t: channel.put(("progress", t)))
        channel.put(("done", result))
    except BaseException:  # report everything, the parent raises it
        channel.put(("error", traceback.format_exc()))


def measure_isolated(name: str, setup: Setup, bar=None, timeout: float = 1800.0) -> dict[str, Any]:
    """``measure`` in a fresh process; progress goes to the tqdm ``bar``.

    The process is forked from a ``forkserver`` that has imported this module (and so torch and
    transformers) but run nothing, which is a fresh process without the import time of ``spawn``.
    """
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = mp.get_context("spawn")
    channel = ctx.Queue()
    proc = ctx.Process(target=_worker, args=(name, setup, channel), daemon=True)
    proc.start()
    last, deadline = 0, time.monotonic() + timeout
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
            if kind == "progress":
                if bar is not None:
                    bar.update(payload - last)
                last = payload
            elif kind == "error":
                raise RuntimeError(f"memory bench worker for {name!r} failed:\n{payload}")
            else:
                if bar is not None:
                    bar.update(setup.tokens - last)
                return payload
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---- the suite ----------------------------------------------------------------------------


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


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    print(table(run(RunOptions(quick=args.quick, out=args.out), tokens=args.tokens, layers=args.layers)))
