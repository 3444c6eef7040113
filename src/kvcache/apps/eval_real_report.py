"""The real-model eval's report: a summary line per run, the tables, the plot, the files.

:func:`summary` folds the result's rows (one per answer, one per held-out text sample) into one line
per ``(cache, mode, budget)``: the share of needles found per context length and per depth, the share
of (layer, KV head) pairs that kept the needle, KL divergence (nats) and top-1 agreement with the
full cache, and bytes per token. :func:`table`, :func:`costs_table` and :func:`profile_table` are
Markdown; :func:`write` puts ``eval.json``, ``eval.md`` and (where matplotlib is installed)
``eval.png`` into a folder.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .bench.common import write_files
from .report import markdown, mean, pct, tokens_label


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (cache, mode, budget): accuracy per length and per depth, KL, top-1, bytes/token."""
    lines: dict[tuple, dict[str, Any]] = {}
    for r in result["runs"]:
        key = (r["cache"], r["mode"], r["budget"])
        line = lines.setdefault(key, {"cache": r["cache"], "mode": r["mode"], "budget": r["budget"], "hits": {}, "bytes": []})
        line["hits"].setdefault((r["length"], r["depth"]), []).append(bool(r["correct"]))
        if r.get("needle_kept") is not None:
            line.setdefault("kept", []).append(r["needle_kept"])
        line["bytes"].append(r["bytes_per_token"])
    for t in result.get("text", []):
        for line in lines.values():
            if line["cache"] == t["cache"] and line["budget"] == t["budget"]:
                line.setdefault("kl", []).append(t["kl"])
                line.setdefault("top1", []).append(t["top1"])
    out = []
    for line in lines.values():
        hits = line.pop("hits")
        lengths = sorted({L for L, _ in hits})
        depths = sorted({d for _, d in hits})
        line["by_length"] = {L: mean(mean(hits[(L, d)]) for d in depths if (L, d) in hits) for L in lengths}
        line["by_depth"] = {d: mean(x for (L, dd), v in hits.items() if dd == d for x in v) for d in depths}
        line["accuracy"] = mean(x for v in hits.values() for x in v)
        line["bytes_per_token"] = mean(line.pop("bytes"))
        line["needle_kept"] = mean(line.pop("kept", []))
        line["kl"] = mean(line.get("kl", []))
        line["top1"] = mean(line.get("top1", []))
        out.append(line)
    return sorted(out, key=lambda l: l["mode"] != "question")  # stable: kinds in run order


def _budget(b) -> str:
    return "-" if b is None else f"{b:.1%}".replace(".0%", "%")


def table(result: dict[str, Any]) -> str:
    lines = summary(result)
    lengths = result["config"]["lengths"]
    depths = result["config"]["depths"]
    header = ["cache", "kept", "compressed", *map(tokens_label, lengths), *[f"depth {d}" for d in depths], "all", "key kept",
              "KL (nats)", "top-1", "bytes/token"]  # fmt: skip
    rows = []
    for line in lines:
        cells = [line["cache"], _budget(line["budget"]), "with question" if line["mode"] == "question" else "once, reused"]
        cells += [pct(line["by_length"].get(L, math.nan)) for L in lengths]
        cells += [pct(line["by_depth"].get(d, math.nan)) for d in depths]
        text = ("-", "-") if math.isnan(line["kl"]) else (f"{line['kl']:.3f}", f"{line['top1']:.1%}")
        rows.append(cells + [f"{line['accuracy']:.0%}", pct(line["needle_kept"]), *text, f"{line['bytes_per_token']:,.0f}"])
    return markdown(header, rows)


def costs_table(result: dict[str, Any]) -> str:
    out = ["| document tokens | prefill (s) | KVzip repetition (s) | question pass (s) | 3 questions, recompressed each time | 3 questions, KVzip once |",
           "|---|---|---|---|---|---|"]
    for c in result["costs"].values():
        recompress = 3 * c["prefill_seconds"]
        once = c["prefill_seconds"] + c["repeat_seconds"] + 3 * c["question_seconds"]
        out.append(f"| {c['document_tokens']} | {c['prefill_seconds']:.1f} | {c['repeat_seconds']:.1f} | {c['question_seconds']:.2f} | {recompress:.1f} | {once:.1f} |")
    return "\n".join(out)


def profile_table(result: dict[str, Any]) -> str:
    """Where the question's attention goes: the needle's lift (mass share / slot share) per layer,
    averaged over KV heads and questions, for the last query (TOVA) and the window (SnapKV)."""
    profiles = result.get("profiles", [])
    if not profiles:
        return ""
    modes = [m for m in profiles[0] if m not in ("length", "depth")]
    layers = len(profiles[0][modes[0]]["lift"])
    header = ["layer", *[f"{m} lift" for m in modes], *[f"{m} heads ranking the needle in the top 12.5%" for m in modes]]
    return markdown(header, ([str(i), *[f"{mean(h for p in profiles for h in p[m]['lift'][i]):.1f}" for m in modes],
                              *[f"{mean(float(r < 0.125) for p in profiles for r in p[m]['rank'][i]):.0%}" for m in modes]]
                             for i in range(layers)))


def plot(result: dict[str, Any], path: Path) -> None:
    from .bench.common import figure

    lines = summary(result)
    with figure(path, panels=1, size=(7.5, 5)) as (ax,):
        for kind in sorted({(l["cache"], l["mode"]) for l in lines}):
            pts = sorted((l["bytes_per_token"], l["accuracy"]) for l in lines if (l["cache"], l["mode"]) == kind)
            label = kind[0] + (" (once, reused)" if kind[1] == "context" else "")
            ax.plot(*zip(*pts), marker="o", label=label, linestyle="--" if kind[1] == "context" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per token (allocated)")
        ax.set_ylabel("needles found")
        ax.set_title(f"{result['config']['model']}: needles found against memory")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, ncol=2)


def write(result: dict[str, Any], out: Path) -> None:
    c = result["config"]
    contexts = c["contexts"] if not isinstance(c["contexts"], dict) else ", ".join(f"{n} at {L}" for L, n in c["contexts"].items())
    head = (
        f"Needles in prose on {c['model']}: {contexts} contexts per length, {c['questions_per_context']} pass key(s) "
        f"each (depths {', '.join(map(str, c['depths']))}; one needle: the depth turns with the context), one question "
        f"per key; kept = share of the document's tokens; "
        f"KL / top-1 against the full cache over {c['text']['text_steps']} held-out tokens x {c['text']['text_samples']}.\n\n"
    )
    write_files(out, "eval", result, head + table(result) + "\n\nMeasured costs (first context of each length):\n\n"
                + costs_table(result) + "\n\n" + profile_table(result) + "\n", plot)
