"""Consistent checkpoints of a hybrid-parallel run, and resume on any number of workers.

Why this layout: embedding rows are sharded by owner, so every rank writes only its own shard, and
keys each row by (table, id), not by its fused global id (whose padded table offsets depend on W).
A reader with another W takes the rows it owns from each saved shard, one file at a time, so no
rank ever holds a whole table. Caches are flushed first, so the owners' rows, versions and
optimizer state are the whole sparse state.

Why it is atomic: everything is written into `step_K.tmp-<token>`; once every rank's file is
written (an allgather of their checksums), rank 0 writes the manifest (sha256 of every file) last
and renames the directory to `step_K`. A directory named step_K is therefore complete, a crash
mid-save leaves the earlier checkpoints untouched, and rotation deletes old ones only afterwards.
A save that fails removes its own `.tmp-` directory, so a full disk does not fill up with them.
checkpoint.dir must be one filesystem visible to every rank.

Why a lock: two runs writing into one directory would replace each other's step_K and delete each
other's saves in progress. The directory belongs to one run at a time: rank 0 creates `lock.json`
(run id, pid, host, the process's start time) with O_EXCL at start-up, and every rank learns the
outcome. A second run fails at once naming the holder; a lock whose process is gone (same host, pid
not running or reused) is taken over with a warning, together with that dead run's unfinished saves,
so a killed run never keeps the directory. Runs that follow one another in the directory continue
one job: their saves are ordered together.

Why a save sequence: "newest" means the last save, not the highest step. A run resumed from an
older checkpoint (a branch) saves lower steps than the abandoned branch; each manifest carries
`save_seq` (one more than any save in the directory), and rotation and resume=auto follow it.
"""
from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import random
import re
import shutil
import socket
import sys
import time
import uuid
import weakref
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from .comm import Collectives
from .embedding.store import ShardStore
from .procs import pid_namespace, proc_start

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"  # rank 0: dense model + optimizer, step, RNG, losses, evals
SCHEMA_KEYS = ("table_rows", "dim", "model", "optim_sparse", "optim_dense")  # must match to resume
LOCK = "lock.json"  # the run that owns a checkpoint dir (see DirLock)
# data sources whose stream position depends on W: a step's batch is only defined at the saved W
# (Criteo: DALI's reader splits the blocks into W contiguous shards, trainer/data/blocks.py)
WORLD_BOUND_DATA = ("criteo",)
_STEP_DIR = re.compile(r"^step_(\d+)$")
_WORK_DIR = re.compile(r"^step_\d+\.(tmp|old)-(?P<run>[0-9a-f]+)-[0-9a-f]+$")  # a save in progress
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (corrupt, truncated, incompatible); names the file."""


# ---- names ----------------------------------------------------------------------------------
def shard_file(rank: int, world: int) -> str:
    return f"shard_{rank:05d}-of-{world:05d}.pt"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def complete_checkpoints(root: str | None) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root (named step_K, manifest present), in
    the order they were saved, oldest first (see save_order); `.tmp-` directories of unfinished
    saves are ignored."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((save_order(path, int(m.group(1))), int(m.group(1)), path))
    return [(step, path) for _, step, path in sorted(found)]


def save_order(path: str, step: int) -> tuple[int, int]:
    """Sort key of a complete checkpoint by save time: its manifest's save_seq; checkpoints
    written before save_seq existed (or with an unreadable manifest) come first, by step."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            seq = json.load(f).get("save_seq")
    except (OSError, ValueError, AttributeError):
        seq = None
    return (1, int(seq)) if isinstance(seq, int) else (0, step)


