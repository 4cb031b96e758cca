"""Hydra sweeps (`python -m trainer -m ...`): every job of a sweep under torchrun runs in its own
process group (a 3-job staleness sweep at W = 2, each job equal to the same job run alone); a job
that fails is named in one line, the sweep goes on and exits 2, and the sweep's summary.json says
which jobs ran; scripts/plot_sweep.py names the jobs without a summary and refuses to choose a bound
from an incomplete sweep unless --allow-missing; a second sweep on a sweep dir in use is refused
before Hydra rewrites its multirun.yaml (alone and under torchrun), and a killed sweep's dir is
taken over.

(Under torchrun the second job of a sweep used to fail to connect: env:// put every process group
of a worker under the same keys of torchrun's store, so the second group's gloo read the first
group's addresses. The horovodrun sweep is in test_horovod.py.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from failure_helpers import _popen, _wait_for

from helpers import run_world
from hvd_launch import ROOT, TORCHRUN, env, tail, torchrun

pytestmark = pytest.mark.dist

SWEEP_ARGS = ["data=tiny", "train.steps=12", "data.test_samples=512", "train.progress=off",
              "checkpoint.enabled=false", "cache=lru", "comm.timeout_s=30"]
BOUNDS = [0, 1, 4]


def _read(path) -> dict:
    with open(path) as f:
        return json.load(f)


def test_torchrun_staleness_sweep_runs_every_job_as_if_alone(tmp_path):
    sweep = tmp_path / "stale"
    proc = torchrun(["-m", "trainer", "-m", "comm=torch", *SWEEP_ARGS,
                     f"consistency.pull_bound={','.join(map(str, BOUNDS))}",
                     "consistency.push_bound=${consistency.pull_bound}", f"hydra.sweep.dir={sweep}"])
    assert proc.returncode == 0, tail(proc)
    index = _read(sweep / "summary.json")
    assert (index["ok"], index["failed"]) == (3, 0), index
    assert [j["num"] for j in index["jobs"]] == [0, 1, 2]
    for job, bound in zip(index["jobs"], BOUNDS):
        assert job["status"] == "ok" and f"consistency.pull_bound={bound}" in job["overrides"], job
        summary = _read(job["summary"])
        assert summary["world_size"] == 2 and summary["cache"]["pull_bound"] == bound
        alone = run_world(2, SWEEP_ARGS + [f"consistency.pull_bound={bound}",
                                           f"consistency.push_bound={bound}"], return_state=False)[0].summary
        for key in ("final_loss", "eval_auc", "eval_logloss", "bytes", "steps"):
            assert summary[key] == alone[key], (bound, key, summary[key], alone[key])
        assert summary["cache"]["hits"] == alone["cache"]["hits"]


def _trainer(args: list[str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})


def _plot(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_sweep.py"), *args],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})


def test_a_failed_job_is_named_the_sweep_goes_on_and_plot_refuses_to_choose(tmp_path):
    sweep = tmp_path / "sw"
    proc = _trainer(["-m", "data=tiny", "train.steps=3", "data.test_samples=256", "train.progress=off",
                     "checkpoint.enabled=false", "cache=lru", "consistency.pull_bound=0,-7,4",
                     "consistency.push_bound=${consistency.pull_bound}", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 2, tail(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, proc.stderr[-3000:]
    assert errors[0].startswith("error: sweep job 1 (consistency.pull_bound=-7) failed: ") and "failed: consistency" in errors[0]
    assert errors[1].startswith("error: 1 of 3 sweep jobs failed: job 1 (consistency.pull_bound=-7); see ")
    assert "Traceback" not in proc.stderr
    index = _read(sweep / "summary.json")
    assert [j["status"] for j in index["jobs"]] == ["ok", "failed", "ok"] and index["failed"] == 1
    assert index["jobs"][1]["error"].startswith("consistency") and "summary" not in index["jobs"][1]
    assert "consistency.push_bound=${consistency.pull_bound}" in index["jobs"][0]["overrides"]
    assert (sweep / "0" / "summary.json").exists() and (sweep / "2" / "summary.json").exists()

    png = tmp_path / "s.png"
    refused = _plot([str(sweep), "--out", str(png)])
    assert refused.returncode == 2 and not png.exists(), refused.stderr
    assert "1 of 3 jobs have no summary.json" in refused.stderr and "consistency.pull_bound=-7" in refused.stderr
    assert "--allow-missing" in refused.stderr
    used = _plot([str(sweep), "--out", str(png), "--allow-missing", "--auc-tol", "1"])
    assert used.returncode == 0, used.stderr
    rep = json.loads(used.stdout.strip().splitlines()[-1])
    assert [p["x"] for p in rep["points"]] == [0, 4] and rep["chosen"] is not None  # the interpolated bound too
    assert [(m["num"], m["error"][:11]) for m in rep["missing"]] == [(1, "consistency")]
    assert "no summary.json: job 1" in used.stderr and png.exists()


def test_plot_names_jobs_of_a_sweep_that_was_stopped(tmp_path):
    """A sweep stopped after its first job (no sweep summary for the rest): the jobs never run are
    named from Hydra's multirun.yaml."""
    sweep = tmp_path / "sw"
    proc = _trainer(["-m", "data=tiny", "train.steps=2", "data.test_samples=256", "train.progress=off",
                     "checkpoint.enabled=false", "consistency.pull_bound=0,2", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, tail(proc)
    for leftover in (sweep / "1").iterdir():  # as if the sweep had been killed before job 1 wrote anything
        if leftover.is_file():
            leftover.unlink()
    (sweep / "summary.json").unlink()
    refused = _plot([str(sweep), "--out", str(tmp_path / "p.png")])
    assert refused.returncode == 2 and "job 1 of" in refused.stderr and "consistency.pull_bound=2" in refused.stderr


def test_plot_without_matplotlib_one_line_names_the_extra(tmp_path, capsys, monkeypatch):
    """matplotlib comes with the `plot` extra: without it the command says so in one line, before
    reading the sweep."""
    from trainer.tools import sweep

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what importlib finds when it is not installed
    assert sweep.main([str(tmp_path / "stale")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "matplotlib" in err and "pip install 'hybrid-trainer[plot]'" in err, err


def test_a_second_sweep_on_a_sweep_dir_in_use_is_refused(tmp_path):
    """Sweep A trains its job 0 in hydra.sweep.dir=sw; sweep B on the same dir, alone and under
    torchrun (W = 2), stops with one error naming the dir and A before Hydra writes anything: every
    byte under sw (multirun.yaml, job 0's record and metrics, lock.json) is as it was; rank 1's
    Hydra wrote into a private sweep dir. Once A is killed, sweep C takes the dir over (a warning)."""
    sweep = tmp_path / "sw"
    base = ["data=tiny", "train.progress=off", "checkpoint.enabled=false", f"hydra.sweep.dir={sweep}"]
    a = _popen(tmp_path, "-m", *base, "train.steps=100000", "optim.lr=0.01,0.1")
    try:
        _wait_for(a, (sweep / "0" / "metrics.jsonl").exists, "sweep A did not start its job 0")
        a.send_signal(signal.SIGSTOP)  # A holds sw and stands still
        holder = _read(sweep / "lock.json")
        before = {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()}
        assert holder["pid"] == a.pid and sweep / "multirun.yaml" in before
        said = f"error: hydra.sweep.dir {sweep} is in use by run {holder['run_id']} (pid {a.pid} on host "
        alone = _trainer(["-m", *base, "train.steps=2", "optim.lr=0.5,1"], tmp_path)
        assert alone.returncode == 2 and alone.stderr.strip().splitlines()[-1].startswith(said), tail(alone)
        assert [line for line in alone.stderr.splitlines() if line.startswith("error:")] == \
            alone.stderr.strip().splitlines()[-1:] and "Traceback" not in alone.stderr
        private = tmp_path / "tmp"
        private.mkdir()
        both = subprocess.run([sys.executable, TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "trainer",
                               "-m", "comm=torch", *base, "train.steps=2", "optim.lr=0.5,1"], cwd=ROOT,
                              env={**env(), "TMPDIR": str(private)}, capture_output=True, text=True, timeout=300)
        assert both.returncode != 0 and said in both.stderr, tail(both)
        assert {p: p.read_bytes() for p in sweep.rglob("*") if p.is_file()} == before
    finally:
        a.send_signal(signal.SIGKILL)  # a killed sweep: its lock stays
        a.communicate()
    c = _trainer(["-m", *base, "train.steps=2", "optim.lr=0.5"], tmp_path)
    assert c.returncode == 0, tail(c)
    assert f"hydra.sweep.dir {sweep}: took over the lock of run {holder['run_id']} (pid {a.pid}" in c.stderr
    assert "optim.lr=0.5" in (sweep / "multirun.yaml").read_text() and not (sweep / "lock.json").exists()
    assert [j["status"] for j in _read(sweep / "summary.json")["jobs"]] == ["ok"]
