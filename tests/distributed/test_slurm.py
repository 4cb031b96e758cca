"""The trainer on a real Slurm (tests/slurm_helpers.py: slurmctld and two one-CPU slurmd nodes on
this host, everything in a private directory), with the commands of docs/running.md's "On Slurm" as
printed (`documented`), run from a scratch directory holding the checkout's scripts/ and .venv:

- `srun` one task per rank (no launcher: the tasks take RANK / WORLD_SIZE / LOCAL_RANK from
  SLURM_*) trains the same W = 2 job as torchrun: every logged loss, every final parameter and
  optimizer state, the bytes and the eval;
- scripts/slurm/train.sbatch, preempted by `scancel --signal=TERM` and then by USR1 (what
  `--signal=USR1@N` sends the tasks ahead of the time limit), saves, exits 143 through the job
  wrapper, requeues itself (SLURM_RESTART_COUNT 1, then 2), resumes with checkpoint.resume=auto
  and ends equal to the same job never stopped;
- scripts/slurm/sweep.sbatch as an `sbatch --array` runs one job per staleness bound, and
  scripts/plot_sweep.py plots them.

Needs root and Slurm (scripts/install_slurm.sh, which .ci/run runs as root): skipped with the
reason otherwise. The tests share one cluster (one xdist group)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from benchmarks.bench_stop import trained_steps
from docs_registry import documented
from helpers import free_port
from hvd_launch import ROOT, tail, torchrun
from multihost_helpers import assert_same_model, assert_same_training
from slurm_helpers import CRED_EXPIRE_S, SlurmCluster, require_slurm

pytestmark = [pytest.mark.dist, pytest.mark.xdist_group("slurm")]
SHORT = ["data.test_samples=512", "train.progress=off"]  # what the registry's entries add, and the reference


@pytest.fixture(scope="module")
def cluster():
    require_slurm()
    with SlurmCluster() as c:
        yield c


def _scratch(tmp_path, cluster=None) -> tuple[str, dict]:
    """A directory to submit from (the checkout's scripts/ and .venv linked in, as a user's checkout
    has them) and the clients' environment: this checkout's trainer on PYTHONPATH (the venv's
    editable install may be another checkout's); MASTER_ADDR for srun alone, because the test's node
    names (n1, n2) do not resolve (a cluster's do; train.sbatch takes the node's NodeAddr)."""
    d = str(tmp_path)
    for name in ("scripts", "dev"):
        os.symlink(os.path.join(ROOT, name), os.path.join(d, name))
    os.symlink(sys.prefix, os.path.join(d, ".venv"))
    extra = {"PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1"}
    return d, (cluster.env(extra) if cluster is not None else {**os.environ, **extra})


def _submit(cluster, argv: list[str], cwd: str, env: dict) -> str:
    assert argv[0] == "sbatch"
    p = cluster.run(argv[:1] + ["--parsable"] + argv[1:], cwd=cwd, env=env)
    return p.stdout.strip().split(";")[0]


def _losses(out: str) -> dict[int, float]:
    """Step -> loss of metrics.jsonl (every train.log_every-th step, and a stop's step)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_srun_one_task_per_rank_equals_torchrun(cluster, tmp_path):
    cwd, env = _scratch(tmp_path, cluster)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    argv = documented("srun --nodes=2 --ntasks-per-node=1 .venv/bin/python -m trainer comm=torch hydra.run.dir=runs/srun")
    got = cluster.run(argv, cwd=cwd, env=env, check=False, timeout=240)
    assert got.returncode == 0, tail(got) + cluster.log()
    net = os.path.join(cwd, "runs", "srun")
    s = json.load(open(os.path.join(net, "summary.json")))
    assert s["world_size"] == 2 and s["backend"] == "TorchCollectives", s
    # the two nodes are two hosts to the trainer (LOCAL_WORLD_SIZE 1 each): comm.settled_rows=auto sends
    # the settled rows early as across hosts, what `always` does on one
    local = str(tmp_path / "torchrun")
    ref = torchrun(["-m", "trainer", "comm=torch", *argv[argv.index("comm=torch") + 1:], f"hydra.run.dir={local}",
                    "comm.settled_rows=always"], timeout=240)
    assert ref.returncode == 0, tail(ref)
    assert_same_training(local, net, logged=[10, 12])


def _requeued(cluster, job: str, count: int) -> None:
    """Wait until the job was requeued `count` times, then, once its old credential has expired
    (cred_expire after the requeue revoked it: a start before that is killed, "Job credential
    revoked", and the job FAILS), let it start at once instead of at Slurm's later begin time."""
    cluster.wait(job, lambda i: int(i.get("Restarts", "0")) >= count, timeout=120, what=f"requeued {count}x")
    time.sleep(CRED_EXPIRE_S + 1)
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)


def test_a_preempted_job_saves_requeues_itself_and_resumes(cluster, tmp_path):
    cwd, env = _scratch(tmp_path, cluster)
    env.update(MASTER_PORT=str(free_port()))
    argv = documented("sbatch scripts/slurm/train.sbatch hydra.run.dir=runs/slurm")
    job = _submit(cluster, argv, cwd, env)
    out = os.path.join(cwd, "runs", "slurm")
    log = os.path.join(cwd, f"slurm-trainer-{job}.out")

    def until(cond, what: str, timeout: float = 180) -> None:
        t0 = time.monotonic()
        while not cond():
            info = cluster.job(job)
            assert info["JobState"] not in ("FAILED", "CANCELLED", "COMPLETED", "TIMEOUT", "NODE_FAIL"), \
                f"{what}: job {job} {info['JobState']}\n{open(log).read()[-3000:] if os.path.exists(log) else ''}"
            assert time.monotonic() - t0 < timeout, f"{what}: not after {timeout:g} s\n{cluster.log()}"
            time.sleep(0.1)

    until(lambda: trained_steps(out) >= 1, "training")
    cluster.run(documented("scancel --signal=TERM JOBID")[:-1] + [job])  # to the tasks: they save
    _requeued(cluster, job, 1)
    first = json.load(open(os.path.join(out, "summary.json")))["stopped"]
    until(lambda: "resuming from" in open(log).read() and trained_steps(out) > first["step"] // 10 + 1, "resumed")
    cluster.run(["scancel", "--signal=USR1", job])  # what --signal=USR1@N sends the tasks before the limit
    _requeued(cluster, job, 2)
    second = json.load(open(os.path.join(out, "summary.json")))["stopped"]
    info = cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", timeout=240, what="completed")
    text = open(log).read()
    assert info["ExitCode"] == "0:0" and int(info["Restarts"]) == 2, info
    assert [int(n) for n in re.findall(r"^\[train\.sbatch\] job \d+ start (\d+):", text, re.M)] == [0, 1, 2], text
    assert text.count("[job] preempted (exit 143; 2 trainer process(es) ended: ") == 2, text[-4000:]
    assert "2 trainer process(es) ended: 138, 138" in text  # USR1: 128 + 10, the wrapper's 143
    assert text.count("requeue job") == 2 and "[job] complete (exit 0; 2 trainer process(es) ended: 0, 0" in text
    assert "Traceback" not in text, text[-4000:]
    assert 0 < first["step"] < second["step"] < 200 and first["signal"] == "SIGTERM" and second["signal"] == "SIGUSR1"
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["start_step"] == second["step"] and s["end_step"] == 200 and s.get("stopped") is None, s
    # the same job never stopped: torchrun, the same overrides
    ref = str(tmp_path / "uninterrupted")
    r = torchrun(["-m", "trainer", "comm=torch", *argv[argv.index("hydra.run.dir=runs/slurm") + 1:],
                  f"hydra.run.dir={ref}"], timeout=300)
    assert r.returncode == 0, tail(r)
    got, want = _losses(out), _losses(ref)
    # a stop's step is logged too; it may be a logged step already (a stop at step 30)
    assert sorted(want) == list(range(10, 201, 10)) and sorted(got) == sorted({*want, first["step"], second["step"]})
    assert [got[k] for k in sorted(want)] == pytest.approx([want[k] for k in sorted(want)], rel=1e-6)
    assert_same_model(ref, out)


def test_an_array_job_sweeps_the_staleness_bound_and_plot_sweep_plots_it(cluster, tmp_path):
    cwd, env = _scratch(tmp_path, cluster)
    argv = documented("sbatch --array=0-1 scripts/slurm/sweep.sbatch consistency.pull_bound=0,4 cache=lfu "
                      "hydra.sweep.dir=multirun/stale-slurm")
    array = _submit(cluster, argv, cwd, env)
    t0 = time.monotonic()
    while True:  # every array task done
        p = cluster.run(["squeue", "-h", "-r", "-j", array, "-o", "%i %T"], check=False)
        if not p.stdout.strip():
            break
        assert time.monotonic() - t0 < 240, p.stdout + cluster.log()
        time.sleep(0.2)
    sweep = os.path.join(cwd, "multirun", "stale-slurm")
    got = {}
    for task, bound in enumerate((0, 4)):
        info = cluster.job(f"{array}_{task}")
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", info
        s = got[bound] = json.load(open(os.path.join(sweep, f"bound{bound}", "summary.json")))
        assert s["config"]["consistency"]["pull_bound"] == s["config"]["consistency"]["push_bound"] == bound
        assert s["config"]["cache"]["policy"] == "lfu" and s["world_size"] == 2, s["world_size"]
    # every point at W = 2: the bound acts (copies read behind the others' updates at 4, never at 0)
    assert got[0]["cache"]["staleness"]["max"] == 0 < got[4]["cache"]["staleness"]["max"] <= 4
    assert got[0]["final_loss"] != got[4]["final_loss"]
    one = _submit(cluster, ["sbatch", "--array=0", "--nodes=1", "scripts/slurm/sweep.sbatch", "consistency.pull_bound=0,4",
                            "hydra.sweep.dir=multirun/stale-one"], cwd, env)  # a point at W = 1: refused
    info = cluster.wait(f"{one}_0", lambda i: i.get("JobState") in ("FAILED", "COMPLETED"), timeout=120, what="ended")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", info
    out = open(os.path.join(cwd, f"slurm-stale-{one}_0.out")).read()
    assert "every point needs W >= 2" in out and not os.path.exists(os.path.join(cwd, "multirun", "stale-one")), out
    plot = subprocess.run(documented(".venv/bin/python scripts/plot_sweep.py multirun/stale-slurm --out stale-slurm.png"),
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-3000:]
    line = json.loads(plot.stdout.strip().splitlines()[-1])
    assert sorted(p["x"] for p in line["points"]) == [0, 4], line
    assert line["chosen"] is not None and os.path.getsize(os.path.join(cwd, "stale-slurm.png")) > 1000


def test_slurm_on_one_machine_as_the_docs_show_it(tmp_path):
    """docs/running.md's way to try Slurm without a cluster: dev/slurmcluster.py starts a real one on
    this host, runs the srun job against it at W = 2 (each task's threads its node's one CPU), and
    stops it (no daemon left, its directory gone)."""
    require_slurm()
    cwd, env = _scratch(tmp_path)
    env["MASTER_PORT"] = str(free_port())
    got = subprocess.run(documented(".venv/bin/python -m dev.slurmcluster -- srun --nodes=2 --ntasks-per-node=1 "
                                    "--export=ALL,MASTER_ADDR=127.0.0.1 .venv/bin/python -m trainer comm=torch "
                                    "train.steps=20 hydra.run.dir=runs/srun-local"),
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, tail(got)
    conf = re.search(r"export SLURM_CONF=(\S+)", got.stdout).group(1)
    assert not os.path.exists(os.path.dirname(conf))  # the cluster's directory removed
    s = json.load(open(os.path.join(cwd, "runs", "srun-local", "summary.json")))
    assert s["world_size"] == 2 and s["threads"] == 1 and s["steps"] == 20, s


def test_bench_slurm_puts_srun_beside_torchrun(tmp_path):
    """benchmarks/bench_slurm.py, shrunk: one srun and one torchrun job, a line each and the ratio."""
    require_slurm()
    got = subprocess.run([sys.executable, "-m", "benchmarks.bench_slurm", "--steps", "4", "--repeats", "1", "--",
                          "data.max_table_rows=1000", "data.batch_size=64", "data.test_samples=128"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, tail(got)
    lines = [json.loads(x) for x in got.stdout.splitlines()]
    assert [x.get("launcher") for x in lines[:2]] == ["srun", "torchrun"] and all(x["world_size"] == 2 for x in lines[:2])
    assert lines[2]["srun_to_torchrun"] > 0
    bad = subprocess.run([sys.executable, "-m", "benchmarks.bench_slurm", "--steps", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --steps 0"), bad.stderr
