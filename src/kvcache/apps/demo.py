"""``kvcache demo``: greedy generation with each cache, side by side, on a small local model.

By default the model is the one trained here and shipped with the package
(:mod:`kvcache.apps.trained`), and the prompt is a pass-key retrieval task on held-out text: a five-digit
key hidden at ``depth`` (0 = the start, 1 = just before the question) in a long prompt. So the
table shows both sides of the trade: what each cache costs in bytes and speed, and whether the
model still finds the key with it. Contenders, all run through ``model.generate`` (greedy):

* ``DynamicCache`` -- Hugging Face's default, ``transformers.DynamicCache(config=model.config)``,
  on the model's own attention; the reference for the output tokens;
* ``growable`` (and with a random model also ``concat`` and ``static``, capacity = prompt + new
  tokens) -- ``kvcache.make_cache``, unbounded, so their tokens must equal the reference's; like
  every kvcache contender they run as the README recommends, inside
  ``kvcache.use_kvcache_attention(model)``;
* bounded caches (:data:`BOUNDED`), each with the reason it keeps the key or loses it: the
  query-aware kinds (SnapKV, Ada-KV) and ``auto`` at an eighth of the cache, 4-bit storage, and
  a sliding window with sinks and H2O at a quarter of the prompt. They drop or round what they
  hold, so their tokens may differ; the ``answer`` column says whether the pass key survived.

With ``family`` set, the model is instead a tiny random-weight model of that family
(:func:`kvcache.apps.tiny.tiny_model`, nothing downloaded) widened where the cache lives: 8 key/value
heads of dimension 128, so one token costs 8 KiB per layer and the cost of the cache itself shows
on a CPU; the prompt is random tokens and only the unbounded contenders run.

They alternate within one process, round-robin over the repeats (the starting contender rotates
each repeat), and the table reports medians. Measured, not taken from the library, except where
said:

* decode tokens/s: a logits processor stamps the time after every forward pass; decode time is
  from the first stamp (end of prefill) to the last, minus the probe's own time;
* cache bytes: bytes of the distinct storages behind every layer's keys and values at the end
  (for bounded caches, whose layers hold codes, slot positions and scores beside a view, the
  library's own ``nbytes``);
* reallocations: how many times a layer's key/value storage moved (its storage pointer changed,
  the first allocation included), observed after every forward pass and summed over layers (for
  bounded caches, the library's own counter);
* identical: the generated tokens equal ``DynamicCache``'s in every repeat;
* answer: the first generated line, and whether it is the pass key (trained model only).

This module builds the contenders and runs them; :mod:`kvcache.apps.demo_measure` measures one
generation, :mod:`kvcache.apps.demo_table` prints the header line and the table.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

import kvcache

from . import tasks
from .. import make_cache, use_kvcache_attention
from .bench.harness import alternate
from .contenders import make_contender, spec_for
from .demo_measure import measured_generate
from .tiny import tiny_model

__all__ = [
    "BOUNDED",
    "DEMO_SHAPE",
    "DEPTH",
    "RANDOM_PROMPT_TOKENS",
    "REFERENCE",
    "TRAINED_PROMPT_TOKENS",
    "build_model",
    "results_of",
    "run_contenders",
    "run_demo",
    "torch_threads",
]

#: Config overrides applied to the random tiny model: 16 query heads sharing 8 key/value heads of 128.
DEMO_SHAPE: dict[str, int] = {"num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}

#: Name of the reference contender (Hugging Face's cache).
REFERENCE = "DynamicCache"

#: Default prompt length with the trained model (it was trained on prompts up to 2K tokens).
TRAINED_PROMPT_TOKENS = 1024

#: Default prompt length with a random model (``family``).
RANDOM_PROMPT_TOKENS = 2048

#: Default depth of the pass key in the prompt: early enough that a window of a quarter loses it.
DEPTH = 0.25

#: The bounded contenders: name -> (contender, share it keeps, why it keeps the key or loses it).
#: The share: of the prompt's tokens (the window's becomes slots); for ``auto``, of the fp32
#: cache's bytes; None for storage that keeps every token.
BOUNDED: dict[str, tuple[str, float | None, str]] = {
    "snapkv 12.5%": ("snapkv", 0.125, "keeps the tokens the question's own queries attend to"),
    "adakv 12.5%": ("adakv", 0.125, "SnapKV's choice, the budget split across heads by need"),
    "auto 12.5% bytes": ("auto", 0.125, "chooses tokens x precision per layer within a byte budget"),
    "quantized int4": ("quantized-int4", None, "every token kept, in 4 bits"),
    "window 25%": ("window", 0.25, "keeps the newest tokens only; the key came earlier"),
    "h2o 25%": ("h2o", 0.25, "keeps what earlier tokens attended to, before the question came"),
}


def build_model(family: str = "llama", seed: int = 0) -> PreTrainedModel:
    """The demo's random tiny model: ``tiny_model(family)`` with :data:`DEMO_SHAPE`."""
    return tiny_model(family, seed=seed, **DEMO_SHAPE)


