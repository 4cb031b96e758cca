"""trainer/base/core/cgroup.py: the memory a process's own cgroup leaves it, cgroup v1 and v2, found
through /proc/self/cgroup; the memory plan obeys it (trainer/run/resolve/memplan.py).

Made-up trees for the layouts this machine does not have (v2 under a Slurm-like slice, v2 inside
a cgroup namespace, v1 with the limit on an ancestor, a container's subtree mount), and a real v1
memory cgroup (dev/memcg.py, root only) where the trainer's plan names the cgroup and a plan that
cannot fit refuses in one line with exit status 2 instead of being OOM-killed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainer.base.core import cgroup

MIB = 1 << 20
V1_NONE = "9223372036854771712\n"  # what v1 says for no limit
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _proc(tmp_path, cgroup_lines: str, mountinfo: str) -> str:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup_lines)
    (proc / "mountinfo").write_text(mountinfo)
    return str(proc)


def _files(d, **values) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, v in values.items():
        (d / name.replace("_", ".", 1)).write_text(v)


def test_v1_the_limit_of_an_ancestor_binds(tmp_path):
    """cgroup v1 (this machine's kind): the process's cgroup has no limit, its job's parent has
    1.2 GB with 200 MB used: the room is 1.0 GB, named by that directory."""
    mnt = tmp_path / "memory"
    _files(mnt, memory_limit_in_bytes=V1_NONE, memory_usage_in_bytes="5000000000\n")
    _files(mnt / "slurm" / "job_7", memory_limit_in_bytes=str(1200 * 10**6), memory_usage_in_bytes=str(200 * 10**6))
    _files(mnt / "slurm" / "job_7" / "step_0", memory_limit_in_bytes=V1_NONE, memory_usage_in_bytes="150000000")
    proc = _proc(tmp_path, "5:cpu,cpuacct:/slurm/job_7\n4:memory:/slurm/job_7/step_0\n0::/\n",
                 f"33 25 0:30 / {mnt} rw,nosuid - cgroup cgroup rw,memory\n")
    room = cgroup.memory_room(proc, str(tmp_path))
    assert room == cgroup.MemoryRoom(1000 * 10**6, str(mnt / "slurm" / "job_7"), 1200 * 10**6)
    # the step's own, tighter limit binds when it has one
    (mnt / "slurm" / "job_7" / "step_0" / "memory.limit_in_bytes").write_text(str(400 * 10**6))
    assert cgroup.memory_room(proc, str(tmp_path)).bytes == 250 * 10**6


def test_v2_a_slice_and_a_container_subtree(tmp_path):
    """cgroup v2: the `0::` path under a mount that shows only a subtree (mountinfo's root), a
    limit on the slice, `max` below it; usage over the limit gives 0, never a negative room."""
    root = tmp_path / "cg"
    _files(root, **{"cgroup.controllers": "cpu io memory pids\n"})
    _files(root / "job", memory_max="1073741824\n", memory_current="73741824\n")
    _files(root / "job" / "task", memory_max="max\n", memory_current="1000\n")
    proc = _proc(tmp_path, "0::/system.slice/job/task\n",
                 f"40 25 0:35 /system.slice {root} rw - cgroup2 cgroup2 rw\n")
    assert cgroup.memory_room(proc, str(root)) == cgroup.MemoryRoom(10**9, str(root / "job"), 1073741824)
    (root / "job" / "memory.current").write_text("2000000000\n")
    assert cgroup.memory_room(proc, str(root)).bytes == 0


def test_v2_inside_a_cgroup_namespace(tmp_path):
    """Inside a cgroup namespace /proc/self/cgroup says `0::/` and the mount's root is the
    container's cgroup: its memory.max binds."""
    root = tmp_path / "cg"
    _files(root, **{"cgroup.controllers": "memory\n"}, memory_max=str(512 * MIB), memory_current=str(12 * MIB))
    proc = _proc(tmp_path, "0::/\n", f"40 25 0:35 / {root} rw - cgroup2 cgroup2 rw\n")
    assert cgroup.memory_room(proc, str(root)) == cgroup.MemoryRoom(500 * MIB, str(root), 512 * MIB)


def test_no_limit_or_no_controller_is_none(tmp_path):
    root = tmp_path / "cg"
    _files(root, **{"cgroup.controllers": "memory\n"}, memory_max="max\n", memory_current="1\n")
    proc = _proc(tmp_path, "0::/\n", f"40 25 0:35 / {root} rw - cgroup2 cgroup2 rw\n")
    assert cgroup.memory_room(proc, str(root)) is None
    assert cgroup.memory_room(proc, str(tmp_path / "nothing")) is None  # neither v2 nor a v1 mount


@pytest.mark.memcg
def test_in_a_real_v1_cgroup_the_plan_obeys_the_limit_and_refuses_in_one_line(tmp_path):
    """A real memory cgroup of 400 MiB (dev/memcg.py): the cgroup's room as the trainer's memory
    plan sees it is at most the limit and names the cgroup; a run whose plan needs more stops
    with one line naming the cgroup's figure, exit status 2, before it allocates (no OOM kill)."""
    from dev import memcg
    ok, why = memcg.availability()
    if not ok:
        pytest.skip(f"memory cgroups unavailable: {why}")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    probe = ("import json, torch; from trainer.run.resolve.memplan import available_memory; "
             "print(json.dumps(available_memory(torch.device('cpu'), 1)))")
    with memcg.MemoryCgroup(400 * MIB) as cg:
        path = cg.path
        got = cg.run([sys.executable, "-c", probe], env=env, cwd=ROOT, timeout=120)
        assert got.returncode == 0, got
        avail, source = json.loads(got.stdout.strip().splitlines()[-1])
        assert 0 < avail <= 400 * MIB and path in source, (avail, source)
        # 8 tables of 2M rows, d = 16, adagrad (137 B a row): ~2.2 GB of rows, far past the 400 MiB
        run = cg.run([sys.executable, "-m", "trainer", "data=tiny", "data.table_rows=[" + ",".join(["2000000"] * 8) + "]",
                      "model.embedding_dim=16", "optim=adagrad", "train.steps=2",
                      f"hydra.run.dir={tmp_path / 'run'}"], env=env, cwd=str(tmp_path), timeout=300)
        assert cg.oom_kills() == 0
    assert run.returncode == 2, run
    err = [x for x in run.stderr.splitlines() if x.strip()]
    assert any(path in x and "memory" in x for x in err), run.stderr[-2000:]
