"""What /proc says about a process: its state, parent, start time, command line and directory.

Why one module: three places ask these questions, and each used to parse /proc/PID/stat itself:
the checkpoint directory lock (is the run holding the lock still alive, or was its pid reused?),
the relaunch advice after a lost worker (which ancestor process is the launcher, and where was it
started?) and the cluster emulation in dev/netcluster.py (which processes are still running below
a launch, which cluster owners are gone). /proc/PID/stat is `pid (comm) state ppid ...`, and comm
may itself hold spaces and parentheses, so the fields are counted after the *last* `)`; getting
that right once is the point of this file.

A leaf on purpose: it imports only the standard library, so a standalone script (dev/netcluster.py)
can use it without loading torch or the rest of the package. Every function answers None when
/proc cannot tell (no such process, another OS, no permission) rather than raising.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["ProcStat", "alive", "boot_id", "cmdline", "cwd", "group", "identity", "is_me", "pid_namespace",
           "proc_start", "stat"]


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat this project reads."""

    state: str  # R running, S sleeping, D disk wait, Z zombie (exited, not reaped), X dead, ...
    ppid: int  # the parent's pid
    start: str  # start time in clock ticks since boot (field 22): with the pid, names one process
    pgrp: int = 0  # its process group

    @property
    def exited(self) -> bool:
        """The process has ended (a zombie waiting for its parent, or dead)."""
        return self.state in ("Z", "X")


def stat(pid: int) -> Optional[ProcStat]:
    """/proc/PID/stat of pid, or None when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after comm: state is field 3
        return ProcStat(fields[0], int(fields[1]), fields[19], int(fields[2]))
    except (OSError, IndexError, ValueError):
        return None


def proc_start(pid: int) -> Optional[str]:
    """The start time of pid while it is running (not a zombie), or None."""
    st = stat(pid)
    return None if st is None or st.exited else st.start


def cmdline(pid: int) -> Optional[list[str]]:
    """pid's command line (its argv), or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [x.decode(errors="surrogateescape") for x in f.read().split(b"\0")[:-1]]
    except OSError:
        return None


def cwd(pid: int) -> Optional[str]:
    """pid's working directory, or None."""
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return None


def boot_id() -> Optional[str]:
    """This machine's boot (a new random id at every boot; None where there is no /proc)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """This process as a holder of something (a directory's lock, a store's scratch folder): its
    host, the machine's boot, its PID namespace, pid and start time. `alive` reads it back."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": boot_id(), "pid_ns": pid_namespace(), "pid": pid,
            "proc_start": proc_start(pid)}


def is_me(holder: dict[str, Any]) -> bool:
    """Does the `identity` name this very process? (A holder written before boot_id and proc_start
    were recorded matches on the rest.)"""
    return all(holder.get(k) == v or (k in ("boot_id", "proc_start") and holder.get(k) is None)
               for k, v in identity().items())


def alive(holder: dict[str, Any]) -> Optional[bool]:
    """Is the process an `identity` names running? None when it cannot be known from here
    (another host, or another PID namespace: a container); False also when this host has booted
    since (another boot id), or when its pid runs a process started at another time."""
    if holder.get("host") != socket.gethostname():
        return None
    if holder.get("boot_id") not in (None, boot_id()):
        return False
    if holder.get("pid_ns") != pid_namespace():
        return None
    pid = int(holder.get("pid", -1))
    if os.path.isdir("/proc/self"):
        start, want = proc_start(pid), holder.get("proc_start")
        return start is not None and (want is None or start == want)  # a reused pid: dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def pid_namespace() -> Optional[str]:
    """This process's pid namespace (containers on one host can share a host name, not pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def group(pgid: int) -> list[int]:
    """The running (not exited) processes of process group pgid, by pid ([] without /proc)."""
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return []
    out = []
    for pid in sorted(pids):
        st = stat(pid)
        if st is not None and st.pgrp == pgid and not st.exited:
            out.append(pid)
    return out
