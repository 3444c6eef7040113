"""Suite ``engine``: many chat sessions served at once by the paged engine (``kvcache.Engine``),
against one request at a time and against ``transformers``' own continuous batching, on
SmolLM2-135M-Instruct (fp32, CPU).

The workload (issue 24): ``sessions`` requests (16), each a shared system prompt of ``shared``
tokens (1,024) and a distinct user turn of ``user`` tokens (64; ChatML, real text: ``Prompts`` of
suite ``prompt``), ``new_tokens`` (64) greedy new tokens each, end of sequence ignored. Two arrival
patterns: ``burst`` (all at once) and ``poisson`` (seeded exponential gaps whose mean is
``gap_share`` (1/4) of one sequential request's time, measured in the warm-up, so requests overlap).

Contenders (``CONTENDERS``, ``--contenders``; ``sequential``, the reference, always runs; ``configured``
says how each is set up), each run in a fresh state made before the first arrival (a new cache, store
or manager; each engine contender's one engine, made and compiled before its first run, its prefix
cache forgotten): ``sequential`` (``model.generate`` one request after another in arrival order, a
new ``DynamicCache`` each; TTFT includes the wait for the one before), ``sequential+store`` (the same
through ``PromptStore("memory")``: the first request computes the system prompt, the others reuse
it), ``hf_generate_batch`` (``transformers``' continuous batching, pool sized to the workload) and
``engine`` / ``engine+sharing`` / ``engine+int8`` (``Engine(..., compile=True)`` on ``ENGINES``' blocks,
stepping on its background thread; int8's coded blocks step eagerly: the compiled step takes float
blocks; ``--eager``: none compiled).

Contenders and patterns alternate round by round (``harness.alternate``). Per row: output tokens/s,
TTFT p50/p95, TPOT, K/V bytes, prompt tokens computed, and the requests whose tokens equal
``sequential``'s (``engine_report``); the targets: ``engine+sharing`` >= 1.5x ``hf_generate_batch``
and >= 4x ``sequential`` in tokens/s, TTFT p95 <= half of ``hf_generate_batch``'s, the shared
prompt computed once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ...errors import KVCacheError
from ..run_options import RunOptions
from .engine_report import REFERENCE, plot, rows, summarize, table
from .engine_workload import (
    Run, Workload, arrival_times, engine_settings, hf_settings, make_engine, make_workload, serve_engine, serve_hf,
    serve_sequential,
)  # fmt: skip
from .harness import alternate, report
from .prompt_request import Prompts

#: Block formats of the engine contenders: (spec, share_prefixes).
ENGINES = {"engine": ("growable", False), "engine+sharing": ("growable", True), "engine+int8": ("quantized:bits=8", True)}
CONTENDERS = (REFERENCE, "sequential+store", "hf_generate_batch", *ENGINES)
ARRIVALS = ("burst", "poisson")
__all__ = ["ARRIVALS", "CONTENDERS", "REFERENCE", "plot", "run", "sizes", "table"]


@dataclass(frozen=True)
class Sizes:
    """Tokens and counts of one run (``sizes``)."""

    sessions: int
    shared: int
    user: int
    new_tokens: int
    repeats: int
    block_size: int  # the engine's
    page_size: int  # transformers' continuous batching's
    max_batch_tokens: int  # both
    store_chunk: int
    gap_share: float
    seed: int


#: The issue's workload.
FULL = Sizes(sessions=16, shared=1024, user=64, new_tokens=64, repeats=3, block_size=32, page_size=256,
             max_batch_tokens=512, store_chunk=256, gap_share=0.25, seed=0)


def sizes(options: RunOptions) -> Sizes:
    """``FULL``, or smaller for ``quick`` (1 round) and ``tiny`` (seconds on the shipped tiny model)."""
    return options.pick(
        tiny=replace(FULL, sessions=3, shared=64, user=16, new_tokens=6, repeats=1, block_size=16, page_size=16,
                     max_batch_tokens=48, store_chunk=32),
        quick=replace(FULL, sessions=4, shared=256, new_tokens=16, repeats=1),
        full=FULL,
    )


def load(options: RunOptions) -> tuple[Any, Prompts, str, int]:
    """(model, its prompts, its name, its pad id): SmolLM2-135M-Instruct, or for ``tiny`` the shipped
    trained tiny model with random ids (its byte tokenizer makes ChatML longer than a tiny turn)."""
    if options.tiny:
        from ..trained import MODEL_DIR, load_pretrained

        model, _ = load_pretrained(MODEL_DIR, options.device)
        tokenizer = None  # random ids: Prompts draws them
        name = "the shipped tiny model (random ids)"
    else:
        from ... import models

        model, tokenizer = models.load("smollm2", device=options.device, progress=options.progress)
        name = "smollm2 (SmolLM2-135M-Instruct, fp32)"
    model.set_attn_implementation("sdpa")
    return model, Prompts(tokenizer, model.config.vocab_size), name, model.config.pad_token_id or 0


def chosen(given: Sequence[str] | None, valid: Sequence[str], what: str) -> list[str]:
    """``given`` (default all of ``valid``) in ``valid``'s order; ``KVCacheError`` naming unknown ones."""
    names = list(valid) if given is None else list(dict.fromkeys(given))
    unknown = [n for n in names if n not in valid]
    if unknown or not names:
        raise KVCacheError(f"unknown {what}(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(valid)}")
    return [n for n in valid if n in names]


