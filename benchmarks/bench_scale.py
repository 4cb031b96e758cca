"""Memory and I/O of every phase of a run at the size the trainer exists for: one JSON line per
(run, phase), per rank.

    python -m benchmarks.bench_scale --rows 2000000 --dim 16 --optim adagrad --worlds 1 2
    python -m benchmarks.bench_scale --rows 100000 --steps 10 --worlds 2 --resume-worlds 1 2 4 --val

For each W of --worlds it trains the bench workload with `--tables` tables of `--rows` rows each
(data=bench, data.table_rows), rows of `--dim`, `--optim`'s sparse optimizer, `--steps` steps and
the final checkpoint, as W processes (torchrun above W = 1), each under benchmarks/scale_probe.py;
then resumes that checkpoint at the final step at every W' of --resume-worlds (default: W, 2W and
W / 2 when whole), which loads and evaluates it. `--val` adds a validation split (data.val_fraction
0.1 of 32 batches per rank, an evaluation every few steps, early stopping off but the best model
kept), so the best-model snapshot and its restore are measured too.

Lines: {"bench": "scale", "run": "train" | "resume", "world", "from_world" (resume), "phase",
"calls", "wall_s" (the slowest rank's seconds in the phase), per rank lists: "peak_rss",
"share_bytes" (the rank's rows + versions + optimizer state), "peak_over_share", "steady_rss" (the
train run: RSS after the last step; a resume run: RSS when its evaluation starts),
"peak_over_steady", "rchar" / "wchar" (bytes through read / write calls) and "read_bytes" /
"write_bytes" (bytes that reached the disk); and the run's "model_bytes" (every rank's share)}.
Then one line {"bench": "scale", "io_reference": ...}: writing (with fsync) and reading back, in
64 MiB sequential pieces, one file of the largest share's size in the checkpoint's file system:
what the disk allows, to compare save and resume times with. Progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.scale_probe import ENV as PROBE_ENV
from trainer.tools.cli import bad_input, input_errors
from dev.launch import ROOT, check_trainer, trainer_command

PIECE = 64 << 20  # the I/O reference's write / read size


def log(msg: str) -> None:
    print(f"[bench_scale] {msg}", file=sys.stderr, flush=True)


def workload(a: argparse.Namespace) -> list[str]:
    """The trainer overrides of the measured runs (without the output and checkpoint places)."""
    rows = "[" + ",".join([str(a.rows)] * a.tables) + "]"
    out = ["data=bench", f"data.table_rows={rows}", f"model.embedding_dim={a.dim}", f"optim={a.optim}",
           f"train.steps={a.steps}", "train.progress=off", "train.tensorboard=false", "train.threads=1",
           f"data.batch_size={a.batch}", f"data.test_samples={a.eval_samples}", "train.log_every=10"]
    if a.val:
        out += [f"data.train_samples={32 * a.batch * max(a.worlds)}", "data.val_fraction=0.1",
                f"train.eval_every={max(a.steps // 3, 1)}"]
    return out + list(a.overrides)


def run(world: int, overrides: list[str], work: str, timeout: float) -> list[dict[str, Any]]:
    """Run the trainer under the probe on `world` processes; the ranks' reports, rank order."""
    probe = os.path.join(work, "probe")
    shutil.rmtree(probe, ignore_errors=True)
    argv = trainer_command(world, overrides, module="benchmarks.scale_probe")
    env = {**os.environ, PROBE_ENV: probe, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    reports = []
    for r in range(world):
        with open(os.path.join(probe, f"scale_rank{r}.json")) as f:
            reports.append(json.load(f))
    return reports


def lines(kind: str, world: int, reports: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    """One line per phase that ran, with the ranks' figures side by side."""
    out = []
    shares = [r["share_bytes"] for r in reports]
    steady = [r["steady_rss"] or (r["phases"].get("eval") or {}).get("rss_at_start") or 0 for r in reports]
    for phase in [p for p in reports[0]["phases"]]:
        per = [r["phases"].get(phase, {}) for r in reports]
        peaks = [p.get("peak_rss", 0) for p in per]
        line = {"bench": "scale", "run": kind, "world": world, **extra, "phase": phase,
                "calls": per[0].get("calls", 0), "wall_s": round(max(p.get("seconds", 0.0) for p in per), 3),
                "peak_rss": peaks, "share_bytes": shares, "steady_rss": steady,
                "peak_over_share": [round(p / s, 3) if s else None for p, s in zip(peaks, shares)],
                "peak_over_steady": [round(p / s, 3) if s else None for p, s in zip(peaks, steady)],
                "model_bytes": sum(shares)}
        for k in ("rchar", "wchar", "read_bytes", "write_bytes"):
            line[k] = [p.get(k, 0) for p in per]
        out.append(line)
    return out


def io_reference(directory: str, size: int) -> dict[str, Any]:
    """Sequential write (fsync) and read of `size` bytes in `directory`, MB/s; the read after the
    page cache was dropped where this process may (root), else from the cache (said)."""
    path = os.path.join(directory, "io_reference.bin")
    piece = bytes(min(PIECE, max(size, 1)))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(piece[:min(left, len(piece))])
            left -= len(piece)
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    dropped = False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        dropped = True
    except OSError:
        pass
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(PIECE)
        while f.readinto(buf):
            pass
    read_s = time.perf_counter() - t0
    os.unlink(path)
    return {"bench": "scale", "io_reference": {"bytes": size, "write_MBps": round(size / write_s / 1e6, 1),
                                               "read_MBps": round(size / read_s / 1e6, 1),
                                               "read_from_disk": dropped}}


def resume_worlds(a: argparse.Namespace, world: int) -> list[int]:
    if a.resume_worlds:
        return list(a.resume_worlds)
    return sorted({world, 2 * world} | ({world // 2} if world % 2 == 0 else set()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="more trainer overrides (key=value)")
    ap.add_argument("--rows", type=int, default=2_000_000, help="rows per table (default 2,000,000)")
    ap.add_argument("--tables", type=int, default=26)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--optim", default="adagrad", help="optim preset (default adagrad: element-wise state)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--resume-worlds", type=int, nargs="+", default=None,
                    help="worlds to resume each checkpoint at (default: W, 2W, W/2)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=2048, help="samples per rank and step")
    ap.add_argument("--eval-samples", type=int, default=8192)
    ap.add_argument("--val", action="store_true", help="a validation split: the best-model snapshot too")
    ap.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    a = ap.parse_intermixed_args(argv)
    base = workload(a)
    try:  # every run's config, before any work
        for w in sorted(set(a.worlds) | {v for w in a.worlds for v in resume_worlds(a, w)}):
            check_trainer(w, base + ["checkpoint.resume=null"])
    except input_errors() as exc:
        return bad_input(exc)
    work = a.work or tempfile.mkdtemp(prefix="bench_scale-")
    biggest = 0
    try:
        for w in a.worlds:
            out = os.path.join(work, f"w{w}")
            ck = os.path.join(out, "checkpoints")
            log(f"train: W = {w}, {a.tables} x {a.rows:,} rows, d = {a.dim}, optim={a.optim}, {a.steps} steps")
            reports = run(w, base + [f"hydra.run.dir={out}"], work, a.timeout)
            biggest = max([biggest] + [r["share_bytes"] for r in reports])
            for line in lines("train", w, reports):
                print(json.dumps(line), flush=True)
            final = sorted(d for d in os.listdir(ck) if d.startswith("step_") and ".tmp" not in d)[-1]
            for w2 in resume_worlds(a, w):
                log(f"resume: {final} of W = {w} at W = {w2}")
                out2 = os.path.join(work, f"w{w}-resume{w2}")
                reports = run(w2, base + [f"hydra.run.dir={out2}", f"checkpoint.resume={os.path.join(ck, final)}",
                                          f"checkpoint.dir={os.path.join(out2, 'checkpoints')}"], work, a.timeout)
                for line in lines("resume", w2, reports, from_world=w):
                    print(json.dumps(line), flush=True)
                shutil.rmtree(out2, ignore_errors=True)
            if w != a.worlds[-1]:
                shutil.rmtree(out, ignore_errors=True)
        print(json.dumps(io_reference(work, biggest)), flush=True)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
