"""Issue 43: codes of rotated keys and values (``int4h``, ``codes=rotated``) on the items of an
earlier task-family frontier (``kvcache eval --frontier --tasks ...``, which ran plain codes). Runs
the rotated points, then prints per budget each one's answers found, its paired difference from its
plain twin (``adakv/int4h`` against ``adakv/int4``, ``auto,codes=rotated`` against ``auto``) and
from the earlier run's best fixed mix (plain codes).

    python benchmarks/families_rotated.py FRONTIER_DIR OUT_DIR [POINT;POINT...]

Default points: ``snapkv/int4h;adakv/int4h;auto,codes=rotated;auto-heads,codes=rotated``.
"""

import json
import sys
from pathlib import Path

from kvcache.apps import eval_frontier
from kvcache.apps.run_options import RunOptions

base = json.loads((Path(sys.argv[1]) / "frontier.json").read_text())
c = base["config"]
out = Path(sys.argv[2])
asked = sys.argv[3] if len(sys.argv) > 3 else "snapkv/int4h;adakv/int4h;auto,codes=rotated;auto-heads,codes=rotated"
points = [p.strip() for p in asked.split(";") if p.strip()]
fixed = [p for p in points if "/" in p]
autos = tuple(p for p in points if "/" not in p)
if not (out / "frontier.json").exists():
    seeds = eval_frontier.context_seeds(c)
    ((length, first),) = seeds.items()
    eval_frontier.run(RunOptions(out=out, progress=False), kinds=tuple(dict.fromkeys(p.split("/")[0] for p in fixed)),
                      storages=tuple(dict.fromkeys(p.split("/")[1] for p in fixed)), lengths=(length,), contexts=len(first),
                      first_context=first[0], budgets=tuple(c["budgets"]), tasks=tuple(c["tasks"]), split=c["split"],
                      autos=autos)  # fmt: skip
new = json.loads((out / "frontier.json").read_text())
lines = eval_frontier.points_of(base)
runs = base["runs"] + [r for r in new["runs"] if r["cache"] != "full"]
every = eval_frontier.points_of({**base, "runs": runs})


def twin(point: str) -> str:
    """The plain-codes point a rotated one is compared with."""
    if "/" in point:
        return point[:-1] if point.endswith("h") else point
    return ",".join(o for o in point.split(",") if o != "codes=rotated")


print(f"{c['split']}, {sum(len(v) for v in eval_frontier.context_seeds(c).values())} seeds x {len(c['tasks'])} families")
print("| budget | point | found | plain twin | found | - plain twin (95%) | - best fixed mix, plain (95%) |")
print("|---|---|---|---|---|---|---|")
for b in c["budgets"]:
    best = eval_frontier.best_fixed(lines, b)
    for point in points:
        line, other = eval_frontier.line_of(every, point, b), eval_frontier.line_of(every, twin(point), b)
        diff = eval_frontier._difference(runs, (point, b), (twin(point), b)) if other else "-"
        found = f"{other['accuracy']:.0%}" if other else "not run"
        print(f"| {b:g} | {point} | {line['accuracy']:.0%} | {twin(point)} | {found} | {diff} | "
              f"{eval_frontier._difference(runs, (point, b), (best['point'], b))} ({best['point']} {best['accuracy']:.0%}) |")  # fmt: skip
