"""One exit status for a whole job, launcher included (trainer/run/job.py): `python -m trainer.run.job
-- LAUNCHER ...` exits 0 complete, 143 preempted and resumable, 2 bad config or input, 3 a worker
lost, 1 any other failure; the launchers' tracebacks are held back unless the job failed otherwise.
Real torchrun and horovodrun jobs (W = 2, gloo) are signalled through the wrapper as a scheduler
signals a job, then requeued with checkpoint.resume=auto."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hvd_launch import HOROVODRUN, TORCHRUN, env, require_horovod

from benchmarks.bench_stop import trained_steps
from trainer.run.job import LauncherFilter, job_status

JOB = [sys.executable, "-m", "trainer.run.job", "--"]
ARGS = ["data=tiny", "data.global_batch_size=48", "data.test_samples=96", "train.threads=1", "train.progress=off",
        "train.log_every=1"]


def test_the_job_status_of_its_processes():
    assert job_status([0, 0], 0) == 0
    assert job_status([143, 143], 1) == 143 and job_status([138, 0], 1) == 143 and job_status([130], 130) == 143
    assert job_status([2, 2], 1) == 2 and job_status([2, 143], 1) == 2
    assert job_status([3, 143], 1) == 143 and job_status([3, 0], 1) == 3
    assert job_status([1, 0], 1) == 1 and job_status([0, 0], 1) == 1  # every process fine, the launcher not
    assert job_status([], 0) == 0 and job_status([], 2) == 1 and job_status([], -15) == 143


TORCHRUN_FAILURE = """[trainer] a line of ours
Traceback (most recent call last):
  File "/x/torch/distributed/run.py", line 1, in <module>
    main()
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainer FAILED
------------------------------------------------------------
Root Cause (first observed failure):
  exitcode  : 143
============================================================
W1129 05:00:00.000000 1 torch/distributed/elastic/agent/server/api.py:1] Received Signals.SIGTERM death signal
error: a line of ours after it
Traceback (most recent call last):
  File "mine.py", line 1, in <module>
ValueError: a real bug of ours
"""


def test_the_filter_holds_the_launchers_lines_back():
    out = io.StringIO()
    f = LauncherFilter(out)
    for line in io.StringIO(TORCHRUN_FAILURE):
        f.feed(line)
    f.close(show_held=False)
    assert out.getvalue() == ("[trainer] a line of ours\nerror: a line of ours after it\nTraceback (most recent call "
                              "last):\n  File \"mine.py\", line 1, in <module>\nValueError: a real bug of ours\n")
    assert "ChildFailedError" in "".join(f.held) and "Received Signals.SIGTERM" in "".join(f.held)
    shown = io.StringIO()
    g = LauncherFilter(shown)
    for line in io.StringIO(TORCHRUN_FAILURE):
        g.feed(line)
    g.close(show_held=True)
    assert sorted(shown.getvalue().splitlines()) == sorted(TORCHRUN_FAILURE.splitlines())


def _signalled_job(cmd: list[str], out: str, cwd: str, signum: int = signal.SIGTERM) -> subprocess.CompletedProcess:
    """Start the job through the wrapper, signal the wrapper (as a scheduler does: TERM, or Slurm's
    --signal=USR1) once a few steps ran, and wait for it."""
    proc = subprocess.Popen(JOB + cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while trained_steps(out) < 3:
        assert proc.poll() is None and time.monotonic() - t0 < 180, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _running_with(marker: str) -> list[int]:
    """Pids of running processes whose command line holds marker (a run's own output directory)."""
    from trainer.base.core import procs
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()
            and marker in " ".join(procs.cmdline(int(p)) or []) and not (procs.stat(int(p)) or procs.ProcStat("X", 0, "")).exited]


@pytest.mark.dist
def test_usr1_to_the_wrapper_under_torchrun_stops_every_worker_with_a_checkpoint(tmp_path):
    """SIGUSR1 to `python -m trainer.run.job -- torchrun ...` (Slurm's --signal=USR1@T): torchrun,
    which has no USR1 handler, gets TERM and stops its workers, which save; the wrapper exits 143
    within a minute with both workers ended and none left running."""
    out = str(tmp_path / "out")
    cmd = [sys.executable, TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "trainer", "comm=torch",
           *ARGS, "train.steps=100000", f"hydra.run.dir={out}"]
    t0 = time.monotonic()
    stopped = _signalled_job(cmd, out, str(tmp_path), signal.SIGUSR1)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("[job] preempted (exit 143; 2 trainer process(es) ended: 143, 143;"), last
    assert time.monotonic() - t0 < 180 and _running_with(out) == []
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["stopped"]["checkpoint"] and os.path.isdir(s["stopped"]["checkpoint"])


