"""Preemption (trainer/run/signals.py): SIGTERM, SIGINT and SIGUSR1 stop every rank at the next step
boundary with a checkpoint of that step, summary.json saying why and where, one line naming the
relaunch command and exit status 128 + the signal; a second signal exits at once; a worker lost
mid-save leaves the survivor speaking even though torchrun SIGTERMs it.

In-process runs get their signal at a known step from a patched LrSchedule.apply (the process
signals itself); the command and torchrun runs get theirs once metrics.jsonl shows a few steps.
Every resumed run is compared with an uninterrupted one (BSP: equal)."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
from failure_helpers import CLI_BASE, ROOT, _env
from data_helpers import prepare_sample
from helpers import make_cfg, run_single
from hvd_launch import finish, worker
from parity_helpers import assert_same_run

import trainer.run.checkpoint as ckpt
from trainer.run.checkpoint import saver
from trainer.run.evaluation.evaluator import Evaluator
from trainer.step.lr import LrSchedule
import trainer.run.runner as runner
from trainer.run.runner import run
from trainer.run.signals import REPEAT_S, STOP_SIGNALS

BASE = CLI_BASE + ["train.steps=12", "train.log_every=1"]
LONG = CLI_BASE + ["train.steps=200", "train.log_every=1"]  # long enough to be signalled on the way


def _signal_at(monkeypatch, step: int, signum: int = signal.SIGTERM) -> None:
    """This process signals itself as step `step` begins (before its flag is sampled)."""
    real = LrSchedule.apply

    def apply(self, s):
        if s == step:
            os.kill(os.getpid(), signum)
        return real(self, s)

    monkeypatch.setattr(LrSchedule, "apply", apply)


def _stop_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("stopped: ")]


def _metrics_steps(out) -> list[int]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "loss" in r]


def _summary(out) -> dict:
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def _wait_for_steps(proc: subprocess.Popen, out: str, n: int, timeout: float = 120) -> None:
    path, t0 = os.path.join(out, "metrics.jsonl"), time.monotonic()
    while not (os.path.exists(path) and sum(1 for _ in open(path)) >= n):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no {n} steps in {path}:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.02)


@functools.lru_cache(maxsize=2)
def _reference(overrides: tuple[str, ...]):
    """The uninterrupted run (the checkpoint keys and train.nonfinite change nothing in it)."""
    return run_single(list(overrides))


def _resume_equals_the_uninterrupted_run(out: str, overrides: list[str], stopped_at: int) -> None:
    """checkpoint.resume=auto in the same output dir (here, W = 1) reaches train.steps and equals the
    run that was never stopped: losses, dense model, tables, final figures; each step logged once."""
    got = run(make_cfg(overrides + ["comm=local", "checkpoint.resume=auto"]), out_dir=out, return_state=True)
    ref = _reference(tuple(o for o in overrides if not o.startswith(("checkpoint.", "train.nonfinite"))))
    assert got.summary["resumed_from"] == ckpt.step_dir(os.path.join(out, "checkpoints"), stopped_at)
    assert got.summary["stopped"] is None and got.summary["end_step"] == ref.summary["end_step"]
    assert_same_run(ref, got)
    for key in ("final_loss", "eval_auc", "eval_logloss"):
        assert got.summary[key] == pytest.approx(ref.summary[key], rel=1e-5), key
    assert _metrics_steps(out) == list(range(1, ref.summary["end_step"] + 1))


# ------------------------------------------------------------------------------- in-process, W = 1
def test_sigint_stops_at_the_step_boundary_saves_and_resumes(tmp_path, monkeypatch, capsys):
    """Ctrl-C at step 4: no KeyboardInterrupt; step 5 (the step it arrived in) is finished, saved
    (checkpoint.every=0), summary.json says why and where, one stderr line gives the command; the
    handlers are the previous ones again; resume=auto then equals the uninterrupted run."""
    out = str(tmp_path / "out")
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _signal_at(monkeypatch, 4, signal.SIGINT)
    got = run(make_cfg(BASE + ["comm=local"]), out_dir=out)
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before
    path = ckpt.step_dir(os.path.join(out, "checkpoints"), 5)
    stopped = {"reason": "signal", "signal": "SIGINT", "rank": 0, "ranks": [0], "step": 5, "checkpoint": path,
               "continue_from": path, "no_checkpoint": None, "exit_status": 130}
    assert got.summary["stopped"] == stopped and _summary(out)["stopped"] == stopped
    assert got.summary["end_step"] == 5 and len(got.losses) == 5 and got.summary["checkpoint"] == path
    assert got.summary["eval_auc"] is None and got.summary["evals"] == []  # no evaluation on a stop
    assert ckpt.complete_checkpoints(os.path.join(out, "checkpoints")) == [(5, path)]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step_00000005"]  # lock released
    assert _metrics_steps(out) == [1, 2, 3, 4, 5]
    lines = _stop_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith(
        f"stopped: SIGINT received: training stopped after step 5 of 12, saved checkpoint {path}; summary: "
        f"{out}/summary.json (exit status 130); to continue from it, run: cd "), lines
    assert lines[0].endswith(f" checkpoint.resume={path} checkpoint.dir={out}/checkpoints hydra.run.dir={out}")
    monkeypatch.undo()
    _resume_equals_the_uninterrupted_run(out, BASE, 5)


@pytest.mark.parametrize("case", ["on_signal=stop", "checkpoints off", "no output dir"])
def test_a_stop_without_a_checkpoint_says_why(case, tmp_path, monkeypatch, capsys):
    """SIGUSR1 (exit status 138) with nothing to save at the stop: the summary and the line say why
    and name the newest checkpoint there is (or that the command starts over)."""
    out = str(tmp_path / "out")
    extra, why = {"on_signal=stop": (["train.on_signal=stop", "checkpoint.every=2"], "train.on_signal=stop"),
                  "checkpoints off": (["checkpoint.enabled=false"], "checkpoint.enabled=false"),
                  "no output dir": ([], "the run has no output dir, so no checkpoint dir")}[case]
    _signal_at(monkeypatch, 4, signal.SIGUSR1)
    got = run(make_cfg(BASE + extra + ["comm=local"]), out_dir=None if case == "no output dir" else out)
    stopped = got.summary["stopped"]
    assert stopped["signal"] == "SIGUSR1" and stopped["exit_status"] == 138 and stopped["step"] == 5
    assert stopped["checkpoint"] is None and stopped["no_checkpoint"] == why
    (line,) = _stop_lines(capsys.readouterr().err)
    assert f"training stopped after step 5 of 12, no checkpoint saved ({why})" in line, line
    if case == "on_signal=stop":  # the periodic save of step 4 is the one to continue from
        path = ckpt.step_dir(os.path.join(out, "checkpoints"), 4)
        assert stopped["continue_from"] == path and ckpt.latest(os.path.join(out, "checkpoints")) == path
        assert f"; the newest complete checkpoint of this run is {path}; to continue from it, run: cd " in line
        assert line.endswith(f"checkpoint.resume={path} checkpoint.dir={out}/checkpoints hydra.run.dir={out}")
    else:
        assert stopped["continue_from"] is None and "checkpoint.resume=" not in line
        assert "; no checkpoint of this run is complete; to run it again from the start" in line, line


def test_a_failed_save_at_the_stop_is_rescued_and_not_evaluated(tmp_path, monkeypatch):
    """The save at the stop fails in checkpoint.dir: as any failed save, the model goes to the output
    dir's checkpoints/ instead and the run ends with exit 2's error, but without an evaluation;
    summary.json has both `checkpoint_error` and `stopped` (naming the fallback)."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    real = saver.write_file

    def write_file(path, obj):
        if path.startswith(root + os.sep):
            raise OSError(28, "No space left on device (injected)", path)
        return real(path, obj)

    monkeypatch.setattr(saver, "write_file", write_file)
    _signal_at(monkeypatch, 4)
    with pytest.raises(ckpt.CheckpointError) as err:
        run(make_cfg(BASE + ["comm=local", f"checkpoint.dir={root}"]), out_dir=out)
    fallback = ckpt.step_dir(os.path.join(out, "checkpoints"), 5)
    assert f"saved instead to {fallback}" in str(err.value), err.value
    assert str(err.value).endswith(f"; stopped on SIGTERM, not evaluated, summary: {out}/summary.json (checkpoint_error)")
    summary = _summary(out)
    assert summary["stopped"]["checkpoint"] == summary["stopped"]["continue_from"] == fallback
    assert summary["checkpoint_error"]["fallback"] == fallback and summary["eval_auc"] is None
    assert summary["end_step"] == 5 and os.listdir(root) == []  # no partial save, no lock


