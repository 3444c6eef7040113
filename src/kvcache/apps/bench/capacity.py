"""Suite ``capacity``: how many sessions one engine pool of fixed bytes holds in each block format,
and the needle accuracy of SmolLM2-135M-Instruct (fp32, CPU) served through the engine in each.

The workload: ``contexts`` needle contexts of ``length`` tokens (``needles.make_context``: prose of
the standard library's docstrings, one pass key at depth 0.1, 0.5 or 0.9 turning with the seed),
one question each, all submitted at once to an ``Engine`` whose pool has the bytes of
``fp32_sessions`` full-precision sessions of ``length + new_tokens`` tokens. Every format gets
the same bytes (its pool's blocks, scales and open blocks all count) and the same requests.

Formats (``FORMATS``): ``growable`` (fp32 blocks), ``quantized:bits=8``, ``bits=4`` and
``codes=fp8`` (coded blocks, one exact open block per running request), and bounded kinds, each request's context in a
cache of its own once its prompt is computed (``engine/compression.py``): ``snapkv:budget=0.25``
(a quarter of the tokens, the question's last 32 tokens its observation window),
``adakv:budget=0.25,storage=int8`` (Ada-KV's head-adaptive budgets over int8 slots),
``auto:bytes=0.125`` (an eighth of fp32's bytes, tokens and precision chosen per layer) and
``MIXED`` (Ada-KV keeping 30% of the tokens, the quarter of them it ranks highest in int8, the rest in int4).

Per format (``serve``): the bytes one session holds while it decodes and the sessions the pool
holds (how each is counted: the table's note; a bounded request's prompt is held whole until it
is compressed, so the prompts in flight, at most ``max_batch_tokens`` tokens a step, come on top),
the most sessions past their prompt at once in the run (``EngineStats.peak_decoding``, bounded by
how requests overlap in time as well as by the pool), the sessions held at once, measured
(``_hold``), needle accuracy (the first number of each answer against the pass key) by depth, and
the run's wall time. ``TARGETS`` judges them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ...errors import KVCacheError
from .. import needles
from ..run_options import RunOptions
from .common import figure, markdown_table
from .harness import report

AUTO = "auto:bytes=0.125"
#: Mixed precision inside a layer (``layers/tiers.py``): the quarter of Ada-KV's kept slots ranked highest in int8, the rest in int4.
MIXED = "adakv:budget=0.3,storage=int4,fine=int8,fine_share=0.25"
FORMATS = ("growable", "quantized:bits=8", "quantized:bits=4", "quantized:codes=fp8", "snapkv:budget=0.25",
           "adakv:budget=0.25,storage=int8", AUTO, MIXED)
#: summary key -> (format, least sessions over fp32's, most accuracy below fp32's, what the table says):
#: int8 at the same accuracy (issue 24), ``auto:bytes=0.125`` within 5 points (issue 41), mixed
#: precision within 2 of the 24 needles (issue 61).
TARGETS = {
    "int8_target": ("quantized:bits=8", 1.9, 0.0, "int8 >= 1.9x fp32's sessions at the same accuracy"),
    "auto_target": (AUTO, 7.0, 0.05, f"{AUTO} >= 7x fp32's sessions within 5 points"),
    "mixed_target": (MIXED, 10.0, 2 / 24, f"{MIXED} >= 10x fp32's sessions within 2 of 24 needles"),
}
#: Every row is one format (its ``contender``).
CONTENDERS = FORMATS
REFERENCE = "growable"


@dataclass(frozen=True)
class Sizes:
    contexts: int
    length: int
    new_tokens: int
    fp32_sessions: int
    block_size: int
    max_batch_tokens: int


FULL = Sizes(contexts=24, length=2048, new_tokens=16, fp32_sessions=4, block_size=32, max_batch_tokens=512)


def sizes(options: RunOptions) -> Sizes:
    """The sizes of this run; ``tiny`` runs the shipped tiny model (its answers mean nothing)."""
    return options.pick(
        tiny=replace(FULL, contexts=3, length=256, new_tokens=4, fp32_sessions=2, block_size=16, max_batch_tokens=128),
        quick=replace(FULL, contexts=6, length=1024, fp32_sessions=2),
        full=FULL,
    )


def load(options: RunOptions) -> tuple[Any, Any, str]:
    if options.tiny:
        from ..trained import MODEL_DIR, load_pretrained

        model, tokenizer = load_pretrained(MODEL_DIR, options.device)
        return model, tokenizer, "the shipped tiny model"
    from ... import models

    model, tokenizer = models.load("smollm2", device=options.device, progress=options.progress)
    return model, tokenizer, "smollm2 (SmolLM2-135M-Instruct, fp32)"


def serve(model: Any, tokenizer: Any, spec: str, requests: Sequence[tuple[list[int], needles.Question]], s: Sizes, pool_bytes: int) -> dict[str, Any]:
    """One format's run: every request submitted at once; the row of numbers."""
    from ... import Engine

    engine = Engine(model, spec, block_size=s.block_size, max_bytes=pool_bytes, max_batch_tokens=s.max_batch_tokens,
                    max_seqs=len(requests))  # fmt: skip
    start = time.perf_counter()
    handles = [engine.submit(ids, max_new_tokens=s.new_tokens) for ids, _ in requests]
    answers = [tokenizer.decode(h.result(), skip_special_tokens=True) for h in handles]
    seconds = time.perf_counter() - start
    pool = engine.pool
    per_session = max(h.stats.held_blocks for h in handles) * pool.block_nbytes + getattr(pool, "tail_nbytes", 0)
    held, hold_preemptions = _hold(engine, requests, s)
    found = [needles.answer_of(a) == q.key for a, (_, q) in zip(answers, requests)]
    by_depth = {f"{d:g}": _share([f for f, (_, q) in zip(found, requests) if q.depth == d]) for d in needles.DEPTHS}
    return {
        "contender": spec,
        "pool_bytes": pool.nbytes,
        "blocks": pool.total,
        "session_bytes": per_session,
        "sessions_held": pool.nbytes // per_session,
        "peak_decoding": engine.stats.peak_decoding,
        "held_at_once": held,
        "hold_preemptions": hold_preemptions,
        "preemptions": engine.stats.preemptions,
        "accuracy": _share(found),
        "by_depth": by_depth,
        "found": sum(found),
        "questions": len(found),
        "seconds": seconds,
        "answers": answers,
    }


