"""benchmarks/bench_scale.py (and the per-rank probe benchmarks/scale_probe.py), the documented
command shrunk: training at W = 1 and W = 2, each checkpoint resumed at W = 2, one JSON line per (run, phase) with
every rank's figures, then the disk's sequential reference. The figures themselves are the
benchmark's (benchmarks/reports/); here: every phase is there, per rank, and adds up."""
from __future__ import annotations

import json
import os
import subprocess

from docs_registry import documented

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_phase_of_a_train_and_a_resume_at_2w():
    """benchmarks/README.md's command (`--rows 2000000 --worlds 1 2`) as its registry entry shrinks
    it (tests/docs_registry.py): training at W = 1 and at W = 2, each checkpoint resumed at W = 2."""
    argv = documented(".venv/bin/python -m benchmarks.bench_scale --rows 2000000 --worlds 1 2")
    rows, tables, dim = (int(argv[argv.index(k) + 1]) for k in ("--rows", "--tables", "--dim"))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    ref = lines.pop()
    assert ref["bench"] == "scale" and ref["io_reference"]["bytes"] > 0, ref
    assert "[bench_scale] resume:" in proc.stderr  # progress on stderr
    runs = {(x["run"], x["world"], x.get("from_world")): [] for x in lines}
    for x in lines:
        runs[(x["run"], x["world"], x.get("from_world"))].append(x)
    assert sorted(runs, key=str) == sorted([("resume", 2, 1), ("resume", 2, 2), ("train", 1, None), ("train", 2, None)],
                                           key=str)
    phases = {k: {x["phase"]: x for x in v} for k, v in runs.items()}
    for w in (1, 2):
        assert {"init", "store_init", "train", "eval", "save"} <= set(phases[("train", w, None)])
        assert {"init", "resume", "eval"} <= set(phases[("resume", 2, w)])
    share = rows * tables * (dim * 4 + dim * 4 + 8)  # adagrad: row + its state + version, per real row
    for (run, world, _), by in phases.items():
        for x in by.values():
            assert len(x["peak_rss"]) == world and all(p > 0 for p in x["peak_rss"]), x
            assert x["model_bytes"] == sum(x["share_bytes"]) and x["model_bytes"] >= share, x
            assert x["peak_over_share"] == [round(p / s, 3) for p, s in zip(x["peak_rss"], x["share_bytes"])]
            assert all(s > 0 for s in x["steady_rss"]), x
    save = phases[("train", 1, None)]["save"]
    assert save["wchar"][0] >= share  # the shard went through write calls
    # what a rank at 2W reads is counted (its bound, half a shard, is checked byte for byte by
    # test_checkpoint_format.py: at this size whole 1 MiB blocks and imports dominate)
    assert all(r > 0 for r in phases[("resume", 2, 1)]["resume"]["rchar"])
