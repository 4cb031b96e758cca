#!/usr/bin/env python3
"""Plot a staleness sweep: eval AUC and embedding bytes per sample against the bound.

    python -m trainer -m cache=lru consistency.pull_bound=0,1,4,16,64 hydra.sweep.dir=multirun/s
    python scripts/plot_sweep.py multirun/s --baseline runs/nocache/summary.json --out sweep.png

Reads the summary.json of every job of the given sweeps, writes the PNG and prints one JSON line: the
points, the cheapest bound (fewest embedding bytes) whose eval AUC is within --auc-tol of the
bound-0 (BSP) run, and its byte saving against --baseline (a cache=none run) when given.
A sweep with jobs that have no summary.json (failed, or never run) is refused, naming them,
unless --allow-missing: then the plot and the choice use the jobs there are, and the JSON line
lists the missing ones (`missing`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the repository root: this checkout's package, not another one installed
    sys.path.insert(0, ROOT)
from trainer.tools.sweep import find_jobs, load_points, plot, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", nargs="+", help="sweep directories (or summary.json files)")
    ap.add_argument("--out", default="sweep.png", help="PNG to write (default: sweep.png)")
    ap.add_argument("--x", default="consistency.pull_bound", help="swept config key (dotted)")
    ap.add_argument("--series", default=None, help="config key splitting the points into lines, "
                                                   "e.g. cache.policy")
    ap.add_argument("--baseline", default=None, help="summary.json of a cache=none run")
    ap.add_argument("--auc-tol", type=float, default=0.002, help="AUC tolerance against bound 0")
    ap.add_argument("--title", default="")
    ap.add_argument("--allow-missing", action="store_true",
                    help="plot and choose from the jobs that have a summary when others have none")
    a = ap.parse_args(argv)
    try:
        found, missing = find_jobs(a.sweep)
        points = load_points(found, a.x, a.series)
        baseline = json.load(open(a.baseline)) if a.baseline else None
    except (OSError, KeyError, ValueError) as e:  # a missing or malformed summary, a key it lacks
        print(f"error: {e}", file=sys.stderr)
        return 2
    for job in missing:
        print(f"[plot_sweep] no summary.json: {job.describe()}", file=sys.stderr)
    if missing and not a.allow_missing:
        print(f"error: the sweep is incomplete: {len(missing)} of {len(missing) + len(found)} jobs have no "
              f"summary.json ({'; '.join(j.describe() for j in missing)}); rerun them, or pass "
              f"--allow-missing to plot the {len(found)} there are", file=sys.stderr)
        return 2
    plot(points, baseline, a.x, a.out, a.title, a.auc_tol)
    extra = {"missing": [{"sweep": j.sweep, "num": j.num, "overrides": j.overrides, "error": j.error}
                         for j in missing]} if missing else {}
    print(json.dumps({"png": a.out, **report(points, baseline, a.auc_tol), **extra}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
