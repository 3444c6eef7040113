"""MkDocs hook: benchmark tables come from ``benchmarks/results``, not typed by hand.

A line ``<!-- results: NAME.md -->`` in a page is replaced by the file
``benchmarks/results/NAME.md`` as the suite wrote it; a missing file fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- results: ([\w./-]+\.md) -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    def table(match: re.Match) -> str:
        path = RESULTS / match.group(1)
        if not path.is_file():
            raise FileNotFoundError(f"{page.file.src_path}: no benchmark result {path}")
        return path.read_text(encoding="utf-8")

    return MARKER.sub(table, markdown)


def on_files(files, config):
    """Plots, JSON and CSV under benchmarks/results are served at ``results/...``."""
    from mkdocs.structure.files import File

    for path in sorted(RESULTS.rglob("*")):
        if path.is_file() and path.suffix in (".png", ".json", ".csv"):
            uri = "results/" + path.relative_to(RESULTS).as_posix()
            files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files