def test_signal_during_start_up_or_an_evaluation_stops_within_a_batch(tmp_path, monkeypatch):
    """A signal while the sparse side is built (start-up) stops the run after step 1; one during
    the evaluation after step 3 (train.eval_every=3) ends that evaluation before its next batch and
    stops the run at step 3 (saved there, the partial evaluation dropped); one during the final
    evaluation stops the trained run with its final checkpoint, saved once, unevaluated."""
    real_build, real_eval = runner.build_sparse, Evaluator.evaluate

    def build(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(runner, "build_sparse", build)
    got = run(make_cfg(BASE + ["comm=local"]), out_dir=str(tmp_path / "a"))
    assert got.summary["stopped"]["step"] == 1 and got.summary["end_step"] == 1
    assert ckpt.latest(str(tmp_path / "a" / "checkpoints")) == ckpt.step_dir(str(tmp_path / "a" / "checkpoints"), 1)
    monkeypatch.setattr(runner, "build_sparse", real_build)

    def evaluate(self, *args):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_eval(self, *args)

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    got = run(make_cfg(BASE + ["comm=local", "train.eval_every=3"]), out_dir=str(tmp_path / "b"))
    assert got.summary["stopped"]["step"] == 3 and got.summary["evals"] == []
    assert got.summary["stopped"]["checkpoint"] == ckpt.step_dir(str(tmp_path / "b" / "checkpoints"), 3)
    saves = []
    real_save = saver.CheckpointWriter.save
    monkeypatch.setattr(saver.CheckpointWriter, "save", lambda self, step, *a: saves.append(step) or real_save(self, step, *a))
    got = run(make_cfg(BASE + ["comm=local"]), out_dir=str(tmp_path / "c"))
    stopped = got.summary["stopped"]
    assert stopped["step"] == 12 and stopped["checkpoint"] == ckpt.step_dir(str(tmp_path / "c" / "checkpoints"), 12)
    assert saves == [12] and got.summary["eval_auc"] is None and got.summary["end_step"] == 12


def _signalled_in_evaluation(rank: int, world: int, overrides: list[str], out: str) -> dict:
    """Spawned worker: rank 1 receives SIGTERM as the evaluation after step 3 begins."""
    real = Evaluator.evaluate

    def evaluate(self, *args):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args)

    Evaluator.evaluate = evaluate
    return run(make_cfg(overrides + ["comm=torch"]), out_dir=out).summary


