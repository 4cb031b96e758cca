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

import sys

from trainer.tools.sweep import main  # the installed `hybrid-trainer-plot-sweep`

if __name__ == "__main__":
    sys.exit(main())
