"""A directory's lock: one run at a time writes into a checkpoint.dir (and, with the same lock, into
an output dir or a sweep dir: trainer/run/outdir.py).

Why a lock: two runs writing into one checkpoint dir would replace each other's step_K and delete
each other's saves in progress (in one output dir they would mix their metrics and summaries). The
directory belongs to one run at a time: rank 0 creates `lock.json`
(run id, pid, host, the process's start time) with O_EXCL at start-up, and every rank learns the
outcome (saver.CheckpointWriter). A second run fails at once naming the holder; a lock whose process is
gone (same host, pid not running or reused: trainer/base/core/procs.py reads its start time) is taken over
with a warning, together with that dead run's unfinished saves, so a killed run never keeps the
directory. Runs that follow one another in the directory continue one job: their saves are ordered
together (manifest.py's save sequence).

A lock is also a lease, for holders whose process cannot be seen from here (another host, another
PID namespace: a container or pod restarted on the same volume): the holder touches the file every
lease / 4 seconds (a daemon thread) while it runs, and a lock not touched for longer than its lease
(checkpoint.lock_lease_s, written into the lock) is stale and taken over with one warning line. A
live holder keeps its lease fresh, so two live runs are still refused. An empty or unreadable lock
(a run killed between creating and writing it) older than a few seconds is stale too.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Pattern

from ...base.core.procs import pid_namespace, proc_start
from .manifest import WORK_DIR, CheckpointError

LOCK = "lock.json"  # the run that owns a checkpoint dir (see DirLock)
LEASE_S = 60.0  # default lease: a lock from another host or namespace not touched for this long is stale
UNREADABLE_GRACE_S = 5.0  # an empty or unreadable lock older than this is stale (a starting run writes it at once)
ACQUIRE_S = 15.0  # how long acquire() retries a lock that keeps changing or is being written
_HELD: dict[str, str] = {}  # lock path -> run id of the locks this process holds now
_REFRESH: dict[str, threading.Event] = {}  # lock path -> the stop event of its refresher


def _alive(holder: dict[str, Any]) -> bool | None:
    """Is the lock holder's process running? None when it cannot be known from here (another
    host, or another pid namespace: a container)."""
    if holder.get("host") != socket.gethostname() or holder.get("pid_ns") != pid_namespace():
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


@dataclass(frozen=True)
class Guarded:
    """What a DirLock guards, for its messages and its take-over: the directory's name as the user
    sets it, what two runs there would spoil, what to do instead, the error raised, and the names
    of a dead holder's unfinished work removed with its lock (a regex whose group "run" is the run
    id; None: nothing)."""

    name: str
    clash: str
    advice: str
    error: type[Exception] = CheckpointError
    leftovers: Optional[Pattern[str]] = None


CHECKPOINT_DIR = Guarded("checkpoint.dir", "would overwrite each other's checkpoints",
                         "give this run its own checkpoint.dir", CheckpointError, WORK_DIR)


def describe_holder(holder: dict[str, Any]) -> str:
    return (f"run {holder.get('run_id')} (pid {holder.get('pid')} on host {holder.get('host')}, "
            f"started {holder.get('started')}: {holder.get('command', '?')})")


class DirLock:
    """One run's ownership of a directory (a checkpoint.dir unless `guards` says otherwise): the
    file root/lock.json, created with O_EXCL. Only rank 0 holds it (CheckpointWriter, outdir.py pass
    the outcome to every rank)."""

    def __init__(self, root: str, run_id: str, guards: Guarded = CHECKPOINT_DIR, lease_s: float = LEASE_S) -> None:
        self.root, self.run_id, self.guards, self.lease_s = root, run_id, guards, float(lease_s)
        self.path = os.path.join(root, LOCK)
        self.notes: list[str] = []  # warnings for the user (a dead run's lock taken over)
        self._release = None

    def acquire(self) -> None:
        """Take the lock or raise guards.error naming the directory and the holder."""
        name, error = self.guards.name, self.guards.error
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise error(f"{name} {self.root} cannot be created: {exc}") from exc
        me = {"run_id": self.run_id, "pid": os.getpid(), "host": socket.gethostname(),
              "pid_ns": pid_namespace(), "proc_start": proc_start(os.getpid()),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300],
              "lease_s": self.lease_s}
        deadline = time.monotonic() + ACQUIRE_S
        while time.monotonic() < deadline:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._resolve_existing()
                continue
            except OSError as exc:
                raise error(f"{name} {self.root} is not writable (its lock file "
                            f"{self.path} cannot be created: {exc})") from exc
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                _unlink(self.path)
                raise error(f"{name} {self.root} is not writable (its lock file "
                            f"{self.path} cannot be written: {exc})") from exc
            _HELD[self.path] = self.run_id
            _start_refresher(self.path, self.run_id, self.lease_s / 4)
            self._release = weakref.finalize(self, _release_lock, self.path, self.run_id)
            return
        raise error(f"{name} {self.root}: its lock file {self.path} keeps changing "
                    f"(other runs are starting in it); {self.guards.advice}")

    def _resolve_existing(self) -> None:
        """The lock file exists: raise if its holder may be running, else remove it (takeover)."""
        name, error = self.guards.name, self.guards.error
        holder = _read_lock(self.path)
        if holder is None:  # being written right now by a starting run, or vanished: look again
            time.sleep(0.05)
            holder = _read_lock(self.path)
            if holder is None:
                age = _age(self.path)
                if age is None:  # gone: try again
                    return
                if age < UNREADABLE_GRACE_S:  # a run starting right now is writing it
                    time.sleep(min(UNREADABLE_GRACE_S - age, 0.5))
                    return
                if self._take_over({}):
                    self.notes.append(f"{name} {self.root}: took over the lock file {self.path}, which was empty "
                                      f"or unreadable for {age:.0f} s (a run killed while writing it)")
                return
        mine = (holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
                and holder.get("pid_ns") == pid_namespace())
        if mine and holder.get("run_id") in _HELD.values():
            gc.collect()  # a run of this process that ended, not yet collected, releases its lock
            if holder.get("run_id") in _HELD.values():
                raise error(f"{name} {self.root} is in use by another run in this "
                            f"process ({describe_holder(holder)})")
        alive = False if mine else _alive(holder)
        if alive is None and "lease_s" in holder:  # another host or container: its lease decides
            age, lease = _age(self.path), float(holder["lease_s"])
            if age is None:
                return
            if age > lease:
                if self._take_over(holder):
                    self.notes.append(f"{name} {self.root}: took over the lock of {describe_holder(holder)}, "
                                      f"whose lease expired (not refreshed for {age:.0f} s, lease {lease:g} s): it "
                                      "runs on another host or in another container, and is gone")
                return
            raise error(
                f"{name} {self.root} is in use by {describe_holder(holder)}; it runs on another host (or in "
                f"another container) and refreshed its lock {age:.0f} s ago: if it is dead, its lock is taken over "
                f"once it is {lease:g} s old (its lease). Two runs in one {name} {self.guards.clash}: "
                f"{self.guards.advice} (or wait until that run ends)")
        if alive is not False:
            hint = ("" if alive else f"; it runs on another host (or in another container), so its "
                    f"state is unknown here: if it is dead, delete {self.path}")
            raise error(
                f"{name} {self.root} is in use by {describe_holder(holder)}{hint}. Two runs in "
                f"one {name} {self.guards.clash}: {self.guards.advice} (or wait until that run ends)")
        if self._take_over(holder) and not mine:
            self.notes.append(f"{name} {self.root}: took over the lock of {describe_holder(holder)}, "
                              "whose process is no longer running")

    def _take_over(self, holder: dict[str, Any]) -> bool:
        """Remove the dead holder's lock (only if it is still that one) and its unfinished work
        (guards.leftovers: a checkpoint dir's saves in progress)."""
        stale = f"{self.path}.stale-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(self.path, stale)  # atomic: of two runs taking over, one wins
        except FileNotFoundError:
            return False
        if (_read_lock(stale) or {}).get("run_id") != holder.get("run_id"):  # a new holder came in
            try:
                os.link(stale, self.path)  # put it back unless yet another lock exists
            except OSError:
                pass
            _unlink(stale)
            return False
        _unlink(stale)
        dead, leftovers = str(holder.get("run_id")), self.guards.leftovers
        for name in os.listdir(self.root) if leftovers is not None else ():
            m = leftovers.match(name)
            if m and m.group("run") == dead:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return True

    def release(self) -> None:
        if self._release is not None:
            self._release()


def _read_lock(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _age(path: str) -> float | None:
    """Seconds since the lock file was last written or refreshed (None: it is gone)."""
    try:
        return max(0.0, time.time() - os.stat(path).st_mtime)
    except OSError:
        return None


def _start_refresher(path: str, run_id: str, every: float) -> None:
    """A daemon thread that touches the lock every `every` seconds while it is this run's."""
    stop = threading.Event()
    _REFRESH[path] = stop

    def refresh() -> None:
        while not stop.wait(every):
            if _HELD.get(path) != run_id or (_read_lock(path) or {}).get("run_id") != run_id:
                return
            try:
                os.utime(path)
            except OSError:
                return
    threading.Thread(target=refresh, name=f"lock-lease {path}", daemon=True).start()


def _release_lock(path: str, run_id: str) -> None:
    """Remove the lock file if it is still this run's (also at interpreter exit)."""
    if _HELD.get(path) == run_id:
        del _HELD[path]
        stop = _REFRESH.pop(path, None)
        if stop is not None:
            stop.set()
    if (_read_lock(path) or {}).get("run_id") == run_id:
        _unlink(path)
