"""Training throughput benchmark: one JSON line per point (world size x batch size x precision).

Workloads (`--workload`):
- bench (the default; data=bench): 26 tables x 100,000 rows, d = 16, 13 dense features, 2048
  samples per rank, Zipf alpha 1.1, DLRM with bottom [64, 32] and top [64, 32];
- mlperf (data=mlperf model=dlrm_mlperf): the MLPerf DLRM shape, 26 tables with MLPerf's Criteo
  1TB row counts capped at data.max_table_rows (200,000 by default: ~0.9 GiB of rows; raise it
  with `-- data.max_table_rows=N` where the machine holds more), d = 128, bottom 512-256-128, top
  1024-1024-512-256-1, 2048 samples per rank.
Both: one torch thread per rank, exact (no cache) BSP mode, the default step (train.pipeline=ids;
`-- train.pipeline=off` for the serial one). W = 1 runs `python -m trainer`, W > 1 runs
`torchrun --standalone --nproc_per_node W -m trainer comm=torch`, each under benchmarks/phases.py
(timers around the step's phases, about a microsecond per call) and writing summary.json.

A point per (--worlds, --batch-sizes: samples per rank, data.batch_size; --precisions:
train.precision; --kinds: embedding.kind, fixed against dynamic); left out, the workload's own. Each line: samples_per_sec (global, all steps,
eval excluded) and after the first 10 steps, ms_per_step by phase (rank 0's: step, batch,
prefetch, lookup, backward, apply, wait; they nest, see benchmarks/phases.py), cpu_busy,
bytes_per_sample by kind, and `phases` (every rank's report); `ms_per_step_steady`: the phases
over the steps after the first 10 (and after the profiled ones). `--profile-steps N` (1..10; needs
--steps >= 30) runs torch.profiler over steps 11..10+N and adds rank 0's `profile`: wall and
device-busy ms per step, the busy share, kernels, launches, aten ops and copies per step, the top
kernels and ops (benchmarks/phases.py); the steady rate then starts after step 20. On a GPU,
`-- data.cycle_batches=8 data.loader_threads=8` takes the host's synthetic generator out of the
measured step (docs/gpu.md). Extra trainer overrides can follow `--`.

    python -m benchmarks.bench_train [--worlds 1 2] [--steps 60] [--workload bench|mlperf]
        [--batch-sizes 2048 16384] [--precisions fp32 tf32 bf16 fp16] [--kinds fixed dynamic]
        [--repeats R] [--profile-steps 5] [-- model.embedding_dim=32 embedding.capacity=100000 ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.phases import ENV as PHASES_ENV, PROFILE_ENV, read_phases
from trainer.tools.cli import bad_input, input_errors
from dev.launch import ROOT, check_trainer, run_trainer, trainer_command

COMMON = ["train.threads=1", "train.log_every=10", "data.test_samples=8192", "train.progress=off",
          "checkpoint.enabled=false"]
WORKLOADS = {"bench": ["data=bench", "model.embedding_dim=16", *COMMON],
             "mlperf": ["data=mlperf", "model=dlrm_mlperf", *COMMON]}
BASE = WORKLOADS["bench"]


def point_overrides(batch: int | None, precision: str | None, kind: str | None = None) -> list[str]:
    """The overrides of one point (none where the workload's own value stands)."""
    return ([f"data.batch_size={batch}"] if batch is not None else []) + \
        ([f"train.precision={precision}"] if precision is not None else []) + \
        ([f"embedding.kind={kind}"] if kind is not None else [])


def overrides(steps: int, extra: list[str], workload: str = "bench", point: list[str] = ()) -> list[str]:
    """The trainer overrides of a run (the output directory aside)."""
    return [*WORKLOADS[workload], f"train.steps={steps}", *point, *extra]


def launcher(world: int, backend: str) -> str:
    return "local" if world == 1 else ("horovodrun" if backend == "horovod" else "torchrun")


def command(world: int, steps: int, out: str, extra: list[str], backend: str, workload: str = "bench",
            point: list[str] = ()) -> list[str]:
    return trainer_command(world, [*overrides(steps, extra, workload, point), f"hydra.run.dir={out}"],
                           launcher(world, backend), module="benchmarks.phases")


def check(worlds: list[int], steps: int, extra: list[str], backend: str, workload: str = "bench",
          points: list[list[str]] = ([],)) -> None:
    """Every run's config before any starts: a bad override is one error line, not a failed run."""
    for w in worlds:
        for point in points:
            check_trainer(w, overrides(steps, extra, workload, point), launcher(w, backend))


def bench(world: int, steps: int, extra: list[str], backend: str, workload: str = "bench",
          point: list[str] = (), profile_steps: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        try:
            s = run_trainer(command(world, steps, out, extra, backend, workload, point), out, cwd=ROOT,
                            env={PHASES_ENV: out, "PYTHONUNBUFFERED": "1", PROFILE_ENV: str(profile_steps)})
        except RuntimeError as exc:
            raise SystemExit(f"W={world} {' '.join(point)}: {exc}") from None
        lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
        phases = read_phases(out)
    # the steady rate: after the first 10 steps, and after the profiled ones (the window 10-20)
    steady = [x["samples_per_sec"] for x in lines[2 if profile_steps else 1:]] or [s["samples_per_sec"]]
    cfg = s["config"]
    return {"bench": "train", "workload": workload, "overrides": extra, "world_size": world,
            "backend": backend if world > 1 else "local", "steps": steps,
            "batch_size": cfg["data"]["batch_size"] if cfg["data"]["global_batch_size"] is None else None,
            "global_batch_size": s["global_batch_size"], "precision": cfg["train"]["precision"],
            "kind": cfg["embedding"]["kind"],
            "samples_per_sec": round(s["samples_per_sec"], 1),
            "samples_per_sec_after_first_10_steps": round(
                (len(steady) * 10 * s["global_batch_size"]) / sum(10 * s["global_batch_size"] / v for v in steady), 1),
            "bytes_per_sample": round(s["bytes_per_sample"], 2),
            "bytes_per_sample_by_kind": {k: round(v, 2) for k, v in s["bytes_per_sample_by_kind"].items()},
            "remote_rows_per_step": s["embedding"]["remote_per_step"],
            "ms_per_step": phases[0]["ms_per_step"] if phases else None,
            "ms_per_step_steady": phases[0].get("ms_per_step_steady") if phases else None,
            "cpu_busy": phases[0]["cpu_busy"] if phases else None,
            **({"profile": phases[0]["profile"]} if phases and "profile" in phases[0] else {}),
            "final_loss": s["final_loss"], "eval_auc": s["eval_auc"], "wall_s": round(s["wall_s"], 1),
            "phases": phases}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_train",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", choices=["torch", "horovod"], default="torch")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="bench")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[None], metavar="B",
                    help="samples per rank (data.batch_size), one point each; default: the workload's")
    ap.add_argument("--precisions", nargs="+", default=[None], metavar="P",
                    help="train.precision (fp32, tf32, bf16, fp16), one point each; default: the trainer's (fp32)")
    ap.add_argument("--kinds", nargs="+", default=[None], choices=["fixed", "dynamic"],
                    help="embedding.kind, one point each, side by side at every W (dynamic needs "
                         "`-- embedding.capacity=N`, which fixed tables ignore); default: the trainer's (fixed)")
    ap.add_argument("--repeats", type=int, default=1, metavar="R",
                    help="run every point R times, in rounds (point after point, then again), so that "
                         "a machine's load changes reach all points alike; each line carries `repeat`")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="torch.profiler over N steps after the first 10 (rank 0's summary in `profile`)")
    a = ap.parse_args(argv)
    if a.profile_steps and not (1 <= a.profile_steps <= 10 and a.steps >= 30):
        return bad_input(ValueError(f"--profile-steps takes 1..10 steps (the steps 11-20) and needs --steps >= 30 "
                                    f"(the steady rate is read after step 20), got {a.profile_steps} with --steps {a.steps}"))
    if a.repeats < 1:
        return bad_input(ValueError(f"--repeats takes R >= 1, got {a.repeats}"))
    points = [point_overrides(b, p, t) for b in a.batch_sizes for p in a.precisions for t in a.kinds]
    try:
        check(a.worlds, a.steps, extra, a.backend, a.workload, points)
    except input_errors() as exc:
        return bad_input(exc)
    for r in range(a.repeats):
        for w in a.worlds:
            for point in points:
                line = bench(w, a.steps, extra, a.backend, a.workload, point, a.profile_steps)
                print(json.dumps({**line, "repeat": r} if a.repeats > 1 else line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
