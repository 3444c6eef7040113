"""Before/after timings of two checkouts, side by side in one run.

    python tools/compare_trees.py OLD_TREE NEW_TREE [--suites update,decode,attention,bounded]
        [--rounds 1] [--out DIR]

Each tree needs its own virtual environment in ``TREE/.venv`` with kvcache installed from that
tree. For every suite the two trees run ``kvcache bench SUITE --quick`` in turn (old, new, then
new, old in the next round, so neither always runs first), and every row's timing is compared:
the median over rounds of the new tree's over the old tree's, as a speed ratio (> 1: the new tree
is faster). Rows are matched by their identifying fields (contender, shape, length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: The timing each suite reports per row, and whether a larger value is faster.
METRICS = {
    "update": ("us_per_token", False),
    "decode": ("tokens_per_s", True),
    "attention": ("ms", False),
    "bounded": ("tokens_per_s", True),
}

#: Fields of a row that are results, not identity.
RESULT_FIELDS = {"samples_us", "samples_s", "samples_ms", "peak_bytes", "final_bytes", "cache_bytes"}


def row_key(row: dict, metric: str) -> tuple:
    skip = RESULT_FIELDS | {metric}
    return tuple(
        (k, v)
        for k, v in sorted(row.items())
        if k not in skip and not k.startswith(("speedup", "identical", "bandwidth", "max_abs")) and not isinstance(v, (list, dict, float))
    )


def run_suite(tree: Path, suite: str, out: Path) -> list[dict]:
    exe = tree / ".venv" / "bin" / "kvcache"
    subprocess.run(
        [str(exe), "bench", suite, "--quick", "--out", str(out), "--no-progress"],
        check=True,
        cwd=tree,
        stdout=subprocess.DEVNULL,
    )
    return json.loads((out / f"{suite}.json").read_text())["rows"]


def compare(old: Path, new: Path, suite: str, rounds: int) -> list[tuple[str, float, float, float]]:
    metric, higher_is_faster = METRICS[suite]
    values: dict[str, dict[tuple, list[float]]] = {"old": {}, "new": {}}
    for r in range(rounds):
        order = [("old", old), ("new", new)] if r % 2 == 0 else [("new", new), ("old", old)]
        for name, tree in order:
            with tempfile.TemporaryDirectory() as tmp:
                for row in run_suite(tree, suite, Path(tmp)):
                    if metric in row:
                        values[name].setdefault(row_key(row, metric), []).append(float(row[metric]))
    out = []
    for key, olds in values["old"].items():
        news = values["new"].get(key)
        if not news:
            continue
        o, n = statistics.median(olds), statistics.median(news)
        speed = (n / o) if higher_is_faster else (o / n)
        label = ", ".join(f"{k}={v}" for k, v in key)
        out.append((label, o, n, speed))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--suites", default="update,decode,attention,bounded")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write the table as markdown here too")
    args = parser.parse_args(argv)
    lines = []
    for suite in args.suites.split(","):
        metric, _ = METRICS[suite]
        rows = compare(args.old, args.new, suite, args.rounds)
        speeds = [s for *_, s in rows]
        lines.append(f"\n### {suite} ({metric}; speed new/old > 1 is faster)\n")
        lines.append("| row | old | new | speed new/old |")
        lines.append("|---|---|---|---|")
        lines += [f"| {label} | {o:.4g} | {n:.4g} | {s:.2f}x |" for label, o, n, s in rows]
        if speeds:
            lines.append(
                f"| **median over {len(speeds)} rows** | | | **{statistics.median(speeds):.2f}x** "
                f"(min {min(speeds):.2f}x, max {max(speeds):.2f}x) |"
            )
        print("\n".join(lines[-(len(rows) + 4):]), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
