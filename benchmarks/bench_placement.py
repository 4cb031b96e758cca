"""Issue 7's targets, simulated (no training): one JSON line of figures.

    python -m benchmarks.bench_placement                      # W=8, criteo_like, 40 steps, LRU caches
    python -m benchmarks.bench_placement --workers 16 --steps 20 --fae-budget 262144

For BSP and SSP (consistency=ssp) it replays the same steps for: the cache alone (cache=lru,
placement=none), FAE + cache (placement=fae, budget --fae-budget), and the planner (placement=sca,
budget = FAE's + the configured cache's bytes, so FAE's exact configuration is one of its
candidates); then Herald (schedule=herald) against the naive baseline (random partition, sync every
update). Embedding bytes per global sample by the trainer's own byte formulas (trainer/tools/simulate.py).
Progress on stderr.

--measure instead trains (W = 2 gloo processes under torchrun, `--measure-steps` steps, global
batch 4,096) cache alone, FAE + cache and SCA at BSP and SSP and reports the measured embedding
bytes per sample and SCA's predicted_vs_measured from each run's summary.json. --consistency bsp
(or ssp) compares at that mode alone. Bad input (a data preset that does not exist, a count <= 0) is
one `error: ...` line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from trainer.base.config import cache_capacities
from trainer.sparse.placement.sca import slot_bytes
from trainer.tools import simulate as sim
from trainer.tools.cli import bad_input, input_errors
from dev.launch import ROOT, check_trainer, run_trainer, trainer_command


def _bytes_per_sample(overrides: list[str], workers: int, steps: int) -> dict:
    trace, spec, cfg = sim.build(overrides, workers, "sharded", log=None)
    out = sim.simulate(trace, spec, steps)
    return {"bytes_per_sample": out["bytes_per_sample"], "hit_rate": out["hit_rate"],
            "replicated_rows": int(spec.hot.size), "seconds": out["seconds"],
            "by_kind": {k: v / (steps * trace.global_batch) for k, v in out["bytes"].items() if k != "total"}}


def _train(overrides: list[str], out: str, world: int) -> dict:
    """One torchrun training run; its summary.json."""
    return run_trainer(trainer_command(world, ["train.progress=off", f"hydra.run.dir={out}", *overrides],
                                       "torchrun"), out, cwd=ROOT)


KINDS = ("ids", "versions", "rows", "grads", "replica")  # the embedding bytes of a run's summary


def plan_runs(a: argparse.Namespace) -> tuple[list[str], int, dict[str, dict[str, list[str]]]]:
    """(the overrides every run shares, the configured cache's bytes per worker, {consistency:
    {run name: its overrides}}), each run's config composed and checked here, before any runs:
    bad input (a data preset that does not exist, a count <= 0) raises (trainer.tools.cli.input_errors)."""
    for name in ("workers", "steps", "herald_steps", "measure_steps", "plan_steps"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0")
    base = [f"data={a.data}", "cache=lru", f"placement.plan_steps={a.plan_steps}"]
    base += (["data.global_batch_size=4096", "data.test_samples=4096", f"train.steps={a.measure_steps}"]
             if a.measure else [f"train.steps={a.steps}"])
    cfg = sim.compose_config(base)
    cache_bytes = sum(cache_capacities(cfg)) * slot_bytes(cfg.model.embedding_dim)
    runs = {cons: {"cache": [f"consistency={cons}"],
                   "fae+cache": [f"consistency={cons}", "placement=fae", f"placement.budget_bytes={a.fae_budget}"],
                   # FAE's budget and the cache's bytes: FAE's exact configuration is one of SCA's candidates
                   "sca": [f"consistency={cons}", "placement=sca", f"placement.budget_bytes={a.fae_budget + cache_bytes}"]}
            for cons in a.consistency}
    for named in runs.values():
        for extra in named.values():
            if a.measure:
                check_trainer(2, base + extra, "torchrun")
            else:
                sim.compose_config(base + extra)
    return base, cache_bytes, runs


def measure(a: argparse.Namespace, base: list[str], runs: dict[str, dict[str, list[str]]]) -> dict:
    import tempfile
    out: dict = {"workers": 2, "steps": a.measure_steps, "data": a.data, "plan_steps": a.plan_steps}
    with tempfile.TemporaryDirectory() as tmp:
        for cons, named in runs.items():
            row = {}
            for name, extra in named.items():
                print(f"bench_placement: measure {cons} {name} ...", file=sys.stderr, flush=True)
                s = _train(base + extra, os.path.join(tmp, f"{cons}-{name}"), 2)
                samples = a.measure_steps * 4096
                row[name] = {"bytes_per_sample": sum(s["bytes"].get(k, 0) for k in KINDS) / samples,
                             "predicted_vs_measured": s.get("placement", {}).get("predicted_vs_measured")}
            row["sca_vs_fae"] = row["sca"]["bytes_per_sample"] / row["fae+cache"]["bytes_per_sample"]
            out[cons] = row
    return out


def simulated(a: argparse.Namespace, base: list[str], cache_bytes: int, runs: dict[str, dict[str, list[str]]]) -> dict:
    out: dict = {"workers": a.workers, "steps": a.steps, "data": a.data, "fae_budget_bytes": a.fae_budget,
                 "cache_bytes_per_worker": cache_bytes}
    for cons, named in runs.items():
        got = {}
        for name, extra in named.items():
            print(f"bench_placement: {cons} {name} ...", file=sys.stderr, flush=True)
            got[name] = _bytes_per_sample(base + extra, a.workers, a.steps)
        c, f, s = (got[k]["bytes_per_sample"] for k in ("cache", "fae+cache", "sca"))
        out[cons] = {**got, "fae+cache_vs_cache": f / c, "sca_vs_fae": s / f, "sca_vs_cache": s / c}
    print("bench_placement: herald ...", file=sys.stderr, flush=True)
    cfg = sim.compose_config(base + ["schedule=herald"])
    h = sim.simulate_schedule(cfg, a.workers, a.herald_steps, sys.stderr)
    out["herald"] = {k: h[k] for k in ("steps", "pulls", "pushes", "naive_remote_reads", "pulls_vs_naive",
                                       "pushes_vs_naive", "remote_reads", "random_remote_reads", "seconds")}
    out["targets"] = {"herald_pulls_le_0.52": h["pulls_vs_naive"] <= 0.52,
                      "herald_pushes_le_0.42": h["pushes_vs_naive"] <= 0.42}
    for cons in runs:
        out["targets"].update({f"fae+cache_below_cache_{cons}": out[cons]["fae+cache_vs_cache"] < 1,
                               f"sca_no_worse_than_fae_{cons}": out[cons]["sca_vs_fae"] <= 1})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_placement",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", "-W", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--data", default="criteo_like")
    p.add_argument("--consistency", nargs="+", choices=("bsp", "ssp"), default=["bsp", "ssp"],
                   help="the consistency modes compared (default: both)")
    p.add_argument("--fae-budget", type=int, default=65536, help="FAE's replicated bytes per worker")
    p.add_argument("--plan-steps", type=int, default=8, help="sca: steps each candidate is replayed on")
    p.add_argument("--herald-steps", type=int, default=20)
    p.add_argument("--measure", action="store_true", help="train W = 2 runs and report measured bytes")
    p.add_argument("--measure-steps", type=int, default=40)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        base, cache_bytes, runs = plan_runs(a)
    except input_errors() as exc:
        return bad_input(exc)
    out = measure(a, base, runs) if a.measure else simulated(a, base, cache_bytes, runs)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
