"""What the quality harnesses' reports share (``eval.py``, ``eval_plain.py``, ``eval_real_report.py``,
``eval_frontier_report.py``): means and shares, Markdown tables, and the files each one writes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def mean(xs: Iterable[float]) -> float:
    """The mean of ``xs`` (booleans count as 0 and 1); NaN when there are none."""
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def pct(x: float | None) -> str:
    """A share as a whole percentage; ``-`` when there is none (None or NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0%}"


def tokens_label(length: int) -> str:
    """A context length as a column head: ``4K`` for whole multiples of 1024 tokens, else the count."""
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def markdown(header: list[str], rows: Iterable[list[str]]) -> str:
    """A Markdown table of text cells (``bench.common.markdown_table``), without its last newline."""
    from .bench.common import markdown_table

    return markdown_table(header, [list(cells) for cells in rows]).removesuffix("\n")


def write_files(out: Path, name: str, result: dict[str, Any], text: str,
                plot: Callable[[dict[str, Any], Path], None] | None = None) -> None:  # fmt: skip
    """``name.json`` (the result), ``name.md`` (``text``) and, when ``plot`` is given and matplotlib
    is installed, ``name.png`` in folder ``out`` (made if missing)."""
    from .bench.common import can_plot

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(text)
    if plot is not None and can_plot():
        plot(result, out / f"{name}.png")
