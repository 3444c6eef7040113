"""``kvcache demo``: greedy generation with each cache, side by side, on a tiny local model.

The model is built from a config (:func:`kvcache.tiny.tiny_model`, random weights, nothing
downloaded), widened where the cache lives: 8 key/value heads of dimension 128, so one token costs
8 KiB of keys and values per layer and a 640-token cache holds 20 MiB across 4 layers, while the
matrix multiplies stay small. That makes the cost of the cache itself visible on a CPU.

Contenders, all run through ``model.generate`` (greedy) from the same seeded random prompt:

* ``DynamicCache`` -- Hugging Face's default, ``transformers.DynamicCache(config=model.config)``,
  the reference for the output tokens;
* ``concat``, ``growable``, ``static`` (capacity = prompt + new tokens) -- ``kvcache.make_cache``.

They alternate within one process, round-robin over the repeats (the starting contender rotates
each repeat), and the table reports medians. Everything is measured, not taken from the library:

* decode tokens/s: a logits processor stamps the time after every forward pass; decode time is
  from the first stamp (end of prefill) to the last, minus the probe's own time;
* cache bytes: bytes of the distinct storages behind every layer's keys and values at the end;
* reallocations: how many times a layer's key/value storage moved (its storage pointer changed,
  the first allocation included), observed after every forward pass and summed over layers;
* identical: the generated tokens equal ``DynamicCache``'s in every repeat.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

import kvcache

from .cache import make_cache
from .tiny import tiny_model

__all__ = ["DEMO_SHAPE", "REFERENCE", "build_model", "format_table", "header_line", "run_demo"]

#: Config overrides applied to the tiny model: 16 query heads sharing 8 key/value heads of 128.
DEMO_SHAPE: dict[str, int] = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}

#: Name of the reference contender (Hugging Face's cache).
REFERENCE = "DynamicCache"


def build_model(family: str = "llama", seed: int = 0) -> PreTrainedModel:
    """The demo's tiny model: ``tiny_model(family)`` with :data:`DEMO_SHAPE`."""
    return tiny_model(family, seed=seed, **DEMO_SHAPE)


def contenders(model: PreTrainedModel, prompt_tokens: int, new_tokens: int) -> dict[str, tuple[str, Callable[[], Any]]]:
    """Name -> (spec shown, factory of a fresh cache), the reference first."""
    capacity = prompt_tokens + new_tokens
    return {
        REFERENCE: ("transformers.DynamicCache", lambda: DynamicCache(config=model.config)),
        "concat": ("concat", lambda: make_cache(model, "concat")),
        "growable": ("growable", lambda: make_cache(model, "growable")),
        "static": (f"static:capacity={capacity}", lambda: make_cache(model, "static", capacity=capacity)),
    }


def header_line(
    model: PreTrainedModel, family: str, prompt_tokens: int, new_tokens: int, repeats: int, threads: int | None = None
) -> str:
    """One line: the model, the sizes, and the library versions."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    attn = getattr(c, "_attn_implementation", None) or "default"
    per_token = 2 * c.num_key_value_heads * head_dim * next(model.parameters()).element_size() * c.num_hidden_layers
    threads = threads or torch.get_num_threads()
    return (
        f"kvcache demo: tiny {family} (random weights; {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
        f"{c.num_attention_heads} query / {c.num_key_value_heads} KV heads x {head_dim}, {dtype}, {attn} attention; "
        f"{per_token / 1024:g} KiB of KV per token) | prompt {prompt_tokens} + {new_tokens} new tokens, batch 1, "
        f"greedy, {_plural(repeats, 'repeat')} | kvcache {kvcache.__version__}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {_plural(threads, 'thread')}"
    )


def _storages(cache: Any) -> list[tuple[tuple[int, int], int]]:
    """Per cache layer with content: ((keys storage ptr, values storage ptr), bytes of both storages)."""
    out = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor) or keys.numel() == 0:
            out.append(((0, 0), 0))
            continue
        ks, vs = keys.untyped_storage(), values.untyped_storage()
        out.append(((ks.data_ptr(), vs.data_ptr()), ks.nbytes() + vs.nbytes()))
    return out


class _StepProbe(LogitsProcessor):
    """Called by ``generate`` after every forward pass: stamps the time, watches the storages."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.stamps: list[float] = []  # time after each forward, probe time excluded
        self.overhead = 0.0
        self.pointers: list[tuple[int, int]] | None = None
        self.moves = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.stamps.append(start - self.overhead)
        pointers = [ptr for ptr, _ in _storages(self.cache)]
        if self.pointers is None:
            self.pointers = [(0, 0)] * len(pointers)
        for old, new in zip(self.pointers, pointers):
            if new != (0, 0) and new != old:
                self.moves += 1
        self.pointers = pointers
        self.overhead += time.perf_counter() - start
        return scores


