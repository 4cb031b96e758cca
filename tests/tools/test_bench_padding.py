"""benchmarks/bench_padding.py: the wire of train.cuda_graph=on against off, per policy, at W = 2.

A real run on the tiny workload (three modes of the plain policy): one JSON line per mode, the
final losses equal (the modes are exact), the bound's blocks the widest wire, the measured blocks
between; and bad input as one error line with status 2 before any run starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import bench_padding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.dist
def test_three_modes_of_one_policy_on_the_wire():
    cmd = [sys.executable, "-m", "benchmarks.bench_padding", "--policies", "plain", "--steps", "24", "--skip", "20",
           "--", "data=tiny", "data.global_batch_size=256", "data.max_bag=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [x["mode"] for x in lines] == ["off", "bound", "measured"]
    off, bound, measured = lines
    assert all(x["final_loss_equal"] for x in lines) and off["to_off"] == 1.0
    assert off["unique_capacity"] is None and bound["unique_capacity"] == bound["unique_bound"]
    assert measured["unique_capacity"] < measured["unique_bound"]
    assert off["bytes_per_step"]["dense"] == bound["bytes_per_step"]["dense"] > 0
    assert bound["embedding_to_off"] > measured["embedding_to_off"] >= 1.0
    if measured["overflow_steps"] == 0:  # W blocks of C rows of d = 16 fp32 (the counters count all W)
        c = measured["unique_capacity"]
        assert measured["bytes_per_step"]["rows"] == 2 * c * 16 * 4
        assert measured["bytes_per_step"]["ids"] == 2 * (c + 1) * 4  # int32 ids, one slot more: the excess


@pytest.mark.parametrize("args, says", [(["--world", "1"], "--world 1: must be >= 2"),
                                        (["--steps", "10", "--skip", "10"], "--skip 10: must be > 0 and below"),
                                        (["--", "data.batch_size=-1"], "data.batch_size=-1")])
def test_bad_input_is_one_line(args, says, capsys):
    assert bench_padding.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]
