"""The disk store's scratch folders (trainer/sparse/embedding/store/tier/scratch.py): each names
its owner, and the next store=disk start on a store_dir removes the folders of dead runs with one
line, never a live run's (on this host, in another PID namespace, a folder being made)."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import time

import pytest
from failure_helpers import _cli, _popen, _wait_for

import trainer.base.core.procs as procs
from trainer.sparse.embedding.store.tier import scratch


def _folder(base, name: str, owner: dict | None, age: float = 0.0) -> str:
    path = os.path.join(base, f"{scratch.PREFIX}{name}")
    os.makedirs(path)
    with open(os.path.join(path, "rows.bin"), "wb") as f:
        f.write(b"x" * 8192)
    if owner is not None:
        with open(os.path.join(path, scratch.OWNER), "w") as f:
            json.dump(owner, f)
    for p in (path, os.path.join(path, scratch.OWNER)):
        if os.path.exists(p):
            t = time.time() - age
            os.utime(p, (t, t))
    return path


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_reap_removes_only_the_folders_of_dead_owners(tmp_path, capsys):
    base = str(tmp_path)
    here = procs.identity()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        live = {**here, "pid": sleeper.pid, "proc_start": procs.proc_start(sleeper.pid), "lease_s": 60.0}
        keep = [
            _folder(base, "0-live", live),
            _folder(base, "1-elsewhere-fresh", {**here, "host": "elsewhere.example", "lease_s": 60.0}, age=30),
            _folder(base, "2-being-made", None),
        ]
        gone = [
            _folder(base, "3-dead-pid", {**here, "pid": _dead_pid(), "lease_s": 60.0}),
            _folder(base, "4-pid-reused", {**here, "pid": sleeper.pid, "proc_start": "1", "lease_s": 60.0}),
            _folder(base, "5-earlier-boot", {**live, "boot_id": "an-earlier-boot"}),
            _folder(base, "6-elsewhere-stale", {**here, "host": "elsewhere.example", "lease_s": 60.0}, age=61),
            _folder(base, "7-no-owner-old", None, age=61),
        ]
        os.makedirs(os.path.join(base, "not-a-store"))
        names, freed = scratch.reap(base)
        err = capsys.readouterr().err
        assert scratch.reap(base) == ([], 0) and capsys.readouterr().err == ""  # the live ones stay
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(names) == sorted(os.path.basename(p) for p in gone)
    assert all(os.path.isdir(p) for p in keep) and not any(os.path.exists(p) for p in gone)
    assert os.path.isdir(os.path.join(base, "not-a-store")) and freed >= 5 * 8192
    assert err.count("removed 5 store folder(s) of runs that are gone") == 1, err


def test_a_scratch_dir_names_its_owner_and_keeps_it_fresh(tmp_path):
    d = scratch.ScratchDir(str(tmp_path), 3, lease_s=0.4)
    owner = os.path.join(d.path, scratch.OWNER)
    with open(owner) as f:
        got = json.load(f)
    assert os.path.basename(d.path).startswith("ht-store-rank3-")
    assert got["pid"] == os.getpid() and got["host"] == socket.gethostname() and got["lease_s"] == 0.4
    t = time.time() - 100
    os.utime(owner, (t, t))
    time.sleep(0.35)
    assert time.time() - os.stat(owner).st_mtime < 1.0  # refreshed (every lease / 4)
    assert scratch.reap(str(tmp_path)) == ([], 0)  # its own folder is a live run's
    d.close()
    assert not os.path.exists(d.path)


DISK = ["embedding.store=disk", "checkpoint.enabled=false"]


def test_a_killed_runs_store_folder_is_removed_by_the_next_start(tmp_path):
    """A store=disk run killed hard leaves its folder (GBs at a user's size); the next store=disk
    run on that store_dir removes it with one line, trains, and leaves nothing behind."""
    store = str(tmp_path / "store")
    first = _popen(tmp_path, *DISK, f"embedding.store_dir={store}", "train.steps=100000",
                   f"hydra.run.dir={tmp_path}/first")
    try:
        _wait_for(first, lambda: glob.glob(os.path.join(store, "ht-store-rank0-*", "rows.bin")),
                  "the first run's store file exists")
        time.sleep(1)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    left = glob.glob(os.path.join(store, "ht-store-rank0-*"))
    assert len(left) == 1 and os.path.exists(os.path.join(left[0], scratch.OWNER))  # a hard kill leaves it
    res = _cli(tmp_path, *DISK, f"embedding.store_dir={store}", "train.steps=4", f"hydra.run.dir={tmp_path}/second")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("store folder(s) of runs that are gone") == 1, res.stderr[-3000:]
    assert os.path.basename(left[0]) in res.stderr and os.listdir(store) == []
