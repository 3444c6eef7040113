"""One contender's run of suite ``memory``, and that run in a fresh process of its own.

Every contender is one cache object used through its model-level ``update(key, value, layer_idx)``
with ``key``, ``value`` ``[1, kv_heads, 1, head_dim]``: Hugging Face's ``DynamicCache``
(``concat``), a buffer grown by 256 slots (``step256``, :class:`Step256Cache`), and ours
(``growable``, ``static``); :class:`Setup` holds the run's sizes. :func:`make_contender` also gives
a function returning the tensors whose storage a layer holds, which is what :class:`Tracker` watches.

:func:`measure` appends ``setup.tokens`` tokens to a contender's cache, one step at a time (``concat``
by chunks between checkpoints, stepped only near them), while a :class:`Tracker` watches the
storages behind every layer (bytes held, the peak while a layer reallocates, reallocations, spikes)
and :class:`.rss.PeakRSS` the process's resident memory; it returns the row of the contender.
:func:`measure_isolated` runs it in a fresh process, so that no allocator state carries over from
one contender to the next. What each figure means: :mod:`kvcache.apps.bench.memory`.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..contenders import make_contender as make_named
from .common import cache_config
from .harness import storage_of
from .rss import PeakRSS, current_rss
from .update import Step256


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
    return cache, lambda i: cache.kv_layers[i].view()  # views of the buffers: their storage is the whole buffer


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
    """One contender's run in this process (see :mod:`kvcache.apps.bench.memory`). ``progress(n)`` gets token counts."""
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