Runner = Callable[[Workload, Sequence[float]], Run]


def runners(model: Any, s: Sizes, full: Workload, compile: bool) -> dict[str, Runner]:
    """Contender name -> a function serving a workload at given arrival times; each engine
    contender's one engine sized to ``full`` and made at its first call; a failure inside
    ``transformers`` is its contender's row, not the run's end."""
    from ...prompts import PromptStore

    kept: dict[str, Any] = {}
    settings = engine_settings(full, s.block_size, s.max_batch_tokens)

    def engine(name: str, w: Workload, at: Sequence[float]) -> Run:
        if name not in kept:
            kept[name] = make_engine(model, *ENGINES[name], settings, compile)
        return serve_engine(model, kept[name], w, at)

    def hf(w: Workload, at: Sequence[float]) -> Run:
        try:
            return serve_hf(model, w, at, hf_settings(w, s.page_size, s.max_batch_tokens))
        except Exception as e:  # noqa: BLE001 - another library's machinery: its row says why, the rest is measured
            return Run(reason=f"failed: {type(e).__name__}: {e}")

    return {
        REFERENCE: lambda w, at: serve_sequential(model, w, at),
        "sequential+store": lambda w, at: serve_sequential(model, w, at, PromptStore("memory", chunk=s.store_chunk)),
        "hf_generate_batch": hf,
    } | {name: functools.partial(engine, name) for name in ENGINES}


def warm_up(serve: dict[str, Runner], w: Workload, names: Sequence[str]) -> float:
    """Each contender once on two requests arriving together (first-call costs: kernels, thread
    pools, the engine's C++ library built), then the seconds one warm sequential request takes
    (the second of two: its finish less the first's)."""
    two = w.head(2)
    for name in names:
        serve[name](two, [0.0, 0.0])
    seq = serve[REFERENCE](two, [0.0, 0.0]).requests
    return seq[1].finish - seq[0].finish