def test_the_wrapper_forwards_usr1_to_a_launcher_as_term_and_stops_stragglers(tmp_path):
    """USR1 becomes TERM for torchrun and horovodrun only; a process its command left behind gets
    the grace, then TERM (one line)."""
    from trainer.run import job
    assert job.is_launcher(["torchrun", "--standalone"]) and job.is_launcher([sys.executable, "/x/bin/horovodrun"])
    assert job.is_launcher([sys.executable, "-m", "torch.distributed.run"]) and not job.is_launcher([sys.executable, "-m", "trainer"])
    assert job.forwarded(signal.SIGUSR1, True) == signal.SIGTERM and job.forwarded(signal.SIGUSR1, False) == signal.SIGUSR1
    assert job.forwarded(signal.SIGINT, True) == signal.SIGINT
    # a command that exits at once, leaving a sleeper in its group
    done = subprocess.run(JOB[:-1] + ["--grace", "1", "--", "sh", "-c", "sleep 600 & echo started"], env=env(),
                          capture_output=True, text=True, timeout=120)
    assert "outlived the launcher" in done.stderr and done.stdout.strip() == "started", done.stderr
    assert not [p for p in os.listdir("/proc") if p.isdigit() and (open(f"/proc/{p}/cmdline", "rb").read()
                                                                  if os.path.exists(f"/proc/{p}/cmdline") else b"") == b"sleep\x00600\x00"]


def _check_preempted_then_requeued(cmd: list[str], out: str, cwd: str) -> None:
    stopped = _signalled_job(cmd, out, cwd)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "ChildFailedError" not in stopped.stderr, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith("[job] preempted (exit 143; 2 trainer process(es) ended: 143, 143;"), last
    assert "resumable: run the same command with checkpoint.resume=auto" in last
    k = json.load(open(os.path.join(out, "summary.json")))["stopped"]["step"]
    again = subprocess.run(JOB + cmd + ["checkpoint.resume=auto"], cwd=cwd, env=env(), capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.strip().splitlines()[-1].startswith("[job] complete (exit 0; 2 trainer process(es) ended: 0, 0")
    s = json.load(open(os.path.join(out, "summary.json")))
    assert s["start_step"] == k and s["end_step"] == 400 and s.get("stopped") is None


@pytest.mark.dist
def test_torchrun_preempted_exits_143_then_resumes_and_a_bad_config_exits_2(tmp_path):
    out = str(tmp_path / "out")
    cmd = [sys.executable, TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "trainer", "comm=torch",
           *ARGS, "train.steps=400", f"hydra.run.dir={out}"]
    _check_preempted_then_requeued(cmd, out, str(tmp_path))
    bad = subprocess.run(JOB + cmd[:-1] + ["data.batch_size=-1", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-3000:]
    assert "error: data.batch_size=-1: must be > 0" in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("[job] bad config or input (exit 2;")


@pytest.mark.dist
def test_horovodrun_preempted_exits_143_then_resumes(tmp_path):
    require_horovod()
    out = str(tmp_path / "out")
    cmd = [sys.executable, HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, "-m", "trainer",
           "comm=horovod", *ARGS, "train.steps=400", f"hydra.run.dir={out}"]
    _check_preempted_then_requeued(cmd, out, str(tmp_path))


def test_a_lost_worker_exits_as_asked_for_kubeflows_exit_code_policy(tmp_path):
    """`--lost-worker-exit 203`: a lost worker (a process's status 3) makes the job exit 203, which
    Kubeflow's restartPolicy ExitCode retries; the other statuses stay, a bad value is refused."""
    def job(opts: list[str], status: int) -> subprocess.CompletedProcess:
        child = ("import sys; from trainer.base.core.signals import record_exit; "
                 f"record_exit({status}); sys.exit({status})")
        return subprocess.run(JOB[:3] + opts + ["--", sys.executable, "-c", child], cwd=tmp_path, env=env(),
                              capture_output=True, text=True, timeout=60)
    lost = job(["--lost-worker-exit", "203"], 3)
    assert lost.returncode == 203, lost.stderr
    assert lost.stderr.strip().splitlines()[-1].startswith("[job] a worker was lost (exit 203; 1 trainer process(es) "
                                                           "ended: 3;")
    assert job(["--lost-worker-exit=203"], 2).returncode == 2 and job(["--lost-worker-exit=203"], 143).returncode == 143
    assert job([], 3).returncode == 3
    bad = job(["--lost-worker-exit", "143"], 3)
    assert bad.returncode == 2 and "error: --lost-worker-exit 143: must be" in bad.stderr
