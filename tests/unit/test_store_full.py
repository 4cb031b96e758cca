"""A full embedding.store_dir (tier/records.py): the store's files take their blocks when they are
made (fallocate), so another writer filling the disk mid-run stops nothing, and the log's halves
keep theirs when zeroed; a disk without room for them stops the run at start in one line naming
the store_dir, the file, its free space and what the files take (StoreFull, exit 2); a write that
finds the disk full says the same. On a tmpfs of its own, mounted here (root)."""
from __future__ import annotations

import errno
import glob
import json
import os
import subprocess
import time

import pytest
from failure_helpers import _popen, _wait_for

from trainer.base.core.procs import identity
from trainer.sparse.embedding.store.tier import records


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs of its own needs root")
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    yield str(where)
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(path: str) -> None:
    """Another writer takes every byte left on the disk of `path`."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass


def test_a_disk_filled_mid_run_stops_nothing(tmp_path, small_disk):
    """The store's blocks were taken at its start: the run writes rows back, rotates and merges its
    log (a half zeroed, its blocks taken again) on a full disk, saves its checkpoints (the saves'
    buckets in the checkpoint's directory) and ends complete."""
    run = _popen(tmp_path, "data=bench", "data.max_table_rows=5000", "optim=adagrad", "embedding.store=disk",
                 f"embedding.store_dir={small_disk}", "embedding.store_cache_bytes=4000000", "checkpoint.every=20",
                 "train.steps=60", "train.log_every=10", f"hydra.run.dir={tmp_path}/out")
    try:
        _wait_for(run, lambda: glob.glob(os.path.join(small_disk, "ht-store-rank0-*", "rows.bin")), "the store's file")
        _fill(os.path.join(small_disk, "filler"))
        assert os.statvfs(small_disk).f_bavail == 0
        _, err = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, err[-3000:]
    # the saves' buckets (a record and a key a row) went into the checkpoint's own directory
    assert err.count("its buckets need") == 1 and "they go into" in err, err[-3000:]
    assert os.path.isdir(tmp_path / "out" / "checkpoints" / "step_00000060")
    s = json.load(open(tmp_path / "out" / "summary.json"))
    assert s["steps"] == 60 and s["store"]["rows_written_per_step"] > 0 and s["store"]["log_merges"] > 0, s["store"]
    assert os.listdir(small_disk) == ["filler"]  # the run's store folder removed


def test_a_store_the_disk_cannot_hold_is_refused_when_made(small_disk):
    folder = os.path.join(small_disk, "ht-store-rank0-x")
    os.makedirs(folder)
    with pytest.raises(records.StoreFull) as got:
        records.RecordFile(folder, "rows.bin", 400_000, 144)  # 57.6 MB on a 40 MB disk
    line = str(got.value)
    assert line.startswith(f"embedding.store_dir {small_disk}: no space left on its disk (") and "rows.bin" in line, line


def test_a_write_on_a_full_disk_names_the_store_dir(tmp_path):
    path = str(tmp_path / "ht-store-rank0-y" / "log.bin")
    os.makedirs(os.path.dirname(path))
    open(path, "wb").close()

    def full(fd, views, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    def short_then_full(fd, views, offset, calls=[]):
        calls.append(offset)
        if len(calls) == 1:
            return 4096
        raise OSError(errno.ENOSPC, "No space left on device")
    for call in (full, short_then_full):
        with pytest.raises(records.StoreFull, match=rf"embedding.store_dir {tmp_path}: no space left on its disk "
                                                    rf"\(.* free\) writing 8\.2 kB into {path}"):
            records.full_io(call, 0, memoryview(bytearray(8192)), 0, path)


def test_a_dead_runs_folder_is_reaped_before_the_free_space_is_counted(tmp_path, small_disk):
    """A killed run's folder holding most of the disk: the next start removes it first, so its room
    counts as free and the run (whose shard would not fit beside it) trains."""
    dead = os.path.join(small_disk, "ht-store-rank0-dead")
    os.makedirs(dead)
    dead_pid = subprocess.Popen(["true"])
    dead_pid.wait()
    with open(os.path.join(dead, "owner.json"), "w") as f:
        json.dump({**identity(), "pid": dead_pid.pid, "lease_s": 60.0}, f)
    with open(os.path.join(dead, "rows.bin"), "wb") as f:
        f.write(b"\1" * (30 << 20))  # 30 MB of the 40: the new shard (~20 MB) would not fit beside it
    run = _popen(tmp_path, "data=bench", "data.max_table_rows=5000", "optim=adagrad", "embedding.store=disk",
                 f"embedding.store_dir={small_disk}", "checkpoint.enabled=false", "train.steps=4",
                 f"hydra.run.dir={tmp_path}/out")
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert err.count("removed 1 store folder(s) of runs that are gone (ht-store-rank0-dead)") == 1, err[-3000:]
    assert os.listdir(small_disk) == []
