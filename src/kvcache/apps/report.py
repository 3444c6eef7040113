"""What the quality harnesses' reports share (``eval.py``, ``eval_plain.py``, ``eval_real_report.py``,
``eval_frontier.py``): means and shares, Markdown tables (the files: ``bench.common.write_files``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from .bench.common import markdown_table


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
    return markdown_table(header, [list(cells) for cells in rows]).removesuffix("\n")
