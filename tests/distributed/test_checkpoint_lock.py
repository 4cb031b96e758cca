"""One run per checkpoint directory: a second run on a directory in use fails at start naming the
holder (on every rank: only rank 0 takes the lock), a killed run's lock is taken over with a
warning, the rules for which existing lock is taken over (a dead or reused pid: yes; another host:
no), and an unusable checkpoint.dir (read-only, a file) is refused before the sparse side is built.
Runs that involve two runs or a killed one are real `python -m trainer` processes."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

import pytest
from failure_helpers import CLI_BASE, _cli, _manifest, _popen, _wait_for
from helpers import make_cfg, spawn

import trainer.checkpoint as ckpt
import trainer.core.procs as procs
import trainer.runner as runner
from trainer.runner import run


def _lock(root: str) -> dict | None:
    try:
        with open(os.path.join(root, ckpt.LOCK)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_lock(root: str, **holder) -> str:
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, ckpt.LOCK)
    with open(path, "w") as f:
        json.dump({"run_id": "0123456789ab", "host": socket.gethostname(), "pid_ns": procs.pid_namespace(),
                   "started": "then", "command": "python -m trainer (test)", **holder}, f)
    return path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def sleeper():
    """A live process that is not us (holds locks in these tests)."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait()


def _try_run(rank: int, world: int, overrides: list[str]) -> str:
    """Spawned worker: one rank of a run; returns its error (every rank must get one)."""
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]))
    except Exception as exc:  # noqa: BLE001 - the test looks at every rank's error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_second_run_fails_at_start_and_a_killed_runs_lock_is_taken_over(tmp_path):
    """Run A trains with checkpoint.every=10; run B, started on the same checkpoint.dir while A
    runs, exits 2 before training, naming the dir and A (pid, run id) and leaving A's files alone.
    A is then killed (SIGKILL: no clean-up); run C with resume=auto takes the dead run's lock over
    (a warning), removes A's unfinished save and continues from A's newest checkpoint."""
    root = str(tmp_path / "S")
    a = _popen(tmp_path, "train.steps=100000", "checkpoint.every=10", "checkpoint.keep_last=2",
               f"checkpoint.dir={root}", f"hydra.run.dir={tmp_path / 'a'}")
    try:
        _wait_for(a, lambda: ckpt.complete_checkpoints(root), "run A wrote no checkpoint")
        holder = _lock(root)
        assert holder is not None and holder["pid"] == a.pid
        b = _cli(tmp_path, "train.steps=200", "data.seed=7", "optim.lr=0.5", "checkpoint.every=1",
                 f"checkpoint.dir={root}", f"hydra.run.dir={tmp_path / 'b'}")
        assert b.returncode == 2, b.stderr[-3000:]
        msg = b.stderr
        assert f"error: checkpoint.dir {root} is in use by run {holder['run_id']} (pid {a.pid} on host " \
               f"{socket.gethostname()}" in msg, msg[-3000:]
        assert "Traceback" not in msg
        assert not (tmp_path / "b" / "metrics.jsonl").exists()  # B stopped before its first step
        assert a.poll() is None and _lock(root)["run_id"] == holder["run_id"]  # A goes on, still owns S
        for _, path in ckpt.complete_checkpoints(root):  # every save in S is A's
            try:
                manifest = _manifest(path)
            except FileNotFoundError:  # rotated away by A meanwhile
                continue
            assert manifest["run_id"] == holder["run_id"] and manifest["config"]["data"]["seed"] != 7
    finally:
        a.send_signal(signal.SIGKILL)
        a.communicate()
    # as if A had been killed in the middle of a save
    os.makedirs(os.path.join(root, f"step_99999999.tmp-{holder['run_id']}-00000000"))
    newest = ckpt.latest(root)
    step = _manifest(newest)["step"]
    assert _lock(root)["pid"] == a.pid  # the dead run's lock is still there
    c = _cli(tmp_path, f"train.steps={step + 5}", "checkpoint.every=10", "checkpoint.keep_last=2",
             f"checkpoint.dir={root}", "checkpoint.resume=auto", f"hydra.run.dir={tmp_path / 'c'}")
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"took over the lock of run {holder['run_id']} (pid {a.pid}" in c.stderr
    assert "no longer running" in c.stderr
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["resumed_from"] == newest and summary["start_step"] == step
    assert not [n for n in os.listdir(root) if ".tmp-" in n]
    assert _lock(root) is None  # released at the end of C


