"""``kvcache demo``: greedy generation with each cache, side by side, on a small local model (a run,
and what it shows: docs/cli.md, "The demo").

By default the model is the one trained here and shipped with the package (:mod:`kvcache.apps.trained`)
and the prompt a pass-key retrieval task on held-out text, a five-digit key hidden at ``depth`` (0 = the
start, 1 = just before the question): the table shows what each cache costs in bytes and speed, and
whether the model still finds the key with it. Contenders, all through greedy ``model.generate``:
``DynamicCache`` (Hugging Face's default, on the model's own attention), the reference; unbounded
kvcache caches, whose tokens must be the reference's; bounded ones (:data:`BOUNDED`), which drop or
round what they hold, so their tokens may differ. Every kvcache contender runs inside
``kvcache.use_kvcache_attention(model)``, as the README recommends. With ``family``, a random tiny
model widened where the cache lives (:data:`DEMO_SHAPE`: 8 KiB a token and layer, so the cost of the
cache itself shows on a CPU) runs the unbounded kinds on random tokens; a real model
(:func:`run_real_demo`) answers a chat prompt with them and the quantized caches of :data:`QUANTIZED`.
The second part (:func:`run_sessions`) answers many prompts at once through the engine, against
``generate`` one after another.

Contenders alternate within one process, round-robin over the repeats (the first one rotates), and
the table reports medians. Measured by :func:`measured_generate`, not taken from the library (but for
bounded caches, whose layers hold codes, slot positions and scores beside a view: their own
``nbytes`` and ``reallocations``): decode time from the end of the first forward pass to the end of
the last, stamped by a logits processor, its own time taken out; the bytes of the distinct storages
behind every layer's keys and values at the end; and reallocations, the times a layer's key/value
storage pointer changed (the first allocation included), summed over layers.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

import kvcache

from . import tasks
from .. import make_cache, use_kvcache_attention
from .bench.harness import alternate, greedy_generate
from .contenders import make_contender, spec_for
from .tiny import tiny_model

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

#: The unbounded kvcache contenders beside the reference (the trained model runs growable only).
UNBOUNDED = ("concat", "growable", "static")

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

#: The user message a real model answers by default.
DEFAULT_PROMPT = "In two sentences, why do language models cache keys and values when they generate text?"

#: Table name -> contender name of the quantized caches that run beside a real model's unbounded ones.
QUANTIZED: dict[str, str] = {"quantized int8": "quantized-int8", "quantized int4": "quantized-int4"}


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


def contenders(
    model: PreTrainedModel,
    prompt_tokens: int,
    new_tokens: int,
    unbounded: tuple[str, ...],
    bounded: dict[str, tuple[str, float | None, str]],
) -> dict[str, Contender]:
    """Name -> contender: the reference, the ``unbounded`` kinds, then the ``bounded`` ones (as in
    :data:`BOUNDED`)."""
    out = {REFERENCE: Contender("transformers.DynamicCache", lambda: make_contender("dynamic", model), ours=False)}
    for name in unbounded:
        spec = spec_for(name, capacity=prompt_tokens + new_tokens)
        out[name] = Contender(spec, lambda spec=spec: make_cache(model, spec))
    for name, (kind, share, why) in bounded.items():
        spec = spec_for(kind, slots=max(1, int(prompt_tokens * share)) if kind == "window" else share)
        out[name] = Contender(spec, lambda spec=spec: make_cache(model, spec), bounded=True, why=why)
    return out


def _at_least(*limits: tuple[str, int | None, int]) -> None:
    """``ValueError`` for the first ``(name, value, least)`` whose value is below ``least`` (None passes)."""
    for name, value, least in limits:
        if value is not None and int(value) < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")


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
    _at_least(*limits, ("threads", threads, 1))
    if family is None:
        if model is None:
            from .trained import load_trained

            model, tokenizer = load_trained()
        if tokenizer is None:
            raise ValueError("run_demo: a trained model needs its tokenizer")
        instance = tasks.passkey(seed, length=prompt_tokens - 1, depth=depth)  # + <bos>
        prompt = torch.tensor([tokenizer.encode(instance.prompt)])
        entries = contenders(model, prompt_tokens, new_tokens, ("growable",), BOUNDED)
    else:
        model = build_model(family, seed) if model is None else model
        instance = None
        generator = torch.Generator().manual_seed(seed)
        body = torch.randint(3, model.config.vocab_size, (1, prompt_tokens - 1), generator=generator)
        prompt = torch.cat([torch.tensor([[model.config.bos_token_id]]), body], dim=1)
        entries = contenders(model, prompt_tokens, new_tokens, UNBOUNDED, {})
    runs, caches = run_contenders(model, prompt, entries, new_tokens, repeats, progress, threads)
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
    threads: int | None = None,
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """Every contender once untimed, then ``repeats`` timed runs round-robin on ``prompt`` ``[1, T]``
    with ``threads`` torch threads: the runs per contender and each contender's cache of its last run."""
    caches: dict[str, Any] = {}  # each contender's cache of its latest run

    def generate(name: str, tokens: int) -> dict[str, Any]:
        # kvcache contenders run as the README recommends; the reference on the model's own attention.
        with use_kvcache_attention(model) if entries[name].ours else contextlib.nullcontext():
            caches[name] = entries[name].make()
            return measured_generate(model, prompt, caches[name], tokens)

    bar = tqdm(total=len(entries) * (repeats + 1), desc="kvcache demo", unit="run", disable=not progress, leave=False)
    with bar, torch_threads(threads):
        # Warm-up, untimed: every path runs once on the real shapes before anything is measured.
        for name in entries:
            bar.set_postfix_str(f"warm-up {name}")
            generate(name, min(new_tokens, 4))
            bar.update()
        return alternate(list(entries), repeats, lambda name: generate(name, new_tokens), bar), caches


