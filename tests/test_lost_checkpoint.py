"""Nothing lost, ever (issue 18), checkpoint side: a checkpoint dir belongs to one run at a time
(a second run fails at start naming the holder; a dead holder's lock is taken over), rotation and
resume=auto follow the save order (a branch from an older step keeps its newest save), a failed
save removes its own partial directory (a real full disk), and a Criteo checkpoint is refused at
another W. Runs that involve two runs or a killed one are real `python -m trainer` processes."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

import trainer.checkpoint as ckpt
import trainer.procs as procs
from trainer.checkpoint import saver  # where Checkpointer writes its files
from data_helpers import prepare_sample, train_models
from helpers import make_cfg, run_single, spawn, tmpfs
from trainer.runner import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["data=tiny", "data.global_batch_size=48", "data.eval_samples=96", "data.eval_batch_size=48",
        "train.threads=1", "train.progress=off"]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _cli(cwd, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", *BASE, *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _popen(cwd, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", *BASE, *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lock(root: str) -> dict | None:
    try:
        with open(os.path.join(root, ckpt.LOCK)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _manifest(path: str) -> dict:
    with open(os.path.join(path, ckpt.MANIFEST)) as f:
        return json.load(f)


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


# ---------------------------------------------------------------------------- 1. one run per dir
def test_second_run_fails_at_start_and_a_killed_runs_lock_is_taken_over(tmp_path):
    """Run A trains with checkpoint.every=10; run B, started on the same checkpoint.dir while A
    runs, exits 2 before training, naming the dir and A (pid, run id) and leaving A's files alone.
    A is then killed (SIGKILL: no clean-up); run C with resume=auto takes the dead run's lock over
    (a warning), removes A's unfinished save and continues from A's newest checkpoint."""
    root = str(tmp_path / "S")
    a = _popen(tmp_path, "train.steps=100000", "checkpoint.every=10", "checkpoint.keep_last=2",
               f"checkpoint.dir={root}", f"hydra.run.dir={tmp_path / 'a'}")
    try:
        t0 = time.monotonic()
        while not ckpt.complete_checkpoints(root):
            assert a.poll() is None, a.communicate()[1][-3000:]
            assert time.monotonic() - t0 < 120, "run A wrote no checkpoint"
            time.sleep(0.05)
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


def _try_run(rank: int, world: int, overrides: list[str]) -> str:
    """Spawned worker: one rank of a run; returns its error (every rank must get one)."""
    try:
        run(make_cfg(list(overrides) + ["comm=torch"]))
    except Exception as exc:  # noqa: BLE001 - the test looks at every rank's error
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.dist
def test_lock_held_elsewhere_stops_every_rank_at_start(tmp_path, sleeper):
    """W = 2: only rank 0 takes the lock; its refusal reaches rank 1 too (nobody waits in a
    collective), and the holder's lock and checkpoints are untouched."""
    root = str(tmp_path / "S")
    lock = _write_lock(root, pid=sleeper.pid, proc_start=procs.proc_start(sleeper.pid))
    os.makedirs(os.path.join(root, "step_00000005.tmp-0123456789ab-00000000"))  # its save in progress
    before = open(lock).read()
    errors = spawn(2, _try_run, BASE + ["train.steps=4", f"checkpoint.dir={root}"], timeout=120)
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


def test_rotation_touches_only_this_runs_work_dirs(tmp_path):
    """Cleanup after a save removes this run's own leftovers only: another run's save in progress
    (or an unrecognised directory) stays."""
    root = str(tmp_path / "ck")
    foreign = ["step_00000004.tmp-0123456789ab-00000000", "step_00000004.old-0123456789ab-00000000",
               "step_00000099.tmp-leftover"]
    for name in foreign:
        os.makedirs(os.path.join(root, name))
    run_single(BASE + ["train.steps=6", "checkpoint.every=2", "checkpoint.keep_last=1", f"checkpoint.dir={root}"])
    assert sorted(os.listdir(root)) == sorted(foreign + ["step_00000006"])


