"""The report of suite ``memory``: its Markdown table and its two-panel plot.

:func:`table` gives one row per contender (peak RSS above the baseline, peak RSS over the bytes the
tokens need, peak and final cache bytes in MiB, reallocations, spikes, seconds) with notes on how
each was counted; :func:`plot` draws the cache bytes held and the process's peak RSS per sample
window against the tokens appended. Both read the result :func:`kvcache.apps.bench.memory.run` returns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import figure, human_bytes, markdown_table


def mib(n: float) -> str:
    """``n`` bytes for the table: in MiB from 16 MiB up, else in the unit that suits."""
    return human_bytes(n) if abs(n) < 16 * 2**20 else f"{n / 2**20:,.0f} MiB"


def table(result: dict[str, Any]) -> str:
    c = result["config"]
    header = [
        "contender",
        "tokens",
        "peak RSS above baseline",
        "peak RSS / bytes of T tokens",
        "peak cache bytes",
        "final cache bytes",
        "reallocations",
        "spikes",
        "seconds",
    ]
    body = [
        [
            r["contender"] + (" *" if r["counts_extrapolated"] else ""),
            r["tokens"],
            mib(r["peak_rss_bytes"]),
            r["peak_rss_over_needed"],
            mib(r["peak_cache_bytes"]),
            mib(r["final_cache_bytes"]),
            r["reallocations"],
            r["spikes"],
            r["seconds"],
        ]
        for r in result["rows"]
    ]
    notes = (
        f"\n{c['model']}; one token appended to every layer per step; T tokens need {mib(c['needed_bytes'])}. "
        f"Reallocations are summed over the {c['layers']} layers (first allocation included); spikes are steps in "
        "which any layer allocated. Peak RSS: the kernel's high-water mark in a fresh process per contender, minus "
        "its RSS before the run; buffer capacity never written is not resident, so it can be below the cache bytes.\n"
    )
    if any(r["counts_extrapolated"] for r in result["rows"]):
        stepped = next(r["stepped_tokens"] for r in result["rows"] if r["counts_extrapolated"])
        notes += (
            f"\n\\* concat was stepped one token at a time for {stepped} of its tokens (the last {c['window']} before each of "
            f"{c['checkpoints']} checkpoints, T included) and brought between them by one chunk append, since stepping "
            "all of them copies O(T²) bytes. Each stepped append reallocated every layer, so its counts are T per layer "
            "and T spikes; its seconds are not comparable.\n"
        )
    return markdown_table(header, body) + notes


def plot(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    unit = 2**20
    with figure(path, panels=2, size=(6.5, 4.5)) as (held, rss):
        for r in result["rows"]:
            # concat is sampled at few points (see the docstring): dashed with markers, on top.
            style = dict(linestyle="--", marker="o", markersize=3, zorder=3) if r["counts_extrapolated"] else {}
            xs, ys = zip(*r["bytes_curve"])
            held.plot(xs, [y / unit for y in ys], label=r["contender"], **style)
            pts = [(t, peak) for t, _, _, peak in r["samples"]]
            rss.plot([t for t, _ in pts], [p / unit for _, p in pts], label=r["contender"], **style)
        for ax, ylabel, title in (
            (held, "MiB of storage held by the cache", "Cache bytes held"),
            (rss, "MiB above baseline (peak per sample window)", "Process RSS"),
        ):
            ax.set_xlabel("tokens appended")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title}: {c['layers']} layers x {c['kv_heads']}x{c['head_dim']} {c['dtype']}")
            ax.grid(True, alpha=0.3)
            ax.legend()