@pytest.mark.dist
def test_lock_held_elsewhere_stops_every_rank_at_start(tmp_path, sleeper):
    """W = 2: only rank 0 takes the lock; its refusal reaches rank 1 too (nobody waits in a
    collective), and the holder's lock and checkpoints are untouched."""
    root = str(tmp_path / "S")
    lock = _write_lock(root, pid=sleeper.pid, proc_start=procs.proc_start(sleeper.pid))
    os.makedirs(os.path.join(root, "step_00000005.tmp-0123456789ab-00000000"))  # its save in progress
    before = open(lock).read()
    errors = spawn(2, _try_run, CLI_BASE + ["train.steps=4", f"checkpoint.dir={root}"], timeout=120)
    for err in errors:
        assert err.startswith(f"CheckpointError: checkpoint.dir {root} is in use by run 0123456789ab "
                              f"(pid {sleeper.pid} on host"), err
    assert open(lock).read() == before
    assert sorted(os.listdir(root)) == [ckpt.LOCK, "step_00000005.tmp-0123456789ab-00000000"]


def test_lock_rules(tmp_path, sleeper):
    """Which existing lock is taken over: a dead pid or a reused pid (another start time) yes,
    with a note; a live process, or a run on another host (unknown), no, naming the holder."""
    root = str(tmp_path / "d")
    _write_lock(root, pid=_dead_pid())
    lock = ckpt.DirLock(root, "aaaaaaaaaaaa")
    lock.acquire()
    assert "no longer running" in lock.notes[0] and _lock(root)["run_id"] == "aaaaaaaaaaaa"
    assert _lock(root)["pid"] == os.getpid()
    lock.release()
    assert _lock(root) is None

    _write_lock(root, pid=sleeper.pid, proc_start="1")  # same pid, another process start: reused
    lock = ckpt.DirLock(root, "bbbbbbbbbbbb")
    lock.acquire()
    assert lock.notes and _lock(root)["run_id"] == "bbbbbbbbbbbb"
    with pytest.raises(ckpt.CheckpointError, match="in use by another run in this process"):
        ckpt.DirLock(root, "cccccccccccc").acquire()
    lock.release()

    _write_lock(root, pid=sleeper.pid, proc_start=procs.proc_start(sleeper.pid))
    with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint\.dir {root} is in use by run 0123456789ab "
                                                   rf"\(pid {sleeper.pid} on host "):
        ckpt.DirLock(root, "dddddddddddd").acquire()
    _write_lock(root, pid=_dead_pid(), host="elsewhere.example")
    with pytest.raises(ckpt.CheckpointError, match=r"on host elsewhere\.example.*another host.*delete "
                                                   + os.path.join(root, ckpt.LOCK)):
        ckpt.DirLock(root, "eeeeeeeeeeee").acquire()
    assert _lock(root)["host"] == "elsewhere.example"  # refused: left as it was
    _write_lock(root, pid=_dead_pid(), pid_ns="pid:[1]")  # same host name, another container
    with pytest.raises(ckpt.CheckpointError, match=r"another container"):
        ckpt.DirLock(root, "eeeeeeeeeeee").acquire()

    # a lock of this very process that no live run of it holds (its run ended without releasing
    # it) is reused silently
    _write_lock(root, pid=os.getpid(), proc_start=procs.proc_start(os.getpid()))
    again = ckpt.DirLock(root, "ffffffffffff")
    again.acquire()
    assert _lock(root)["run_id"] == "ffffffffffff" and not again.notes
    again.release()
    # dropping a DirLock without release() (a run that failed half-way) releases it too
    ckpt.DirLock(root, "gggggggggggg").acquire()
    assert _lock(root) is None


def test_unwritable_checkpoint_dir_is_refused_before_the_sparse_side_is_built(tmp_path, read_only, monkeypatch):
    """checkpoint.dir read-only (or a file): the lock cannot be created; that is found before the
    data and the placement planning (build_sparse) run."""
    (tmp_path / "afile").write_text("x")

    def no_build(*a, **k):
        raise AssertionError("the sparse side was built before the checkpoint dir was checked")

    monkeypatch.setattr(runner, "build_sparse", no_build)
    monkeypatch.setattr(runner, "make_data", no_build)
    for root, needle in ((os.path.join(read_only, "out"), "Read-only file system"),
                         (str(tmp_path / "afile" / "ck"), "Not a directory")):
        with pytest.raises(ckpt.CheckpointError, match=rf"checkpoint\.dir {root} .*{needle}"):
            run(make_cfg(CLI_BASE + ["comm=local", "train.steps=4", f"checkpoint.dir={root}"]),
                out_dir=str(tmp_path / "out"))
