#!/usr/bin/env python
"""Training throughput benchmark: the `bench` workload at W = 1 and W = 2, one JSON line per run.

Workload (data=bench): 26 tables x 100,000 rows, d = 16, 13 dense features, 2048 samples per rank,
Zipf alpha 1.1, one torch thread per rank, exact (no cache) BSP mode, the default step
(train.pipeline=ids; `-- train.pipeline=off` for the serial one). W = 1 runs
`python -m trainer`, W > 1 runs `torchrun --standalone --nproc_per_node W -m trainer comm=torch`,
each writing summary.json; the line reports its samples_per_sec (global, all steps, eval excluded)
and bytes_per_sample by kind. Extra trainer overrides can follow `--`.

    python benchmarks/bench_train.py [--worlds 1 2] [--steps 60] [-- model.embedding_dim=32 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the repository root, for the package when run from a checkout
    sys.path.insert(0, ROOT)

from trainer.tools.cli import bad_input, input_errors  # noqa: E402
from trainer.tools.launch import check_trainer, run_trainer, trainer_command  # noqa: E402

BASE = ["data=bench", "model.embedding_dim=16", "train.threads=1", "train.log_every=10",
        "data.eval_samples=8192", "train.progress=off", "checkpoint.enabled=false"]


def overrides(steps: int, extra: list[str]) -> list[str]:
    """The trainer overrides of a run (the output directory aside)."""
    return [*BASE, f"train.steps={steps}", *extra]


def launcher(world: int, backend: str) -> str:
    return "local" if world == 1 else ("horovodrun" if backend == "horovod" else "torchrun")


def command(world: int, steps: int, out: str, extra: list[str], backend: str) -> list[str]:
    return trainer_command(world, [*overrides(steps, extra), f"hydra.run.dir={out}"], launcher(world, backend))


def check(worlds: list[int], steps: int, extra: list[str], backend: str) -> None:
    """Every run's config before any starts: a bad override is one error line, not a failed run."""
    for w in worlds:
        check_trainer(w, overrides(steps, extra), launcher(w, backend))


def bench(world: int, steps: int, extra: list[str], backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        try:
            s = run_trainer(command(world, steps, out, extra, backend), out, cwd=ROOT)
        except RuntimeError as exc:
            raise SystemExit(f"W={world}: {exc}") from None
        lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    steady = [x["samples_per_sec"] for x in lines[1:]] or [s["samples_per_sec"]]
    return {"bench": "train", "overrides": extra, "world_size": world, "backend": backend if world > 1 else "local",
            "steps": steps, "global_batch_size": s["global_batch_size"],
            "samples_per_sec": round(s["samples_per_sec"], 1),
            "samples_per_sec_after_first_10_steps": round(
                (len(steady) * 10 * s["global_batch_size"]) / sum(10 * s["global_batch_size"] / v for v in steady), 1),
            "bytes_per_sample": round(s["bytes_per_sample"], 2),
            "bytes_per_sample_by_kind": {k: round(v, 2) for k, v in s["bytes_per_sample_by_kind"].items()},
            "remote_rows_per_step": s["embedding"]["remote_per_step"],
            "final_loss": s["final_loss"], "eval_auc": s["eval_auc"], "wall_s": round(s["wall_s"], 1)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", choices=["torch", "horovod"], default="torch")
    a = ap.parse_args(argv)
    try:
        check(a.worlds, a.steps, extra, a.backend)
    except input_errors() as exc:
        return bad_input(exc)
    for w in a.worlds:
        print(json.dumps(bench(w, a.steps, extra, a.backend)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