def latest(root: str | None) -> str | None:
    """The most recently saved complete checkpoint under root (not the highest step), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def last_save_seq(root: str | None) -> int:
    """The highest save_seq of the complete checkpoints under root (0 when none has one)."""
    seqs = [save_order(path, step) for step, path in complete_checkpoints(root)]
    return max((seq for known, seq in seqs if known), default=0)


# ---- files -----------------------------------------------------------------------------------
def _write_file(path: str, obj: Any) -> dict[str, Any]:
    """torch.save obj to path (flushed to disk); returns {"sha256", "bytes"} of what was written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _read_file(ckpt: str, name: str, manifest: dict[str, Any]) -> Any:
    """Load one file of checkpoint ckpt after checking its size and sha256 against the manifest."""
    path = os.path.join(ckpt, name)
    want = manifest["files"].get(name)
    if want is None:
        raise CheckpointError(f"checkpoint {ckpt}: manifest lists no file {name}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc
    got = hashlib.sha256(data).hexdigest()
    if len(data) != want["bytes"] or got != want["sha256"]:
        raise CheckpointError(
            f"checkpoint file {path} fails its checksum (corrupt or truncated): {len(data)} bytes, "
            f"sha256 {got[:16]}..; the manifest says {want['bytes']} bytes, sha256 {want['sha256'][:16]}..")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_manifest(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {exc}") from exc
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt}: format_version {manifest.get('format_version')} "
                              f"is not the supported {FORMAT_VERSION}")
    return manifest


def _write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


# ---- coordination ----------------------------------------------------------------------------
def _agree(comm: Collectives, what: str, fn: Callable[[], T]) -> T:
    """Run fn on every rank; if it fails anywhere, every rank raises (no rank is left waiting)."""
    err: BaseException | None = None
    out = None
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - any local failure must reach every rank
        err = exc
    flags = comm.allgather(torch.tensor([0 if err is None else 1]), kind="meta")
    if isinstance(err, CheckpointError):
        raise err
    if err is not None:
        raise CheckpointError(f"{what} failed on rank {comm.rank}: {err}") from err
    bad = torch.nonzero(flags).flatten().tolist()
    if bad:
        raise CheckpointError(f"{what} failed on rank(s) {bad}; see their error")
    return out  # type: ignore[return-value]


# ---- the directory lock -----------------------------------------------------------------------
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


def describe_holder(holder: dict[str, Any]) -> str:
    return (f"run {holder.get('run_id')} (pid {holder.get('pid')} on host {holder.get('host')}, "
            f"started {holder.get('started')}: {holder.get('command', '?')})")


class DirLock:
    """One run's ownership of a checkpoint directory: the file root/lock.json, created with O_EXCL.
    Only rank 0 holds it (Checkpointer passes the outcome to every rank)."""

    def __init__(self, root: str, run_id: str) -> None:
        self.root, self.run_id = root, run_id
        self.path = os.path.join(root, LOCK)
        self.notes: list[str] = []  # warnings for the user (a dead run's lock taken over)
        self._release = None

    def acquire(self) -> None:
        """Take the lock or raise CheckpointError naming the directory and the holder."""
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint.dir {self.root} cannot be created: {exc}") from exc
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
                raise CheckpointError(f"checkpoint.dir {self.root} is not writable (its lock file "
                                      f"{self.path} cannot be created: {exc})") from exc
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(me, f, indent=1)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                _unlink(self.path)
                raise CheckpointError(f"checkpoint.dir {self.root} is not writable (its lock file "
                                      f"{self.path} cannot be written: {exc})") from exc
            _HELD[self.path] = self.run_id
            self._release = weakref.finalize(self, _release_lock, self.path, self.run_id)
            return
        raise CheckpointError(f"checkpoint.dir {self.root}: its lock file {self.path} keeps changing "
                              "(other runs are starting in it); give this run its own checkpoint.dir")

    def _resolve_existing(self) -> None:
        """The lock file exists: raise if its holder may be running, else remove it (takeover)."""
        holder = _read_lock(self.path)
        if holder is None:  # being written right now by a starting run, or vanished: look again
            time.sleep(0.05)
            holder = _read_lock(self.path)
            if holder is None:
                if os.path.exists(self.path):
                    raise CheckpointError(
                        f"checkpoint.dir {self.root} is locked by a run whose lock file {self.path} "
                        "cannot be read; if no run uses this directory, delete that file")
                return
        mine = (holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()
                and holder.get("pid_ns") == pid_namespace())
        if mine and holder.get("run_id") in _HELD.values():
            gc.collect()  # a run of this process that ended, not yet collected, releases its lock
            if holder.get("run_id") in _HELD.values():
                raise CheckpointError(f"checkpoint.dir {self.root} is in use by another run in this "
                                      f"process ({describe_holder(holder)})")
        alive = False if mine else _alive(holder)
        if alive is not False:
            hint = ("" if alive else f"; it runs on another host (or in another container), so its "
                    f"state is unknown here: if it is dead, delete {self.path}")
            raise CheckpointError(
                f"checkpoint.dir {self.root} is in use by {describe_holder(holder)}{hint}. Two runs in "
                "one checkpoint.dir would overwrite each other's checkpoints: give this run its own "
                "checkpoint.dir (or wait until that run ends)")
        if self._take_over(holder) and not mine:
            self.notes.append(f"checkpoint.dir {self.root}: took over the lock of {describe_holder(holder)}, "
                              "whose process is no longer running")

    def _take_over(self, holder: dict[str, Any]) -> bool:
        """Remove the dead holder's lock (only if it is still that one) and its unfinished saves."""
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
        dead = str(holder.get("run_id"))
        for name in os.listdir(self.root):
            m = _WORK_DIR.match(name)
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


