"""Quality per byte: ``kvcache eval --model smollm2 --frontier``.

At each byte budget (a share of the fp32 cache: :data:`BYTE_BUDGETS`), every fixed mix (an
eviction kind of :data:`EVICTION` x a slot storage of :data:`STORAGES`, keeping as many tokens as
the budget affords in that storage: :func:`spec_for`) and the ``auto`` and ``auto-heads`` specs at
that budget; the ``quantized`` kinds (every token coded) and the full cache at their own bytes. Each is scored as
``kvcache eval`` scores a kind with the question in the prompt (``eval_real_context.run_context``:
needles in prose, the bounded cache compressed from one recorded pass), and on held-out prose (KL,
top-1). The bytes plotted are measured: each cache's ``nbytes`` after its answer, per token, as a
share of an fp32 cache of the same tokens.

With ``tasks`` (``kvcache eval --frontier --tasks needle-digits,turn --split held-out``) the
questions are the task families' items (``families.py``) instead of the needles, one per family
and seed, each scored by its family's rule; the points are the full cache, ``auto`` and
``auto-heads``, and ``snapkv``/``adakv`` over every storage (kvpress's full-precision eviction among
them), and the report has a table per family.

Output (``frontier.json``, ``frontier.md``, ``frontier.png``): per budget the ``auto`` spec, the best
fixed mix and ``snapkv/full`` (kvpress-style eviction in full precision); every point's accuracy by
length and depth, KL, top-1 and bytes; the points on the Pareto front (none other finds more
needles in fewer bytes) marked.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from . import families, needles
from .eval_real_context import run_context, text_runs
from .eval_frontier_report import write
from .eval_real_plan import ANSWER_TOKENS, Setting
from .eval_real_weights import modes_for
from .frontier_points import (
    AUTO, BYTE_BUDGETS, EVICTION, FAMILY_ANSWER_TOKENS, FAMILY_KINDS, STORAGES, UNBOUNDED, check_autos, context_seeds,
    fp32_per_token, geometry_of, mixes, spec_for,
)  # fmt: skip
from .run_options import RunOptions


def setting(options: RunOptions) -> Setting:
    return options.pick(
        tiny=Setting((384,), 1, 128, 8, 1, (0.25,)),
        quick=Setting((2048,), 2, 1024, 32, 1, (0.25, 0.0625)),
        full=Setting((2048, 4096, 8192), 6, 1024, 64, 1, BYTE_BUDGETS),
    )


def run(
    options: RunOptions = RunOptions(),
    *,
    model_name: str = "smollm2",
    kinds: tuple[str, ...] | None = None,
    lengths: tuple[int, ...] | None = None,
    contexts: int | None = None,
    needles_per_context: int = 1,
    budgets: tuple[float, ...] | None = None,
    first_context: int = 0,
    tasks: tuple[str, ...] | None = None,
    split: str = "held-out",
    autos: tuple[str, ...] = AUTO,
    storages: tuple[str, ...] = STORAGES,
) -> dict[str, Any]:
    """The frontier (see the module docstring); ``budgets``: byte budgets, shares of the fp32 cache;
    the contexts are those of seeds ``first_context ..`` (so that runs of more contexts can be
    merged by :func:`merge`). ``tasks``: task families (``families.FAMILIES``) instead of the
    needles, items of ``split``, one item per family and seed; their kinds default to
    :data:`FAMILY_KINDS` and the only unbounded point is the full cache. ``autos``: the points that
    choose their own mix (``"auto-heads,rule=output"``: with options); ``kinds=()`` runs no fixed mix;
    ``storages``: the slot storages of the fixed mixes (``"int4h"``, over rotated codes, among them)."""
    from tqdm.auto import tqdm

    from ..models import load

    autos = check_autos(tuple(autos)) if autos else ()
    if tasks is not None:
        unknown = [t for t in tasks if t not in families.FAMILIES]
        if unknown or not tasks:
            raise ValueError(f"unknown task famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; choose from {families.FAMILIES}")
        if split not in families.SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {families.SPLITS}")
    kinds = (EVICTION if tasks is None else FAMILY_KINDS) if kinds is None else tuple(kinds)
    s = setting(options)
    if budgets is not None:
        s = replace(s, budgets=tuple(budgets))
    lengths = s.lengths if lengths is None else tuple(lengths)
    contexts = s.contexts if contexts is None else contexts
    answer_tokens = ANSWER_TOKENS if tasks is None else FAMILY_ANSWER_TOKENS
    model, tokenizer = load(model_name, device=options.device, progress=options.progress)
    g = geometry_of(model)
    unbounded = list(UNBOUNDED) if tasks is None else ["full"]
    # The full cache first: the held-out text's KL and top-1 are taken against the first run.
    points = [(u, None) for u in unbounded] + [(a, b) for a in autos for b in s.budgets] + [(m, b) for m in mixes(kinds, storages) for b in s.budgets]
    plan = [(name, "question", b) for name, b in points]
    per_seed = needles_per_context if tasks is None else len(tasks)
    bar = tqdm(total=len(lengths) * contexts * per_seed * len(plan), desc="frontier", disable=not options.progress)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        for c in range(first_context, first_context + contexts):
            for family, ctx, judge in _contexts(tokenizer, length, c, needles_per_context, tasks, split):
                T = len(ctx.prefix_ids) + max(len(q.ids) for q in ctx.questions)
                specs = {(name, b): spec_for(name, b, T, g, room=answer_tokens) for name, b in points}
                doc_modes, q_modes = modes_for(model, list(specs.values()), [len(q.ids) for q in ctx.questions])
                bar.set_postfix_str(f"{length} tokens, {family or 'context'} {c + 1 - first_context}/{contexts}")
                got, _ = run_context(model, tokenizer, ctx, plan, specs, doc_modes, q_modes, bar, judge, answer_tokens)
                rows += [{**r, "family": family, "split": split} for r in got] if family else got
    text = text_runs(model, tokenizer, plan, s, seed=0, spec_for=lambda name, b, n: spec_for(name, b, n, g, room=s.text_steps + 1))
    bar.close()
    fp32 = fp32_per_token(model, g)
    result = {
        "suite": "frontier",
        "config": {"model": model_name, "lengths": list(lengths), "contexts": {str(L): list(range(first_context, first_context + contexts)) for L in lengths},
                   "questions_per_context": needles_per_context if tasks is None else 1,
                   "depths": list(needles.DEPTHS if tasks is None else families.DEPTHS), "budgets": list(s.budgets),
                   "kinds": list(kinds), "storages": list(storages),
                   "fp32_bytes_per_token": fp32, "answer_tokens": answer_tokens, "text_steps": s.text_steps,
                   "tasks": None if tasks is None else list(tasks), "split": None if tasks is None else split,
                   "quick": options.quick, "tiny": options.tiny},  # fmt: skip
        "runs": rows,
        "text": text,
    }
    if options.out is not None:
        write(result, Path(options.out))
    return result


def _contexts(tokenizer, length: int, seed: int, count: int, tasks: tuple[str, ...] | None, split: str):
    """``(family, context, judge)`` for one seed: the needles' context (family None, the default
    judge), or one item per task family with its own scoring."""
    if tasks is None:
        yield None, needles.make_context(tokenizer, length, seed=seed, count=count), None
        return
    for family in tasks:
        item = families.make_item(tokenizer, family, length, seed, split)
        yield family, families.as_context(item), lambda q, text, item=item: families.score(item, text)


MERGED_ALIKE = ("model", "questions_per_context", "depths", "budgets", "kinds", "storages", "fp32_bytes_per_token", "answer_tokens",
                "text_steps", "tasks", "split")  # fmt: skip


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from runs of other lengths or other contexts (``first_context``) of the same
    frontier: the same model, budgets, kinds and questions; no context twice. The held-out text is
    the same in every run (same seed and budgets): the first run's is kept."""
    if not results:
        raise ValueError("merge: no results given")
    for r in results:
        if r.get("suite") != "frontier":
            raise ValueError(f"merge: expected frontier results, got suite {r.get('suite')!r}")
    first = results[0]["config"]
    seeds: dict[int, list[int]] = {}
    for r in results:
        c = r["config"]
        differ = [k for k in MERGED_ALIKE if c.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"merge: the runs differ in {', '.join(differ)}; only runs of the same frontier merge")
        for L, got in context_seeds(c).items():
            twice = sorted(set(seeds.get(L, [])) & set(got))
            if twice:
                raise ValueError(f"merge: contexts {twice} at {L} tokens are in two runs")
            seeds[L] = sorted(seeds.get(L, []) + got)
    config = {**first, "lengths": sorted(seeds), "contexts": {str(L): seeds[L] for L in sorted(seeds)}}
    return {"suite": "frontier", "config": config, "runs": [row for r in results for row in r["runs"]], "text": results[0].get("text", [])}


