"""dev/memcg.py: a memory cgroup under this process's own, whose limit holds the page cache too (a
file 3x the limit is written and read back inside it, and the cgroup's peak stays at the limit
with no OOM kill) and OOM-kills an anonymous allocation past it; torn down on exit and on an
exception; stale cgroups of dead owners removed, live ones kept. Root and a memory cgroup
controller, else skipped saying why."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dev import memcg
from trainer.base.core import cgroup

MIB = 1 << 20


@pytest.fixture
def require_memcg():
    ok, why = memcg.availability()
    if not ok:
        pytest.skip(f"memory cgroups unavailable: {why}")


def _fstype(path: str) -> str:
    """The filesystem type of the mount holding path (/proc/self/mounts, longest prefix)."""
    best, fstype = "", ""
    path = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            _, mnt, fs = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, fs
    return fstype


def _enter(cgroup: str) -> None:
    """preexec_fn: the child moves itself into the cgroup before it execs."""
    fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
    os.write(fd, b"0")
    os.close(fd)


def test_v2_layout_and_files_as_the_kernel_writes_them(tmp_path, monkeypatch):
    """cgroup v2 has no machine here: the detection (cgroup.controllers at the root), the parent
    from /proc/self/cgroup's `0::` line under a mount of a subtree, and the files read for the limit,
    peak and OOM kills, against a made-up tree."""
    root = tmp_path / "cgroup"
    (root / "job" / "me").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/outer/job/me\n")
    (proc / "mountinfo").write_text(f"30 25 0:26 /outer {root} rw,nosuid - cgroup2 cgroup2 rw\n")
    monkeypatch.setattr(memcg, "CGROUP_ROOT", str(root))
    assert memcg.hierarchy(str(proc)) == memcg.Hierarchy(2, str(root), str(root / "job" / "me"))
    assert cgroup.join("/m", "/", "/a/b") == "/m/a/b" and cgroup.join("/m", "/a", "/a") == "/m"
    cg = memcg.MemoryCgroup(64 * MIB)
    cg.path, cg.version = str(root / "job" / "me"), 2
    d = root / "job" / "me"
    (d / "memory.current").write_text("1000\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n")
    assert cg.usage_bytes() == 1000 and cg.oom_kills() == 1
    cg._sampled_peak = 5000
    assert cg.peak_bytes() == 5000  # no memory.peak (kernels before 5.19): the sampled maximum
    (d / "memory.peak").write_text("7000\n")
    assert cg.peak_bytes() == 7000
    cg.version = 1  # v1's files, for the kernels that lack oom_kill
    (d / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    (d / "memory.failcnt").write_text("3\n")
    assert cg.oom_kills() == 3
    cg.path = None  # nothing to remove: it was never created


def test_parse_size():
    assert [memcg.parse_size(x) for x in ("4096", "64M", "64MiB", "2G", "1.5g", "512k")] == [
        4096, 64 * MIB, 64 * MIB, 2 << 30, 3 << 29, 512 << 10]
    for bad in ("", "2X", "-1G", "G"):
        with pytest.raises(ValueError):
            memcg.parse_size(bad)


@pytest.mark.memcg
@pytest.mark.usefixtures("require_memcg")
def test_the_cgroup_nests_in_this_process_own_and_is_removed():
    h = memcg.hierarchy()
    own = open("/proc/self/cgroup").read()
    with memcg.MemoryCgroup(64 * MIB) as cg:
        path = cg.path
        assert path is not None and os.path.dirname(path) == h.parent
        assert os.path.basename(path).startswith(f"ht-memcg-{os.getpid()}-")
        r = cg.run(["cat", "/proc/self/cgroup"])
        assert r.returncode == 0 and os.path.basename(path) in r.stdout, r
        assert os.path.basename(path) not in own  # this process stays where it was
        limit = "memory.limit_in_bytes" if cg.version == 1 else "memory.max"
        assert int(open(os.path.join(path, limit)).read()) == 64 * MIB
        swap = "memory.memsw.limit_in_bytes" if cg.version == 1 else "memory.swap.max"
        if os.path.exists(os.path.join(path, swap)):
            assert int(open(os.path.join(path, swap)).read()) == (64 * MIB if cg.version == 1 else 0)
    assert not os.path.exists(path)


@pytest.mark.memcg
@pytest.mark.usefixtures("require_memcg")
def test_page_cache_is_charged_a_file_3x_the_limit_reads_back_without_oom(tmp_path):
    """The point of the tool: under a 64 MiB limit a 192 MiB file written and read back at random
    offsets stays correct, nothing is OOM-killed, and the cgroup's peak is at the limit (the page
    cache filled it: Python alone is ~10 MiB) but never above."""
    if _fstype(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on tmpfs: its pages are memory, not page cache that can be dropped")
    limit, size, block = 64 * MIB, 192 * MIB, 4096
    child = textwrap.dedent(f"""
        import os, random, sys
        path, size, block = sys.argv[1], {size}, {block}
        chunk = 4 << 20
        with open(path, "wb") as f:  # block i holds its number repeated: checkable anywhere
            for start in range(0, size, chunk):
                f.write(b"".join((i).to_bytes(8, "little") * (block // 8)
                                 for i in range(start // block, (start + chunk) // block)))
        rng, bad = random.Random(0), 0
        with open(path, "rb") as f:
            for _ in range(3000):
                i = rng.randrange(size // block)
                f.seek(i * block)
                bad += f.read(block) != i.to_bytes(8, "little") * (block // 8)
            f.seek(0)
            while f.read(chunk):  # and the whole file once more, start to end
                pass
        print("bad", bad)
    """)
    with memcg.MemoryCgroup(limit) as cg:
        r = cg.run([sys.executable, "-c", child, str(tmp_path / "big.bin")], timeout=60)
        peak, kills = cg.peak_bytes(), cg.oom_kills()
    assert r.returncode == 0 and r.stdout.strip() == "bad 0", r
    assert os.path.getsize(tmp_path / "big.bin") == size
    assert kills == 0
    assert limit // 2 < peak <= limit, (peak, limit)


@pytest.mark.memcg
@pytest.mark.usefixtures("require_memcg")
def test_anonymous_memory_past_the_limit_is_oom_killed():
    child = "b = bytearray(128 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('survived')"
    with memcg.MemoryCgroup(64 * MIB) as cg:
        r = cg.run([sys.executable, "-c", child], timeout=60)
        assert r.returncode != 0 and "survived" not in r.stdout, r
        assert cg.oom_kills() >= 1
        assert cg.peak_bytes() <= 64 * MIB
    # the same allocation fits under a larger limit: the limit, not the allocation, killed it
    with memcg.MemoryCgroup(512 * MIB) as cg:
        r = cg.run([sys.executable, "-c", child], timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "survived" and cg.oom_kills() == 0, r
        assert cg.peak_bytes() > 128 * MIB


@pytest.mark.memcg
@pytest.mark.usefixtures("require_memcg")
def test_children_are_inside_and_killed_on_timeout_and_on_an_exception():
    # a grandchild in its own session escapes the process group, not the cgroup
    with memcg.MemoryCgroup(64 * MIB) as cg:
        r = cg.run(["sh", "-c", "setsid sleep 300 & sleep 300"], timeout=1)
        assert r.timed_out and cg.pids() == []
    path = None
    with pytest.raises(RuntimeError, match="boom"):
        with memcg.MemoryCgroup(64 * MIB) as cg:
            path = cg.path
            subprocess.Popen(["sleep", "300"], preexec_fn=lambda: _enter(str(path)))
            assert len(cg.pids()) == 1
            raise RuntimeError("boom")
    assert path is not None and not os.path.exists(path)


@pytest.mark.memcg
@pytest.mark.usefixtures("require_memcg")
def test_cleanup_stale_removes_dead_owners_cgroups_only():
    """Its own prefix, so another test process's cleanup (every MemoryCgroup runs one, for the
    default prefix) cannot take this test's stale cgroup first."""
    parent, prefix = memcg.hierarchy().parent, "ht-memcgtest"
    p = subprocess.Popen(["true"])  # a pid that existed and is gone
    p.wait()
    stale = os.path.join(parent, f"{prefix}-{p.pid}-7")
    live = os.path.join(parent, f"{prefix}-{os.getpid()}-999999")
    other = os.path.join(parent, f"{prefix}x-{p.pid}-7")  # not this prefix's name
    for d in (stale, live, other):
        os.mkdir(d)
    try:
        leftover = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: _enter(stale))
        assert memcg.cleanup_stale(prefix) == [stale]
        assert leftover.wait(timeout=10) == -9  # what was left inside was killed
        assert not os.path.exists(stale) and os.path.isdir(live) and os.path.isdir(other)
    finally:
        for d in (stale, live, other):
            if os.path.isdir(d):
                os.rmdir(d)