# ---- the sparse shard ------------------------------------------------------------------------
def shard_state(store: ShardStore) -> dict[str, Any]:
    """This rank's real rows: table [n], id [n], weight [n, d], version [n], optim {name: [n, ...]}."""
    s = store.sharding
    at = torch.nonzero(s.valid(s.local_gids())).flatten()
    table, ids = s.decode(s.local_gids()[at])
    dev_at = at.to(store.weight.device)
    return {"table": table, "id": ids,
            "weight": store.weight.index_select(0, dev_at).cpu(),
            "version": store.version.index_select(0, dev_at).cpu(),
            "optim": {k: v.index_select(0, dev_at).cpu()
                      for k, v in store.optimizer.state_tensors().items()}}


def load_shard_rows(store: ShardStore, saved: dict[str, Any], name: str) -> int:
    """Copy the rows of one saved shard that this rank owns (under its W) into store; returns how
    many. Row, version and every optimizer state tensor move together."""
    s = store.sharding
    gids = s.global_ids(saved["id"], saved["table"])
    mine = s.owner(gids) == s.rank
    idx = s.local_index(gids[mine]).to(store.weight.device)
    state = store.optimizer.state_tensors()
    if set(state) != set(saved["optim"]):
        raise CheckpointError(f"{name}: sparse optimizer state {sorted(saved['optim'])} does not match "
                              f"optim.sparse={store.optimizer.name!r} ({sorted(state)})")
    with torch.no_grad():
        store.weight.index_copy_(0, idx, saved["weight"][mine].to(store.weight))
        store.version.index_copy_(0, idx, saved["version"][mine].to(store.version))
        for k, v in state.items():
            v.index_copy_(0, idx, saved["optim"][k][mine].to(v))
    return int(mine.sum())