@pytest.mark.dist
def test_a_signal_to_one_rank_during_an_evaluation_stops_every_rank_there(tmp_path):
    """W = 2: rank 1 alone is signalled during the evaluation after step 3; both ranks leave the
    evaluation within a batch (they learn it in the evaluation's per-batch agreement) and stop at
    step 3 with its checkpoint, instead of evaluating on past a launcher's grace."""
    from helpers import spawn
    got = spawn(2, _signalled_in_evaluation, BASE + ["train.eval_every=3", "data.test_samples=960",
                                                     "data.eval_batch_size=48"], str(tmp_path / "out"))
    for s in got:
        assert s["stopped"]["step"] == 3 and s["stopped"]["ranks"] == [1] and s["evals"] == []
    assert got[0]["stopped"]["checkpoint"] == ckpt.step_dir(str(tmp_path / "out" / "checkpoints"), 3)


def _signalled_in_profile(rank: int, world: int, overrides: list[str], out: str) -> dict:
    """Spawned worker (or this process: rank 0 of 1): rank 0 receives SIGTERM as the sparse side
    is built, just before FAE's profile (which only rank 0 runs)."""
    import trainer.run.build as build
    real = build._make_store

    def store(*args, **kwargs):
        if rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    build._make_store = store
    try:
        got = run(make_cfg(overrides + (["comm=torch"] if world > 1 else ["comm=local"])), out_dir=out)
    finally:
        build._make_store = real
    return {"summary": got.summary, "losses": got.losses}


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_a_signal_during_the_placement_profile_stops_before_training(tmp_path, capfd, world):
    """FAE's profile of a long stream can take minutes: a stop signal ends it before its next chunk,
    every rank learns it with rank 0's plan (root_decides), and the run stops with nothing trained
    and nothing saved: one line, `stopped` with the phase, exit status 143; the directories free."""
    from helpers import spawn
    out = str(tmp_path / "out")
    args = BASE + ["placement=fae", "placement.profile_fraction=1.0"]
    got = spawn(2, _signalled_in_profile, args, out) if world == 2 else [_signalled_in_profile(0, 1, args, out)]
    for r in got:
        s = r["summary"]["stopped"]
        assert s["during"] == "placement profiling" and s["step"] is None and s["checkpoint"] is None, s
        assert s["exit_status"] == 143 and r["losses"] == []
    if world == 1:  # (spawned workers may be a forkserver's, started under another test's capture)
        err = capfd.readouterr().err
        assert err.count("stopped: SIGTERM received during start-up (placement profiling): nothing was trained") == 1
    assert not os.path.exists(os.path.join(out, "checkpoints", ckpt.LOCK)) and not os.path.exists(
        os.path.join(out, ckpt.LOCK))