def configured(s: Sizes, w: Workload, compile: bool) -> dict[str, str]:
    """How each contender is set up, in words, with this run's numbers."""
    e, h = engine_settings(w, s.block_size, s.max_batch_tokens), hf_settings(w, s.page_size, s.max_batch_tokens)
    n, prompt = len(w.prompts), len(w.prompts[0])
    pool = (f"block_size={e.block_size}, blocks={e.blocks} ({n} x ceil(({prompt} + {w.new_tokens} - 1) / {e.block_size}): "
            f"every request at once, nothing shared), max_batch_tokens={e.max_batch_tokens}, max_seqs={e.max_seqs}")
    steps = (", compile=True (its steps compiled before the first run, `warm_up`; blocks the compiled step refuses, "
             "int8's, step eagerly)") if compile else ""
    stepping = ("stepping on its background thread (`engine.running()`), each request submitted at its arrival; one engine "
                "for every run (as a server keeps one), its prefix cache forgotten (`reset_prefix_cache`) before each")
    return {
        REFERENCE: f"one request at a time in arrival order: `model.generate(ids, max_new_tokens={w.new_tokens}, do_sample=False, "
        "past_key_values=DynamicCache(config=model.config))`, sdpa attention; TTFT from a streamer's first new token",
        "sequential+store": f"the same through `PromptStore('memory', chunk={s.store_chunk})`: `cache_for` (a growable cache) -> "
        "`generate` -> `put` (before the next request); a new store each run",
        "hf_generate_batch": "transformers' continuous batching through the manager `generate_batch` runs: "
        f"`init_continuous_batching(GenerationConfig(max_new_tokens={w.new_tokens}, do_sample=False), "
        f"ContinuousBatchingConfig(page_size={h.page_size}, num_blocks={h.num_blocks} ({n} x ceil(({prompt} + {w.new_tokens}) / "
        f"{h.page_size})), max_batch_tokens={h.max_batch_tokens}, max_requests_per_batch={n}))`, block sharing on (its default), "
        "sdpa (no flash attention on the CPU); warmed up and started before the first arrival, `add_requests` at each arrival "
        "(those due together in one call, as `generate_batch` adds them), `get_result`; a new manager each run",
        "engine": f"`Engine(model, 'growable', {pool}, share_prefixes=False{steps})`, {stepping}",
        "engine+sharing": f"`Engine(model, 'growable', {pool}, share_prefixes=True{steps})`, {stepping}",
        "engine+int8": f"`Engine(model, 'quantized:bits=8', {pool}, share_prefixes=True{steps})`, {stepping}",
    }


def run(
    options: RunOptions = RunOptions(),
    *,
    contenders: Sequence[str] | None = None,
    arrivals: Sequence[str] | None = None,
    eager: bool = False,
) -> dict[str, Any]:
    """Run the suite (``contenders``, ``arrivals``: some of ``CONTENDERS``, ``ARRIVALS``, default all);
    write ``engine.json``/``.md``/``.png`` into ``options.out`` if given."""
    from tqdm.auto import tqdm

    names = chosen(contenders, CONTENDERS, "contender")
    names = names if REFERENCE in names else [REFERENCE, *names]
    patterns = chosen(arrivals, ARRIVALS, "arrival pattern")
    s = sizes(options)
    model, prompts, model_name, pad = load(options)
    w = make_workload(prompts, s.sessions, s.shared, s.user, s.new_tokens, model.config.vocab_size, pad)
    serve = runners(model, s, w, compile=not eager)
    request_s = warm_up(serve, w, names)
    mean_gap = s.gap_share * request_s
    schedule = {p: arrival_times(p, s.sessions, mean_gap, s.seed) for p in patterns}
    texts = {"burst": f"burst, all {s.sessions} at t=0"}
    if "poisson" in schedule:
        texts["poisson"] = (f"poisson, exponential gaps of mean {mean_gap:.3g} s ({s.gap_share:g} x one warm "
                            f"sequential request's {request_s:.3g} s; seed {s.seed}; the last arrives at "
                            f"{schedule['poisson'][-1]:.3g} s)")
    keys = [(n, p) for n in names for p in patterns]
    with tqdm(total=len(keys) * s.repeats, desc="bench engine", disable=not options.progress) as bar:
        samples = alternate(keys, s.repeats, lambda key: serve[key[0]](w, schedule[key[1]]), bar)
    table_rows = rows(samples, w)
    judged = (s.sessions, s.shared, s.user, s.new_tokens) == (FULL.sessions, FULL.shared, FULL.user, FULL.new_tokens)
    config = asdict(s) | {
        "model": model_name,
        "threads": torch.get_num_threads(),
        "text": "random token ids" if options.tiny else "the kvcache package's source text",
        "contenders": names,
        "arrivals": patterns,
        "engine_compile": not eager,
        "sequential_request_s": request_s,
        "mean_gap_s": mean_gap if "poisson" in patterns else None,
        "arrival_s": schedule,
        "arrivals_text": "; ".join(texts[p] for p in patterns),
        "configured": {k: v for k, v in configured(s, w, not eager).items() if k in names},
        "judged": judged,
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("engine", options, config, table_rows, table, plot, summary=summarize(table_rows, w, judged))

