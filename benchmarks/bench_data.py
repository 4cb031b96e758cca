"""Input-pipeline benchmark: Criteo preprocessing MB/s (total and per core) and loader samples/s,
DALI against the numpy-memmap reference. One JSON line per figure on stdout.

The input is a real Criteo file (--input), or a made-up Criteo-format sample of 1,999 rows
(dev/criteo_file.py: Criteo's columns, field widths and empty shares) repeated --repeat times into a
temporary directory (never inside the repo). Everything derived is written under a temporary
directory and removed at the end.

    .venv/bin/python -m benchmarks.bench_data [--input day_0] [--repeat 100] [--workers 1 2] [--batch 4096]

Bad input (a missing --input file, a count <= 0) is one `error: ...` line, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

from dev import criteo_file
from trainer.workload.data.criteo import CriteoFormatError
from trainer.tools.cli import bad_input

SAMPLE_ROWS = 1999


def sample_bytes() -> bytes:
    """The made-up sample the default input repeats."""
    return "".join(criteo_file.lines(SAMPLE_ROWS)).encode()


def make_input(tmp: str, repeat: int) -> str:
    """The sample repeated `repeat` times (a stand-in for a large Criteo file)."""
    text = sample_bytes()
    path = os.path.join(tmp, "input.tsv")
    with open(path, "wb") as f:
        for _ in range(repeat):
            f.write(text)
    return path


def bench_prepare(src: str, tmp: str, workers: int, chunk_mb: float) -> tuple[dict, str]:
    from trainer.workload.data.criteo import NUM_CAT
    from trainer.workload.data.prepare import PrepOptions, prepare

    out = os.path.join(tmp, f"prepared-{workers}")
    t0 = time.perf_counter()
    meta = prepare(PrepOptions(out=out, train=[src], hash_rows=[1_000_000] * NUM_CAT, workers=workers,
                               chunk_mb=chunk_mb, progress=False))
    dt = time.perf_counter() - t0
    mb = os.path.getsize(src) / 2**20
    return {"bench": "prepare", "workers": workers, "input_mb": round(mb, 1),
            "rows": meta["splits"]["train"]["rows"], "seconds": round(dt, 3),
            "mb_per_s": round(mb / dt, 2), "mb_per_s_per_core": round(mb / dt / workers, 2)}, out


def bench_loader(directory: str, loader: str, batch: int, steps: int) -> dict:
    from trainer.run.resolve.configure import load_config
    from trainer.workload.data import make_data

    # train.recipe=none: the loader reads every training row as prepared (the data=criteo recipe
    # would carve a validation split out of them, drop rare ids and standardize the dense features)
    cfg = load_config({"model": {"name": "dlrm"}, "train": {"recipe": "none"}, "data": {
        "name": "criteo", "dir": directory, "loader": loader, "num_dense": 13, "table_rows": [],
        "batch_size": batch, "shuffle": True}})
    data = make_data(cfg, 0, 1)
    data.train_batch(0)  # pipeline start-up, first block
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        data.train_batch(step)
    dt = time.perf_counter() - t0
    return {"bench": "loader", "loader": loader, "batch": batch, "steps": steps,
            "samples_per_s": round(steps * batch / dt, 1)}


def check(a: argparse.Namespace) -> None:
    """The options, before anything is written (ValueError naming the bad one)."""
    for name in ("repeat", "batch", "steps", "chunk_mb"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(a, name)}: must be > 0")
    if min(a.workers) <= 0:
        raise ValueError(f"--workers {min(a.workers)}: must be > 0")
    if a.input is not None and not os.path.isfile(a.input):
        raise ValueError(f"--input {a.input}: no such file")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_data",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", help="a raw Criteo TSV file (default: a made-up sample, repeated)")
    ap.add_argument("--repeat", type=int, default=100, help="repetitions of the sample (default 100, ~45 MB)")
    ap.add_argument("--workers", type=int, nargs="+", default=sorted({1, os.cpu_count() or 1}))
    ap.add_argument("--chunk-mb", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=100)
    a = ap.parse_args(argv)
    try:
        check(a)
    except ValueError as exc:
        return bad_input(exc)
    tmp = tempfile.mkdtemp(prefix="bench_data_")
    try:
        src = a.input or make_input(tmp, a.repeat)
        prepared = None
        for w in a.workers:
            try:
                rec, prepared = bench_prepare(src, tmp, w, a.chunk_mb)
            except CriteoFormatError as exc:  # --input is not a Criteo file
                return bad_input(exc)
            print(json.dumps(rec), flush=True)
        for loader in ("memmap", "dali"):
            print(json.dumps(bench_loader(prepared, loader, a.batch, a.steps)), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