def _signalled_in_load(rank: int, world: int, overrides: list[str], out: str, signalled: int) -> dict:
    """Spawned worker (or this process): rank `signalled` receives SIGTERM at its first read of the
    checkpoint it resumes (the next read sees it)."""
    from trainer.run.checkpoint import shard_io
    real = shard_io.VerifiedFile.read

    def read(self, lo, hi):
        if rank == signalled:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, lo, hi)

    shard_io.VerifiedFile.read = read
    try:
        got = run(make_cfg(overrides + (["comm=torch"] if world > 1 else ["comm=local"])), out_dir=out)
    finally:
        shard_io.VerifiedFile.read = real
    return {"summary": got.summary, "losses": got.losses}


@pytest.mark.dist
@pytest.mark.parametrize("world", [1, 2])
def test_a_signal_during_a_resumes_load_stops_before_training(tmp_path, capfd, world):
    """A resume's load of a big shard takes a while: a stop signal ends it at the next read, on
    every rank (W = 2: rank 1 alone is signalled, rank 0 learns it when the load's ranks agree), with
    nothing trained and the checkpoint untouched; the same command then resumes it to the
    uninterrupted result."""
    from helpers import spawn
    root = str(tmp_path / "ck")
    common = BASE + ["optim=adagrad", f"checkpoint.dir={root}"]
    run_single(common + ["train.steps=6", "checkpoint.every=3"], return_state=False)
    again = common + [f"checkpoint.resume={ckpt.step_dir(root, 3)}"]
    out = str(tmp_path / "out")
    got = spawn(2, _signalled_in_load, again, out, 1) if world == 2 else [_signalled_in_load(0, 1, again, out, 0)]
    for r in got:
        s = r["summary"]["stopped"]
        assert s["during"].startswith(("the resume's load", "loading checkpoint")) and s["step"] is None, s
        assert s["exit_status"] == 143 and r["losses"] == []
    if world == 1:  # (spawned workers may be a pool's, started under another test's capture)
        assert "received during start-up (the resume's load)" in capfd.readouterr().err
    assert [s for s, _ in ckpt.complete_checkpoints(root)] == [3, 6] and not os.path.exists(os.path.join(root, ckpt.LOCK))


