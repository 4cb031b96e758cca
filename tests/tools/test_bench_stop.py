"""benchmarks/bench_stop.py shrunk (data=tiny): a stop signal in every phase ends the run with the
job's preempted status (143), a complete checkpoint of the step it stopped at (none when FAE's
profile was cut: nothing trained), one JSON line per phase; at W = 2 through torchrun under the job
wrapper. The seconds at the bench size are docs/operations.md's table."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hvd_launch import ROOT, env


def _run(args: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_stop", "--data", "tiny", *args],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in proc.stdout.splitlines()]


@pytest.mark.dist
def test_every_phase_stops_with_the_preempted_status_and_its_checkpoint():
    # tiny's evaluation (4,096 samples) can end before the signal reaches the workers (torchrun
    # relays it): then step 6 runs and the stop comes after it. 200,000 samples keep the
    # evaluation going for the signal (about a second).
    long_eval = ["--", "data.test_samples=200000"]
    lines = _run(long_eval)
    assert [x["phase"] for x in lines] == ["startup", "resume", "step", "eval", "save"]
    for x in lines:
        assert x["exit_status"] == 143 and 0 < x["signal_to_exit_s"] < 120, x
        if x["phase"] == "resume" and x["stopped_at"] is None:  # the load was cut short: nothing trained
            continue
        assert x["checkpoint_complete"] and x["stopped_at"] >= 1, x
    eval_, save = lines[3], lines[4]
    assert eval_["stopped_at"] == 5 and "save_step" not in eval_
    # the save of step 5 (or, when it ended between two of the bench's looks 10 ms apart, a later one):
    # it finishes, one more step runs, the stop saves that step
    assert save["save_step"] % 5 == 0 and save["stopped_at"] == save["save_step"] + 1, save
    (fae,) = _run(["--phases", "startup", "--", "placement=fae", "placement.profile_fraction=1.0"])
    assert fae["exit_status"] == 143 and fae["stopped_at"] is None and not fae["checkpoint_complete"]
    (w2,) = _run(["--world", "2", "--phases", "eval", *long_eval])
    assert w2["exit_status"] == 143 and w2["stopped_at"] == 5 and w2["checkpoint_complete"]
