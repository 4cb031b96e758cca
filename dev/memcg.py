"""Run a command under a memory cgroup limit: a model "larger than RAM" with a small model.

Why: the SSD tier for embedding tables (`embedding.store=disk`, issue 54) matters when the rows do not
fit in RAM. A cgroup memory limit makes a small machine small: the kernel charges the page cache
to the cgroup of the process that faulted the page in (cgroup v1 and v2 alike), so a process under
a 64 MiB limit cannot keep a 192 MiB file in RAM: its reads go to the disk once the limit is hit,
and an anonymous allocation past the limit gets the process OOM-killed.

Where: the child cgroup `<prefix>-<pid>-<seq>` (pid: the owning process) is created under the cgroup
this process is in (/proc/self/cgroup), never at the root, so limits nest: a run started inside
another limit gets the smaller of the two.
- cgroup v1 (the memory controller mounted on its own, e.g. /sys/fs/cgroup/memory): the limit is
  memory.limit_in_bytes, and memory.memsw.limit_in_bytes (memory + swap) gets the same value where
  it exists, so swap cannot hide the limit; peak: memory.max_usage_in_bytes; OOM kills: the
  oom_kill count of memory.oom_control (kernels without it: memory.failcnt, the times the limit
  was hit, an upper bound).
- cgroup v2 (the unified hierarchy, /sys/fs/cgroup/cgroup.controllers exists): memory.max, and
  memory.swap.max = 0 where it exists; peak: memory.peak where the kernel has it (5.19+), else
  the largest memory.current sampled while a command ran; OOM kills: memory.events' oom_kill. The
  parent must delegate the memory controller (`+memory` in its cgroup.subtree_control: written
  when missing, which the kernel refuses if the parent holds processes itself and is not the root).

A command started by `MemoryCgroup.run` writes its own pid into cgroup.procs before it execs, so
it and every process it starts are inside from their first page. On exit (also on an exception)
the cgroup's leftover processes are killed and the cgroup removed; `cleanup_stale()` removes the
cgroups of owners that are gone.

Command line, from the repository root: `python -m dev.memcg --limit 2G -- CMD ...` runs CMD under
the limit (its output passes through) and prints one JSON line to stderr at the end: {"rc",
"peak_bytes", "limit_bytes", "oom_kills", "wall_s", "timed_out", "cgroup_version"}; the exit
status is CMD's (128 + N when a signal N ended it). Root only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from trainer.base.core import cgroup, procs  # /proc/PID/stat, parsed once; cgroups (leaves: the standard library only)
from trainer.base.core.cgroup import CGROUP_ROOT, Hierarchy

PREFIX = "ht-memcg"
SAMPLE_S = 0.01  # v2 without memory.peak: memory.current is sampled this often while a command runs
TEARDOWN_S = 10.0
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?$", re.I)
_SEQ = iter(range(1 << 30))
_SEQ_LOCK = threading.Lock()


class MemcgError(RuntimeError):
    """A memory cgroup cannot be created or used; the message says why."""


def parse_size(text: str | int) -> int:
    """Bytes of '2G', '64M', '512k', '1.5GiB', '4096' (binary units: 1G = 2**30)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE_RE.match(str(text).strip())
    if not m:
        raise ValueError(f"size {text!r} is not a size like 2G, 64M, 512k or 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# ------------------------------------------------------------------ where the hierarchy is
# (trainer/base/core/cgroup.py: the same lookup the memory plan makes for its limit)
def hierarchy(proc: str = "/proc/self", cgroup_root: str | None = None) -> Hierarchy:
    """The memory controller of this process; MemcgError when there is none."""
    try:
        return cgroup.hierarchy(proc, cgroup_root or CGROUP_ROOT)
    except cgroup.CgroupError as exc:
        raise MemcgError(str(exc)) from None


def _next_seq() -> int:
    with _SEQ_LOCK:
        return next(_SEQ)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _ensure_delegated(h: Hierarchy) -> None:
    """v2: the memory controller must be enabled in the parent's cgroup.subtree_control."""
    if h.version != 2:
        return
    ctl = os.path.join(h.parent, "cgroup.subtree_control")
    if "memory" in _read(ctl).split():
        return
    try:
        _write(ctl, "+memory")
    except OSError as exc:
        raise MemcgError(f"cannot enable the memory controller for children of {h.parent} ({exc}); on "
                         "cgroup v2 a non-root cgroup holding processes cannot delegate controllers") from exc


def availability() -> tuple[bool, str]:
    """(True, '') when this process can run commands under a memory limit: Linux, root, a memory
    controller, and a child cgroup can be created (and removed again) in its own cgroup."""
    if not sys.platform.startswith("linux"):
        return False, f"memory cgroups need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, f"memory cgroups need root (running as uid {os.geteuid()})"
    try:
        h = hierarchy()
        _ensure_delegated(h)
    except (MemcgError, OSError) as exc:
        return False, str(exc)
    probe = os.path.join(h.parent, f"{PREFIX}-{os.getpid()}-probe{_next_seq()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return False, f"cannot create a child cgroup in {h.parent}: {exc}"
    try:
        limit_file = "memory.max" if h.version == 2 else "memory.limit_in_bytes"
        if not os.path.exists(os.path.join(probe, limit_file)):
            return False, f"a child cgroup of {h.parent} has no {limit_file}"
    finally:
        os.rmdir(probe)
    return True, ""


# ------------------------------------------------------------------ one cgroup
@dataclass
class Result:
    """One finished (or stopped) command."""

    argv: list[str]
    returncode: int  # negative: ended by that signal (subprocess's convention)
    stdout: str | None  # None when not captured
    stderr: str | None
    timed_out: bool
    wall_s: float


def _pids(cg: str) -> list[int]:
    try:
        return [int(x) for x in _read(os.path.join(cg, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _kill_all(cg: str, timeout: float = TEARDOWN_S) -> None:
    """SIGKILL every process in the cgroup until it is empty (processes forking meanwhile too)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _pids(cg)
        if not pids:
            return
        if time.monotonic() > deadline:
            raise MemcgError(f"processes {pids} are still in {cg} after {timeout:g}s")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _remove(cg: str, timeout: float = TEARDOWN_S) -> None:
    """Kill what is left in the cgroup and remove it (rmdir is refused while a dying process is
    still counted: retried)."""
    if not os.path.isdir(cg):
        return
    _kill_all(cg, timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(cg)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise MemcgError(f"cannot remove {cg}: {exc}") from exc
            _kill_all(cg, timeout)
            time.sleep(0.05)


class MemoryCgroup:
    """A child memory cgroup with a limit, as a context manager:

        with MemoryCgroup(64 << 20) as cg:
            r = cg.run(["python", "big.py"], timeout=60)
            print(r.returncode, cg.peak_bytes(), cg.oom_kills())

    Created under this process's own cgroup as `<name_prefix>-<pid>-<seq>`; removed on exit (its
    leftover processes killed), also on an exception."""

    def __init__(self, limit_bytes: int, name_prefix: str = PREFIX):
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes {limit_bytes}: must be > 0")
        if not re.fullmatch(r"[A-Za-z0-9_.]+(-[A-Za-z0-9_.]+)*", name_prefix):
            raise ValueError(f"name_prefix {name_prefix!r}: letters, digits, '_', '.' and single '-' only")
        self.limit_bytes = int(limit_bytes)
        self.name_prefix = name_prefix
        self.path: str | None = None
        self.version = 0
        self._sampled_peak = 0

    # -- life cycle
    def create(self) -> "MemoryCgroup":
        ok, why = availability()
        if not ok:
            raise MemcgError(why)
        cleanup_stale(self.name_prefix)
        h = hierarchy()
        self.version = h.version
        path = os.path.join(h.parent, f"{self.name_prefix}-{os.getpid()}-{_next_seq()}")
        os.mkdir(path)
        self.path = path
        try:
            self._set_limit()
        except BaseException:
            self.close()
            raise
        return self

    def _set_limit(self) -> None:
        assert self.path is not None
        value = str(self.limit_bytes)
        if self.version == 1:
            _write(self._file("memory.limit_in_bytes"), value)  # memsw may never be below it: set first
            if os.path.exists(self._file("memory.memsw.limit_in_bytes")):
                _write(self._file("memory.memsw.limit_in_bytes"), value)
            got = int(_read(self._file("memory.limit_in_bytes")))
        else:
            _write(self._file("memory.max"), value)
            if os.path.exists(self._file("memory.swap.max")):
                _write(self._file("memory.swap.max"), "0")
            got = int(_read(self._file("memory.max")).strip())
        # the kernel rounds the limit down to whole pages
        if abs(got - self.limit_bytes) >= os.sysconf("SC_PAGE_SIZE"):
            raise MemcgError(f"{self.path}: asked for a limit of {self.limit_bytes} bytes, the kernel set {got}")

    def close(self) -> None:
        """Kill the processes left in the cgroup and remove it (idempotent)."""
        if self.path is not None:
            path, self.path = self.path, None
            _remove(path)

    def __enter__(self) -> "MemoryCgroup":
        return self.create()

    def __exit__(self, *exc) -> None:
        self.close()

    def _dir(self) -> str:
        if self.path is None:
            raise MemcgError("the cgroup is not created (use it as a context manager, or call create())")
        return self.path

    def _file(self, name: str) -> str:
        return os.path.join(self._dir(), name)

    # -- running
    def pids(self) -> list[int]:
        """The processes in the cgroup now."""
        return _pids(self._dir())

    def run(self, argv: Sequence[str], timeout: float | None = None, env: Mapping[str, str] | None = None,
            cwd: str | None = None, capture: bool = True) -> Result:
        """Run argv inside the cgroup: the child writes its pid into cgroup.procs before it execs, so
        it and all it starts are charged from their first page. capture=False: its output goes to
        this process's stdout / stderr. On timeout everything in the cgroup is killed."""
        procs_file = self._file("cgroup.procs")

        def enter() -> None:  # runs in the child between fork and exec: os calls only
            fd = os.open(procs_file, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0": the writing process itself (v1 and v2)
            finally:
                os.close(fd)

        out = subprocess.PIPE if capture else None
        t0 = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        try:
            p = subprocess.Popen(list(argv), stdout=out, stderr=out, env=None if env is None else dict(env),
                                 cwd=cwd, text=True, preexec_fn=enter, start_new_session=True)
        except subprocess.SubprocessError as exc:
            raise MemcgError(f"cannot start {argv[0]!r} inside {self.path}: {exc}") from exc
        sampler.start()
        timed_out = False
        try:
            try:
                stdout, stderr = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_all(self._dir())
                stdout, stderr = p.communicate()
        except BaseException:
            p.kill()
            _kill_all(self._dir())
            p.wait()
            raise
        finally:
            stop.set()
            sampler.join()
        return Result(list(argv), p.returncode, stdout, stderr, timed_out, time.monotonic() - t0)

    def _sample(self, stop: threading.Event) -> None:
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        path = self._file(name)
        while True:
            try:
                self._sampled_peak = max(self._sampled_peak, int(_read(path)))
            except (OSError, ValueError):
                return
            if stop.wait(SAMPLE_S):
                return

    # -- what the cgroup saw
    def usage_bytes(self) -> int:
        """Memory charged now (page cache included)."""
        return int(_read(self._file("memory.usage_in_bytes" if self.version == 1 else "memory.current")))

    def peak_bytes(self) -> int:
        """The most memory charged at once since creation (page cache included): v1
        memory.max_usage_in_bytes; v2 memory.peak, or the largest memory.current sampled while
        commands ran on kernels without it."""
        if self.version == 1:
            return int(_read(self._file("memory.max_usage_in_bytes")))
        if os.path.exists(self._file("memory.peak")):
            return int(_read(self._file("memory.peak")).split()[0])
        return max(self._sampled_peak, self.usage_bytes())

    def oom_kills(self) -> int:
        """Processes the OOM killer killed in this cgroup: v1 memory.oom_control's oom_kill (kernels
        before 4.13 have none: memory.failcnt, the times the limit was hit, an upper bound); v2
        memory.events' oom_kill."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        fields = dict(line.split() for line in _read(self._file(name)).splitlines() if len(line.split()) == 2)
        if "oom_kill" in fields:
            return int(fields["oom_kill"])
        if self.version == 1:
            return int(_read(self._file("memory.failcnt")))
        raise MemcgError(f"{self._file(name)} has no oom_kill line")


# ------------------------------------------------------------------ leftovers of dead owners
def cleanup_stale(prefix: str = PREFIX, verbose: bool = False) -> list[str]:
    """Remove the cgroups `<prefix>-<pid>-<seq>` in this process's own cgroup whose owner (pid) is
    gone, killing what is left inside them; returns the paths removed. Cgroups of live owners are
    never touched."""
    if os.geteuid() != 0:
        return []
    try:
        parent = hierarchy().parent
        names = os.listdir(parent)
    except (MemcgError, OSError):
        return []
    name_re = re.compile(rf"^{re.escape(prefix)}-(\d+)-(probe)?\d+$")
    removed = []
    for name in sorted(names):
        m = name_re.match(name)
        path = os.path.join(parent, name)
        if not m or not os.path.isdir(path) or procs.proc_start(int(m.group(1))) is not None:
            continue
        try:
            _remove(path)
        except MemcgError as exc:
            if verbose:
                print(f"memcg: {exc}", file=sys.stderr)
            continue
        removed.append(path)
        if verbose:
            print(f"memcg: removed stale cgroup {path}", file=sys.stderr)
    return removed


# ------------------------------------------------------------------ command line
def _bad(message: str) -> int:
    """Bad input: one `error: ...` line on stderr, exit status 2 (no usage text, no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dev.memcg",
        description="Run a command under a memory cgroup limit (page cache included), so a small model "
                    "can be larger than RAM; prints one JSON line to stderr at the end: rc, peak_bytes, "
                    "limit_bytes, oom_kills. Root only; the cgroup is made inside this process's own.",
        epilog="example: python -m dev.memcg --limit 2G -- python -m trainer data=tiny")
    ap.add_argument("--limit", required=True, help="memory limit: 2G, 512M, 65536 (binary units)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before everything in the cgroup is killed")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="only remove the cgroups of owners that are gone (no command)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS ...")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        limit = parse_size(args.limit)
    except ValueError as exc:
        return _bad(f"--limit {args.limit}: {exc}")
    if limit <= 0:
        return _bad(f"--limit {args.limit}: must be > 0")
    if args.timeout is not None and args.timeout <= 0:
        return _bad(f"--timeout {args.timeout:g}: must be > 0")
    if args.cleanup_stale:
        for path in cleanup_stale(verbose=True):
            print(path)
        return 0
    if not cmd:
        return _bad("no command: python -m dev.memcg --limit SIZE -- CMD ...")
    ok, why = availability()
    if not ok:
        print(f"error: {why}", file=sys.stderr)
        return 2
    with MemoryCgroup(limit) as cg:
        try:
            r = cg.run(cmd, timeout=args.timeout, capture=False)
        except (MemcgError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        line = {"rc": r.returncode, "peak_bytes": cg.peak_bytes(), "limit_bytes": limit, "oom_kills": cg.oom_kills(),
                "wall_s": round(r.wall_s, 3), "timed_out": r.timed_out, "cgroup_version": cg.version}
    print(json.dumps(line), file=sys.stderr, flush=True)
    return r.returncode if r.returncode >= 0 else 128 - r.returncode


if __name__ == "__main__":
    sys.exit(main())
