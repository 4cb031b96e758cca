"""benchmarks/bench_scale.py (and the per-rank probe benchmarks/scale_probe.py), shrunk: a W = 1
training run and its checkpoint resumed at W = 1 and W = 2, one JSON line per (run, phase) with
every rank's figures, then the disk's sequential reference. The figures themselves are the
benchmark's (benchmarks/reports/); here: every phase is there, per rank, and adds up."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_phase_of_a_train_and_a_resume_at_2w(tmp_path):
    rows, tables, dim = 4000, 2, 8
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_scale.py"), "--rows", str(rows),
                           "--tables", str(tables), "--dim", str(dim), "--worlds", "1", "--resume-worlds", "1", "2",
                           "--steps", "2", "--batch", "64", "--eval-samples", "256", "--work", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    ref = lines.pop()
    assert ref["bench"] == "scale" and ref["io_reference"]["bytes"] > 0, ref
    assert "[bench_scale] resume:" in proc.stderr  # progress on stderr
    runs = {(x["run"], x["world"]): [] for x in lines}
    for x in lines:
        runs[(x["run"], x["world"])].append(x)
    assert sorted(runs) == [("resume", 1), ("resume", 2), ("train", 1)]
    phases = {k: {x["phase"]: x for x in v} for k, v in runs.items()}
    assert {"init", "store_init", "train", "eval", "save"} <= set(phases[("train", 1)])
    assert {"init", "resume", "eval"} <= set(phases[("resume", 2)])
    share = rows * tables * (dim * 4 + dim * 4 + 8)  # adagrad: row + its state + version, per real row
    for (run, world), by in phases.items():
        for x in by.values():
            assert len(x["peak_rss"]) == world and all(p > 0 for p in x["peak_rss"]), x
            assert x["model_bytes"] == sum(x["share_bytes"]) and x["model_bytes"] >= share, x
            assert x["peak_over_share"] == [round(p / s, 3) for p, s in zip(x["peak_rss"], x["share_bytes"])]
            assert all(s > 0 for s in x["steady_rss"]), x
        if run == "resume":
            assert all(x["from_world"] == 1 for x in by.values())
    save = phases[("train", 1)]["save"]
    assert save["wchar"][0] >= share  # the shard went through write calls
    # what a rank at 2W reads is counted (its bound, half a shard, is checked byte for byte by
    # test_checkpoint_format.py: at this size whole 1 MiB blocks and imports dominate)
    assert all(r > 0 for r in phases[("resume", 2)]["resume"]["rchar"])
