"""What the fixed shapes cost on the wire: train.cuda_graph=on against off, per policy, at W = 2.
One JSON line per point (workload x policy x mode).

    python -m benchmarks.bench_padding [--workloads bench mlperf] [--policies plain fae sca het herald]
        [--modes off bound measured] [--steps 60] [--skip 20] [--world 2] [--batch B] [--rows R]
        [-- extra trainer overrides]

Modes: `off` (the exact-size sparse half: the batch's unique ids on the wire), `bound` (cuda_graph=on
with train.unique_capacity=0: blocks no batch can overflow) and `measured` (cuda_graph=on with the
default train.unique_capacity=-1: the bound for the first 16 steps, then what they needed + 10%, an
overflowing step trained again in exact sizes; the HET cache's reply and push blocks follow every 16
steps: its traffic settles only once the cache is full, so measure it past that, e.g. --steps 200 --skip
100). `off` always runs, first: the ratios' base. Each run is W ranks under torchrun on this machine
(one torch thread each); the bytes are the collectives' exact counters, rank 0's, per step over the
steady window (the steps after `--skip`, 20 by default: past the measuring), by kind (ids, rows,
grads, replica, versions, dense) and in all; each line gives its ratio to `off`'s, the
overflow steps, and whether the final loss equals `off`'s (it must: the modes are exact).
Workloads as benchmarks/bench_train.py's (bench: 26 x 100,000 rows, d = 16, 2,048 samples per
rank; mlperf: the MLPerf DLRM shape, rows capped by data.max_table_rows). Bad input (an unknown
workload or policy, a count <= 0) is one `error: ...` line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks.bench_train import WORKLOADS
from trainer.tools.cli import bad_input, input_errors
from dev.launch import ROOT, check_trainer, run_trainer, trainer_command

# het: the HET cache under ssp (its version checks, pulled rows and pushes in the blocks: fixed/het.py);
# herald: Herald's partition and on-demand sync (its wire sized by the host's plan in both modes)
POLICIES = {"plain": [], "fae": ["placement=fae"], "sca": ["placement=sca"], "het": ["cache=lru", "consistency=ssp"],
            "herald": ["schedule=herald", "cache=lru"]}
MODES = {"off": ["train.cuda_graph=off"], "bound": ["train.cuda_graph=on", "train.unique_capacity=0"],
         "measured": ["train.cuda_graph=on", "train.unique_capacity=-1"]}
KINDS = ("ids", "versions", "rows", "grads", "replica", "dense")


def run_overrides(workload: str, policy: str, mode: str, steps: int, skip: int, extra: list[str],
                  batch: int | None = None, rows: int | None = None) -> list[str]:
    """A run's trainer overrides (batch: samples per rank; rows: a cap on every table's rows)."""
    return [*WORKLOADS[workload], *POLICIES[policy], *MODES[mode], f"train.steps={steps}",
            f"train.log_every={skip}", "data.test_samples=2048",
            *([f"data.batch_size={batch}"] if batch else []), *([f"data.max_table_rows={rows}"] if rows else []),
            *extra]


def steady_bytes(out: str, skip: int) -> dict[str, float]:
    """Rank 0's bytes per step by kind over the steps after `skip` (metrics.jsonl's running counts)."""
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in x]
    first = next(x for x in lines if x["step"] == skip)
    last = lines[-1]
    n = last["step"] - skip
    return {k: (last["bytes"].get(k, 0) - first["bytes"].get(k, 0)) / n for k in KINDS}


def point(a: argparse.Namespace, workload: str, policy: str, mode: str, extra: list[str]) -> dict:
    steps, skip, world = a.steps, a.skip, a.world
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        cmd = trainer_command(world, [*run_overrides(workload, policy, mode, steps, skip, extra, a.batch, a.rows),
                                      f"hydra.run.dir={out}"], "torchrun")
        s = run_trainer(cmd, out, cwd=ROOT, env={"PYTHONUNBUFFERED": "1"})
        per = steady_bytes(out, skip)
    graph = s.get("cuda_graph") or {}
    return {"bench": "padding", "workload": workload, "policy": policy, "mode": mode, "world_size": world,
            "steps": steps, "steady_after": skip, "bytes_per_step": {k: round(v, 1) for k, v in per.items()},
            "bytes_per_step_all": round(sum(per.values()), 1),
            "unique_capacity": graph.get("unique_capacity"), "unique_bound": graph.get("unique_bound"),
            "most_slots_used": graph.get("most_slots_used"), "overflow_steps": graph.get("overflow_steps"),
            "exact_size_lookups": graph.get("exact_size_lookups"), "het_blocks": graph.get("het_blocks"),
            "hot_rows": (s.get("placement") or {}).get("hot_rows", 0),
            "remote_per_step": s["embedding"]["remote_per_step"], "final_loss": s["final_loss"],
            "samples_per_sec": round(s["samples_per_sec"], 1)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_padding", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["bench"], choices=sorted(WORKLOADS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                    help="which modes (off always runs, first: the ratios' base)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=20, help="the steady window starts after this step")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="samples per rank (default: the workload's 2,048)")
    ap.add_argument("--rows", type=int, default=None, help="cap on every table's rows (default: the workload's)")
    a = ap.parse_args(argv)
    try:
        check(a, extra)
    except input_errors() as exc:
        return bad_input(exc)
    for w in a.workloads:
        for p in a.policies:
            base = None
            for m in modes(a):
                print(f"[bench_padding] {w} {p} {m} ...", file=sys.stderr, flush=True)
                got = point(a, w, p, m, extra)
                if base is None:
                    base = got
                got["to_off"] = round(got["bytes_per_step_all"] / base["bytes_per_step_all"], 3) \
                    if base["bytes_per_step_all"] else None
                got["embedding_to_off"] = _embedding_ratio(got, base)
                got["final_loss_equal"] = got["final_loss"] == base["final_loss"]
                print(json.dumps(got), flush=True)
    return 0


def check(a: argparse.Namespace, extra: list[str]) -> None:
    """Every run's config before any starts (bad input raises one of input_errors)."""
    if a.world < 2:
        raise ValueError(f"--world {a.world}: must be >= 2 (the wire is between ranks)")
    if not 0 < a.skip < a.steps:
        raise ValueError(f"--skip {a.skip}: must be > 0 and below --steps {a.steps}")
    for name in ("batch", "rows"):
        if getattr(a, name) is not None and getattr(a, name) <= 0:
            raise ValueError(f"--{name} {getattr(a, name)}: must be > 0")
    for w in a.workloads:
        for p in a.policies:
            for m in modes(a):
                check_trainer(a.world, run_overrides(w, p, m, a.steps, a.skip, extra, a.batch, a.rows), "torchrun")


def modes(a: argparse.Namespace) -> list[str]:
    """The modes to run, in MODES' order, off first."""
    return [m for m in MODES if m == "off" or m in a.modes]


def _embedding_ratio(got: dict, base: dict) -> float | None:
    """The embedding wire (every kind but the dense allreduce) against off's."""
    emb = lambda x: sum(v for k, v in x["bytes_per_step"].items() if k != "dense")  # noqa: E731
    return round(emb(got) / emb(base), 3) if emb(base) else None


if __name__ == "__main__":
    raise SystemExit(main())
