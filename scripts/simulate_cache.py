"""Replay an id trace through the trainer's cache + consistency code for W simulated workers; print
one JSON line (pulls, pushes, bytes, hit rate, Belady OPT hit rate). Progress goes to stderr.

    python scripts/simulate_cache.py --workers 8 --steps 200 data=criteo_like cache=lru \\
        consistency=ssp consistency.pull_bound=4
    python scripts/simulate_cache.py --workers 2 data=criteo data.dir=DIR cache=lfu
    python scripts/simulate_cache.py --workers 1 --trace ids.npz cache=lru    # W=1: a parameter server
    python scripts/simulate_cache.py --workers 4 --trace ids.txt --batch 1024 cache=lfu_pinned
    python scripts/simulate_cache.py --workers 8 data=criteo_like cache=lru placement=fae  # replicated rows
    python scripts/simulate_cache.py --workers 8 --steps 40 data=criteo_like cache=lru schedule=herald

Placements (placement=fae|sca) are planned as a run would plan them (profile + planner for this W)
and replayed through the run's own feed: replicated rows leave the protocol, bytes gain `replica`
(the allreduce of the rows each step touches). schedule=herald (or --schedule-baseline for the
naive counts alone) runs Herald's partition and on-demand sync planner instead of the cache replay
and prints pulls / pushes against the naive baseline (random partition, sync every update).

Positional arguments are Hydra overrides of `python -m trainer` (cache=..., consistency=...,
cache.capacity_fraction=..., data=...). Semantics, trace formats and the exact OPT definition
follow trainer/tools/simulate.py's docstring.
"""
from __future__ import annotations

import argparse
import json
import sys

from trainer.tools import simulate as sim
from trainer.tools.cli import exit_status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__ + "\n" + (sim.__doc__ or ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=criteo_like cache=lru")
    p.add_argument("--workers", "-W", type=int, default=2, help="simulated workers W (default 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps to replay (default: the whole trace file, else train.steps)")
    p.add_argument("--owners", choices=("auto",) + sim.OWNERS, default="auto",
                   help="sharded: worker g mod W owns row g (the trainer); server: a parameter "
                        "server outside the workers owns every row (HET's setting); auto "
                        "(default): sharded when W > 1, server when W = 1")
    p.add_argument("--trace", default=None, help=".npz (ids [S, B, T], optional table_rows [T]) or "
                                                 "text file (one sample of T ids per line)")
    p.add_argument("--batch", type=int, default=None, help="text trace: global samples per step")
    p.add_argument("--per-table", action="store_true", help="add per_table counters")
    p.add_argument("--opt-bypass", action="store_true",
                   help="also report opt_bypass_hit_rate (MIN that may leave a miss uncached)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--schedule-baseline", action="store_true",
                   help="with schedule=random: count the naive pulls/pushes of the sync planner")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log = None if a.quiet else sys.stderr

    def run() -> None:
        if a.schedule_baseline or any(o.replace(" ", "") == "schedule=herald" for o in a.overrides):
            cfg = sim.compose_config(a.overrides)
            steps = a.steps if a.steps is not None else cfg.train.steps
            if steps <= 0 or a.workers <= 0:
                raise sim.TraceError(f"--steps {steps} / --workers {a.workers}: must be > 0")
            print(json.dumps(sim.simulate_schedule(cfg, a.workers, steps, log)))
            return
        trace, spec, cfg = sim.build(a.overrides, a.workers, a.owners, a.trace, a.batch, sys.stderr)
        steps = sim.resolve_steps(trace, cfg, a.steps, sys.stderr)
        if log is not None:
            print(f"simulate: W={spec.workers} owners={spec.owners} policy={spec.policy} "
                  f"capacity={sum(spec.capacities)} rows/worker, {steps} steps of "
                  f"{trace.global_batch} samples ({trace.description})", file=log, flush=True)
        print(json.dumps(sim.simulate(trace, spec, steps, a.per_table, a.opt_bypass, log)))
    return exit_status(run)


if __name__ == "__main__":
    sys.exit(main())
