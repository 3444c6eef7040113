"""One measured greedy generation of the demo: decode time, cache bytes and reallocations.

:func:`measured_generate` runs ``generate`` once into a given cache with a :class:`StepProbe`, a
logits processor ``generate`` calls after every forward pass: it stamps the time (its own time
excluded), and for an unbounded cache watches the storages behind every layer's keys and values, so
that a reallocation (a storage pointer that changed) is seen as it happens. A bounded cache holds
codes, slot positions and scores beside views, so its own ``nbytes`` and ``reallocations`` are
taken instead. :mod:`kvcache.apps.demo` runs it for every contender and repeat.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from .bench.harness import greedy_generate

__all__ = ["StepProbe", "measured_generate"]


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


class StepProbe(LogitsProcessor):
    """Called by ``generate`` after every forward pass: stamps the time and, if ``watch``, watches
    the storages (not for bounded caches: their ``keys`` may be a dequantized copy, built per call)."""

    def __init__(self, cache: Any, watch: bool = True) -> None:
        self.cache = cache
        self.watch = watch
        self.stamps: list[float] = []  # time after each forward, probe time excluded
        self.overhead = 0.0
        self.pointers: list[tuple[int, int]] | None = None
        self.moves = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.stamps.append(start - self.overhead)
        if self.watch:
            self._watch()
        self.overhead += time.perf_counter() - start
        return scores

    def _watch(self) -> None:
        pointers = [ptr for ptr, _ in _storages(self.cache)]
        if self.pointers is None:
            self.pointers = [(0, 0)] * len(pointers)
        for old, new in zip(self.pointers, pointers):
            if new != (0, 0) and new != old:
                self.moves += 1
        self.pointers = pointers


def measured_generate(model: PreTrainedModel, prompt: torch.Tensor, cache: Any, new_tokens: int) -> dict[str, Any]:
    """One greedy generation into ``cache``; the tokens and what the probe measured (for a bounded
    cache, its own byte and reallocation counters instead)."""
    bounded = getattr(cache, "needs_kvcache_attention", False)
    probe = StepProbe(cache, watch=not bounded)
    with torch.inference_mode():
        started = time.perf_counter()
        out = greedy_generate(
            model,
            prompt,
            cache,
            new_tokens,
            attention_mask=torch.ones_like(prompt),
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
        "reallocations": cache.reallocations if bounded else probe.moves,
        "bytes": cache.nbytes if bounded else sum(nbytes for _, nbytes in _storages(cache)),
    }