def test_a_stop_in_an_ensemble_member_continues_with_resume_auto(tmp_path, monkeypatch, capsys):
    """train.ensemble=2: SIGTERM in member 2 stops the ensemble there; the line names the member and
    a command with checkpoint.resume=auto, which reuses member 1, resumes member 2 from its
    checkpoint and ends with the uninterrupted ensemble's test figures."""
    prepare_sample(str(tmp_path / "criteo"))
    over = ["data=criteo", f"data.dir={tmp_path / 'criteo' / 'prepared'}",
            "data.batch_size=64", "data.epochs=1", "train.progress=off", "train.tensorboard=false",
            "data.loader=memmap", "train.threads=1", "train.ensemble=2", "comm=local"]
    real, calls = LrSchedule.apply, []

    def apply(self, s):
        calls.append(s)
        if s == 3 and calls.count(3) == 2:  # member 2's step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, s)

    monkeypatch.setattr(LrSchedule, "apply", apply)
    out = str(tmp_path / "ens")
    stopped = run(make_cfg(over), out_dir=out).summary["stopped"]
    path = ckpt.step_dir(os.path.join(out, "member2", "checkpoints"), 4)
    assert stopped["member"] == 2 and stopped["step"] == 4 and stopped["checkpoint"] == path
    assert not os.path.exists(os.path.join(out, "summary.json"))  # the ensemble's own: not reached
    (line,) = _stop_lines(capsys.readouterr().err)
    assert f"saved checkpoint {path} (ensemble member 2); summary: {out}/member2/summary.json" in line, line
    assert line.endswith(f" checkpoint.resume=auto hydra.run.dir={out}"), line
    monkeypatch.undo()
    again = run(make_cfg(over + ["checkpoint.resume=auto"]), out_dir=out).summary
    assert [m["reused"] for m in again["ensemble"]["members"]] == [True, False]
    ref = run(make_cfg(over), out_dir=str(tmp_path / "ref")).summary
    assert (again["test_auc"], again["test_logloss"]) == pytest.approx((ref["test_auc"], ref["test_logloss"]), rel=1e-6)


# ------------------------------------------------------------------------------ the command, W = 1
def test_sigterm_to_the_command_exits_143_with_a_checkpoint_ends_the_sweep_and_resumes_to_the_same_run(tmp_path):
    """`python -m trainer -m ... train.seed=0,1`: SIGTERM during job 0 stops it after some step k
    with a checkpoint of k, summary.json saying why, no lock, exit 143 and one line whose command
    continues job 0 alone; the sweep's summary.json records job 0 as failed with the reason and
    job 1 never starts. resume=auto in job 0's dir equals the uninterrupted run."""
    sweep = str(tmp_path / "sw")
    out, root = os.path.join(sweep, "0"), os.path.join(sweep, "0", "checkpoints")
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "-m", *LONG, "train.seed=0,1", f"hydra.sweep.dir={sweep}"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    stopped = _summary(out)["stopped"]
    k = stopped["step"]
    assert 3 <= k < 200 and _summary(out)["end_step"] == k and stopped["signal"] == "SIGTERM"
    assert ckpt.complete_checkpoints(root) == [(k, ckpt.step_dir(root, k))] == [(k, stopped["checkpoint"])]
    assert os.listdir(root) == [f"step_{k:08d}"]  # no lock, no partial save
    (line,) = _stop_lines(err)
    assert err.strip().splitlines()[-1] == line and line.startswith("stopped: SIGTERM received: "), err[-3000:]
    assert line.endswith(f"-m trainer {' '.join(LONG)} train.seed=0 checkpoint.resume={stopped['checkpoint']} "
                         f"checkpoint.dir={root} hydra.run.dir={out}"), line
    (job,) = _summary(sweep)["jobs"]
    assert job["num"] == 0 and job["status"] == "failed" and job["error"] == (
        f"stopped by SIGTERM after step {k} (checkpoint: {stopped['checkpoint']}); the sweep ends here")
    assert not os.path.exists(os.path.join(sweep, "1"))
    _resume_equals_the_uninterrupted_run(out, LONG, k)


SLOW_SAVE = """
import sys, time
from trainer.run.checkpoint import CheckpointWriter
from trainer.run.signals import SIGNALS
real = CheckpointWriter._write_shard
DELAY = float(sys.argv.pop(1))  # seconds, the first argument

def slow(self, tmp, store):  # a save that starts after the first signal takes DELAY seconds
    if SIGNALS.received is not None:
        time.sleep(DELAY)
    return real(self, tmp, store)

CheckpointWriter._write_shard = slow
from trainer.__main__ import cli
cli()
"""


