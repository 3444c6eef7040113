"""Issue 43: more points on the items of an earlier task-family frontier (``kvcache eval --frontier
--tasks ...``). Runs the points on the same items, then prints per budget each one's answers found,
its paired difference from its twin and from the earlier run's best fixed mix.

    python benchmarks/families_rules.py FRONTIER_DIR OUT_DIR [POINTS] [EARLIER_OUT_DIR ...]

POINTS: points separated by ``;`` (``"auto,drop=4;adakv/int4h"``), or a named set: ``output`` (the
default: ``auto,rule=output;auto-heads,rule=output``), ``attention`` (``auto,rule=attention``),
``rotated`` (``snapkv/int4h;adakv/int4h;auto,codes=rotated;auto-heads,codes=rotated``). A point's
twin is the first that was run of: the point over plain codes (``adakv/int4`` for ``adakv/int4h``,
``auto,drop=4`` for ``auto,codes=rotated,drop=4``), the point without its last option
(``auto,tolerance=0.3`` for ``auto,tolerance=0.3,margin=0.01``), the kind alone. EARLIER_OUT_DIR:
earlier runs of this script on the same items, read for twins only.
"""

import json
import sys
from pathlib import Path

from kvcache.apps import eval_frontier, eval_frontier_report, frontier_points
from kvcache.apps.run_options import RunOptions

NAMED = {"output": "auto,rule=output;auto-heads,rule=output", "attention": "auto,rule=attention",
         "rotated": "snapkv/int4h;adakv/int4h;auto,codes=rotated;auto-heads,codes=rotated"}  # fmt: skip

base = json.loads((Path(sys.argv[1]) / "frontier.json").read_text())
c = base["config"]
out = Path(sys.argv[2])
asked = sys.argv[3] if len(sys.argv) > 3 else "output"
points = [p.strip() for p in NAMED.get(asked, asked).split(";") if p.strip()]
fixed = [p for p in points if "/" in p]
autos = tuple(p for p in points if "/" not in p)
if not (out / "frontier.json").exists():
    seeds = frontier_points.context_seeds(c)
    ((length, first),) = seeds.items()
    eval_frontier.run(RunOptions(out=out, progress=False), kinds=tuple(dict.fromkeys(p.split("/")[0] for p in fixed)),
                      storages=tuple(dict.fromkeys(p.split("/")[1] for p in fixed)), lengths=(length,), contexts=len(first),
                      first_context=first[0], budgets=tuple(c["budgets"]), tasks=tuple(c["tasks"]), split=c["split"],
                      autos=autos)  # fmt: skip
runs = list(base["runs"])
for folder in (out, *map(Path, sys.argv[4:])):
    runs += [r for r in json.loads((folder / "frontier.json").read_text())["runs"] if r["cache"] != "full"]
lines = eval_frontier_report.points_of(base)
every = eval_frontier_report.points_of({**base, "runs": runs})


def twin(point: str, budget: float) -> str:
    """The point ``point`` is compared with (see the module docstring)."""
    if "/" in point:
        return point[:-1] if point.endswith("h") else point
    kind, *options = point.split(",")
    plain = ",".join([kind, *(o for o in options if o != "codes=rotated")])
    shorter = ",".join([kind, *options[:-1]])
    return next((p for p in (plain, shorter) if p != point and eval_frontier_report.line_of(every, p, budget)), kind)


print(f"{c['split']}, {sum(len(v) for v in frontier_points.context_seeds(c).values())} seeds x {len(c['tasks'])} families")
print("| budget | point | found | twin | found | - twin (95%) | - best fixed mix (95%) |")
print("|---|---|---|---|---|---|---|")
for b in c["budgets"]:
    best = eval_frontier_report.best_fixed(lines, b)
    for point in points:
        other = twin(point, b)
        line, pair = eval_frontier_report.line_of(every, point, b), eval_frontier_report.line_of(every, other, b)
        diff = eval_frontier_report._difference(runs, (point, b), (other, b)) if pair and other != point else "-"
        found = f"{pair['accuracy']:.0%}" if pair else "not run"
        print(f"| {b:g} | {point} | {line['accuracy']:.0%} | {other} | {found} | {diff} | "
              f"{eval_frontier_report._difference(runs, (point, b), (best['point'], b))} ({best['point']} {best['accuracy']:.0%}) |")  # fmt: skip
