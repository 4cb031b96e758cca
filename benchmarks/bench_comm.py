"""Collective latency and bandwidth through the trainer's Collectives interface, one JSON line per point.

Measures what the trainer pays: alltoall (even splits) and allreduce (sum) of float32 payloads over a
size sweep, through `trainer.base.comm.make_collectives`, so the timeout polling and byte accounting of
each backend are included. Bandwidth uses the bytes the comm layer counts as sent by this rank
(alltoall: the (W-1)/W off-rank share; allreduce: 2(W-1)/W of the payload, the ring traffic).

    torchrun --nproc_per_node 2 -m benchmarks.bench_comm --backend torch
    horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks.bench_comm --backend horovod
    python -m benchmarks.bench_comm --all          # launches both of the above, prints every line

Line: {"backend", "op", "world_size", "bytes" (payload per rank), "iters", "lat_us_p50",
"lat_us_mean", "lat_us_min", "wire_bytes" (per rank per call), "bw_MBps" (wire_bytes / p50)}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from trainer.tools.cli import bad_input
from dev.launch import ROOT, launch_command

MODULE = "benchmarks.bench_comm"  # this file: what the driver's workers run (from ROOT, dev/launch.py)
OPS = ("alltoall", "allreduce")
BACKENDS = ("auto", "local", "torch", "horovod")  # trainer.base.comm.make_collectives

DEFAULT_SIZES = "1KiB,16KiB,256KiB,1MiB,4MiB"
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "B": 1}


def parse_size(s: str) -> int:
    """Bytes of "4MiB", "16KiB", "512B" or "1024"; ValueError naming the text otherwise."""
    try:
        for unit in ("KiB", "MiB", "GiB", "B"):
            if s.endswith(unit):
                n = int(float(s[: -len(unit)]) * UNITS[unit])
                break
        else:
            n = int(s)
    except ValueError:
        raise ValueError(f"size {s!r}: a number of bytes, with KiB, MiB, GiB or B if you like") from None
    if n <= 0:
        raise ValueError(f"size {s!r}: must be > 0")
    return n


def check(args: argparse.Namespace) -> None:
    """The options, before any worker starts (bad ones raise ValueError)."""
    for size in [*args.sizes.split(","), args.budget]:
        parse_size(size)
    bad = [op for op in args.ops.split(",") if op not in OPS]
    if bad:
        raise ValueError(f"--ops {args.ops}: {', '.join(bad)} is not one of {', '.join(OPS)}")
    if args.np < 1 or args.timeout <= 0 or args.launch_timeout <= 0:
        raise ValueError("--np, --timeout and --launch-timeout must be > 0")


def iters_for(nbytes: int, budget_bytes: int) -> int:
    """Enough repetitions for a stable median; fewer for big payloads (same on every rank)."""
    return max(5, min(200, budget_bytes // max(nbytes, 1)))


def time_op(comm, fn, iters: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    comm.barrier()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_point(comm, op: str, nbytes: int, budget: int, backend: str) -> dict:
    import torch
    w = comm.size
    width = 16  # float32 elements per row: 64-byte rows, like a d=16 embedding row
    rows = max(w, (nbytes // 4 // width) // w * w)
    t = torch.randn(rows, width)
    if op == "alltoall":
        splits = [rows // w] * w
        fn = lambda: comm.alltoall(t, splits, kind="rows", recv_splits=splits)  # noqa: E731
    else:
        fn = lambda: comm.allreduce(t, op="sum", kind="dense")  # noqa: E731
    iters = iters_for(nbytes, budget)
    before = sum(comm.counter.totals("train").values())
    times = time_op(comm, fn, iters)
    wire = (sum(comm.counter.totals("train").values()) - before) / (iters + 3)
    p50 = statistics.median(times)
    return {"backend": backend, "op": op, "world_size": w, "bytes": rows * width * 4, "iters": iters,
            "lat_us_p50": round(p50 * 1e6, 1), "lat_us_mean": round(statistics.fmean(times) * 1e6, 1),
            "lat_us_min": round(min(times) * 1e6, 1), "wire_bytes": int(wire),
            "bw_MBps": round(wire / p50 / 1e6, 2)}


def worker(args: argparse.Namespace) -> int:
    import torch
    from trainer.base.comm import make_collectives
    torch.set_num_threads(1)
    comm = make_collectives(args.backend, timeout_s=args.timeout)
    backend = type(comm).__name__.replace("Collectives", "").lower()
    if backend == "torch":
        backend = f"torch-{comm.backend}"
    elif backend == "horovod":
        backend = "horovod-" + ("nccl" if comm.on_gpu else "gloo")
    try:
        for op in args.ops.split(","):
            for size in args.sizes.split(","):
                line = bench_point(comm, op, parse_size(size), parse_size(args.budget), backend)
                if comm.rank == 0:
                    print(json.dumps(line), flush=True)
    finally:
        comm.close()
    return 0


def _launch(cmd: list[str], timeout: float) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = []
    for raw in proc.stdout.splitlines():
        text = raw.split("<stdout>:", 1)[-1].strip()  # horovodrun prefixes "[0]<stdout>:"
        if text.startswith("{") and '"op"' in text:
            lines.append(json.loads(text))
    if proc.returncode != 0 or not lines:
        sys.stderr.write(f"bench_comm: {' '.join(cmd)} failed (rc {proc.returncode})\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n")
        raise SystemExit(1)
    return lines


def driver(args: argparse.Namespace) -> int:
    common = ["--sizes", args.sizes, "--ops", args.ops, "--budget", args.budget,
              "--timeout", str(args.timeout)]
    runs = [launch_command(launcher, args.np, [sys.executable, "-m", MODULE, "--backend", backend, *common])
            for launcher, backend in (("torchrun", "torch"), ("horovodrun", "horovod"))]
    for cmd in runs:
        for line in _launch(cmd, args.launch_timeout):
            print(json.dumps(line), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_comm",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="auto", choices=BACKENDS, help="worker mode: the collectives' backend")
    ap.add_argument("--all", action="store_true", help="driver: launch torchrun and horovodrun workers")
    ap.add_argument("--np", type=int, default=2, help="workers per launch in --all mode")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="payload bytes per rank, comma-separated")
    ap.add_argument("--ops", default="alltoall,allreduce")
    ap.add_argument("--budget", default="64MiB", help="bytes per point: iters = budget / size, 5..200")
    ap.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    ap.add_argument("--launch-timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    try:
        check(args)
    except ValueError as exc:
        return bad_input(exc)
    return driver(args) if args.all else worker(args)


if __name__ == "__main__":
    sys.exit(main())