@dataclass(frozen=True)
class Contender:
    spec: str  # what the table shows
    make: Callable[[], Any]  # a fresh cache
    bounded: bool = False
    ours: bool = True  # a kvcache cache: runs inside use_kvcache_attention(model)
    why: str = ""  # a bounded kind's reason for keeping the key or losing it


def contenders(model: PreTrainedModel, prompt_tokens: int, new_tokens: int, bounded: bool) -> dict[str, Contender]:
    """Name -> contender, the reference first: with ``bounded`` (the trained model's pass key)
    growable and :data:`BOUNDED`, else the unbounded kinds concat, growable and static."""
    capacity = prompt_tokens + new_tokens
    out = {REFERENCE: Contender("transformers.DynamicCache", lambda: make_contender("dynamic", model), ours=False)}
    for name in ("growable",) if bounded else ("concat", "growable", "static"):
        spec = spec_for(name, capacity=capacity)
        out[name] = Contender(spec, lambda spec=spec: make_cache(model, spec))
    if bounded:
        for name, (kind, share, why) in BOUNDED.items():
            spec = spec_for(kind, slots=max(1, int(prompt_tokens * share)) if kind == "window" else share)
            out[name] = Contender(spec, lambda spec=spec: make_cache(model, spec), bounded=True, why=why)
    return out


