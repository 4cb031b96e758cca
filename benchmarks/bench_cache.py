"""CPU cost of the HET cache's bookkeeping per step, without communication: one JSON line.

The end-to-end benchmark (benchmarks/bench_net.py) moves by +-5% (+-2 ms of a ~40 ms step) from run
to run on a shared machine, more than most changes to the cache's own work are worth; this one
moves by a few tenths of a millisecond. It runs W simulated workers in one
process through the simulator's in-process wire (trainer/sparse/sim/: the very HetRemote and RowCache of a
training run, rows of the run's width d, the owners answered at once from one version array) and
times each worker's read (cache lookup, version check, install with evictions, the workspace
fill, the push announcement) and write (local updates, due pushes). Batches are made before the
clock starts; the first --warmup steps (the cache filling up) are not timed.

    python -m benchmarks.bench_cache                                   # the bench workload, cache ssp
    python -m benchmarks.bench_cache --steps 300 cache=lru consistency=bsp
    python -m benchmarks.bench_cache cache.capacity_fraction=0.05 model.embedding_dim=64

Positional arguments are trainer overrides on top of the defaults below (the same key replaces the
default's). The line: read_ms and write_ms per worker and step, their sum, the cache hit rate and
the rows pushed per worker and step over the timed steps (the last two say the work was the same
when two trees are compared). Compare two versions of the code by running each tree's copy of this
script, alternating, on an otherwise idle machine.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from trainer.sparse.sim import CacheSimulator
from trainer.tools import simulate as sim_tools
from trainer.tools.cli import bad_input, input_errors

from benchmarks.phases import Timers

DEFAULTS = ["data=bench", "model.embedding_dim=16", "cache=lfu", "consistency=ssp",
            "consistency.pull_bound=4", "consistency.push_bound=4"]  # bench_net.py's cache ssp


def merged(overrides: list[str]) -> list[str]:
    """DEFAULTS with each override replacing the default of the same key (Hydra refuses a key
    given twice)."""
    out = {o.split("=", 1)[0]: o for o in DEFAULTS}
    for o in overrides:
        if "=" not in o:
            raise ValueError(f"override {o!r} is not key=value")
        out[o.split("=", 1)[0]] = o
    return list(out.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_cache", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=160, help="steps in all (default 160)")
    ap.add_argument("--warmup", type=int, default=40, help="first steps not timed (default 40)")
    ap.add_argument("--workers", type=int, default=2, help="simulated workers W (default 2)")
    ap.add_argument("overrides", nargs="*", help="trainer overrides (key=value)")
    a = ap.parse_intermixed_args(argv)
    if a.workers < 2:
        ap.error(f"--workers {a.workers}: needs 2 or more (with one worker no row is remote)")
    if not 0 <= a.warmup < a.steps:
        ap.error(f"--warmup {a.warmup} must be >= 0 and below --steps {a.steps}")
    try:
        overrides = merged(a.overrides)
        trace, spec, cfg = sim_tools.build(overrides, a.workers, log=None)
    except input_errors() as exc:  # the tool scripts' bad input (TraceError is a ValueError)
        return bad_input(exc)
    if spec.policy == "none":
        print("error: cache=none has no cache bookkeeping to time", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    dim = cfg.model.embedding_dim
    sim = CacheSimulator(spec, row_width=dim)
    print(f"[bench_cache] making {a.steps} steps of batches for {a.workers} workers", file=sys.stderr, flush=True)
    batches = [[trace.batch(s, w) for w in range(a.workers)] for s in range(a.steps)]
    timers = Timers()  # the phase timers of bench_net --phases, around each worker's read and write
    for p in sim.workers:
        p.read, p.write = timers.wrap("read", p.read), timers.wrap("write", p.write)
    stats = sim.stats.t
    for s in range(a.steps):
        if s == a.warmup:  # the warm-up's time and counts are left out
            timers.seconds.clear()
            hits0, req0, pushed0 = (int(stats[k].sum()) for k in ("hits", "requested", "pushed_rows"))
        sim.step(batches[s])
        if (s + 1) % max(1, a.steps // 4) == 0:
            print(f"[bench_cache] step {s + 1}/{a.steps}", file=sys.stderr, flush=True)
    n = a.workers * (a.steps - a.warmup)
    hits, req, pushed = (int(stats[k].sum()) for k in ("hits", "requested", "pushed_rows"))
    read, write = 1e3 * timers.seconds["read"] / n, 1e3 * timers.seconds["write"] / n
    print(json.dumps({"bench": "cache", "overrides": overrides, "workers": a.workers, "dim": dim,
                      "steps": a.steps, "warmup": a.warmup, "read_ms": round(read, 3),
                      "write_ms": round(write, 3), "total_ms": round(read + write, 3),
                      "hit_rate": round((hits - hits0) / max(req - req0, 1), 4),
                      "pushed_rows_per_step": round((pushed - pushed0) / n, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
