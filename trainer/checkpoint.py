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
checkpoint.dir must be one filesystem visible to every rank.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import sys
import uuid
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from .comm import Collectives
from .embedding.store import ShardStore

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"  # rank 0: dense model + optimizer, step, RNG, losses, evals
SCHEMA_KEYS = ("table_rows", "dim", "model", "optim_sparse", "optim_dense")  # must match to resume
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_\d+\.(tmp|old)-")
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (corrupt, truncated, incompatible); names the file."""


# ---- names ----------------------------------------------------------------------------------
def shard_file(rank: int, world: int) -> str:
    return f"shard_{rank:05d}-of-{world:05d}.pt"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def complete_checkpoints(root: str | None) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root (named step_K, manifest present),
    oldest first; `.tmp-` directories of unfinished saves are ignored."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isfile(os.path.join(path, MANIFEST)):
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest(root: str | None) -> str | None:
    """The newest complete checkpoint under root, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


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
    """Writes step_K checkpoints under root (collective) and rotates them (keep_last; 0 = all)."""

    def __init__(self, comm: Collectives, root: str, keep_last: int) -> None:
        self.comm, self.root, self.keep_last = comm, root, keep_last

    def save(self, step: int, store: ShardStore, trainer_state: dict[str, Any] | None,
             schema: dict[str, Any]) -> str:
        """Write checkpoint `step`: every rank its shard, rank 0 also trainer_state and, last, the
        manifest (schema + checksums); then rename. The caller flushed the caches. Collective."""
        tmp = self._tmp_dir(step)
        digest = _agree(self.comm, "checkpoint save", lambda: self._write_shard(tmp, store))
        digests = self.comm.allgather(digest.reshape(1, -1), kind="meta")
        status = None
        if self.comm.rank == 0:
            status = self._finish(tmp, step, trainer_state, schema, digests)
        status = self.comm.broadcast_object(status)
        if status is not None:
            raise CheckpointError(status)
        return step_dir(self.root, step)

    def _tmp_dir(self, step: int) -> str:
        """Rank 0 creates step_K.tmp-<token>; every rank gets its name (or rank 0's error)."""
        made: tuple[str | None, str | None] = (None, None)
        if self.comm.rank == 0:
            tmp = f"{step_dir(self.root, step)}.tmp-{uuid.uuid4().hex[:12]}"
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
        """Rank 0: trainer file, manifest last, rename, rotate. Returns an error message or None."""
        try:
            files = {shard_file(r, self.comm.size): _file_info(d) for r, d in enumerate(digests)}
            files[TRAINER_FILE] = _write_file(os.path.join(tmp, TRAINER_FILE), trainer_state)
            _write_manifest(tmp, {"format_version": FORMAT_VERSION, "step": step,
                                  "world_size": self.comm.size, **schema, "files": files})
            self._publish(tmp, step_dir(self.root, step))
            self.rotate()
        except Exception as exc:  # noqa: BLE001 - reported to every rank, which all raise
            return f"checkpoint save of step {step} into {tmp} failed: {type(exc).__name__}: {exc}"
        return None

    @staticmethod
    def _publish(tmp: str, final: str) -> None:
        """Rename tmp to final (an existing final, from an older branch of the run, is replaced)."""
        old = None
        if os.path.exists(final):
            old = f"{final}.old-{uuid.uuid4().hex[:12]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_dir(os.path.dirname(final))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def rotate(self) -> None:
        """Delete complete checkpoints beyond keep_last (oldest first) and leftovers of crashed saves."""
        found = complete_checkpoints(self.root)
        drop = found[:-self.keep_last] if self.keep_last > 0 else []
        for _, path in drop:
            shutil.rmtree(path, ignore_errors=True)
        for name in os.listdir(self.root):
            if _TMP_DIR.match(name):
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


def _load_local(ckpt: str, store: ShardStore, schema: dict[str, Any]) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    check_schema(ckpt, manifest, schema)
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
