#!/usr/bin/env python3
"""Plot a staleness sweep: eval AUC and embedding bytes per sample against the bound.

    python -m trainer -m cache=lru consistency.pull_bound=0,1,4,16,64 hydra.sweep.dir=multirun/s
    python scripts/plot_sweep.py multirun/s --baseline runs/nocache/summary.json --out sweep.png

Reads every summary.json under the given directories, writes the PNG and prints one JSON line: the
points, the cheapest bound (fewest embedding bytes) whose eval AUC is within --auc-tol of the
bound-0 (BSP) run, and its byte saving against --baseline (a cache=none run) when given.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the repository root: this checkout's package, not another one installed
    sys.path.insert(0, ROOT)
from trainer.tools.sweep import find_summaries, load_points, plot, report  # noqa: E402


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
    a = ap.parse_args(argv)
    try:
        points = load_points(find_summaries(a.sweep), a.x, a.series)
        baseline = json.load(open(a.baseline)) if a.baseline else None
    except (OSError, KeyError, ValueError) as e:  # a missing or malformed summary, a key it lacks
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot(points, baseline, a.x, a.out, a.title, a.auc_tol)
    print(json.dumps({"png": a.out, **report(points, baseline, a.auc_tol)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
