"""trainer/base/core/procs.py: /proc/PID/stat read once for the checkpoint lock, the relaunch advice and the
cluster emulation. A process whose name holds spaces and parentheses (the comm field of
/proc/PID/stat is free text) still gives its state, parent and start time; an exited process is
told apart from a running one until it is reaped, and is gone after."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

from trainer.base.core import procs


def test_stat_of_a_process_with_an_awkward_name(tmp_path):
    exe = tmp_path / "sl ) (eep 1"  # comm: the executable's name, spaces and parentheses included
    exe.symlink_to(shutil.which("sleep"))  # state R, S, or D while its pages load on a busy disk
    child = subprocess.Popen([str(exe), "30"])
    try:
        st = procs.stat(child.pid)
        assert st is not None and st.ppid == os.getpid() and st.state in ("R", "S", "D") and not st.exited
        assert st.start.isdigit() and procs.proc_start(child.pid) == st.start
        # Popen returns once the exec has closed its error pipe, a moment before the kernel has set
        # the new program's arguments: /proc/PID/cmdline reads empty until then (seen once in a full run)
        deadline = time.monotonic() + 10
        while procs.cmdline(child.pid) == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.cmdline(child.pid) == [str(exe), "30"] and procs.cwd(child.pid) == os.getcwd()
        child.kill()
        deadline = time.monotonic() + 10
        while procs.stat(child.pid).state != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert procs.stat(child.pid).exited and procs.proc_start(child.pid) is None  # a zombie
    finally:
        child.kill()
        child.wait()
    assert procs.stat(child.pid) is None and procs.cmdline(child.pid) is None and procs.cwd(child.pid) is None


def test_this_process():
    me = procs.stat(os.getpid())
    assert me.state == "R" and me.ppid == os.getppid()
    assert procs.proc_start(os.getpid()) == me.start
    assert procs.pid_namespace() == os.readlink("/proc/self/ns/pid")


def test_a_process_group_lists_its_running_members():
    """procs.group: a child started in a group of its own is that group's one member, and gone
    from it once it ended (a zombie is not running)."""
    child = subprocess.Popen(["sleep", "30"], process_group=0)
    try:
        assert procs.group(child.pid) == [child.pid] and procs.stat(child.pid).pgrp == child.pid
        assert os.getpid() in procs.group(os.getpgrp())
        child.kill()
        deadline = time.monotonic() + 10
        while procs.group(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.group(child.pid) == []
    finally:
        child.kill()
        child.wait()
