"""benchmarks/bench_criteo_systems.py shrunk, on the suite's Criteo-format sample (tests/data_helpers.py:
1,999 made-up rows in Criteo's raw format): the input prepared into a temporary directory that is
gone afterwards, one JSON line per point of every part, and the figures that must hold whatever the
data: Herald's counters of the W = 2 run equal the simulator's, the plain run's measured pulls equal
the naive count, every lent row is written back once, SCA's prediction is exact when it replays the
whole run. The figures on real rows are the report's (benchmarks/reports/2026-11-29-seed-systems-on-criteo.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from data_helpers import N_ROWS, N_TRAIN, write_sample
from hvd_launch import ROOT, env

MODULE = ["-m", "benchmarks.bench_criteo_systems"]
SHRUNK = ["--worlds", "2", "4", "--capacities", "0.1", "--epochs", "1", "--train-steps", "4",
          "--train-capacities", "0.1", "--fae-budgets", "0.05", "--sca-plan-steps", "2", "0"]


def _run(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *MODULE, *args], check=False, capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=timeout)


@pytest.mark.dist
def test_every_part_on_the_sample_and_nothing_left_behind(tmp_path):
    sample = write_sample(str(tmp_path / "sample.tsv"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = _run(["--input", sample, "--tmp", str(scratch), *SHRUNK])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(scratch.iterdir()) == []  # the prepared rows went with the temporary directory
    assert "[bench_criteo_systems] train herald (W=2, capacity 0.1)" in proc.stderr  # progress on stderr
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert all(x["bench"] == "criteo_systems" for x in lines)
    assert [x["part"] for x in lines] == ["data", "herald_sim", "herald_sim", "herald_train", "fae", "sca", "sca"]
    data, sim2, sim4, train, fae, *sca = lines

    assert data["split_rows"] == {"train": N_TRAIN, "test": N_ROWS - N_TRAIN} and data["train_rows"] == N_TRAIN
    assert data["reads_per_epoch"] == 26 * N_TRAIN and 0 < data["distinct_ids"] <= data["table_rows_total"]
    assert data["vocab"] == {"kind": "vocab", "min_count": 1}

    for x, w in ((sim2, 2), (sim4, 4)):
        h = x["herald"]
        assert (x["workers"], x["steps"], x["capacity_fraction"]) == (w, N_TRAIN // 128, 0.1)
        assert h["writebacks"] == h["lend_pulls"] > 0  # every lent row goes back once (the final flush included)
        assert h["pushes"] == h["grad_pushes"] + h["writebacks"] >= h["pulls"]
        assert x["pulls_vs_naive"] == pytest.approx(h["pulls"] / x["naive_remote_reads"], abs=1e-4)
        assert 0 < x["shared_pulls_vs_naive"] <= x["pulls_vs_naive"] < 1
        assert 0 < x["random_partition_on_demand_sync"]["pulls_vs_naive"] <= 1.0 + 1e-9
        no_lend = x["herald_partition_no_lending"]
        assert no_lend["pulls_vs_naive"] == no_lend["pushes_vs_naive"] <= 1

    assert train["counters_equal"] and train["differences"] == {} and train["trained"] == train["simulated"]
    assert train["naive_equals_plain_measured"]  # the plain run pulled exactly the naive count
    assert train["pulls_from_rows_bytes"] == train["trained"]["pulls"]  # SGD: a pull is one row on the wire
    assert train["pushes_from_grads_bytes"] == train["trained"]["pushes"]
    assert train["final_loss"]["herald"] == pytest.approx(train["final_loss"]["plain"], rel=1e-5)  # exact (BSP)

    assert fae["hot_rows"] == fae["hot_rows_replanned"] > 0
    assert 0 < fae["hot_share_of_reads"] <= 1 and 0 <= fae["all_hot_sample_share"] <= fae["hot_share_of_reads"]
    assert fae["alltoalls_in_hot_steps"] == 0
    assert fae["fae_vs_plain_bytes"] == pytest.approx(
        fae["embedding_bytes_per_sample"]["fae"] / fae["embedding_bytes_per_sample"]["plain"], abs=1e-3)

    assert [x["plan_steps"] for x in sca] == [2, 4]
    whole = sca[1]  # the whole run replayed: the prediction is the measurement
    assert whole["error"] == pytest.approx(0, abs=1e-6)
    assert whole["predicted_bytes_per_sample"] == pytest.approx(whole["measured_bytes_per_sample"], rel=1e-6)
    assert whole["chosen"] in [c["name"] for c in whole["candidates"]]


@pytest.mark.parametrize("args,says", [
    (["--input", "/nonexistent/input"], "--input /nonexistent/input: no such file"),
    (["--prepared", "/nonexistent"], "--prepared /nonexistent: no meta.json there"),
    (["--input", "{sample}", "--batch", "100", "--worlds", "8"],
     "--batch 100: must be divisible by every world size (8)"),
    (["--input", "{sample}", "--train-steps", "0"], "--train-steps 0: must be > 0"),
    (["--input", "{sample}", "--", "nosuch=1"], "Could not override 'nosuch'"),
])
def test_bad_input_is_one_error_line_and_status_2(tmp_path, args, says):
    sample = write_sample(str(tmp_path / "sample.tsv"))
    proc = _run([a.format(sample=sample) for a in args], timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and says in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