def _slow_save_then(tmp_path, first: int, second: int, seconds: float, **popen) -> tuple[subprocess.Popen, str, str]:
    """A run whose save after a signal takes `seconds`; `first` is sent after step 6 (the save of
    step 5 complete), `second` once the stop's save has begun (after REPEAT_S: not the same
    request twice). (proc, output dir, checkpoint dir)."""
    out, args = str(tmp_path / "out"), LONG + ["checkpoint.every=5", "checkpoint.keep_last=0"]
    root = os.path.join(out, "checkpoints")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE, str(seconds), *args, f"hydra.run.dir={out}"],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **popen)
    _wait_for_steps(proc, out, 6)
    proc.send_signal(first)
    t0 = time.monotonic()
    while not any(".tmp-" in n for n in os.listdir(root)):  # the stop's (slow) save has begun
        assert proc.poll() is None and time.monotonic() - t0 < 30, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    time.sleep(REPEAT_S + 0.2)
    proc.send_signal(second)
    return proc, out, root


@pytest.mark.parametrize("first,second", [(signal.SIGUSR1, signal.SIGTERM), (signal.SIGTERM, signal.SIGTERM)],
                         ids=["slurm-usr1-then-term", "kubernetes-term-twice"])
def test_a_second_signal_during_the_save_lets_it_finish(tmp_path, first, second):
    """Slurm's sequence (--signal=B:USR1@N, then TERM at the time limit) and a TERM repeated within
    a grace period: the second signal comes while the stop's save is being written (slow: 3 s); the
    save finishes, the run stops as the first signal asked (exit 128 + its number, the stop line,
    summary.json's `stopped` with that checkpoint), and a resume equals the uninterrupted run."""
    proc, out, root = _slow_save_then(tmp_path, first, second, 3.0)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + first, err[-3000:]
    name = signal.Signals(second).name
    assert err.count(f"second signal ({name}) during a checkpoint save: the save goes on") == 1, err[-3000:]
    stopped = _summary(out)["stopped"]
    assert stopped["signal"] == signal.Signals(first).name and _stop_lines(err)
    assert stopped["checkpoint"] == ckpt.step_dir(root, stopped["step"])
    assert not [n for n in os.listdir(root) if ".tmp-" in n or n == ckpt.LOCK]
    _resume_equals_the_uninterrupted_run(out, LONG + ["checkpoint.every=5", "checkpoint.keep_last=0"],
                                         stopped["step"])


def test_ctrl_c_twice_from_a_terminal_exits_at_once_and_the_earlier_checkpoint_resumes(tmp_path):
    """A user's Ctrl-C twice (SIGINT, stdin a terminal) during the stop's slow save ends the process
    at once with 130. Its unfinished save and lock stay until the next run takes the lock over (and
    removes them); that run resumes the newest complete checkpoint to the uninterrupted result."""
    import pty
    master, slave = pty.openpty()
    try:
        proc, out, root = _slow_save_then(tmp_path, signal.SIGINT, signal.SIGINT, 60.0, stdin=slave)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)
    finally:
        os.close(master)
        os.close(slave)
    assert time.monotonic() - t0 < 5 and proc.returncode == 130, err[-3000:]
    assert "second signal (SIGINT): exiting now (status 130)" in err and not _stop_lines(err), err[-3000:]
    names = os.listdir(root)
    assert ckpt.LOCK in names and [n for n in names if ".tmp-" in n], names
    k = ckpt.complete_checkpoints(root)[-1][0]
    args = LONG + ["checkpoint.every=5", "checkpoint.keep_last=0"]
    assert k >= 5 and not os.path.exists(os.path.join(out, "summary.json"))
    _resume_equals_the_uninterrupted_run(out, args, k)
    assert not [n for n in os.listdir(root) if ".tmp-" in n or n == ckpt.LOCK]


