"""Run every test file in a process of its own, so that no file passes only thanks to another.

The main run (``python -m pytest``) shuffles every test of the suite together (pytest-randomly,
seed printed at the top); this catches the other half of order dependence: a file whose tests
need state that some other file left behind. Files run two at a time (the machines have 2
cores), each in random order with its own seed. Prints one line per file, then
``isolation: N passed, M failed`` over all tests; exits 1 if any file failed.

    python tools/test_each_file.py [--jobs 2] [tests/core/test_x.py ...]
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped)")


def run_file(path: Path) -> tuple[Path, int, dict[str, int], str, float]:
    start = time.perf_counter()
    seed = random.randrange(2**32)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "randomly", f"--randomly-seed={seed}",
         str(path.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True,
    )
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for n, what in COUNTS.findall(last):
        counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
    note = f"--randomly-seed={seed}"
    if proc.returncode != 0:
        note += "\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    return path, proc.returncode, counts, note, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="test files (default: every tests/**/test_*.py)")
    parser.add_argument("--jobs", type=int, default=2, help="files at a time (default: %(default)s)")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or sorted((ROOT / "tests").rglob("test_*.py"))
    totals = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    bad = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for path, rc, counts, note, seconds in pool.map(run_file, files):
            for k in totals:
                totals[k] += counts[k]
            # pytest exits 5 when a file collects no test; a file that is all skips is not a failure.
            ok = rc == 0 or (rc == 5 and not counts["failed"] and not counts["error"])
            status = "ok" if ok else f"FAILED (exit {rc})"
            print(f"{path.relative_to(ROOT)}: {status}, {counts['passed']} passed in {seconds:.0f} s; {note}", flush=True)
            if not ok:
                bad.append(path)
    failed = totals["failed"] + totals["error"] + (len(bad) if not (totals["failed"] + totals["error"]) else 0)
    print(f"isolation: {totals['passed']} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
