"""No module of the library or its applications grows past ``MOST_LINES``: a file that long holds
more than one idea (docs/architecture.md keeps one idea a module)."""

from pathlib import Path

import kvcache

MOST_LINES = 450


def test_no_source_file_is_over_the_limit():
    package = Path(kvcache.__file__).parent
    long = {
        str(path.relative_to(package)): n
        for path in sorted(package.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"files over {MOST_LINES} lines (split each by idea): {long}"
