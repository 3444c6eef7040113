"""Suite ``prefill``: peak process memory and time of a long prompt's prefill, the full cache against
bounded caches fed in chunks (``kvcache.prefill``).

Contenders (``CONTENDERS``), each one prefill of the whole prompt: the full cache and ``h2o`` /
``window`` bounded to ``budget`` (1,024), fed ``chunk`` tokens per forward pass (a bounded layer
holds at most the budget plus one chunk); and the full cache fed the prompt in one pass (fused
SDPA): the plain prefill, the time to beat. (A bounded kind fed in one pass must also score every
query against every key, minutes at 32K, and holds the whole prompt meanwhile: it shows nothing
that row does not.)

Models (``sizes``): SmolLM2-135M (real text) at 8K tokens, and ``WIDE`` (random weights, as many
K/V bytes per token as a model many times its size) at 16K and 32K; ``--quick`` 1K / 2K / 4K
with a budget and chunk of 256. Each row names its model.

How: every run in a fresh process (``fresh_processes``), one after another. There, after loading
the model, making the prompt and a short warm-up pass, the baseline is the current RSS and the
kernel's peak-RSS mark is reset (``rss.PeakRSS``); after the prefill, the mark is the process
peak. Per row (``measure``): seconds, the peak and the peak over the baseline (what the prefill
added: K/V, activations, attention blocks), the cache's ``nbytes`` (largest after any chunk, the
bound the tests check), the K/V bytes a full cache holds for the prompt and the weights' bytes;
``run`` adds the ratios to the full cache's time and to the weights.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..run_options import RunOptions
from .common import figure, finish_axes, human_bytes, markdown_table
from .harness import report
from .rss import PeakRSS, current_rss

#: name -> (cache spec with ``{budget}`` for the bound, chunked)
CONTENDERS: dict[str, tuple[str, bool]] = {
    "full chunked": ("growable", True),
    "h2o chunked": ("h2o:budget={budget}", True),
    "window chunked": ("window:window={budget}", True),
    "full unchunked": ("growable", False),
}
REFERENCE = "full chunked"

#: The random-weight model of the long rows: few layers, wide K/V (16 KV heads of 64 = 16 KiB per token).
WIDE = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16,
    num_key_value_heads=16, head_dim=64, max_position_embeddings=65536, rope_theta=1_000_000.0, tie_word_embeddings=False,
)


def sizes(options: RunOptions) -> list[tuple[str, int]]:
    """(model, prompt tokens) of each size of this run."""
    return options.pick(
        tiny=[("tiny", 192)],
        quick=[("smollm2", 1024), ("wide", 2048), ("wide", 4096)],
        full=[("smollm2", 8192), ("wide", 16384), ("wide", 32768)],
    )


def load(model_name: str):
    """``(model, prompt maker)``: ``make(tokens)`` gives ``[1, tokens]`` ids for the model."""
    if model_name == "smollm2":
        from ... import models
        from .workload import make_prompts

        model, tokenizer = models.load("smollm2", progress=False)
        return model, lambda n: make_prompts(tokenizer, 1, n, model.config.vocab_size)
    if model_name == "wide":
        from transformers import LlamaConfig, LlamaForCausalLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**WIDE)).eval()
    elif model_name == "tiny":
        from ..tiny import tiny_model

        model = tiny_model("llama")
    else:
        raise ValueError(f"unknown model {model_name!r}: smollm2, wide or tiny")
    vocab = model.config.vocab_size
    return model, lambda n: torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def measure(model_name: str, tokens: int, contender: str, budget: int, chunk: int) -> dict[str, Any]:
    """One prefill (see the module docstring); run in a fresh process."""
    import kvcache

    torch.manual_seed(0)
    model, make = load(model_name)
    ids = make(tokens)
    spec, chunked = CONTENDERS[contender]
    spec = spec.format(budget=budget)
    kvcache.prefill(model, ids[:, :16], kvcache.make_cache(model, spec), chunk=8)  # warm-up: first-call costs
    cache = kvcache.make_cache(model, spec)
    held = []
    gc.collect()
    rss = PeakRSS()
    baseline = current_rss()
    rss.start()
    start = time.perf_counter()
    if chunked:
        kvcache.prefill(model, ids, cache, chunk=chunk, after_chunk=lambda _: held.append(cache.nbytes))
    else:
        kvcache.prefill(model, ids, cache, chunk=tokens)
        held.append(cache.nbytes)
    seconds = time.perf_counter() - start
    peak = rss.window_peak()
    c = model.config
    kv_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return {
        "model": model_name,
        "tokens": tokens,
        "contender": contender,
        "spec": spec,
        "chunk": chunk if chunked else tokens,
        "seconds": seconds,
        "peak_rss_bytes": peak,
        "prefill_rss_bytes": max(0, peak - baseline),
        "cache_bytes_max": max(held),
        "full_kv_bytes": tokens * c.num_hidden_layers * c.num_key_value_heads * 2 * kv_dim * 4,
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "rss_method": rss.method,
    }


def fresh_processes() -> ProcessPoolExecutor:
    """One worker process per task, forked from a server that has imported this module only."""
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload([__name__])
    return ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1)


def run(options: RunOptions = RunOptions(), *, budget: int | None = None, chunk: int | None = None) -> dict[str, Any]:
    """Run the suite; write ``prefill.json``/``.md``/``.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    budget = budget or options.pick(32, 256, 1024)
    chunk = chunk or options.pick(32, 256, 512)
    jobs = [(m, n, name) for m, n in sizes(options) for name in CONTENDERS]
    rows = []
    with fresh_processes() as pool, tqdm(total=len(jobs), desc="bench prefill", disable=not options.progress) as bar:
        for model_name, tokens, name in jobs:
            bar.set_postfix_str(f"{model_name} {tokens} {name}")
            rows.append(pool.submit(measure, model_name, tokens, name, budget, chunk).result())
            bar.update()
    for row in rows:
        ref = next(r for r in rows if r["tokens"] == row["tokens"] and r["contender"] == REFERENCE)
        row["time_vs_full"] = row["seconds"] / ref["seconds"]
        row["peak_over_weights"] = row["peak_rss_bytes"] / row["weight_bytes"]
        row["cache_over_weights"] = row["cache_bytes_max"] / row["weight_bytes"]
    config = {
        "budget": budget,
        "chunk": chunk,
        "sizes": [list(s) for s in sizes(options)],
        "wide_model": WIDE,
        "threads": torch.get_num_threads(),
        "rss_method": rows[0]["rss_method"],
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("prefill", options, config, rows, table, plot)


def table(result: dict[str, Any]) -> str:
    head = ["tokens", "model", "contender", "spec", "chunk", "s", "x full", "peak RSS", "prefill RSS",
            "cache max", "full K/V", "weights", "peak/weights", "cache/weights"]
    body = [
        [r["tokens"], r["model"], r["contender"], r["spec"], r["chunk"], f"{r['seconds']:.2f}", f"{r['time_vs_full']:.2f}",
         human_bytes(r["peak_rss_bytes"]), human_bytes(r["prefill_rss_bytes"]), human_bytes(r["cache_bytes_max"]),
         human_bytes(r["full_kv_bytes"]), human_bytes(r["weight_bytes"]), f"{r['peak_over_weights']:.2f}",
         f"{r['cache_over_weights']:.3f}"]
        for r in result["rows"]
    ]
    c = result["config"]
    note = (f"Prefill of one prompt per run, each run in a fresh process; budget {c['budget']}, chunk {c['chunk']}. "
            "prefill RSS: the process peak over its RSS before the prefill (weights and prompt loaded). "
            f"Peak RSS: {c['rss_method']}.\n\n")
    return "# bench prefill\n\n" + note + markdown_table(head, body)


def plot(result: dict[str, Any], path: Path) -> None:
    rows = result["rows"]
    with figure(path, panels=2) as (mem, secs):
        for name in CONTENDERS:
            mine = sorted((r for r in rows if r["contender"] == name), key=lambda r: r["tokens"])
            x = [r["tokens"] for r in mine]
            mem.plot(x, [r["prefill_rss_bytes"] / 2**20 for r in mine], marker="o", label=name)
            secs.plot(x, [r["seconds"] for r in mine], marker="o", label=name)
        finish_axes(mem, "prompt tokens", "MiB added by the prefill (peak RSS)", "prefill memory", log_y=True)
        finish_axes(secs, "prompt tokens", "seconds", "prefill time", log_y=True)