def _hold(engine: Any, requests: Sequence[tuple[list[int], Any]], s: Sizes) -> tuple[int, int]:
    """The most sessions the pool held at once, measured: every context submitted again with room
    to decode for as long as the others' prompts take (``4 x contexts + 8`` tokens), the engine
    stepped until each has generated a token or as many steps as every prompt needs have passed;
    then all cancelled. Returns (the most requests decoding after one step, preemptions)."""
    before = engine.stats.preemptions
    prompt_steps = sum(-(-len(ids) // s.max_batch_tokens) for ids, _ in requests)
    handles = [engine.submit(ids, max_new_tokens=4 * len(requests) + 8, eos_token_id=[]) for ids, _ in requests]
    most = 0
    for _ in range(prompt_steps + len(requests) + 8):
        if not engine.step():
            break
        most = max(most, sum(1 for h in handles if h.tokens and not h.done))
        if all(h.tokens for h in handles):
            break
    for h in handles:
        h.cancel()
    return most, engine.stats.preemptions - before


def _requests(tokenizer: Any, s: Sizes, tiny: bool, vocab: int) -> list[tuple[list[int], needles.Question]]:
    """One needle question per context; for ``tiny`` (a tokenizer with no chat template) random
    ids of the same length with a key no answer holds (the answers mean nothing there)."""
    out = []
    for seed in range(s.contexts):
        if tiny:
            ids = torch.randint(3, vocab, (s.length - 16,), generator=torch.Generator().manual_seed(seed)).tolist()
            out.append((ids, needles.Question("none", "-", needles.DEPTHS[seed % 3], [])))
            continue
        ctx = needles.make_context(tokenizer, s.length, seed)
        (question,) = ctx.questions
        out.append((ctx.prefix_ids + question.ids, question))
    return out


def _share(xs: Sequence[bool]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run(options: RunOptions = RunOptions(), *, formats: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the suite over ``formats`` (default ``FORMATS``); write ``capacity.json``/``.md``/``.png``
    into ``options.out`` if given."""
    from tqdm.auto import tqdm

    from ...engine import pool_shape

    chosen = list(FORMATS if formats is None else dict.fromkeys(formats))
    if not chosen:
        raise KVCacheError(f"no format given; formats are engine specs such as {', '.join(FORMATS)}")
    s = sizes(options)
    model, tokenizer, name = load(options)
    requests = _requests(tokenizer, s, options.tiny, model.config.vocab_size)
    g = pool_shape(model)  # keys and values of fp32_sessions sessions at full precision (the model's dtype)
    pool_bytes = s.fp32_sessions * 2 * g.layers * g.kv_heads * g.head_dim * g.dtype.itemsize * (s.length + s.new_tokens)
    specs = tqdm(chosen, desc="bench capacity", disable=not options.progress)
    rows = [serve(model, tokenizer, spec, requests, s, pool_bytes) for spec in specs]
    reference = next((r for r in rows if r["contender"] == REFERENCE), None)
    for row in rows:
        row["sessions_x_fp32"] = row["sessions_held"] / reference["sessions_held"] if reference else None
    config = asdict(s) | {
        "model": name,
        "threads": torch.get_num_threads(),
        "pool_bytes": pool_bytes,
        "prompt_tokens": [len(ids) for ids, _ in requests],
        "formats": chosen,
        "quick": options.quick,
        "tiny": options.tiny,
    }
    return report("capacity", options, config, rows, table, plot, summary=summarize(rows, options))


def summarize(rows: list[dict[str, Any]], options: RunOptions) -> dict[str, Any]:
    """``TARGETS``, met or not (not judged on the tiny model, whose answers mean nothing)."""
    by = {r["contender"]: r for r in rows}
    fp32 = by.get(REFERENCE)
    out: dict[str, Any] = dict.fromkeys(TARGETS)
    if fp32 is None or options.tiny:
        return out
    for name, (spec, times, points, _) in TARGETS.items():
        row = by.get(spec)
        if row is not None:
            met = row["sessions_x_fp32"] >= times and row["accuracy"] >= fp32["accuracy"] - points
            out[name] = {"sessions_x_fp32": row["sessions_x_fp32"], "accuracy": row["accuracy"],
                         "fp32_accuracy": fp32["accuracy"], "met": met}  # fmt: skip
    return out


HEADER = ["format", "MiB / session", "sessions the pool holds", "x fp32", "held at once, measured", "needles found",
          "depth 0.1 / 0.5 / 0.9", "s (answers)"]  # fmt: skip


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    mib = 2**20
    lines = [
        f"Model: {c['model']}, {c['threads']} threads. {c['contexts']} needle contexts of {c['length']} tokens "
        f"(one question each, {c['new_tokens']} new tokens), all submitted at once; every format's pool "
        f"{c['pool_bytes'] / mib:.0f} MiB = {c['fp32_sessions']} fp32 sessions of {c['length'] + c['new_tokens']} tokens; "
        f"block_size {c['block_size']}, max_batch_tokens {c['max_batch_tokens']}.",
        "",
        markdown_table(HEADER, [
            [r["contender"], f"{r['session_bytes'] / mib:.1f}", r["sessions_held"],
             "-" if r["sessions_x_fp32"] is None else f"{r['sessions_x_fp32']:.2f}x", r["held_at_once"],
             f"{r['found']}/{r['questions']} ({r['accuracy']:.0%})",
             " / ".join("-" if v is None else f"{v:.0%}" for v in r["by_depth"].values()), f"{r['seconds']:.0f}"]
            for r in result["rows"]
        ]),
        "MiB / session: what one request holds while it decodes (its blocks or the lease for its own cache's bytes, and a coded pool's open block); sessions the "
        "pool holds: the pool's bytes over that. Held at once, measured: every context submitted again with room to "
        "decode while the others' prompts are computed, the most decoding together after one step (a prompt being "
        "computed holds blocks too, and under a bounded kind the whole prompt until it is compressed). s (answers): the wall "
        "time of the answering run, every request submitted at once.",
    ]
    summary = result.get("summary", {})
    for name, (*_, what) in TARGETS.items():
        target = summary.get(name)
        if target:
            verdict = "met" if target["met"] else "not met"
            lines += ["", f"Target: {what}: {target['sessions_x_fp32']:.2f}x, "
                          f"{target['accuracy']:.0%} against {target['fp32_accuracy']:.0%}: **{verdict}**."]  # fmt: skip
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    with figure(path, size=(6, 4)) as (ax,):
        for r in result["rows"]:
            point = (r["sessions_held"], 100 * (r["accuracy"] or 0))
            ax.scatter(*point, s=60)
            ax.annotate(r["contender"], point, textcoords="offset points", xytext=(5, 5), fontsize=8)
        ax.set_xlabel("sessions the pool holds (equal bytes)")
        ax.set_ylabel("needles found (%)")
        ax.set_ylim(-5, 105)
        ax.set_title("Engine pool: sessions against accuracy")
