"""The predictor's speed (trainer/serving/predictor.py, docs/serving.md): one JSON line per point.

An artifact is made first (unless `--artifact DIR` names one): a short `data=bench`-shaped run
(26 tables of `--rows` rows, d = `--dim`, DLRM, one process, a checkpoint at its end) exported
with each of `--row-types`. Per artifact and batch size (`--batches`): rows scored per second over
`--repeat` calls of Predictor.logits on random ids and dense features (the batch made before the
clock starts; one torch thread unless `--threads`), and at batch 1 the p50 / p99 latency of one
call. The files are in the page cache (the run just wrote them): what is timed is the gather, the
pooling and the dense program, not the disk.

    python -m benchmarks.bench_predict [--rows 100000] [--dim 16] [--batches 1 256 4096] [--repeat 200]
        [--row-types saved int8] [--threads 1] [--artifact DIR] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from dev.launch import run_trainer, trainer_command
from trainer.serving.export import export
from trainer.serving.predictor import Predictor
from trainer.tools.cli import bad_input


def make_run(rows: int, dim: int, where: str) -> str:
    out = os.path.join(where, "run")
    overrides = ["data=bench", f"data.table_rows=[{','.join([str(rows)] * 26)}]", f"model.embedding_dim={dim}",
                 "model=dlrm", "train.steps=4", "train.threads=1", "train.progress=off", "data.test_samples=2048",
                 f"hydra.run.dir={out}"]
    run_trainer(trainer_command(1, overrides), out)
    return out


def measure(p: Predictor, batch: int, repeat: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, p.num_dense, generator=g)
    ids = torch.stack([torch.randint(0, int(n), (batch,), generator=g) for n in p.rows], 1)
    for _ in range(3):
        p.logits(dense, ids)
    took = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        p.logits(dense, ids)
        took.append(time.perf_counter() - t0)
    took = np.asarray(took)
    point = {"batch": batch, "calls": repeat, "rows_per_s": round(batch * repeat / float(took.sum()), 1)}
    if batch == 1:
        point.update({"p50_ms": round(float(np.percentile(took, 50)) * 1e3, 3),
                      "p99_ms": round(float(np.percentile(took, 99)) * 1e3, 3)})
    return point


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=100_000, help="rows per table of the run exported")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 256, 4096])
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--row-types", nargs="+", default=["saved", "int8"], choices=["saved", "fp16", "int8"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--artifact", help="score with this artifact instead of making one")
    ap.add_argument("--dir", help="where the run and artifacts go (default: a temporary directory, removed)")
    a = ap.parse_args(argv)
    try:
        for name, v in (("--rows", a.rows), ("--dim", a.dim), ("--repeat", a.repeat), ("--threads", a.threads),
                        ("--batches", min(a.batches))):
            if v < 1:
                raise ValueError(f"{name} {v}: must be >= 1")
        if a.artifact is not None and not os.path.isdir(a.artifact):
            raise ValueError(f"--artifact {a.artifact}: no such directory")
    except ValueError as exc:
        return bad_input(exc)
    torch.set_num_threads(a.threads)
    where = a.dir or tempfile.mkdtemp(prefix="bench-predict-")
    os.makedirs(where, exist_ok=True)
    try:
        if a.artifact is not None:
            arts = {"given": a.artifact}
        else:
            run = make_run(a.rows, a.dim, where)
            arts = {}
            for rows in a.row_types:
                arts[rows] = os.path.join(where, f"art-{rows}")
                shutil.rmtree(arts[rows], ignore_errors=True)
                export(run, arts[rows], rows_as=rows, say=lambda line: None)
        for rows, art in arts.items():
            p = Predictor(art)
            for batch in a.batches:
                print(json.dumps({"row_type": rows, "rows_per_table": int(p.rows[0]), "dim": p.dim,
                                  "threads": a.threads, **measure(p, batch, a.repeat)}), flush=True)
    finally:
        if a.dir is None:
            shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
