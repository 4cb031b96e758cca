"""benchmarks/bench_cache.py: the cache bookkeeping's CPU time per step, through the simulator at the
run's row width. The width must not change what the simulator counts (so the benchmark times the
work the simulator reports), and the script must give its line and refuse bad input."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.sparse.sim import CacheSimulator
from trainer.tools import simulate as sim_tools

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = [sys.executable, "-m", "benchmarks.bench_cache"]  # run from ROOT, as documented
SMALL = ["data=bench", "data.max_table_rows=3000", "data.batch_size=256", "cache=lfu", "consistency=ssp",
         "consistency.pull_bound=2", "consistency.push_bound=2", "cache.capacity_fraction=0.05"]


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_row_width_changes_nothing_the_simulator_counts(policy):
    """Rows of width 16 (the benchmark's) against the simulator's width 1: the same hits, pulls,
    pushes, evictions and staleness, step by step, with evictions happening."""
    trace, spec, _ = sim_tools.build(SMALL + [f"cache={policy}"], 2, log=None)
    runs = [CacheSimulator(spec), CacheSimulator(spec, row_width=16)]
    for s in range(12):
        batches = [trace.batch(s, w) for w in range(2)]
        for sim in runs:
            sim.step(batches)
        narrow, wide = (sim.stats.all.clone() for sim in runs)
        assert narrow.equal(wide), s
    assert int(runs[0].stats.t["evicted_dirty"].sum()) > 0  # the caches were full and evicting
    assert runs[0].staleness.hist.equal(runs[1].staleness.hist)
    assert runs[1].workers[0].cache.rows.shape[1] == 16


def test_prints_one_line_with_its_timings():
    proc = subprocess.run([*BENCH, "--steps", "6", "--warmup", "2", *SMALL],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    x = json.loads(lines[0])
    assert x["bench"] == "cache" and x["workers"] == 2 and x["dim"] == 16 and x["steps"] == 6
    assert x["overrides"][-1] == "cache.capacity_fraction=0.05"
    assert x["read_ms"] > 0 and x["write_ms"] > 0
    assert x["total_ms"] == pytest.approx(x["read_ms"] + x["write_ms"], abs=2e-3)
    assert 0 < x["hit_rate"] < 1 and x["pushed_rows_per_step"] > 0
    assert "step 6/6" in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["cache=none"], "no cache bookkeeping"),
    (["--workers", "1"], "needs 2 or more"),
    (["--steps", "4", "--warmup", "4"], "below --steps"),
    (["foo"], "not key=value"),
    (["cache=fifo"], "cache"),
])
def test_bad_input_is_refused(args, message):
    proc = subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", proc.stderr[-2000:]