def first_line(tokenizer: Any, tokens: list[int]) -> str:
    """The first line of the text of ``tokens``, special tokens skipped."""
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
    speeds = {name: [run["decode_steps"] / run["decode_s"] for run in runs[name]] for name in entries}
    results = []
    for name, entry in entries.items():
        last, cache = runs[name][-1], caches[name]
        ours = isinstance(cache, kvcache.KVCache)
        answers = [first_line(tokenizer, run["tokens"]) for run in runs[name]] if instance else None
        results.append(
            {
                "cache": name,
                "spec": entry.spec,
                "bounded": entry.bounded,
                "why": entry.why,
                "tokens_per_s": statistics.median(speeds[name]),
                "tokens_per_s_runs": speeds[name],
                "prefill_s": statistics.median(run["prefill_s"] for run in runs[name]),
                "speedup": statistics.median(speeds[name]) / statistics.median(speeds[REFERENCE]),
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


# ---- one measured generation -----------------------------------------------------------------


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
    """Called by ``generate`` after every forward pass: stamps the time (its own time excluded) and,
    if ``watch``, counts the layers whose key/value storage pointers changed since the last call (not
    for bounded caches: their ``keys`` may be a dequantized copy, built per call)."""

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
            pointers = [ptr for ptr, _ in _storages(self.cache)]
            before = self.pointers if self.pointers is not None else [(0, 0)] * len(pointers)
            self.moves += sum(new != (0, 0) and new != old for old, new in zip(before, pointers))
            self.pointers = pointers
        self.overhead += time.perf_counter() - start
        return scores


def measured_generate(model: PreTrainedModel, prompt: torch.Tensor, cache: Any, new_tokens: int) -> dict[str, Any]:
    """One greedy generation into ``cache``: the tokens and what the :class:`StepProbe` measured (for
    a bounded cache, its own byte and reallocation counters instead)."""
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
    decode_steps = len(probe.stamps) - 1
    return {
        "tokens": out[0, prompt.shape[1] :].tolist(),
        "prefill_s": probe.stamps[0] - started,
        "decode_steps": decode_steps,
        "decode_s": probe.stamps[-1] - probe.stamps[0] if decode_steps > 0 else math.nan,
        "reallocations": cache.reallocations if bounded else probe.moves,
        "bytes": cache.nbytes if bounded else sum(nbytes for _, nbytes in _storages(cache)),
    }


# ---- a real model (kvcache demo --model NAME|DIR) --------------------------------------------


def chat_prompt(tokenizer: Any, text: str) -> torch.Tensor:
    """``text`` as a user turn of the tokenizer's chat template (generation prompt added), else as
    plain text: token ids ``[1, T]``."""
    if getattr(tokenizer, "chat_template", None):
        turn = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
    else:
        ids = tokenizer.encode(text)
    return torch.tensor([list(ids)], dtype=torch.long)


def run_real_demo(
    model: Any,
    tokenizer: Any,
    text: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    repeats: int = 3,
    *,
    progress: bool = True,
    threads: int | None = None,
) -> tuple[list[dict[str, Any]], torch.Tensor]:
    """Each contender ``repeats`` times, round-robin, answering ``text``: the result dicts of
    :func:`run_demo` (``answer`` the reply's first line, ``correct`` None, and ``reply``) and the
    prompt ids ``[1, T]``. The unbounded caches' replies must be DynamicCache's token for token."""
    _at_least(("new_tokens", new_tokens, 2), ("repeats", repeats, 1))
    prompt = chat_prompt(tokenizer, text)
    quantized = {name: (kind, None, "") for name, kind in QUANTIZED.items()}
    entries = contenders(model, prompt.shape[1], new_tokens, UNBOUNDED, quantized)
    runs, caches = run_contenders(model, prompt, entries, new_tokens, repeats, progress, threads)
    results = results_of(entries, runs, caches, None, tokenizer)
    for result in results:
        result["reply"] = reply_of(tokenizer, runs[result["cache"]][-1]["tokens"])
        result["answer"], result["correct"] = result["reply"].strip().split("\n", 1)[0], None
    return results, prompt


def reply_of(tokenizer: Any, tokens: list[int]) -> str:
    """The generated text up to the first end-of-sequence token (``generate`` ran on past it)."""
    eos = tokenizer.eos_token_id
    if eos is not None and eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokenizer.decode(tokens, skip_special_tokens=True)
