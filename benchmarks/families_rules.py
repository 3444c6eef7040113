"""Issue 43: `auto`'s rules on the same task-family items. Runs another rule's points (``output``:
``auto,rule=output`` and ``auto-heads,rule=output``; ``attention``: ``auto,rule=attention``, which
``auto-heads`` does not take; no fixed mix) on the items of an earlier family frontier
(``kvcache eval --frontier --tasks ...``, which ran the ``mass`` rule), then prints per budget each
point's answers found and its paired difference from the ``mass`` rule and from the best fixed mix
of that run.

    python benchmarks/families_rules.py FRONTIER_DIR OUT_DIR [RULE]   (RULE: output, the default, or attention)

RULE may also be points separated by ``;`` (``"auto,drop=4;auto,drop=8"``), each paired with its
kind's default point.
"""

import json
import sys
from pathlib import Path

from kvcache.apps import eval_frontier
from kvcache.apps.run_options import RunOptions

base = json.loads((Path(sys.argv[1]) / "frontier.json").read_text())
c = base["config"]
out = Path(sys.argv[2])
rule = sys.argv[3] if len(sys.argv) > 3 else "output"
named = {"output": ("auto,rule=output", "auto-heads,rule=output"), "attention": ("auto,rule=attention",)}
autos = named[rule] if rule in named else tuple(p.strip() for p in rule.split(";") if p.strip())
if not (out / "frontier.json").exists():
    seeds = eval_frontier.context_seeds(c)
    (length, first), = ((L, s) for L, s in seeds.items())
    eval_frontier.run(RunOptions(out=out, progress=False), kinds=(), lengths=(length,), contexts=len(first), first_context=first[0],
                      budgets=tuple(c["budgets"]), tasks=tuple(c["tasks"]), split=c["split"],
                      autos=autos)  # fmt: skip
new = json.loads((out / "frontier.json").read_text())
runs = base["runs"] + [r for r in new["runs"] if r["cache"] != "full"]
lines = eval_frontier.points_of({**base, "runs": runs})
print(f"{c['split']}, {sum(len(v) for v in eval_frontier.context_seeds(c).values())} seeds x {len(c['tasks'])} families")
print("| budget | point | found | - same kind, mass rule (95%) | - best fixed mix (95%) |")
print("|---|---|---|---|---|")
for b in c["budgets"]:
    best = eval_frontier.best_fixed(lines, b)
    for point in ("auto", "auto-heads", *autos):
        line = eval_frontier.line_of(lines, point, b)
        same = eval_frontier._difference(runs, (point, b), (point.split(",")[0], b)) if "," in point else "-"
        print(f"| {b:g} | {point} | {line['accuracy']:.0%} | {same} | {eval_frontier._difference(runs, (point, b), (best['point'], b))} ({best['point']}) |")
