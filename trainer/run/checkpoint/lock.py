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
holder that may be dead is a condition to wait out, not an error: a run that finds such a lock
younger than its lease says so once and watches it, until the holder refreshes it (a live run: the
start is refused, exit 2, as two live runs in one directory are) or the lease runs out (taken over):
a container restarted at once after a hard kill needs no person and no retry loop. The wait is
made in rounds (acquire's wait_s) so that the other ranks, waiting for rank 0's verdict, are never
held in one collective longer than a round (lock_in_rounds). An empty or unreadable lock (a run
killed between creating and writing it) older than a few seconds is stale too.

A holder is named by its host, the machine's boot (/proc/sys/kernel/random/boot_id), its PID
namespace, its pid and its process's start time: a lock from an earlier boot of this host is dead
at once, and a new PID namespace that the kernel gave the dead one's inode (and pid 1 again) is not
mistaken for the holder.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Pattern

from ...base.core.holder import age as _age, keep_fresh, mtime as _mtime, read_holder as _read_lock
from ...base.core.procs import alive as _alive, identity, is_me
from .manifest import WORK_DIR, CheckpointError

LOCK = "lock.json"  # the run that owns a checkpoint dir (see DirLock)
LEASE_S = 60.0  # default lease: a lock from another host or namespace not touched for this long is stale
UNREADABLE_GRACE_S = 5.0  # an empty or unreadable lock older than this is stale (a starting run writes it at once)
ACQUIRE_S = 15.0  # how long acquire() retries a lock that keeps changing or is being written
WATCH_S = 0.5  # how often a holder that may be dead is looked at again while its lease is waited out
ROUND_S = 10.0  # the longest one verdict of rank 0 waits for a lease (lock_in_rounds)
_HELD: dict[str, str] = {}  # lock path -> run id of the locks this process holds now
_REFRESH: dict[str, threading.Event] = {}  # lock path -> the stop event of its refresher


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
        self._watch: Optional[tuple[Any, float]] = None  # (holder's run id, its lock's mtime) being waited out

    def acquire(self, wait_s: Optional[float] = None) -> bool:
        """Take the lock or raise guards.error naming the directory and the holder. A holder that
        may be dead (its lease not run out, not refreshed since this run first saw it) is waited
        for: at most wait_s seconds in this call (None: until it is decided), returning False when
        that is not enough (call again: the watch goes on); True once taken."""
        name, error = self.guards.name, self.guards.error
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise error(f"{name} {self.root} cannot be created: {exc}") from exc
        me = {"run_id": self.run_id, **identity(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(sys.argv)[:300], "lease_s": self.lease_s}
        start = time.monotonic()
        deadline = start + ACQUIRE_S
        while time.monotonic() < deadline:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._resolve_existing():  # a holder that may be dead: its lease is waited out
                    if wait_s is not None and time.monotonic() - start >= wait_s:
                        return False
                    time.sleep(WATCH_S)
                    deadline = time.monotonic() + ACQUIRE_S
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
            return True
        raise error(f"{name} {self.root}: its lock file {self.path} keeps changing "
                    f"(other runs are starting in it); {self.guards.advice}")

    def _resolve_existing(self) -> bool:
        """The lock file exists: raise if its holder runs, remove it if it is dead (takeover);
        True: a holder that may be dead, whose lease is being waited out (look again later)."""
        name, error = self.guards.name, self.guards.error
        holder = _read_lock(self.path)
        if holder is None:  # being written right now by a starting run, or vanished: look again
            time.sleep(0.05)
            holder = _read_lock(self.path)
            if holder is None:
                age = _age(self.path)
                if age is None:  # gone: try again
                    return False
                if age < UNREADABLE_GRACE_S:  # a run starting right now is writing it
                    time.sleep(min(UNREADABLE_GRACE_S - age, 0.5))
                    return False
                if self._take_over({}):
                    self.notes.append(f"{name} {self.root}: took over the lock file {self.path}, which was empty "
                                      f"or unreadable for {age:.0f} s (a run killed while writing it)")
                return False
        mine = is_me(holder)
        if mine and holder.get("run_id") in _HELD.values():
            gc.collect()  # a run of this process that ended, not yet collected, releases its lock
            if holder.get("run_id") in _HELD.values():
                raise error(f"{name} {self.root} is in use by another run in this "
                            f"process ({describe_holder(holder)})")
        alive = False if mine else _alive(holder)
        if alive is None and "lease_s" in holder:  # another host or container: its lease decides
            mtime, lease = _mtime(self.path), float(holder["lease_s"])
            if mtime is None:
                return False
            age = max(0.0, time.time() - mtime)
            if age > lease:
                if self._take_over(holder):
                    self.notes.append(f"{name} {self.root}: took over the lock of {describe_holder(holder)}, "
                                      f"whose lease expired (not refreshed for {age:.0f} s, lease {lease:g} s): it "
                                      "runs on another host or in another container, and is gone")
                return False
            seen = self._watch
            if seen is None or seen[0] != holder.get("run_id"):  # first seen: watched from now on
                self._watch = (holder.get("run_id"), mtime)
                print(f"[trainer] {name} {self.root}: its lock is held by {describe_holder(holder)}, on another "
                      f"host or in another container, last refreshed {age:.0f} s ago: waiting up to "
                      f"{lease - age:.0f} s, until it refreshes it (a live run: this start is refused) or its "
                      f"lease ({lease:g} s) runs out (a dead one: its lock is taken over)",
                      file=sys.stderr, flush=True)
                return True
            if mtime == seen[1]:  # not refreshed since: may be dead
                return True
            raise error(
                f"{name} {self.root} is in use by {describe_holder(holder)}; it runs on another host (or in "
                f"another container) and refreshed its lock {age:.0f} s ago: it is running (if it is dead, its "
                f"lock is taken over once it is {lease:g} s old: its lease). Two runs in one {name} "
                f"{self.guards.clash}: {self.guards.advice} (or wait until that run ends)")
        if alive is not False:
            hint = ("" if alive else f"; it runs on another host (or in another container), so its "
                    f"state is unknown here: if it is dead, delete {self.path}")
            raise error(
                f"{name} {self.root} is in use by {describe_holder(holder)}{hint}. Two runs in "
                f"one {name} {self.guards.clash}: {self.guards.advice} (or wait until that run ends)")
        if self._take_over(holder) and not mine:
            self.notes.append(f"{name} {self.root}: took over the lock of {describe_holder(holder)}, "
                              "whose process is no longer running")
        return False

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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def lock_in_rounds(comm: Any, make: Callable[[], Optional[DirLock]], then: Callable[[Optional[DirLock]], Any],
                   error: type[Exception]) -> Any:
    """Rank 0 makes its lock (make(): None when there is nothing to lock), takes it and returns
    then(lock); every rank gets that value or the error. A holder's lease waited out
    (DirLock.acquire) is waited in rounds of at most a third of the collectives' timeout, each one
    verdict of rank 0 (comm.root_decides), so no rank waits in one collective longer. Collective."""
    round_s = max(0.5, min(ROUND_S, comm.timeout_s / 3))
    made: list[Optional[DirLock]] = []

    def attempt() -> tuple[bool, Any]:
        if not made:
            made.append(make())
        lock = made[0]
        if lock is not None and not lock.acquire(wait_s=round_s):
            return False, None
        return True, then(lock)
    while True:
        done, value = comm.root_decides(attempt, error)
        if done:
            return value


def _start_refresher(path: str, run_id: str, every: float) -> None:
    """A daemon thread that touches the lock every `every` seconds while it is this run's."""
    _REFRESH[path] = keep_fresh(path, every, lambda: _HELD.get(path) == run_id
                                and (_read_lock(path) or {}).get("run_id") == run_id)


def _release_lock(path: str, run_id: str) -> None:
    """Remove the lock file if it is still this run's (also at interpreter exit)."""
    if _HELD.get(path) == run_id:
        del _HELD[path]
        stop = _REFRESH.pop(path, None)
        if stop is not None:
            stop.set()
    if (_read_lock(path) or {}).get("run_id") == run_id:
        _unlink(path)
