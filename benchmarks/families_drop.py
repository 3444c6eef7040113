"""Issue 43: the task-family frontier with `auto`'s ``drop`` weight at several values, beside the
full cache, every fixed mix and the default `auto` kinds, on one split and length. Tune ``drop``
here on the tuned split; then run the value chosen on the held-out items with
``benchmarks/families_rules.py``.

    python benchmarks/families_drop.py SPLIT LENGTH CONTEXTS OUT_DIR [DROP,...]   (default 2,4,8,16)
"""

import sys
from pathlib import Path

from kvcache.apps import eval_frontier, eval_frontier_report, frontier_points
from kvcache.apps.families import FAMILIES
from kvcache.apps.run_options import RunOptions

split, length, contexts, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
drops = [float(d) for d in (sys.argv[5] if len(sys.argv) > 5 else "2,4,8,16").split(",")]
tasks = tuple(t for t in FAMILIES if t in ("needle-digits", "needle-words", "needle-mixed", "turn"))
autos = (*frontier_points.AUTO, *(f"auto,drop={d:g}" for d in drops))
result = eval_frontier.run(RunOptions(out=out, progress=False), lengths=(length,), contexts=contexts, budgets=(0.25, 0.125, 0.0625),
                           tasks=tasks, split=split, autos=autos)  # fmt: skip
lines = eval_frontier_report.points_of(result)
print(f"{split}, {contexts} seeds x {len(tasks)} families at {length}")
print("| budget | point | found | - full cache (95%) | - auto (95%) | - best fixed mix (95%) |")
print("|---|---|---|---|---|---|")
for b in result["config"]["budgets"]:
    best = eval_frontier_report.best_fixed(lines, b)
    for point in autos:
        line = eval_frontier_report.line_of(lines, point, b)
        diff = lambda other: eval_frontier_report._difference(result["runs"], (point, b), other)  # noqa: E731
        print(f"| {b:g} | {point} | {line['accuracy']:.0%} | {diff(('full', None))} | {diff(('auto', b))} | "
              f"{diff((best['point'], b))} ({best['point']}) |")
