"""The suite's report of its slowest files (printed at the end of every run by ``conftest.py``)."""

from __future__ import annotations


def slowest_files(reports, count: int = 10) -> list[tuple[str, float]]:
    """The ``count`` test files that took longest: seconds summed over their tests' set-up, call and
    tear-down (``reports``: pytest's test reports, from every worker)."""
    seconds: dict[str, float] = {}
    for report in reports:
        path = report.nodeid.split("::", 1)[0]
        seconds[path] = seconds.get(path, 0.0) + getattr(report, "duration", 0.0)
    return sorted(seconds.items(), key=lambda item: -item[1])[:count]
