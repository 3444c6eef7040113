"""The one benchmark harness: contenders alternating within each repeat, timed greedy generation,
storage watching, and the result every suite returns and writes.

Contenders alternate so that drift and noise (a busy core, a warm cache line) hit them alike: repeat
``r`` runs them in the listed order rotated by ``r``, and reports take the median of the repeats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvcache import cache_kwargs

from ...hf import ATTENTION_NAME, use_kvcache_attention
from ..run_options import RunOptions
from .common import clock, machine_info, write_files

T = TypeVar("T")


def alternate(names: Sequence[str], repeats: int, measure: Callable[[str], T], bar=None) -> dict[str, list[T]]:
    """``measure(name)`` for every contender in each of ``repeats`` rounds, the order rotated by one
    each round; returns name -> the measurements in round order. ``bar`` (tqdm) advances per call."""
    names = tuple(names)
    samples: dict[str, list[T]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if bar is not None:
                bar.set_postfix_str(f"repeat {r + 1}/{repeats} {name}")
            samples[name].append(measure(name))
            if bar is not None:
                bar.update()
    return samples


def greedy_generate(model, ids: torch.Tensor, cache, new_tokens: int, **options) -> torch.Tensor:
    """Exactly ``new_tokens`` greedy tokens after ``ids`` ``[B, S]`` with ``cache``: ``[B, S + new]``.
    ``options`` go to ``generate`` as they are (attention mask, logits processors, pad id)."""
    return model.generate(
        ids,
        **cache_kwargs(model, cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **options,
    )


def timed_generate(model, cache, ids: torch.Tensor, new_tokens: int, attention: str) -> tuple[float, torch.Tensor]:
    """(seconds, all tokens) of ``new_tokens`` greedy steps continuing ``ids`` with ``cache``.

    ``attention="kvcache"`` runs inside ``use_kvcache_attention(model)``, the call the README
    recommends; any other name runs the model on that implementation. The model is back on sdpa after.
    """
    model.set_attn_implementation("sdpa")
    out = []
    with use_kvcache_attention(model) if attention == ATTENTION_NAME else _attention(model, attention):
        seconds = clock(lambda: out.append(greedy_generate(model, ids, cache, new_tokens)), ids.device)
    return seconds, out[0]


@contextlib.contextmanager
def _attention(model, name: str):
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


def storage_of(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """{storage address: bytes} of the distinct storages behind ``tensors`` (views included: a view
    of a cache's buffer names the whole buffer, so a new address means the store moved)."""
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def report(
    suite: str,
    options: RunOptions,
    config: dict[str, Any],
    rows: list[dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
    plot: Callable[[dict[str, Any], Path], None],
    **extra: Any,
) -> dict[str, Any]:
    """A suite's result (``suite``, ``machine``, ``extra``, ``config``, ``rows``), written into
    ``options.out`` as JSON, markdown and (with matplotlib) PNG when ``options.out`` is given."""
    result = {"suite": suite, "machine": machine_info(options.device), **extra, "config": config, "rows": rows}
    if options.out is not None:
        write_files(Path(options.out), suite, result, table(result), plot)
    return result
