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
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(world: int, steps: int, out: str, extra: list[str], backend: str) -> list[str]:
    args = ["data=bench", "model.embedding_dim=16", "train.threads=1", f"train.steps={steps}",
            "train.log_every=10", "data.eval_samples=8192", "train.progress=off",
            "checkpoint.enabled=false",
            f"hydra.run.dir={out}", *extra]
    if world == 1:
        return [sys.executable, "-m", "trainer", *args]
    if backend == "horovod":
        hvd = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        return [hvd, "-np", str(world), "-H", f"localhost:{world}", "--gloo", sys.executable,
                "-m", "trainer", "comm=horovod", *args]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc_per_node", str(world), "-m", "trainer",
            "comm=torch", *args]


def bench(world: int, steps: int, extra: list[str], backend: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        t0 = time.perf_counter()
        proc = subprocess.run(command(world, steps, out, extra, backend), cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"W={world} failed:\n{proc.stderr[-3000:]}")
        s = json.load(open(os.path.join(out, "summary.json")))
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
            "final_loss": s["final_loss"], "eval_auc": s["eval_auc"], "wall_s": round(wall, 1)}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--backend", choices=["torch", "horovod"], default="torch")
    a = ap.parse_args(argv)
    for w in a.worlds:
        print(json.dumps(bench(w, a.steps, extra, a.backend)), flush=True)


if __name__ == "__main__":
    main()