# ---------------------------------------------------------------------------- 2. save order
def test_branch_keeps_its_newest_save_and_auto_follows_it(tmp_path):
    """The issue's reproduction, as processes: 40 steps saved every 10, then a branch from step_20
    to step 35 at another lr. keep_last=1 keeps step_35 (the newest save, not step_40); with
    keep_last=3 a later resume=auto continues the branch (step_35), not the abandoned step_40."""
    b = str(tmp_path / "B")
    first = _cli(tmp_path, "train.steps=40", "checkpoint.every=10", f"checkpoint.dir={b}",
                 f"hydra.run.dir={tmp_path / 'r1'}")
    assert first.returncode == 0, first.stderr[-3000:]
    b3 = str(tmp_path / "B3")
    shutil.copytree(b, b3)
    branch = ["train.steps=35", "optim.lr=0.01", "checkpoint.every=10"]
    one = _cli(tmp_path, *branch, "checkpoint.keep_last=1", f"checkpoint.resume={ckpt.step_dir(b, 20)}",
               f"checkpoint.dir={b}", f"hydra.run.dir={tmp_path / 'r2'}")
    assert one.returncode == 0, one.stderr[-3000:]
    summary = json.loads((tmp_path / "r2" / "summary.json").read_text())
    assert summary["checkpoint"] == ckpt.step_dir(b, 35) and os.path.isdir(summary["checkpoint"])
    assert [s for s, _ in ckpt.complete_checkpoints(b)] == [35]

    three = _cli(tmp_path, *branch, "checkpoint.keep_last=3", f"checkpoint.resume={ckpt.step_dir(b3, 20)}",
                 f"checkpoint.dir={b3}", f"hydra.run.dir={tmp_path / 'r3'}")
    assert three.returncode == 0, three.stderr[-3000:]
    assert [s for s, _ in ckpt.complete_checkpoints(b3)] == [40, 30, 35]  # save order
    seqs = [_manifest(p)["save_seq"] for _, p in ckpt.complete_checkpoints(b3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    assert _manifest(ckpt.step_dir(b3, 30))["config"]["optim"]["lr"] == 0.01  # the branch's step_30
    auto = _cli(tmp_path, "train.steps=40", "optim.lr=0.01", f"checkpoint.dir={b3}", "checkpoint.resume=auto",
                f"hydra.run.dir={tmp_path / 'r4'}")
    assert auto.returncode == 0, auto.stderr[-3000:]
    summary = json.loads((tmp_path / "r4" / "summary.json").read_text())
    assert summary["resumed_from"] == ckpt.step_dir(b3, 35) and summary["start_step"] == 35


def test_checkpoints_without_save_seq_come_first_by_step(tmp_path):
    """Checkpoints written before save_seq existed are older than any with one, by step."""
    root = tmp_path / "ck"
    for step, seq in ((30, None), (10, None), (20, 1)):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / ckpt.MANIFEST).write_text(json.dumps({"step": step} | ({"save_seq": seq} if seq else {})))
    assert [s for s, _ in ckpt.complete_checkpoints(str(root))] == [10, 30, 20]
    assert ckpt.latest(str(root)) == str(root / "step_00000020") and ckpt.last_save_seq(str(root)) == 1


# ---------------------------------------------------------------------------- 5. failed saves
@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs (a tiny checkpoint is ~180 KiB): real ENOSPC. Unmounted afterwards."""
    with tmpfs(tmp_path / "small") as mnt:
        yield mnt


def test_failed_save_on_a_full_disk_removes_its_partial_dir(tiny_fs):
    """The final save runs out of space: the run fails naming the error, its step_K.tmp-* is gone
    (relaunching on the same full disk does not pile them up) and the lock is released."""
    root = os.path.join(tiny_fs, "ck")
    for attempt in range(2):
        with pytest.raises(ckpt.CheckpointError, match=r"No space left on device"):
            run_single(BASE + ["train.steps=2", f"checkpoint.dir={root}"])
        assert os.listdir(root) == [], (attempt, os.listdir(root))


def test_failed_trainer_file_write_removes_the_partial_dir(tmp_path, monkeypatch):
    """An injected failure half-way through rank 0's trainer file (after the shards): same."""
    root = str(tmp_path / "ck")
    real = saver.write_file

    def half_then_fail(path: str, obj):
        if os.path.basename(path) == ckpt.TRAINER_FILE:
            with open(path, "wb") as f:
                f.write(b"x" * 1000)
            raise OSError(28, "No space left on device (injected)", path)
        return real(path, obj)

    monkeypatch.setattr(saver, "write_file", half_then_fail)
    with pytest.raises(ckpt.CheckpointError, match=r"injected"):
        run_single(BASE + ["train.steps=4", "checkpoint.every=2", f"checkpoint.dir={root}"])
    assert os.listdir(root) == []


def test_peer_lost_after_the_rename_still_names_that_checkpoint(tmp_path, monkeypatch):
    """A peer dies in a save's closing broadcast, after rank 0 renamed the checkpoint into place
    (seen in CI: the test of a killed worker killed it right when the checkpoint appeared). The
    checkpoint is complete on disk, so the failure message must offer to continue from it, not
    to start over."""
    from trainer.comm import CollectiveError
    from trainer.comm.local import LocalCollectives
    root = str(tmp_path / "ck")
    real_finish, real_bcast = ckpt.Checkpointer._finish, LocalCollectives.broadcast_object
    lost = {"armed": False}

    def finish(self, tmp, step, *args):
        out = real_finish(self, tmp, step, *args)
        lost["armed"] = step == 4  # the second save: the first one completes normally
        return out

    def bcast(self, obj, root=0):
        if lost["armed"]:
            raise CollectiveError("collective 'broadcast' failed on rank 0/2 (injected: the peer died)")
        return real_bcast(self, obj, root)

    monkeypatch.setattr(ckpt.Checkpointer, "_finish", finish)
    monkeypatch.setattr(LocalCollectives, "broadcast_object", bcast)
    with pytest.raises(CollectiveError) as err:
        run_single(BASE + ["train.steps=8", "checkpoint.every=2", "checkpoint.keep_last=0",
                           f"checkpoint.dir={root}"])
    msg = str(err.value)
    step, path = ckpt.complete_checkpoints(root)[-1]
    assert step == 4, ckpt.complete_checkpoints(root)
    assert f"The newest complete checkpoint of this run is {os.path.abspath(path)}; to continue from it" in msg, msg
    assert f"checkpoint.resume={os.path.abspath(path)}" in msg, msg


# ---------------------------------------------------------------------------- 7. Criteo at another W
@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("criteo")
    prepare_sample(str(out))
    return str(out / "prepared")


@pytest.mark.dist
def test_criteo_checkpoint_is_refused_at_another_world_size(prepared, tmp_path):
    """The Criteo stream position depends on W: a W = 2 checkpoint resumes at W = 2 (equal to the
    uninterrupted run) and is refused at W = 1 with a message naming both world sizes."""
    root = str(tmp_path / "ck")
    crit = ["data=criteo", f"data.dir={prepared}", "data.loader=memmap", "data.batch_size=32", "data.epochs=0",
            "train.steps=6", "train.progress=off", "train.threads=1", "train.ensemble=1"]
    full, again = spawn(2, train_models, [crit + ["checkpoint.every=3", f"checkpoint.dir={root}"],
                                          crit + [f"checkpoint.resume={ckpt.step_dir(root, 3)}"]])[0]
    assert _manifest(ckpt.step_dir(root, 3))["data_order_world"] == 2
    assert again["summary"]["start_step"] == 3
    assert again["losses"] == pytest.approx(full["losses"], rel=1e-5)
    with pytest.raises(ckpt.CheckpointError, match=r"written by a data=criteo run with 2 workers and this run "
                                                   r"has 1.*Resume it with 2 workers"):
        run_single(crit + [f"checkpoint.resume={ckpt.step_dir(root, 3)}"], return_state=False)


def test_stream_world_check_reads_older_manifests():
    """A manifest from before data_order_world: the data name in its config decides."""
    old = {"world_size": 2, "step": 3, "config": {"data": {"name": "criteo"}}}
    with pytest.raises(ckpt.CheckpointError, match="with 2 workers and this run has 3"):
        ckpt.check_stream_world("ck", old, 3)
    ckpt.check_stream_world("ck", old, 2)
    ckpt.check_stream_world("ck", {**old, "config": {"data": {"name": "synthetic"}}}, 3)
    ckpt.check_stream_world("ck", {**old, "data_order_world": None}, 3)