def _generate(model: PreTrainedModel, prompt: torch.Tensor, cache: Any, new_tokens: int) -> dict[str, Any]:
    """One greedy generation into ``cache``; the tokens and what the probe measured."""
    probe = _StepProbe(cache)
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            logits_processor=LogitsProcessorList([probe]),
            pad_token_id=model.config.pad_token_id,
        )
    tokens = out[0, prompt.shape[1] :].tolist()
    decode_steps = len(probe.stamps) - 1
    decode_s = probe.stamps[-1] - probe.stamps[0] if decode_steps > 0 else math.nan
    return {
        "tokens": tokens,
        "prefill_s": probe.stamps[0] - started,
        "decode_steps": decode_steps,
        "decode_s": decode_s,
        "reallocations": probe.moves,
        "bytes": sum(nbytes for _, nbytes in _storages(cache)),
    }


def run_demo(
    family: str = "llama",
    prompt_tokens: int = 512,
    new_tokens: int = 128,
    repeats: int = 3,
    *,
    seed: int = 0,
    model: PreTrainedModel | None = None,
    progress: bool = True,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Run every contender ``repeats`` times, round-robin; one result dict per contender.

    Keys of each dict: ``cache``, ``spec``, ``tokens_per_s`` (decode, median), ``tokens_per_s_runs``,
    ``prefill_s`` (median), ``speedup`` (median tokens/s over the reference's), ``cache_bytes``,
    ``reallocations`` (both measured at the end of the last repeat), ``reported_nbytes`` and
    ``reported_reallocations`` (the library's own counters; None for the reference), ``identical``
    (tokens equal the reference's in every repeat), ``new_tokens``.

    ``threads`` sets torch's intra-op thread count for the run (restored afterwards); None keeps it.
    Small decode steps gain little from threads and suffer when the cores are shared.
    """
    if threads is None:
        return _run(family, prompt_tokens, new_tokens, repeats, seed, model, progress)
    if int(threads) < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        return _run(family, prompt_tokens, new_tokens, repeats, seed, model, progress)
    finally:
        torch.set_num_threads(before)


def _run(
    family: str,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
    seed: int,
    model: PreTrainedModel | None,
    progress: bool,
) -> list[dict[str, Any]]:
    limits = (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 2), ("repeats", repeats, 1))
    for name, value, least in limits:
        if int(value) < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    model = build_model(family, seed) if model is None else model
    generator = torch.Generator().manual_seed(seed)
    body = torch.randint(3, model.config.vocab_size, (1, prompt_tokens - 1), generator=generator)
    prompt = torch.cat([torch.tensor([[model.config.bos_token_id]]), body], dim=1)

    entries = contenders(model, prompt_tokens, new_tokens)
    names = list(entries)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    caches: dict[str, Any] = {}

    bar = tqdm(total=len(names) * (repeats + 1), desc="kvcache demo", unit="run", disable=not progress, leave=False)
    try:
        # Warm-up, untimed: every path runs once on the real shapes before anything is measured.
        for name in names:
            bar.set_postfix_str(f"warm-up {name}")
            _generate(model, prompt, entries[name][1](), min(new_tokens, 4))
            bar.update()
        for r in range(repeats):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                bar.set_postfix_str(f"repeat {r + 1}/{repeats} {name}")
                cache = entries[name][1]()
                runs[name].append(_generate(model, prompt, cache, new_tokens))
                caches[name] = cache
                bar.update()
    finally:
        bar.close()

    reference_tokens = runs[REFERENCE][0]["tokens"]
    reference_speed = statistics.median(_speeds(runs[REFERENCE]))
    results = []
    for name in names:
        speeds = _speeds(runs[name])
        last, cache = runs[name][-1], caches[name]
        ours = isinstance(cache, kvcache.KVCache)
        results.append(
            {
                "cache": name,
                "spec": entries[name][0],
                "tokens_per_s": statistics.median(speeds),
                "tokens_per_s_runs": speeds,
                "prefill_s": statistics.median(run["prefill_s"] for run in runs[name]),
                "speedup": statistics.median(speeds) / reference_speed,
                "cache_bytes": last["bytes"],
                "reallocations": last["reallocations"],
                "reported_nbytes": cache.nbytes if ours else None,
                "reported_reallocations": cache.reallocations if ours else None,
                "identical": all(run["tokens"] == reference_tokens for run in runs[name]),
                "new_tokens": len(last["tokens"]),
            }
        )
    return results


def _speeds(runs: list[dict[str, Any]]) -> list[float]:
    return [run["decode_steps"] / run["decode_s"] for run in runs]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _identical_cell(result: dict[str, Any]) -> str:
    if result["cache"] == REFERENCE:
        return "reference" if result["identical"] else "NO: reference varies between repeats"
    return "yes" if result["identical"] else "NO"


def format_table(results: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`run_demo`'s results, with a one-line legend."""
    head = ("cache", "tokens/s", f"vs {REFERENCE}", "cache bytes", "reallocations", "identical output")
    rows = [
        (
            r["cache"],
            f"{r['tokens_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            _mib(r["cache_bytes"]),
            str(r["reallocations"]),
            _identical_cell(r),
        )
        for r in results
    ]
    widths = [max(len(cell) for cell in column) for column in zip(head, *rows)]
    lines = []
    for i, row in enumerate([head, *rows]):
        cells = [cell.ljust(w) if j == 0 else cell.rjust(w) for j, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        "tokens/s: decode, median over repeats; cache bytes: storage held at the end; reallocations: "
        "times a layer's key/value storage moved, summed over layers (measured from storage pointers)"
    )
    return "\n".join(lines)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
