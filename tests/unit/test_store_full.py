"""A full embedding.store_dir mid-run (another writer fills its disk): the run stops with one line
naming the store_dir, the file, its disk's free space and what the store's files take there (exit
2, no traceback), and its store folder is removed (tier/records.py: StoreFull). On a tmpfs of its
own, mounted here (root)."""
from __future__ import annotations

import glob
import os
import subprocess
import time

import pytest
from failure_helpers import _popen, _wait_for


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


def test_a_full_store_dir_stops_the_run_in_one_line(tmp_path, small_disk):
    run = _popen(tmp_path, "data=bench", "data.max_table_rows=5000", "optim=adagrad", "embedding.store=disk",
                 f"embedding.store_dir={small_disk}", "embedding.store_cache_bytes=4000000", "checkpoint.enabled=false",
                 "train.steps=100000", f"hydra.run.dir={tmp_path}/out")
    try:
        _wait_for(run, lambda: glob.glob(os.path.join(small_disk, "ht-store-rank0-*", "rows.bin")), "the store's file")
        time.sleep(2)
        with open(os.path.join(small_disk, "filler"), "wb") as f:  # another writer takes what is left
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        _, err = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    line = lines[0]
    assert f"embedding.store_dir {small_disk}: no space left on its disk (0 B free)" in line, line
    assert ".bin;" in line and "this rank's store files there take up to" in line and "checkpoint.resume=auto" in line
    assert os.listdir(small_disk) == ["filler"]  # the run's store folder removed
