"""The report of the quality-per-byte frontier (``eval_frontier.py``): one line per point and
budget, the paired differences between points, the tables by budget, length and family, the plot,
and ``frontier.json``/``.md``/``.png``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .bench.common import write_files
from .frontier_points import AUTO, STORAGES, UNBOUNDED, context_seeds
from .report import markdown, mean, pct, tokens_label


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


def at(result: dict[str, Any], length: int) -> dict[str, Any]:
    """``result`` with the runs at ``length`` tokens only."""
    return {**result, "runs": [r for r in result["runs"] if r["length"] == length]}


def line_of(lines: list[dict[str, Any]], point: str, budget: float | None) -> dict[str, Any] | None:
    """The line of ``point`` at ``budget`` (None for the unbounded kinds), if it was run."""
    return next((l for l in lines if l["point"] == point and l["budget"] == budget), None)


def best_fixed(lines: list[dict[str, Any]], budget: float) -> dict[str, Any] | None:
    """The fixed mix of ``budget`` finding the most needles within it (by measured bytes; fewer
    bytes break ties)."""
    fixed = [l for l in lines if "/" in l["point"] and l["budget"] == budget and l["bytes"] <= budget * 1.0001]
    return max(fixed, key=lambda l: (l["accuracy"], -l["bytes"]), default=None)


def of_family(result: dict[str, Any], family: str) -> dict[str, Any]:
    """``result`` with the runs of task family ``family`` only."""
    return {**result, "runs": [r for r in result["runs"] if r.get("family") == family]}


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
        at_length = at(result, L)
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
        out += [(f"all families, {L} tokens", at(result, L)) for L in c["lengths"] if at(result, L)["runs"]]
    for family in c.get("tasks") or [None]:
        part = result if family is None else of_family(result, family)
        for length in c["lengths"]:
            sub = at(part, length)
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
        body = "".join(f"## {f}\n\n" + length_table(of_family(result, f)) + "\n\n" for f in c["tasks"])
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