# ------------------------------------------------------------------------------- torchrun, W = 2
def _torchrun(args: list[str], out: str, hook: str | None = None) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex  # inherited by the workers: finds them among all processes
    env = {**_env(), "TEST_RUN": marker}
    if hook is not None:
        env["PYTHONPATH"] = hook + os.pathsep + env["PYTHONPATH"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "trainer",
           *args, "comm=torch", f"hydra.run.dir={out}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), marker


@pytest.mark.dist
@pytest.mark.parametrize("target", ["worker", "launcher"])
def test_sigterm_under_torchrun_stops_every_rank_at_one_step(target, tmp_path):
    """SIGTERM to rank 1 alone (train.nonfinite=skip: the flag rides the loss allreduce) or to
    torchrun (it forwards SIGTERM to both workers; the flag rides the dense allreduce): both ranks
    stop after the same step and write one checkpoint of it together; rank 0 says so once; the
    resumed run equals the uninterrupted one."""
    out = str(tmp_path / "out")
    args = LONG + (["train.nonfinite=skip"] if target == "worker" else [])
    proc, marker = _torchrun(args, out)
    _wait_for_steps(proc, out, 3)
    os.kill(worker(marker, 1) if target == "worker" else proc.pid, signal.SIGTERM)
    log = finish(proc, 60)
    assert proc.returncode == 1, log[-3000:]  # torchrun's own status (the job's: trainer.run.job, test_job_status.py)
    stopped, root = _summary(out)["stopped"], os.path.join(out, "checkpoints")
    k = stopped["step"]
    assert stopped["ranks"] == ([1] if target == "worker" else [0, 1]) and stopped["exit_status"] == 143, stopped
    assert 3 <= k < 200 and _summary(out)["end_step"] == k
    assert ckpt.complete_checkpoints(root) == [(k, stopped["checkpoint"])]
    with open(os.path.join(stopped["checkpoint"], ckpt.MANIFEST)) as f:
        assert json.load(f)["world_size"] == 2
    assert os.listdir(root) == [f"step_{k:08d}"]  # no lock, no partial save
    (line,) = _stop_lines(log)
    who = "by rank 1" if target == "worker" else "by every rank"
    assert line.startswith(f"stopped: SIGTERM received {who}: training stopped after step {k} of 200, "), line
    assert "torch.distributed.run --standalone --nproc_per_node 2 -m trainer" in line, line
    _resume_equals_the_uninterrupted_run(out, args, k)


LOSE_RANK_1 = """
import os
if "RANK" in os.environ:  # a worker: rank 1 dies while the final checkpoint is written, rank 0 writes slowly
    import time
    from trainer.run.checkpoint import CheckpointWriter
    real = CheckpointWriter._write_shard

    def write(self, tmp, store):
        if os.path.basename(tmp).startswith("step_00000020.tmp-"):
            if self.comm.rank == 1:
                os._exit(1)
            time.sleep(3)  # torchrun's SIGTERM arrives meanwhile
        return real(self, tmp, store)

    CheckpointWriter._write_shard = write
"""


@pytest.mark.dist
def test_survivor_of_a_worker_lost_in_the_final_save_speaks_despite_torchruns_sigterm(tmp_path):
    """Rank 1 dies while the final checkpoint is written; torchrun SIGTERMs rank 0 within a second,
    during its own write. Rank 0 still names the last complete checkpoint and the relaunch command,
    and leaves neither its partial save nor the lock."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LOSE_RANK_1)
    out = str(tmp_path / "out")
    proc, _ = _torchrun(CLI_BASE + ["train.steps=20", "checkpoint.every=10", "checkpoint.keep_last=0"],
                        out, str(hook))
    log = finish(proc, 90)
    root = os.path.join(out, "checkpoints")
    path = ckpt.step_dir(root, 10)
    assert proc.returncode == 1, log[-3000:]  # torchrun's own status for a lost worker
    said = log.find(f"The newest complete checkpoint of this run is {path}; to continue from it, run:")
    assert 0 <= log.find("closing signal SIGTERM") < said, log[-3000:]  # the SIGTERM came first
    assert f"checkpoint.resume={path} checkpoint.dir={root} hydra.run.dir={out}" in log[said:], log[-3000:]
    assert os.listdir(root) == ["step_00000010"]  # the final save's .tmp- directory and lock.json are gone
