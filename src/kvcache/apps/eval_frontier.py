"""Quality per byte: ``kvcache eval --model smollm2 --frontier``.

At each byte budget (a share of the fp32 cache: :data:`BYTE_BUDGETS`), every fixed mix (an
eviction kind of :data:`EVICTION` x a slot storage of :data:`STORAGES`, keeping as many tokens as
the budget affords in that storage: :func:`spec_for`) and the ``auto`` and ``auto-heads`` specs at
that budget; the ``quantized`` kinds (every token coded) and the full cache at their own bytes. Each is scored as
``kvcache eval`` scores a kind with the question in the prompt (``eval_real.run_context``:
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
needles in fewer bytes) marked; the paired differences between points; tables by budget, length
and family.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from . import families, needles
from .bench.common import write_files
from .eval_real import run_context, text_runs
from .eval_real_plan import ANSWER_TOKENS, Setting
from .frontier_points import (
    AUTO, BYTE_BUDGETS, EVICTION, FAMILY_ANSWER_TOKENS, FAMILY_KINDS, STORAGES, UNBOUNDED, check_autos, context_seeds,
    fp32_per_token, geometry_of, mixes, spec_for,
)  # fmt: skip
from .report import markdown, mean, pct, tokens_label
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
                bar.set_postfix_str(f"{length} tokens, {family or 'context'} {c + 1 - first_context}/{contexts}")
                got, _ = run_context(model, tokenizer, ctx, plan, specs, bar, judge, answer_tokens)
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


# ---- report -------------------------------------------------------------------------------------


def paired_difference(runs: list[dict[str, Any]], a: tuple, b: tuple) -> tuple[float, float, int]:
    """Accuracy of point ``a`` minus point ``b`` (each ``(cache, budget)``) over the questions both
    answered, with the half-width of its 95% interval (1.96 standard errors of the mean per-question
    difference: pairing removes the questions' own difficulty from the noise), and how many."""
    answers = {(r["length"], r["context"], r["door"]): r["correct"] for r in runs if (r["cache"], r["budget"]) == b}
    d = [int(r["correct"]) - int(answers[k]) for r in runs if (r["cache"], r["budget"]) == a
         and (k := (r["length"], r["context"], r["door"])) in answers]  # fmt: skip
    n = len(d)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else math.nan
    return mean, 1.96 * math.sqrt(var / n), n


def only(result: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``result`` with only the runs whose ``key`` is ``value`` (a length, a task family)."""
    return {**result, "runs": [r for r in result["runs"] if r.get(key) == value]}


def line_of(lines: list[dict[str, Any]], point: str, budget: float | None) -> dict[str, Any] | None:
    """The line of ``point`` at ``budget`` (None for the unbounded kinds), if it was run."""
    return next((l for l in lines if l["point"] == point and l["budget"] == budget), None)


def best_fixed(lines: list[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The fixed mix of ``budget`` finding the most needles within it (by measured bytes; fewer
    bytes break ties)."""
    fixed = [l for l in lines if "/" in l["point"] and l["budget"] == budget and l["bytes"] <= budget * 1.0001]
    return max(fixed, key=lambda l: (l["accuracy"], -l["bytes"]), default=None)


def length_table(result: dict[str, Any]) -> str:
    """Per length and budget: ``auto`` (found, its difference from the full cache and from the best
    fixed mix on the same questions, its lowest depth, mean and largest bytes), the best fixed mix
    within the budget at that length, ``snapkv/full``, ``adakv/full`` and the full cache."""
    c = result["config"]
    header = ["tokens", "budget", "auto: found", "auto - full cache (95%)", "auto: lowest depth", "auto: bytes (mean / max)",
              "best fixed mix", "found", "auto - best fixed (95%)", "auto-heads: found", "auto-heads - full cache (95%)",
              "snapkv/full", "adakv/full", "full cache", "answers"]  # fmt: skip
    rows = []
    fp32 = c["fp32_bytes_per_token"]
    for L in c["lengths"]:
        at_length = only(result, "length", L)
        runs = at_length["runs"]
        if not runs:
            continue
        lines = points_of(at_length)
        full = line_of(lines, "full", None)
        for b in c["budgets"]:
            auto, best, heads = line_of(lines, "auto", b), best_fixed(lines, b), line_of(lines, "auto-heads", b)
            snap, ada = line_of(lines, "snapkv/full", b), line_of(lines, "adakv/full", b)
            worst = min(auto["by_depth"].items(), key=lambda kv: kv[1]) if auto else None
            top = max((r["bytes_per_token"] / fp32 for r in runs if (r["cache"], r["budget"]) == ("auto", b)), default=math.nan)
            rows.append([
                str(L), f"{b:g}", pct(auto["accuracy"]) if auto else "-", _difference(runs, ("auto", b), ("full", None)),
                f"{pct(worst[1])} (depth {worst[0]})" if worst else "-",
                f"{auto['bytes']:.3f} / {top:.3f}" if auto else "-",
                f"{best['point']} ({best['bytes']:.3f})" if best else "-", pct(best["accuracy"]) if best else "-",
                _difference(runs, ("auto", b), (best["point"], b)) if best else "-",
                pct(heads["accuracy"]) if heads else "-", _difference(runs, ("auto-heads", b), ("full", None)) if heads else "-",
                pct(snap["accuracy"]) if snap else "-", pct(ada["accuracy"]) if ada else "-",
                pct(full["accuracy"]) if full else "-", str(auto["answers"]) if auto else "-",
            ])  # fmt: skip
    return markdown(header, rows)


def _difference(runs: list[dict[str, Any]], a: tuple, b: tuple) -> str:
    diff, half, _ = paired_difference(runs, a, b)
    if math.isnan(diff):
        return "-"
    return f"{diff * 100:+.1f} ± {half * 100:.1f} pts" if not math.isnan(half) else f"{diff * 100:+.1f} pts"


def points_of(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (point, budget): needles found (all, by length, by depth), bytes as a share of
    fp32 (measured), KL and top-1 on held-out prose, and for ``auto`` the storages its layers chose."""
    fp32 = result["config"]["fp32_bytes_per_token"]
    lines: dict[tuple, dict[str, Any]] = {}
    for r in result["runs"]:
        line = lines.setdefault((r["cache"], r["budget"]), {"point": r["cache"], "budget": r["budget"], "hits": [], "bytes": [], "mix": {}})
        line["hits"].append((r["length"], r["depth"], bool(r["correct"])))
        line["bytes"].append(r["bytes_per_token"] / fp32)
        for storage, n in (r.get("storages") or {}).items():
            line["mix"][storage] = line["mix"].get(storage, 0) + n
    text = {(t["cache"], t["budget"]): t for t in result.get("text", [])}
    out = []
    for (name, budget), line in lines.items():
        hits = line.pop("hits")
        line["accuracy"] = sum(h for *_, h in hits) / len(hits)
        line["answers"] = len(hits)
        line["by_length"] = {L: mean([h for LL, _, h in hits if LL == L]) for L in sorted({h[0] for h in hits})}
        line["by_depth"] = {d: mean([h for _, dd, h in hits if dd == d]) for d in sorted({h[1] for h in hits})}
        line["bytes"] = sum(line["bytes"]) / len(line["bytes"])
        t = text.get((name, budget))
        line["kl"], line["top1"] = (t["kl"], t["top1"]) if t else (math.nan, math.nan)
        out.append(line)
    front = pareto(out)
    for line in out:
        line["pareto"] = id(line) in front
    return out


def pareto(lines: list[dict[str, Any]]) -> set[int]:
    """ids of the lines no other line beats: as many needles or more in no more bytes, strictly
    better in one of the two."""
    front = set()
    for a in lines:
        if not any((b["bytes"] <= a["bytes"] and b["accuracy"] >= a["accuracy"]) and (b["bytes"] < a["bytes"] or b["accuracy"] > a["accuracy"]) for b in lines):
            front.add(id(a))
    return front


def budget_table(lines: list[dict[str, Any]], budgets: list[float]) -> str:
    """Per budget: auto, the best fixed mix within the budget (by measured bytes), snapkv/full."""
    full = line_of(lines, "full", None)
    header = ["budget (of fp32)", "auto: found", "auto: bytes", "auto: layers chose", "best fixed mix", "found", "bytes",
              "snapkv/full: found", "full cache: found"]  # fmt: skip
    rows = []
    for b in budgets:
        auto, best, snap = line_of(lines, "auto", b), best_fixed(lines, b), line_of(lines, "snapkv/full", b)
        mix = ", ".join(f"{k} {v}" for k, v in sorted(auto["mix"].items())) if auto and auto["mix"] else "-"
        rows.append([
            f"{b:g}", pct(auto["accuracy"]) if auto else "-", f"{auto['bytes']:.3f}" if auto else "-", mix,
            best["point"] if best else "-", pct(best["accuracy"]) if best else "-", f"{best['bytes']:.3f}" if best else "-",
            pct(snap["accuracy"]) if snap else "-", pct(full["accuracy"]) if full else "-",
        ])  # fmt: skip
    return markdown(header, rows)


def points_table(lines: list[dict[str, Any]], lengths: list[int], depths: list[float]) -> str:
    header = ["point", "budget", "bytes (of fp32)", *map(tokens_label, lengths), *[f"depth {d}" for d in depths],
              "all", "answers", "KL (nats)", "top-1", "Pareto"]  # fmt: skip
    rows = []
    for l in sorted(lines, key=lambda l: l["bytes"]):
        cells = [l["point"], "-" if l["budget"] is None else f"{l['budget']:g}", f"{l['bytes']:.3f}"]
        cells += [pct(l["by_length"].get(L, math.nan)) for L in lengths] + [pct(l["by_depth"].get(d, math.nan)) for d in depths]
        kl = "-" if math.isnan(l["kl"]) else f"{l['kl']:.3f}"
        rows.append(cells + [pct(l["accuracy"]), str(l["answers"]), kl, pct(l["top1"]), "yes" if l["pareto"] else ""])
    return markdown(header, rows)


def panels_of(result: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The plot's panels: per length (on task families: all families together, then each) a title
    and its runs."""
    c = result["config"]
    out = []
    if c.get("tasks"):
        at = [(L, only(result, "length", L)) for L in c["lengths"]]
        out += [(f"all families, {L} tokens", sub) for L, sub in at if sub["runs"]]
    for family in c.get("tasks") or [None]:
        part = result if family is None else only(result, "family", family)
        for length in c["lengths"]:
            sub = only(part, "length", length)
            if sub["runs"]:
                out.append((f"{family + ', ' if family else ''}{length} tokens", sub))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Accuracy against measured bytes, one panel per length (and task family): every fixed mix by
    storage, the unbounded kinds, ``auto`` joined across budgets, and the Pareto front."""
    from .bench.common import figure

    panels = panels_of(result)
    with figure(path, panels=len(panels), size=(6.5, 4.8)) as axes:
        for ax, (title, sub) in zip(axes, panels):
            lines = points_of(sub)
            for storage, marker in zip(result["config"].get("storages", STORAGES), "osD^v<>p"):
                pts = [(l["bytes"], l["accuracy"]) for l in lines if l["point"].endswith("/" + storage)]
                if pts:
                    ax.scatter(*zip(*pts), marker=marker, alpha=0.5, label=f"fixed mixes, {storage}")
            for l in lines:
                if l["point"] in UNBOUNDED:
                    ax.scatter([l["bytes"]], [l["accuracy"]], marker="x", color="k")
                    ax.annotate(l["point"], (l["bytes"], l["accuracy"]), fontsize=7)
            for name, color in zip(AUTO, ("C3", "C5")):
                auto = sorted((l["bytes"], l["accuracy"]) for l in lines if l["point"] == name)
                if auto:
                    ax.plot(*zip(*auto), color=color, marker="*", markersize=10, label=name)
            front = sorted((l["bytes"], l["accuracy"]) for l in lines if l["pareto"])
            ax.step(*zip(*front), where="post", color="k", alpha=0.4, label="Pareto front")
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.03, 1.05)
            ax.set_xlabel("bytes after the answer, share of fp32 (measured)")
            ax.set_ylabel("answers found")
            answers = max((l["answers"] for l in lines), default=0)
            ax.set_title(f"{result['config']['model']}: {title}, {answers} answers a point")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")


def write(result: dict[str, Any], out: Path) -> None:
    c = result["config"]
    lines = points_of(result)
    counts = ", ".join(f"{len(v)} at {L}" for L, v in context_seeds(c).items())
    common = (
        "Bytes: each cache's allocated bytes after its answer per token, as a share of an fp32 cache "
        f"({c['fp32_bytes_per_token']:,} bytes per token). Fixed mixes: `kind/storage`, keeping the tokens the budget affords "
        "in that storage; `auto`: `auto:bytes=<budget>`. Differences are paired (the same questions), with 95% intervals.\n\n"
    )
    if c.get("tasks"):
        head = (
            f"# Quality per byte on {c['model']}: task families\n\nFamilies {', '.join(c['tasks'])} "
            f"(`kvcache.apps.families`), split `{c['split']}`, at {', '.join(map(str, c['lengths']))} tokens, items per family "
            f"and length: {counts}; the question in the prompt, {c['answer_tokens']} tokens decoded. " + common
        )
        body = "".join(f"## {f}\n\n" + length_table(only(result, "family", f)) + "\n\n" for f in c["tasks"])
        body += "## All families together\n\n" + length_table(result) + "\n\n"
    else:
        head = (
            f"# Quality per byte on {c['model']}\n\nNeedles in prose at {', '.join(map(str, c['lengths']))} tokens, contexts per length: {counts}; "
            f"{c['questions_per_context']} question(s) each (depths {', '.join(map(str, c['depths']))}, turning "
            f"with the context), the question in the prompt; KL / top-1 against the full cache over {c['text_steps']} held-out tokens. "
            + common
        )
        body = "By length:\n\n" + length_table(result) + "\n\n"
    write_files(out, "frontier", result, head + body + "All lengths together:\n\n" + budget_table(lines, c["budgets"])
                + "\n\nEvery point:\n\n" + points_table(lines, c["lengths"], c["depths"]) + "\n", plot)