# ---- save ------------------------------------------------------------------------------------
class Checkpointer:
    """Writes step_K checkpoints under root (collective) and rotates them (keep_last; 0 = all).

    Created at start-up: rank 0 takes root's lock (DirLock) and every rank gets the outcome, so a
    directory in use by another run stops every rank before any training. close() releases it."""

    def __init__(self, comm: Collectives, root: str, keep_last: int) -> None:
        self.comm, self.root, self.keep_last = comm, root, keep_last
        self.lock: DirLock | None = None
        self._seq = 0  # save_seq of this run's last save
        # rank 0: the newest save of this object that is complete on disk, known as soon as it is
        # renamed into place: a peer lost in the save's closing broadcast leaves it resumable, and
        # the failure message must name it (Trainer.save_checkpoint)
        self.completed: str | None = None
        status: tuple[str | None, str | None, list[str]] = (None, None, [])
        if comm.rank == 0:
            lock = DirLock(root, uuid.uuid4().hex[:12])
            try:
                lock.acquire()
                self.lock = lock
                status = (lock.run_id, None, lock.notes)
            except CheckpointError as exc:
                status = (None, str(exc), [])
        run_id, err, notes = comm.broadcast_object(status)
        if err is not None:
            raise CheckpointError(err)
        self.run_id: str = run_id  # type: ignore[assignment]
        for note in notes if comm.rank == 0 else []:
            print(f"[trainer] warning: {note}", file=sys.stderr)

    def close(self) -> None:
        """Release the directory (rank 0); the run's checkpoints stay."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def save(self, step: int, store: ShardStore, trainer_state: dict[str, Any] | None,
             schema: dict[str, Any]) -> str:
        """Write checkpoint `step`: every rank its shard, rank 0 also trainer_state and, last, the
        manifest (schema + checksums); then rename. The caller flushed the caches. Collective.
        On failure anywhere the partial `.tmp-` directory is removed before every rank raises."""
        tmp = self._tmp_dir(step)
        try:
            digest = _agree(self.comm, f"checkpoint save of step {step} into {self.root}",
                            lambda: self._write_shard(tmp, store))
        except CheckpointError:
            self._discard(tmp)  # every rank has passed the allgather: nobody writes into tmp now
            raise
        digests = self.comm.allgather(digest.reshape(1, -1), kind="meta")
        status = None
        if self.comm.rank == 0:
            status = self._finish(tmp, step, trainer_state, schema, digests)
            if status is None:
                self.completed = step_dir(self.root, step)
        status = self.comm.broadcast_object(status)
        if status is not None:
            raise CheckpointError(status)
        return step_dir(self.root, step)

    def _discard(self, tmp: str) -> None:
        """Rank 0 removes this run's partial save."""
        if self.comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def _tmp_dir(self, step: int) -> str:
        """Rank 0 creates step_K.tmp-<run id>-<token>; every rank gets its name (or rank 0's error)."""
        made: tuple[str | None, str | None] = (None, None)
        if self.comm.rank == 0:
            tmp = f"{step_dir(self.root, step)}.tmp-{self.run_id}-{uuid.uuid4().hex[:8]}"
            try:
                os.makedirs(tmp)
                made = (tmp, None)
            except OSError as exc:
                made = (None, f"checkpoint save of step {step}: cannot create {tmp}: {exc}")
        tmp, err = self.comm.broadcast_object(made)
        if err is not None:
            raise CheckpointError(err)
        return tmp

    def _write_shard(self, tmp: str, store: ShardStore) -> torch.Tensor:
        """Write this rank's shard; returns [1 + 32] int64: bytes written, then the sha256 bytes."""
        path = os.path.join(tmp, shard_file(self.comm.rank, self.comm.size))
        info = _write_file(path, shard_state(store))
        return torch.tensor([info["bytes"]] + list(bytes.fromhex(info["sha256"])), dtype=torch.int64)

    def _finish(self, tmp: str, step: int, trainer_state: dict[str, Any] | None,
                schema: dict[str, Any], digests: torch.Tensor) -> str | None:
        """Rank 0: trainer file, manifest last, rename, rotate. Returns an error message or None
        (after removing the partial save)."""
        try:
            files = {shard_file(r, self.comm.size): _file_info(d) for r, d in enumerate(digests)}
            files[TRAINER_FILE] = _write_file(os.path.join(tmp, TRAINER_FILE), trainer_state)
            seq = max(self._seq, last_save_seq(self.root)) + 1
            data = (schema.get("config") or {}).get("data") or {}
            _write_manifest(tmp, {"format_version": FORMAT_VERSION, "step": step,
                                  "world_size": self.comm.size, "save_seq": seq, "run_id": self.run_id,
                                  "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "data_order_world": (self.comm.size if data.get("name") in WORLD_BOUND_DATA
                                                       else None),
                                  **schema, "files": files})
            self._publish(tmp, step_dir(self.root, step))
            self._seq = seq
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all raise
            shutil.rmtree(tmp, ignore_errors=True)
            return f"checkpoint save of step {step} into {tmp} failed: {type(exc).__name__}: {exc}"
        try:
            self.rotate()
        except OSError as exc:  # the new checkpoint is complete; old ones stay for now
            print(f"[trainer] warning: checkpoint rotation in {self.root} failed: {exc}", file=sys.stderr)
        return None

    def _publish(self, tmp: str, final: str) -> None:
        """Rename tmp to final (an existing final, from an older branch of the job, is replaced)."""
        old = None
        if os.path.exists(final):
            old = f"{final}.old-{self.run_id}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None:  # put the replaced checkpoint back
                os.replace(old, final)
            raise
        _fsync_dir(os.path.dirname(final))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def rotate(self) -> None:
        """Delete complete checkpoints beyond keep_last, the least recently saved first (save_seq,
        not the step: a branch resumed from an older step keeps its own saves), and this run's
        own leftovers; other runs' work directories are never touched."""
        found = complete_checkpoints(self.root)
        drop = found[:-self.keep_last] if self.keep_last > 0 else []
        for _, path in drop:
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(self.root):
            m = _WORK_DIR.match(name)
            if m and m.group("run") == self.run_id:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


