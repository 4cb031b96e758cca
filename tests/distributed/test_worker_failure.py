"""Worker failure under the real launchers (torchrun and horovodrun, W = 2, gloo on localhost).

- A worker killed (SIGKILL) after the run has written a checkpoint: the launcher and the surviving
  worker exit non-zero within comm.timeout_s + a margin, never hang, and the survivor's message
  names the failed collective and prints a relaunch command; exactly that command (run from
  another directory) continues from the checkpoint it names, in the same output dir, and reaches
  the final step. torchrun runs with the default (timestamped) output dir, where "the same command
  with resume=auto" would start over in a new dir; horovodrun with an explicit hydra.run.dir.
- A worker that stalls (SIGSTOP) without dying: the survivor's collective times out after
  comm.timeout_s and the survivor process exits by itself right after (the launcher does not notice
  a stopped process, so this is our own exit path: status 3, no wait for Horovod's shutdown).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
from hvd_launch import HOROVODRUN, ROOT, env, finish, require_horovod, worker

from trainer.run import checkpoint as ckpt

pytestmark = pytest.mark.dist
TIMEOUT_S = 10  # comm.timeout_s of these runs
STEPS, EVERY = 300, 20
ARGS = ["-m", "trainer", "data=tiny", f"train.steps={STEPS}", f"comm.timeout_s={TIMEOUT_S}",
        f"checkpoint.every={EVERY}", "checkpoint.keep_last=0", "train.progress=off", "train.threads=1",
        "data.test_samples=512"]
LAUNCHERS = ("torchrun", "horovodrun")


def _command(launcher: str, out: str | None, extra: list[str]) -> list[str]:
    args = ARGS + ([f"hydra.run.dir={out}"] if out is not None else []) + extra
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + \
            args + ["comm=torch"]
    require_horovod()
    return [sys.executable, HOROVODRUN, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable] + \
        args + ["comm=horovod"]


def _start(launcher: str, out: str | None, extra: list[str] = (), cwd: str = ROOT) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex  # inherited by the workers: finds them among all processes
    proc = subprocess.Popen(_command(launcher, out, list(extra)), cwd=cwd, env={**env(), "TEST_RUN": marker},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, marker


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie has exited
    except OSError:
        return False


def _wait_for_checkpoint(proc: subprocess.Popen, root: str, timeout: float = 90) -> None:
    t0 = time.monotonic()
    while not ckpt.complete_checkpoints(root):
        if proc.poll() is not None:
            raise AssertionError(f"run ended before its first checkpoint:\n{proc.communicate()[0][-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no checkpoint after {timeout}s:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)


def _printed_command(log: str) -> str:
    """The relaunch command of the survivor's message: the first line starting with 'cd ' after
    '..., run:' (without horovodrun's '[rank]<stderr>:' line prefix). Not simply the next line:
    the launcher's own report of the killed worker ("Killed") can land between the two."""
    lines = [re.sub(r"^\[\d+\]<std(err|out)>:", "", line).strip() for line in log.splitlines()]
    at = [i for i, line in enumerate(lines) if line.endswith("to continue from it, run:")]
    assert at, log[-3000:]
    after = [line for line in lines[at[0] + 1:] if line.startswith("cd ")]
    assert after, log[-3000:]
    return after[0]


def _run_dirs(cwd) -> set[str]:
    """Every Hydra run dir (outputs/DATE/TIME) under cwd."""
    base = os.path.join(cwd, "outputs")
    return {os.path.join(base, d, t) for d in os.listdir(base) for t in os.listdir(os.path.join(base, d))} \
        if os.path.isdir(base) else set()


@pytest.mark.parametrize("launcher,default_dir", [("torchrun", True), ("horovodrun", False)])
def test_killed_worker_stops_the_others_then_the_printed_command_finishes(launcher, default_dir, tmp_path):
    work = tmp_path / "work"  # the launch dir: outputs/<date>/<time> goes here by default
    work.mkdir()
    out = None if default_dir else str(tmp_path / "run")
    proc, marker = _start(launcher, out, cwd=str(work))
    t0 = time.monotonic()
    while out is None:  # rank 0's timestamped dir: the one that gets checkpoints/
        out = next((d for d in _run_dirs(work) if os.path.isdir(os.path.join(d, "checkpoints"))), None)
        if proc.poll() is not None or time.monotonic() - t0 > 90:
            proc.kill()
            raise AssertionError(f"no checkpoints/ in a run dir:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    root = os.path.join(out, "checkpoints")
    _wait_for_checkpoint(proc, root)
    victim = worker(marker, 1)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    log = finish(proc, TIMEOUT_S + 30)
    took = time.monotonic() - t0
    assert proc.returncode != 0, log[-3000:]
    assert took < TIMEOUT_S + 10, (took, log[-3000:])
    assert "collective '" in log and "failed on rank 0/2" in log, log[-3000:]  # the survivor names it
    step, path = ckpt.complete_checkpoints(root)[-1]  # the newest save: what the command must name
    assert step < STEPS  # it really stopped early
    command = _printed_command(log)
    assert f"The newest complete checkpoint of this run is {path};" in log, log[-3000:]
    assert command.startswith(f"cd {work} && ") and command.endswith(
        f" checkpoint.resume={path} checkpoint.dir={root} hydra.run.dir={out}"), command
    assert command.count("hydra.run.dir=") == 1 and "comm.timeout_s=10" in command, command
    dirs = _run_dirs(work)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = subprocess.run(["bash", "-c", command], cwd=elsewhere, env=env(), capture_output=True, text=True,
                           timeout=180)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert _run_dirs(work) == dirs and not os.listdir(elsewhere)  # no new output dir anywhere
    summary = json.loads(open(os.path.join(out, "summary.json")).read())
    assert summary["resumed_from"] == path and summary["start_step"] == step >= EVERY
    assert summary["steps"] == summary["end_step"] == STEPS and summary["world_size"] == 2
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # each step once, up to the end
    assert [r for r in recs if r.get("event") == "resume"] == [{"event": "resume", "from": path, "step": step,
                                                                        "saved_world_size": 2, "world_size": 2}]
    assert ckpt.complete_checkpoints(root)[-1][0] == STEPS


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_stalled_worker_times_out_and_the_survivor_exits_by_itself(launcher, tmp_path):
    out = str(tmp_path / "run")
    proc, marker = _start(launcher, out)
    _wait_for_checkpoint(proc, os.path.join(out, "checkpoints"))
    victim, survivor = worker(marker, 1), worker(marker, 0)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    try:
        while _alive(survivor) and time.monotonic() - t0 < TIMEOUT_S + 30:
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        os.kill(victim, signal.SIGKILL)  # a stopped process ignores the launcher's SIGTERM
    log = finish(proc, 30)
    assert not _alive(survivor)
    assert TIMEOUT_S - 1 < took < TIMEOUT_S + 6, (took, log[-3000:])
    assert proc.returncode != 0
    said = [line for line in log.splitlines() if "failed on rank 0/2 (timeout 10s" in line]
    assert said, log[-3000:]
    # the backend's reason, after ours: gloo's words (a wait that expired: "Timed out waiting ...",
    # "... timed out ...", "Wait timeout"; or a connection it closed on its timeout: "Application
    # timeout caused pair closure"; which one depends on the collective the survivor was in), or
    # ours ("no completion within 10s")
    reason = said[0].split("a peer may have died or not called it): ", 1)[-1]
    assert re.search(r"(?i)timed out|timeout|no completion within 10s", reason), said[0]


# ---------------------------------------------------------------------------- the relaunch command
import trainer.run.relaunch as relaunch


def _hydra_values(tokens: list[str]) -> dict[str, str]:
    """Override tokens as Hydra parses them and OmegaConf then resolves the values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf
    parsed = OverridesParser.create().parse_overrides(tokens)
    return {o.key_or_group: OmegaConf.create({"v": o.value()}).v for o in parsed}


def test_relaunch_command_replaces_the_run_dirs_and_quotes_paths(monkeypatch, tmp_path):
    """The command of a plain run (no launcher above it): this process's command line, any
    checkpoint.resume / checkpoint.dir / hydra.run.dir (also with + or ++) replaced by the absolute
    ones given; paths with spaces, commas, quotes, backslashes and ${ survive the shell, Hydra's
    parser and OmegaConf."""
    args = ["data=tiny", "+checkpoint.resume=auto", "optim.lr=0.5", "++checkpoint.dir=old",
            "hydra.run.dir=outputs/x"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/trainer/__main__.py", *args])
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "-u", "-m", "trainer", *args])
    cwd = tmp_path / "launch dir"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    odd = str(tmp_path / "a b,c'd\\e${f}")
    cmd = relaunch.relaunch_command(f"{odd}/ck/step_00000010", f"{odd}/ck", odd, size=2)
    import shlex
    tokens = shlex.split(cmd)
    assert tokens[:4] == ["cd", str(cwd), "&&", "/venv/bin/python"]
    assert tokens[4:11] == ["-u", "-m", "trainer", "data=tiny", "optim.lr=0.5", tokens[9], tokens[10]]
    assert _hydra_values(tokens[9:]) == {"checkpoint.resume": f"{odd}/ck/step_00000010",
                                         "checkpoint.dir": f"{odd}/ck", "hydra.run.dir": odd}
    monkeypatch.chdir(tmp_path)
    plain = relaunch.relaunch_command(None, "ck", "out", size=1)  # no checkpoint yet: no resume
    assert plain == f"cd {tmp_path} && /venv/bin/python -u -m trainer data=tiny optim.lr=0.5 " \
                    f"checkpoint.dir={tmp_path}/ck hydra.run.dir={tmp_path}/out"


def test_relaunch_command_of_a_sweep_job_is_that_job_alone(monkeypatch, tmp_path):
    """A job of a Hydra sweep (-m): -m and the sweep's values go, this job's values come in."""
    from types import SimpleNamespace

    from hydra.core.hydra_config import HydraConfig
    args = ["-m", "data=tiny", "optim.lr=0.1,0.5", "hydra.sweep.dir=ms", "hydra/job_logging=stdout"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/trainer/__main__.py", *args])
    monkeypatch.setattr(sys, "orig_argv", ["python", "-m", "trainer", *args])
    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(
        lambda: SimpleNamespace(overrides=SimpleNamespace(task=["data=tiny", "optim.lr=0.5"]))))
    monkeypatch.chdir(tmp_path)
    cmd = relaunch.relaunch_command("/ck/step_00000004", "/ck", "/ms/1")
    assert cmd == (f"cd {tmp_path} && python -m trainer hydra/job_logging=stdout data=tiny optim.lr=0.5 "
                   "checkpoint.resume=/ck/step_00000004 checkpoint.dir=/ck hydra.run.dir=/ms/1")
