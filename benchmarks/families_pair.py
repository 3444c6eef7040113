"""Pair the points of frontier results run on the same items (other runs of `kvcache eval --frontier`
on the same seeds, families and lengths) and print each point's exact answers and its paired
difference from a reference point, with a 95% interval.

    python benchmarks/families_pair.py RESULT.json [RESULT.json ...] [--ref adakv/int4] [--points "full;auto,tolerance=0.3"]

The reference is taken at the same budget (the full cache has none). Only the items every point
answered are counted.
"""

from __future__ import annotations

import argparse
import collections
import json
import math


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="frontier.json files")
    p.add_argument("--ref", default="full", help="the point differences are taken from (default: full)")
    p.add_argument("--points", help="only these points, ';' between them (a point's name may hold commas; default: every point)")
    args = p.parse_args()
    wanted = None if args.points is None else set(args.points.split(";")) | {args.ref}
    by: dict[tuple[str, float | None], dict[tuple, bool]] = collections.defaultdict(dict)
    for path in args.results:
        with open(path) as f:
            for r in json.load(f)["runs"]:
                if wanted is not None and r["cache"] not in wanted:
                    continue
                by[(r["cache"], r.get("budget"))][(r.get("family"), r["context"], r["length"], r.get("depth"))] = r["correct"]
    common = set.intersection(*(set(v) for v in by.values()))
    print(f"{len(common)} items answered by every point; differences from {args.ref}")
    for (cache, budget), answers in sorted(by.items(), key=lambda x: (-(x[0][1] or 1), x[0][0])):
        ref = by.get((args.ref, None if args.ref == "full" else budget))
        if ref is None:
            continue
        d = [answers[k] - ref[k] for k in common]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else 0.0
        found = sum(answers[k] for k in common) / len(common)
        print(f"{cache:32s} {budget!s:7s} {found:6.1%}  {100 * mean:+6.1f} ± {196 * sd / math.sqrt(len(d)):.1f} pts")


if __name__ == "__main__":
    main()