def _file_info(digest: torch.Tensor) -> dict[str, Any]:
    """{"bytes", "sha256"} from one rank's [1 + 32] digest row (see Checkpointer._write_shard)."""
    return {"bytes": int(digest[0]), "sha256": bytes(digest[1:].tolist()).hex()}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- RNG ---------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, Any]:
    """torch / numpy / python RNG states, as tensors and plain values (torch.load weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what rng_state saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---- resume ----------------------------------------------------------------------------------
def resolve(comm: Collectives, resume: str | None, root: str | None) -> str | None:
    """The checkpoint to resume from (rank 0 decides, every rank gets the same answer):
    None -> None; "auto" -> newest complete under root, None (said on stderr) if there is none;
    else the path itself."""
    path = None
    if comm.rank == 0 and resume is not None:
        path = latest(root) if resume == "auto" else resume
        if path is None:
            print(f"[trainer] checkpoint.resume=auto: no complete checkpoint in "
                  f"{root or '(no checkpoint.dir and no output dir)'}; starting fresh",
                  file=sys.stderr)
        else:
            print(f"[trainer] resuming from {path}", file=sys.stderr)
    return comm.broadcast_object(path)


def check_schema(ckpt: str, manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise naming every key of SCHEMA_KEYS whose checkpoint value differs from this run's."""
    diff = [f"{k}: checkpoint {manifest.get(k)!r}, this run {schema[k]!r}"
            for k in SCHEMA_KEYS if manifest.get(k) != schema[k]]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt} is incompatible with this run's config: " + "; ".join(diff))


def load(comm: Collectives, ckpt: str, store: ShardStore, schema: dict[str, Any]) -> dict[str, Any]:
    """Verify ckpt (checksums, schema), load this rank's rows under the current W into store, and
    return rank 0's trainer state (dense model/optimizer, step, RNG, losses). Collective."""
    return _agree(comm, f"loading checkpoint {ckpt}", lambda: _load_local(ckpt, store, schema))


def check_stream_world(ckpt: str, manifest: dict[str, Any], world: int) -> None:
    """Refuse to resume a W-dependent data stream (Criteo) at another W: its saved position (the
    step) names batches that exist only under the saved W's sharding of the blocks."""
    data = (manifest.get("config") or {}).get("data") or {}
    saved = manifest.get("data_order_world")
    if "data_order_world" not in manifest:  # written before the key existed: ask its config
        saved = manifest.get("world_size") if data.get("name") in WORLD_BOUND_DATA else None
    if saved is not None and int(saved) != world:
        raise CheckpointError(
            f"checkpoint {ckpt} was written by a data={data.get('name', '?')} run with {saved} workers "
            f"and this run has {world}: its block stream is split among the workers, so the saved position (step "
            f"{manifest.get('step')}) only exists with {saved} workers. Resume it with {saved} workers, "
            "or start a fresh run")


def _load_local(ckpt: str, store: ShardStore, schema: dict[str, Any]) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    check_schema(ckpt, manifest, schema)
    check_stream_world(ckpt, manifest, store.sharding.world)
    state = _read_file(ckpt, TRAINER_FILE, manifest)
    loaded = 0
    for r in range(int(manifest["world_size"])):  # one saved shard in memory at a time
        name = shard_file(r, int(manifest["world_size"]))
        loaded += load_shard_rows(store, _read_file(ckpt, name, manifest), os.path.join(ckpt, name))
    s = store.sharding
    owned = int(s.valid(s.local_gids()).sum())
    if loaded != owned:
        raise CheckpointError(f"checkpoint {ckpt} holds {loaded} of the {owned} rows rank {s.rank} owns")
    return state
