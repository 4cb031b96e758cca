"""One run per checkpoint directory: a second run on a directory in use fails at start naming the
holder (on every rank: only rank 0 takes the lock), a killed run's lock is taken over with a
warning, the rules for which existing lock is taken over (a dead or reused pid: yes; another host:
no), and an unusable checkpoint.dir (read-only, a file) is refused before the sparse side is built.
Runs that involve two runs or a killed one are real `python -m trainer` processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time

import pytest
from failure_helpers import CLI_BASE, _cli, _command, _env, _manifest, _popen, _wait_for
from helpers import make_cfg, spawn

import trainer.run.checkpoint as ckpt
import trainer.base.core.procs as procs
import trainer.run.runner as runner
from trainer.run.runner import run


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


def _age(path: str) -> float:
    return time.time() - os.stat(path).st_mtime


def _backdate(path: str, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_lease_rules(tmp_path, monkeypatch, capsys):
    """A lock whose holder cannot be seen from here (another host, another container) is a lease:
    while it is fresh the holder may be dead, so it is watched (said once on stderr) until it is
    refreshed (a live run: refused, naming its age and lease) or older than its lease (taken over
    with one note, with the holder's unfinished saves). An empty or garbage lock (a run killed
    while writing it) is stale once a few seconds old, and a starting run's fresh one is waited for."""
    import trainer.run.checkpoint.lock as lockmod
    root = str(tmp_path / "d")
    path = _write_lock(root, pid=_dead_pid(), host="elsewhere.example", lease_s=30.0)
    waiting = ckpt.DirLock(root, "aaaaaaaaaaaa")
    assert not waiting.acquire(wait_s=0.2) and not waiting.acquire(wait_s=0.2)  # not refreshed: still watched
    err = capsys.readouterr().err
    assert err.count("waiting up to") == 1 and "on host elsewhere.example" in err and "lease (30 s)" in err, err
    os.utime(path)  # its holder refreshes it: it runs
    with pytest.raises(ckpt.CheckpointError, match=r"on host elsewhere\.example.*refreshed its lock \d+ s ago: it is "
                                                   r"running \(if it is dead, its lock is taken over once it is 30 s old"):
        waiting.acquire(wait_s=5)
    os.makedirs(os.path.join(root, "step_00000005.tmp-0123456789ab-00000000"))  # its save in progress
    _backdate(path, 31)
    lock = ckpt.DirLock(root, "bbbbbbbbbbbb")
    lock.acquire()
    assert "whose lease expired (not refreshed for 31 s, lease 30 s)" in lock.notes[0], lock.notes
    assert _lock(root)["run_id"] == "bbbbbbbbbbbb" and _lock(root)["lease_s"] == 60.0
    assert os.listdir(root) == [ckpt.LOCK]
    lock.release()
    for content in ("", "{not json"):
        with open(path, "w") as f:
            f.write(content)
        _backdate(path, 10)
        lock = ckpt.DirLock(root, "cccccccccccc")
        lock.acquire()
        assert "empty or unreadable for 10 s" in lock.notes[0], lock.notes
        lock.release()
    monkeypatch.setattr(lockmod, "UNREADABLE_GRACE_S", 0.5)
    open(path, "w").close()  # being written right now: waited for, then stale
    t0 = time.monotonic()
    lock = ckpt.DirLock(root, "dddddddddddd")
    lock.acquire()
    assert time.monotonic() - t0 >= 0.4 and lock.notes and _lock(root)["run_id"] == "dddddddddddd"
    lock.release()


