"""Print a placement plan and its predicted bytes, without training: one JSON line on stdout (the
plan summary as summary.json reports it), a readable table on stderr.

    python scripts/plan.py --workers 8 data=criteo_like cache=lru placement=sca
    python scripts/plan.py --workers 8 data=criteo_like placement=sca placement.budget_bytes=4194304
    python scripts/plan.py --workers 8 data=criteo_like cache=lru placement=fae --predict

Positional arguments are Hydra overrides of `python -m trainer` (placement=..., data=..., cache=...,
consistency=...). The plan is the one a W-worker run of the same config makes (rank 0 profiles the
run's stream and plans). placement=sca predicts by replaying its candidates through the cache
simulator (trainer/sparse/placement/sca.py); --predict gives any other plan the same prediction.
"""
from __future__ import annotations

import argparse
import json
import sys

from trainer.base.config import ConfigError, needs_global_view
from trainer.tools.cli import exit_status


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. data=criteo_like placement=sca")
    p.add_argument("--workers", "-W", type=int, default=2, help="workers W the plan is for (default 2)")
    p.add_argument("--predict", action="store_true",
                   help="also predict bytes for a plan whose planner does not (fae, none)")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)

    def run() -> None:
        if a.workers <= 0:
            raise ConfigError(f"--workers {a.workers}: must be > 0")
        from trainer.run.resolve.configure import compose_config
        cfg = compose_config(a.overrides, a.workers)  # data.epochs -> train.steps for W workers
        if not needs_global_view(cfg):
            raise ConfigError("placement=none: nothing to plan (use placement=fae or placement=sca)")
        from trainer.workload.data import make_data
        from trainer.sparse.placement import plan_run
        from trainer.sparse.placement.sca import predict_bytes
        data = make_data(cfg, 0, a.workers)
        plan = plan_run(cfg, data, a.workers)
        if plan.predicted is None and a.predict:
            pred = predict_bytes(cfg, a.workers, plan, data)
            plan.predicted = {k: v for k, v in pred.items() if k != "total"}
        out = {"workers": a.workers, **plan.summary()}
        if plan.predicted is not None:
            out["predicted_total_bytes_per_sample"] = sum(plan.predicted.values())
        _table(out, sys.stderr)
        print(json.dumps(out))
    return exit_status(run)


def _table(out: dict, f) -> None:
    print(f"plan {out['name']} for W={out['workers']}: {out['hot_rows']} replicated rows"
          + (f", cache rows per table {out['cache_rows']}" if "cache_rows" in out else ""), file=f)
    for c in out.get("candidates", []):
        mark = "*" if c["name"] == out.get("chosen") else " "
        pred = c["predicted_bytes_per_sample"]
        print(f" {mark} {c['name']:<15} hot={c['hot_rows']:<8} cache={c['cache_rows']:<8} "
              f"mem={c['memory_bytes']:<10} predicted={pred if pred is None else round(pred, 1)} B/sample",
              file=f)
    if "buckets" in out:
        print("   bucket ranks          reads/sample  decision   shard B/step  replicate B/step", file=f)
        for b in out["buckets"]:
            print(f"   {str(b['ranks']):<20} {b['reads_per_sample']:<13.4f} {b['decision']:<10} "
                  f"{b['shard_bytes_per_step']:<13.0f} {b['replicate_bytes_per_step']:.0f}", file=f)
    if "predicted_total_bytes_per_sample" in out:
        print(f"predicted embedding bytes per global sample: {out['predicted_total_bytes_per_sample']:.1f} "
              f"{out['predicted_bytes_per_sample']}", file=f)


if __name__ == "__main__":
    sys.exit(main())
