"""The same W = 2 job under srun (one task per rank, on a real Slurm of this host: dev/slurmcluster.py,
two one-CPU nodes) and under torchrun on this machine: samples/s side by side, one JSON line each
and their ratio.

    python -m benchmarks.bench_slurm [--workload bench] [--steps 60] [--repeats 2] [-- extra overrides]

Each job's samples/s is its summary.json's (the trained steps' rate); the runs alternate (srun,
torchrun, srun, ...) so that both see the machine alike; the last line gives the ratio of the
medians (srun / torchrun). The torch threads of each rank are the trainer's default
(train.threads=0: the CPUs the rank may use, a Slurm step's share of its node); the line of each
run says how many. Needs root and Slurm (scripts/install_slurm.sh); bad input is one `error: ...`
line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks.bench_train import WORKLOADS
from dev.launch import ROOT, run_trainer, trainer_command
from dev.slurmcluster import SlurmCluster, free_port, missing


def _srun(cluster: SlurmCluster, overrides: list[str], out: str) -> dict:
    env = cluster.env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"})
    argv = ["srun", "--nodes=2", "--ntasks-per-node=1", sys.executable, "-m", "trainer", "comm=torch", *overrides,
            f"hydra.run.dir={out}"]
    got = cluster.run(argv, cwd=ROOT, env=env, check=False, timeout=1800)
    if got.returncode != 0:
        raise RuntimeError(f"srun exited {got.returncode}: {got.stderr[-3000:]}\n{cluster.log()}")
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_slurm", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="bench", choices=sorted(WORKLOADS))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if a.steps <= 0 or a.repeats <= 0:
        print(f"error: --steps {a.steps} / --repeats {a.repeats}: must be > 0", file=sys.stderr)
        return 2
    why = missing()
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    # comm.settled_rows=always: Slurm's two nodes are two hosts to the trainer (auto would send the
    # settled rows early there and not under torchrun): the same work under both launchers
    overrides = [*WORKLOADS[a.workload], f"train.steps={a.steps}", "train.progress=off", "checkpoint.enabled=false",
                 "comm.settled_rows=always", *extra]
    rates: dict[str, list[float]] = {"srun": [], "torchrun": []}
    with SlurmCluster() as cluster, tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for how in ("srun", "torchrun"):
                out = os.path.join(tmp, f"{how}{i}")
                print(f"[bench_slurm] {how} {i + 1}/{a.repeats} ...", file=sys.stderr, flush=True)
                if how == "srun":
                    s = _srun(cluster, overrides, out)
                else:
                    s = run_trainer(trainer_command(2, [*overrides, f"hydra.run.dir={out}"], "torchrun"), out,
                                    cwd=ROOT, env={"PYTHONUNBUFFERED": "1"})
                rates[how].append(s["samples_per_sec"])
                print(json.dumps({"bench": "slurm", "launcher": how, "repeat": i, "workload": a.workload,
                                  "world_size": s["world_size"], "steps": a.steps, "threads": s.get("threads"),
                                  "samples_per_sec": round(s["samples_per_sec"], 1),
                                  "final_loss": s["final_loss"]}), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"bench": "slurm", "workload": a.workload, "median_samples_per_sec": {k: round(v, 1) for k, v in med.items()},
                      "srun_to_torchrun": round(med["srun"] / med["torchrun"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
