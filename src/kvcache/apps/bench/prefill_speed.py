"""Prefill speed, side by side in one process: the model's own SDPA prefill against the ``"kvcache"``
attention with our caches, whole prompt and chunked, and every bounded kind against ``growable``.

::

    python -m kvcache.apps.bench.prefill_speed --tokens 1024,4096 --batches 1,8 --repeats 3
    python -m kvcache.apps.bench.prefill_speed --tokens 2048 --contenders sdpa,growable,adakv

Contenders (``CONTENDERS``; ``--contenders`` picks some by name): ``sdpa``, the model on
``attn_implementation="sdpa"`` with ``DynamicCache`` and the prompt in one forward pass (what
``model(ids)`` or ``generate`` do): the time to match; our caches under ``use_kvcache_attention``
through ``kvcache.prefill``; each in one pass or ``chunk`` tokens per pass (``... chunked``).

Every contender runs once per round, the order rotated each round (``harness.alternate``), after
one untimed warm-up pass each; the table gives the median seconds and their ratios to ``sdpa`` and
to ``growable`` of the same size. A pass keeps the logits of the last position only, as
``kvcache.prefill`` does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvcache import cache_kwargs

from ...errors import KVCacheError

#: name -> (attention implementation, cache spec or None for ``DynamicCache``, chunked)
CONTENDERS: dict[str, tuple[str, str | None, bool]] = {
    "sdpa": ("sdpa", None, False),
    "sdpa chunked": ("sdpa", None, True),
    "growable": ("kvcache", "growable", False),
    "growable chunked": ("kvcache", "growable", True),
    "snapkv": ("kvcache", "snapkv:budget=0.25", False),
    "adakv": ("kvcache", "adakv:budget=0.25", False),
    "h2o": ("kvcache", "h2o:budget=0.25", False),
    "tova": ("kvcache", "tova:budget=0.25", False),
    "window": ("kvcache", "window:window=1024", False),
    "snapkv chunked": ("kvcache", "snapkv:budget=0.25", True),
    "adakv chunked": ("kvcache", "adakv:budget=0.25", True),
}
#: What a run compares when not told: the plain prefills and each bounded kind in one pass.
DEFAULT = ("sdpa", "sdpa chunked", "growable", "growable chunked", "snapkv", "adakv", "h2o", "tova", "window")


def one_prefill(model: Any, ids: torch.Tensor, contender: str, chunk: int) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of one prefill of ``ids`` ``[B, S]`` by ``contender`` (a fresh
    cache): elapsed time, and the CPU time of the process (every thread's)."""
    from transformers import DynamicCache

    import kvcache

    attention, spec, chunked = CONTENDERS[contender]
    step = chunk if chunked else ids.shape[1]
    if attention == "sdpa":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for s in range(0, ids.shape[1], step):
                model(ids[:, s : s + step], **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - wall, time.process_time() - cpu
    cache = kvcache.make_cache(model, spec)
    wall, cpu = time.perf_counter(), time.process_time()
    kvcache.prefill(model, ids, cache, chunk=step)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(
    tokens: Sequence[int], batches: Sequence[int], contenders: Sequence[str], *, chunk: int = 512, repeats: int = 3,
    model_name: str = "smollm2", progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per (tokens, batch, contender): median seconds over ``repeats`` alternated rounds,
    each sample, and the ratios to ``sdpa`` and ``growable`` where those ran."""
    from tqdm.auto import tqdm

    from .harness import alternate
    from .workload import load_model, make_prompts

    unknown = [c for c in contenders if c not in CONTENDERS]
    if unknown:
        raise KVCacheError(f"unknown contenders {unknown}; known: {', '.join(CONTENDERS)}")
    model, tokenizer, _ = load_model(model_name)
    rows: dict[tuple[int, int, str], dict[str, Any]] = {}
    total = len(tokens) * len(batches) * len(contenders) * repeats
    with tqdm(total=total, desc="prefill speed", disable=not progress) as bar:
        for n in tokens:
            for batch in batches:
                ids = make_prompts(tokenizer, batch, n, model.config.vocab_size)
                for name in contenders:  # warm-up: first-call costs, allocator growth
                    one_prefill(model, ids[:, : min(n, 2 * chunk)], name, chunk)
                samples = alternate(contenders, repeats, lambda name: one_prefill(model, ids, name, chunk), bar)
                for clock, which in (("seconds", 0), ("cpu_seconds", 1)):
                    medians = {name: statistics.median(s[which] for s in samples[name]) for name in contenders}
                    for name in contenders:
                        row = rows.setdefault((n, batch, name), {
                            "tokens": n, "batch": batch, "contender": name, "spec": CONTENDERS[name][1] or "DynamicCache",
                            "chunk": chunk if CONTENDERS[name][2] else n,
                        })
                        row[clock] = medians[name]
                        row[f"{clock}_samples"] = [s[which] for s in samples[name]]
                        for ref in ("sdpa", "growable"):
                            row[f"{clock}_vs_{ref}"] = medians[name] / medians[ref] if ref in medians else None
    model.set_attn_implementation("sdpa")
    return list(rows.values())


def table(rows: list[dict[str, Any]]) -> str:
    """Medians and ratios, by the wall clock and by the process's CPU time (every thread's: with one
    thread, the work done, whatever else the machine runs)."""
    from .common import markdown_table

    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}"

    head = ["tokens", "batch", "contender", "spec", "chunk", "s", "x sdpa", "x growable", "cpu s", "cpu x sdpa",
            "cpu x growable", "s samples"]
    body = [[r["tokens"], r["batch"], r["contender"], r["spec"], r["chunk"], f"{r['seconds']:.2f}", ratio(r["seconds_vs_sdpa"]),
             ratio(r["seconds_vs_growable"]), f"{r['cpu_seconds']:.2f}", ratio(r["cpu_seconds_vs_sdpa"]),
             ratio(r["cpu_seconds_vs_growable"]), " ".join(f"{s:.2f}" for s in r["seconds_samples"])] for r in rows]
    return markdown_table(head, body)


def main(argv: Sequence[str] | None = None) -> int:
    from ..cli_runs import int_list

    p = argparse.ArgumentParser(prog="python -m kvcache.apps.bench.prefill_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int_list, default=[1024, 2048], metavar="N,...", help="prompt lengths (default: 1024,2048)")
    p.add_argument("--batches", type=int_list, default=[1], metavar="N,...", help="batch sizes (default: 1)")
    p.add_argument("--contenders", default=",".join(DEFAULT), metavar="NAME,...", help=f"from: {', '.join(CONTENDERS)}")
    p.add_argument("--chunk", type=int, default=512, help="tokens per pass of the chunked contenders (default: 512)")
    p.add_argument("--repeats", type=int, default=3, help="alternated rounds (default: 3)")
    p.add_argument("--model", default="smollm2", help="a model name or folder (default: smollm2)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    rows = run(args.tokens, args.batches, names, chunk=args.chunk, repeats=args.repeats, model_name=args.model)
    print(f"torch threads: {torch.get_num_threads()}; medians of {args.repeats} alternated rounds\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
