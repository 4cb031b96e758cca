"""The memory cgroup this process is in, and how much memory it may still take (cgroup v1 and v2).

Why: a scheduler's memory limit (Slurm's --mem, a Kubernetes container's limit, a systemd slice)
is a cgroup's, not the machine's: MemAvailable says nothing of it, and a plan sized by
MemAvailable is OOM-killed at the limit without a word. The limit that binds is the process's own
cgroup's or one of its ancestors' (limits nest), found through /proc/self/cgroup:
- cgroup v2 (the unified hierarchy: <root>/cgroup.controllers exists): the `0::PATH` line, under
  the cgroup2 mount; memory.max ("max": none) and memory.current;
- cgroup v1 (the memory controller mounted on its own, e.g. /sys/fs/cgroup/memory): the line
  whose controllers name `memory`, under that mount; memory.limit_in_bytes (a page-rounded
  LONG_MAX: none) and memory.usage_in_bytes.
A mount may show only a subtree (a container's cgroup namespace, or a bind mount of the job's own
cgroup: mountinfo's root field), so PATH is taken relative to the mount's root; where the
directory is not there, the mount's root is the process's cgroup (inside a cgroup namespace
/proc/self/cgroup says `/`). The room is the least, over the cgroup and its ancestors up to the
mount, of limit - usage.

Every path is a parameter (proc, cgroup_root) so that made-up trees test the layouts this machine
does not have; dev/memcg.py makes its test cgroups under the same `hierarchy()`.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

__all__ = ["CGROUP_ROOT", "CgroupError", "Hierarchy", "MemoryRoom", "hierarchy", "join", "memory_room"]

CGROUP_ROOT = "/sys/fs/cgroup"
V1_UNLIMITED = 1 << 62  # v1 says "no limit" with LONG_MAX rounded down to a page: anything this large


class CgroupError(RuntimeError):
    """No memory cgroup controller can be found; the message says why."""


@dataclass(frozen=True)
class Hierarchy:
    """The memory controller this process sees: its version, mount point and the directory of the
    process's own cgroup."""

    version: int  # 1 or 2
    mount: str
    parent: str  # this process's own cgroup directory (dev/memcg.py makes children here)


@dataclass(frozen=True)
class MemoryRoom:
    """Bytes this process's cgroup may still take (limit - usage at the binding level), that
    level's directory and its limit."""

    bytes: int
    where: str
    limit: int


def mounts(proc: str = "/proc/self") -> list[tuple[str, str, str, str]]:
    """(root, mount point, fstype, super options) of each cgroup mount in PROC/mountinfo."""
    out = []
    try:
        with open(os.path.join(proc, "mountinfo")) as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                    out.append((fields[3], fields[4], rfields[0], rfields[2]))
    except OSError:
        pass
    return out


def own_path(version: int, proc: str = "/proc/self") -> Optional[str]:
    """This process's cgroup path from PROC/cgroup: the memory line (v1) or `0::` (v2)."""
    try:
        with open(os.path.join(proc, "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if version == 2 and parts[0] == "0" and parts[1] == "":
            return parts[2]
        if version == 1 and "memory" in parts[1].split(","):
            return parts[2]
    return None


def join(mount: str, root: str, path: str) -> str:
    """The directory of cgroup `path` under a mount of the hierarchy's `root` (a container's mount
    may show only its own subtree)."""
    if root not in ("", "/") and (path == root or path.startswith(root.rstrip("/") + "/")):
        path = path[len(root.rstrip("/")):]
    return os.path.join(mount, path.lstrip("/")).rstrip("/") or "/"


def hierarchy(proc: str = "/proc/self", cgroup_root: str = CGROUP_ROOT) -> Hierarchy:
    """The memory controller of this process; CgroupError when there is none."""
    if not sys.platform.startswith("linux"):
        raise CgroupError(f"memory cgroups need Linux (this is {sys.platform})")
    found = mounts(proc)
    if os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):  # the unified hierarchy
        path = own_path(2, proc)
        if path is None:
            raise CgroupError(f"{proc}/cgroup has no cgroup v2 line")
        root = next((r for r, mp, fs, _ in found if fs == "cgroup2" and mp == cgroup_root), "/")
        with open(os.path.join(cgroup_root, "cgroup.controllers")) as f:
            if "memory" not in f.read().split():
                raise CgroupError(f"cgroup v2 at {cgroup_root} has no memory controller")
        return Hierarchy(2, cgroup_root, join(cgroup_root, root, path))
    v1 = [(r, mp) for r, mp, fs, opts in found if fs == "cgroup" and "memory" in opts.split(",")]
    root, mount = v1[0] if v1 else ("/", os.path.join(cgroup_root, "memory"))
    if not os.path.isfile(os.path.join(mount, "memory.limit_in_bytes")):
        raise CgroupError(f"no memory cgroup controller: neither {cgroup_root}/cgroup.controllers (v2) nor "
                          f"a v1 memory mount ({mount})")
    path = own_path(1, proc)
    if path is None:
        raise CgroupError(f"{proc}/cgroup has no memory line")
    return Hierarchy(1, mount, join(mount, root, path))


def _number(path: str) -> Optional[int]:
    """The integer in a cgroup file; None where it is missing, unreadable or `max`."""
    try:
        with open(path) as f:
            text = f.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def memory_room(proc: str = "/proc/self", cgroup_root: str = CGROUP_ROOT) -> Optional[MemoryRoom]:
    """What this process's memory cgroup lets it still take: the least over its cgroup and the
    ancestors up to the mount of limit - usage (the module docstring); None where no level has a
    limit or no memory controller is found."""
    try:
        h = hierarchy(proc, cgroup_root)
    except (CgroupError, OSError):
        return None
    limit_file, usage_file = (("memory.max", "memory.current") if h.version == 2 else
                              ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    d = h.parent if os.path.isdir(h.parent) else h.mount
    best: Optional[MemoryRoom] = None
    while True:
        limit = _number(os.path.join(d, limit_file))
        if limit is not None and limit < V1_UNLIMITED:
            room = max(limit - (_number(os.path.join(d, usage_file)) or 0), 0)
            if best is None or room < best.bytes:
                best = MemoryRoom(room, d, limit)
        if os.path.normpath(d) == os.path.normpath(h.mount) or d in ("/", ""):
            return best
        d = os.path.dirname(d)
