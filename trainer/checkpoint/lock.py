"""A directory's lock: one run at a time writes into a checkpoint.dir (and, with the same lock, into
an output dir or a sweep dir: trainer/run/outdir.py).

Why a lock: two runs writing into one checkpoint dir would replace each other's step_K and delete
each other's saves in progress (in one output dir they would mix their metrics and summaries). The
directory belongs to one run at a time: rank 0 creates `lock.json`
(run id, pid, host, the process's start time) with O_EXCL at start-up, and every rank learns the
outcome (saver.Checkpointer). A second run fails at once naming the holder; a lock whose process is
gone (same host, pid not running or reused: trainer/core/procs.py reads its start time) is taken over
with a warning, together with that dead run's unfinished saves, so a killed run never keeps the
directory. Runs that follow one another in the directory continue one job: their saves are ordered
together (manifest.py's save sequence).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import sys
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Pattern

from ..core.procs import pid_namespace, proc_start
from .manifest import WORK_DIR, CheckpointError

LOCK = "lock.json"  # the run that owns a checkpoint dir (see DirLock)
_HELD: dict[str, str] = {}  # lock path -> run id of the locks this process holds now


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
    file root/lock.json, created with O_EXCL. Only rank 0 holds it (Checkpointer, outdir.py pass
    the outcome to every rank)."""

    def __init__(self, root: str, run_id: str, guards: Guarded = CHECKPOINT_DIR) -> None:
        self.root, self.run_id, self.guards = root, run_id, guards
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
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)[:300]}
        for _ in range(20):
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
                if os.path.exists(self.path):
                    raise error(
                        f"{name} {self.root} is locked by a run whose lock file {self.path} "
                        "cannot be read; if no run uses this directory, delete that file")
                return
        mine = (holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
                and holder.get("pid_ns") == pid_namespace())
        if mine and holder.get("run_id") in _HELD.values():
            gc.collect()  # a run of this process that ended, not yet collected, releases its lock
            if holder.get("run_id") in _HELD.values():
                raise error(f"{name} {self.root} is in use by another run in this "
                            f"process ({describe_holder(holder)})")
        alive = False if mine else _alive(holder)
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


def _release_lock(path: str, run_id: str) -> None:
    """Remove the lock file if it is still this run's (also at interpreter exit)."""
    if _HELD.get(path) == run_id:
        del _HELD[path]
    if (_read_lock(path) or {}).get("run_id") == run_id:
        _unlink(path)