def run_demo(
    family: str | None = None,
    prompt_tokens: int | None = None,
    new_tokens: int = 64,
    repeats: int = 3,
    *,
    seed: int = 0,
    depth: float = DEPTH,
    model: PreTrainedModel | None = None,
    tokenizer: Any = None,
    progress: bool = True,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Run every contender ``repeats`` times, round-robin; one result dict per contender.

    ``family=None`` runs the trained model (``model``/``tokenizer``, or the shipped ones) on a
    pass-key prompt of ``prompt_tokens`` (default :data:`TRAINED_PROMPT_TOKENS`) with the key at
    ``depth``; a family name runs that random tiny model (or ``model``) on random tokens (default
    :data:`RANDOM_PROMPT_TOKENS`). ``seed`` picks the prompt (and the random model's weights).

    Keys of each dict: ``cache``, ``spec``, ``bounded``, ``why`` (a bounded kind's reason it keeps
    the key or loses it; empty for the others), ``tokens_per_s`` (decode, median),
    ``tokens_per_s_runs``, ``prefill_s`` (median), ``speedup`` (median tokens/s over the
    reference's), ``cache_bytes``, ``reallocations`` (both at the end of the last repeat),
    ``reported_nbytes`` and ``reported_reallocations`` (the library's own counters; None for the
    reference), ``identical`` (tokens equal the reference's in every repeat), ``new_tokens``,
    ``answer`` (the first generated line; None for a random model) and ``correct`` (whether it is
    the pass key, in every repeat; None for a random model).

    ``threads`` sets torch's intra-op thread count for the run (restored afterwards); None keeps it.
    Small decode steps gain little from threads and suffer when the cores are shared.
    """
    if prompt_tokens is None:
        prompt_tokens = RANDOM_PROMPT_TOKENS if family is not None else TRAINED_PROMPT_TOKENS
    limits = (("prompt_tokens", prompt_tokens, 1), ("new_tokens", new_tokens, 2), ("repeats", repeats, 1))
    for name, value, least in limits:
        if int(value) < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if threads is not None and int(threads) < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if family is None:
        if model is None:
            from .trained import load_trained

            model, tokenizer = load_trained()
        if tokenizer is None:
            raise ValueError("run_demo: a trained model needs its tokenizer")
        instance = tasks.passkey(seed, length=prompt_tokens - 1, depth=depth)  # + <bos>
        prompt = torch.tensor([tokenizer.encode(instance.prompt)])
    else:
        model = build_model(family, seed) if model is None else model
        instance = None
        generator = torch.Generator().manual_seed(seed)
        body = torch.randint(3, model.config.vocab_size, (1, prompt_tokens - 1), generator=generator)
        prompt = torch.cat([torch.tensor([[model.config.bos_token_id]]), body], dim=1)
    entries = contenders(model, prompt_tokens, new_tokens, bounded=instance is not None)
    with torch_threads(threads):
        runs, caches = run_contenders(model, prompt, entries, new_tokens, repeats, progress)
    return results_of(entries, runs, caches, instance, tokenizer)


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count is ``count`` inside the block (None: left as it is)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(int(count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_contenders(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    entries: dict[str, Contender],
    new_tokens: int,
    repeats: int,
    progress: bool,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every contender once untimed, then ``repeats`` timed runs round-robin on ``prompt`` ``[1, T]``:
    the runs per contender and each contender's cache of its last run."""
    names = list(entries)
    caches: dict[str, Any] = {}  # each contender's cache of its latest run

    def generate(name: str, tokens: int) -> tuple[dict[str, Any], Any]:
        # kvcache contenders run as the README recommends; the reference on the model's own attention.
        context = use_kvcache_attention(model) if entries[name].ours else contextlib.nullcontext()
        with context:
            cache = entries[name].make()
            return measured_generate(model, prompt, cache, tokens), cache

    bar = tqdm(total=len(names) * (repeats + 1), desc="kvcache demo", unit="run", disable=not progress, leave=False)
    try:
        # Warm-up, untimed: every path runs once on the real shapes before anything is measured.
        for name in names:
            bar.set_postfix_str(f"warm-up {name}")
            generate(name, min(new_tokens, 4))
            bar.update()

        def measure(name: str) -> dict[str, Any]:
            result, caches[name] = generate(name, new_tokens)
            return result

        runs = alternate(names, repeats, measure, bar)
    finally:
        bar.close()
    return runs, caches


def _first_line(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True).split("\n", 1)[0]


def results_of(
    entries: dict[str, Contender],
    runs: dict[str, list[dict[str, Any]]],
    caches: dict[str, Any],
    instance: tasks.Instance | None,
    tokenizer: Any,
) -> list[dict[str, Any]]:
    """One result dict per contender (keys in :func:`run_demo`); answers only with ``instance``."""
    reference_tokens = runs[REFERENCE][0]["tokens"]
    reference_speed = statistics.median(_speeds(runs[REFERENCE]))
    results = []
    for name, entry in entries.items():
        speeds = _speeds(runs[name])
        last, cache = runs[name][-1], caches[name]
        ours = isinstance(cache, kvcache.KVCache)
        answers = [_first_line(tokenizer, run["tokens"]) for run in runs[name]] if instance else None
        results.append(
            {
                "cache": name,
                "spec": entry.spec,
                "bounded": entry.bounded,
                "why": entry.why,
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
                "answer": answers[-1] if answers else None,
                "correct": all(tasks.score(instance.answer, a) for a in answers) if answers else None,
            }
        )
    return results


def _speeds(runs: list[dict[str, Any]]) -> list[float]:
    return [run["decode_steps"] / run["decode_s"] for run in runs]