def test_a_holder_is_its_boot_namespace_pid_and_start_time(tmp_path):
    """A lock written by this very pid in this PID namespace but by another process (another start
    time: a container restarted into a new namespace that got the dead one's inode, its trainer pid
    1 again) or in an earlier boot of this host is a dead holder's: taken over at once, with one
    note (not mistaken for this process, not waited for)."""
    root = str(tmp_path / "b")
    for holder in ({"proc_start": "1"}, {"proc_start": procs.proc_start(os.getpid()), "boot_id": "an-earlier-boot"}):
        _write_lock(root, pid=os.getpid(), lease_s=30.0, **holder)
        lock = ckpt.DirLock(root, "ffffffffffff")
        t0 = time.monotonic()
        assert lock.acquire(wait_s=10)
        assert time.monotonic() - t0 < 2 and len(lock.notes) == 1 and "no longer running" in lock.notes[0], lock.notes
        assert _lock(root)["boot_id"] == procs.boot_id() is not None
        lock.release()


def test_a_held_lock_is_refreshed_until_released(tmp_path):
    root = str(tmp_path / "r")
    lock = ckpt.DirLock(root, "eeeeeeeeeeee", lease_s=0.4)
    lock.acquire()
    path = os.path.join(root, ckpt.LOCK)
    _backdate(path, 100)
    time.sleep(0.35)
    assert _age(path) < 1.0  # touched by its refresher (every lease / 4)
    lock.release()
    assert not os.path.exists(path)


def _in_own_pid_namespace(cwd, *args: str) -> subprocess.Popen:
    """`python -m trainer` in a PID namespace of its own (unshare -p -f: as in a container), its
    own session so that the test can kill it hard, namespace and all."""
    return subprocess.Popen(["unshare", "-p", "-f", *_command(args)], cwd=cwd, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_a_container_killed_hard_is_restarted_without_a_person(tmp_path):
    """A run in its own PID namespace (a container) holds the checkpoint dir, with a 10 s lease. A
    second run, outside, is refused while the first lives, also when its lock was last written
    longer ago than the lease (the live run refreshes it every 2.5 s). Killed hard (SIGKILL to the namespace), its lock stays; a restart loop (as
    Kubernetes' restartPolicy or `docker --restart` run it) waits for the lease to expire, saying
    so once, then takes the lock over with one warning and finishes: no exit 2, no second try."""
    root, out = str(tmp_path / "ck"), str(tmp_path / "out")
    lease = ["checkpoint.lock_lease_s=10", f"checkpoint.dir={root}", "checkpoint.every=5"]
    first = _in_own_pid_namespace(tmp_path, "train.steps=100000", *lease, f"hydra.run.dir={out}/first")
    try:
        _wait_for(first, lambda: _lock(root) is not None and os.path.isdir(ckpt.step_dir(root, 5)),
                  "the first run holds the dir and has saved step 5")
        holder = _lock(root)
        assert holder["pid_ns"] != procs.pid_namespace() and holder["lease_s"] == 10.0
        _backdate(os.path.join(root, ckpt.LOCK), 60)  # as if not refreshed for a minute ...
        time.sleep(3)  # ... but the live run refreshes it
        live = _cli(tmp_path, "train.steps=10", *lease, f"hydra.run.dir={out}/live")
        assert live.returncode == 2 and "refreshed its lock" in live.stderr, live.stderr[-2000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate()
    assert _lock(root)["run_id"] == holder["run_id"]  # a hard kill leaves the lock
    saved = max(step for step, _ in ckpt.complete_checkpoints(root))
    attempts, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 60:  # the restart loop: again after a second, no person
        res = _cli(tmp_path, f"train.steps={saved + 5}", "checkpoint.resume=auto", *lease,
                   f"hydra.run.dir={out}/restart{len(attempts)}")
        attempts.append(res)
        if res.returncode != 2 or "refreshed its lock" not in res.stderr:
            break
        time.sleep(1)
    last = attempts[-1]
    assert last.returncode == 0, last.stderr[-3000:]
    assert len(attempts) == 1 and last.stderr.count("whose lease expired") == 1, [a.stderr[-300:] for a in attempts]
    assert last.stderr.count("waiting up to") == 1, last.stderr[-3000:]
    assert f"resuming from {ckpt.step_dir(root, saved)}" in last.stderr and _lock(root) is None
