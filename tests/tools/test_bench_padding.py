"""benchmarks/bench_padding.py: the wire of train.cuda_graph=on against off, per policy, at W = 2.

The README's command, shrunk: one JSON line per workload x policy x mode, the final losses equal
(the modes are exact), the bound's blocks the widest wire, the measured blocks between; and bad
input as one error line with status 2 before any run starts."""
from __future__ import annotations

import argparse
import json
import os
import subprocess

import pytest

from benchmarks import bench_padding
from docs_registry import documented

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.dist
def test_every_policy_on_the_wire():
    """The README's command, shrunk as tests/docs_registry.py says (the bench workload only: the
    MLPerf shape runs the same code at d = 128; 22 steps of 64 samples per rank, tables of at most
    3,000 rows): one line per policy x mode, every final loss equal to
    off's, the bound's blocks the widest wire and the measured ones between (Herald: the same wire
    in every mode)."""
    cmd = documented("python -m benchmarks.bench_padding --workloads bench mlperf")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert [(x["workload"], x["policy"], x["mode"]) for x in lines] == [
        (w, p, m) for w in ("bench",) for p in ("plain", "fae", "sca", "het", "herald")
        for m in ("off", "bound", "measured")]
    for i in range(0, len(lines), 3):
        off, bound, measured = lines[i:i + 3]
        assert all(x["final_loss_equal"] for x in (off, bound, measured)) and off["to_off"] == 1.0
        assert off["unique_capacity"] is None and bound["unique_capacity"] == bound["unique_bound"]
        assert measured["unique_capacity"] < measured["unique_bound"]
        assert off["bytes_per_step"]["dense"] > 0
        if off["policy"] == "herald":  # its wire is sized by the host's plan in both modes: the same bytes
            emb = [{k: v for k, v in x["bytes_per_step"].items() if k != "dense"} for x in (off, bound, measured)]
            assert emb[0] == emb[1] == emb[2] and bound["embedding_to_off"] == measured["embedding_to_off"] == 1.0
            assert measured["exact_size_lookups"] is not None
            continue
        assert bound["embedding_to_off"] > measured["embedding_to_off"] >= 1.0
        if measured["overflow_steps"] == 0 and measured["policy"] == "plain":  # W blocks of C rows, fp32
            c, d = measured["unique_capacity"], 16
            assert measured["bytes_per_step"]["rows"] == 2 * c * d * 4
            assert measured["bytes_per_step"]["ids"] == 2 * (c + 1) * 4  # int32 ids, one slot more: the excess
    assert any(x["hot_rows"] > 0 for x in lines if x["policy"] == "fae")
    het = [x for x in lines if x["policy"] == "het"]  # the version checks travel both ways
    assert all(x["bytes_per_step"]["versions"] > 0 for x in het)


@pytest.mark.parametrize("args, says", [(["--world", "1"], "--world 1: must be >= 2"),
                                        (["--steps", "10", "--skip", "10"], "--skip 10: must be > 0 and below"),
                                        (["--batch", "0"], "--batch 0: must be > 0"),
                                        (["--", "data.batch_size=-1"], "data.batch_size=-1")])
def test_bad_input_is_one_line(args, says, capsys):
    assert bench_padding.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0]


def test_modes_run_off_first_as_the_ratios_base():
    """--modes picks modes in their fixed order; off always runs, first (every ratio is against it)."""
    ns = lambda modes: argparse.Namespace(modes=modes)  # noqa: E731
    assert bench_padding.modes(ns(["measured"])) == ["off", "measured"]
    assert bench_padding.modes(ns(["measured", "bound"])) == ["off", "bound", "measured"]
    assert bench_padding.modes(ns(list(bench_padding.MODES))) == ["off", "bound", "measured"]
