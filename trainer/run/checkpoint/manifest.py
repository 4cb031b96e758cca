"""What a checkpoint is on disk: its directory names, its files and its manifest.

Why this layout: embedding rows are sharded by owner, so every rank writes only its own shard, and
keys each row by (table, id), not by its fused global id (whose padded table offsets depend on W).
A reader with another W takes the rows it owns from each saved shard, one file at a time, so no
rank ever holds a whole table (loader.py). A checkpoint is a directory `step_K` holding one shard
file per worker, rank 0's trainer file and the manifest, written last: format version, world
size, table schema, the config, and the sha256 and size of every file, checked on every read.

Why a save sequence: "newest" means the last save, not the highest step. A run resumed from an
older checkpoint (a branch) saves lower steps than the abandoned branch; each manifest carries
`save_seq` (one more than any save in the directory), and rotation and resume=auto follow it.

Why damaged checkpoints stay: a step_K directory whose manifest is missing or unreadable has no
known place in that order. It is never taken for the oldest (rotation leaves it alone) nor silently
passed over by resume=auto, which stops at it (loader.resolve) until a later save has seen it:
every manifest lists the damaged directories present when it was saved (`damaged_seen`: name,
inode and modification time), so after the user continues explicitly from an older checkpoint,
auto follows that run's saves again.

Everything here is plain file I/O without collectives: the save (saver.py) and the load
(loader.py) decide who calls it.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from typing import Any

import torch

FORMAT_VERSION = 2  # 2: shards as directories of raw arrays (shard_io.py); 1: one pickled file per shard
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
TRAINER_FILE = "trainer.pt"  # rank 0: dense model + optimizer, step, RNG, losses, evals
SCHEMA_KEYS = ("table_rows", "dim", "model", "optim_sparse", "optim_dense")  # must match to resume
# data sources whose stream position depended on W in checkpoints written before the key
# data_order_world existed (Criteo's blocks were split into W shards); today every source's order is
# the same at any W (trainer/workload/data/order.py) and a save writes data_order_world = null
WORLD_BOUND_DATA = ("criteo",)
STEP_DIR = re.compile(r"^step_(\d+)$")
WORK_DIR = re.compile(r"^step_(?P<step>\d+)\.(?P<kind>tmp|old)-(?P<run>[0-9a-f]+)-[0-9a-f]+$")  # a save in progress


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (corrupt, truncated, incompatible); names the file."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint's manifest or one of its files is missing, unreadable or fails its checksum."""


def shard_file(rank: int, world: int) -> str:
    return f"shard_{rank:05d}-of-{world:05d}.pt"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def _step_dirs(root: str | None) -> list[tuple[int, str]]:
    """(step, path) of every directory named step_K under root, by step."""
    if not root or not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def _manifest_or_problem(ckpt: str) -> dict[str, Any] | str:
    """ckpt's manifest as a dict, or what is wrong with it (missing, unreadable, not an object)."""
    path = os.path.join(ckpt, MANIFEST)
    if not os.path.lexists(path):
        return f"it has no {MANIFEST}"
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        return f"its {MANIFEST} cannot be read: {exc}"
    return manifest if isinstance(manifest, dict) else f"its {MANIFEST} is not a JSON object"


def complete_checkpoints(root: str | None) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root (named step_K, manifest readable), in
    the order they were saved, oldest first (see save_order); `.tmp-` directories of unfinished
    saves and damaged checkpoints (damaged_checkpoints) are left out."""
    found = []
    for step, path in _step_dirs(root):
        manifest = _manifest_or_problem(path)
        if isinstance(manifest, dict):
            found.append((_order(manifest, step), step, path))
    return [(step, path) for _, step, path in sorted(found)]


def damage_of(ckpt: str) -> str | None:
    """What is wrong with the checkpoint directory ckpt (its manifest missing or unreadable), or
    None when its manifest reads."""
    found = _manifest_or_problem(ckpt)
    return None if isinstance(found, dict) else found


def damaged_checkpoints(root: str | None) -> list[tuple[str, str]]:
    """(path, what is wrong) of every step_K directory under root whose manifest is missing or
    unreadable, by step. Its save order is unknown: rotation never deletes it, resume=auto stops
    at it until a later save has seen it (unseen_damage)."""
    out = []
    for _, path in _step_dirs(root):
        manifest = _manifest_or_problem(path)
        if not isinstance(manifest, dict):
            out.append((path, manifest))
    return out


def damage_record(path: str) -> dict[str, Any]:
    """How a save lists a damaged checkpoint it saw (manifest `damaged_seen`): its name and the
    directory's inode and modification time, so that a later step_K of the same name (or more
    damage to this one) is not taken for the one seen."""
    st = os.stat(path)
    return {"name": os.path.basename(path), "inode": st.st_ino, "mtime_ns": st.st_mtime_ns}


def damage_seen(root: str, final: str) -> list[dict[str, Any]]:
    """What a save into `final` lists as `damaged_seen`: the damaged checkpoints under root (not
    `final`, which the save replaces), each as damage_record says; one gone meanwhile is left out."""
    seen = []
    for path, _ in damaged_checkpoints(root):
        if path != final:
            try:
                seen.append(damage_record(path))
            except OSError:
                pass
    return seen


def unseen_damage(root: str | None, newest: str | None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The damaged checkpoints under root split in two: (unseen, seen), where seen are those that
    the newest complete save `newest` listed as it found them (so it was saved after them), and
    unseen any other: one of those may be the newest save of the job."""
    seen_by_newest: list[Any] = []
    if newest is not None:
        manifest = _manifest_or_problem(newest)
        if isinstance(manifest, dict):
            seen_by_newest = manifest.get("damaged_seen") or []
    unseen, seen = [], []
    for path, why in damaged_checkpoints(root):
        try:
            record = damage_record(path)
        except OSError:
            continue  # gone since the scan
        (seen if record in seen_by_newest else unseen).append((path, why))
    return unseen, seen


def save_order(path: str, step: int) -> tuple[int, int]:
    """Sort key of a complete checkpoint by save time: its manifest's save_seq; checkpoints
    written before save_seq existed come first, by step. (A damaged one has no place: see
    damaged_checkpoints; here it sorts like one without save_seq.)"""
    manifest = _manifest_or_problem(path)
    return _order(manifest if isinstance(manifest, dict) else {}, step)


def _order(manifest: dict[str, Any], step: int) -> tuple[int, int]:
    seq = manifest.get("save_seq")
    return (1, int(seq)) if isinstance(seq, int) else (0, step)


def latest(root: str | None) -> str | None:
    """The most recently saved complete checkpoint under root (not the highest step), or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def last_save_seq(root: str | None) -> int:
    """The highest save_seq of the complete checkpoints under root (0 when none has one)."""
    seqs = [save_order(path, step) for step, path in complete_checkpoints(root)]
    return max((seq for known, seq in seqs if known), default=0)


def write_file(path: str, obj: Any) -> dict[str, Any]:
    """torch.save obj to path (flushed to disk); returns {"sha256", "bytes"} of what was written."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def read_file(ckpt: str, name: str, manifest: dict[str, Any]) -> Any:
    """Load one file of checkpoint ckpt after checking its size and sha256 against the manifest."""
    path = os.path.join(ckpt, name)
    want = manifest["files"].get(name)
    if want is None:
        raise CheckpointDamaged(f"checkpoint {ckpt}: manifest lists no file {name}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointDamaged(f"checkpoint file {path} cannot be read: {exc}") from exc
    got = hashlib.sha256(data).hexdigest()
    if len(data) != want["bytes"] or got != want["sha256"]:
        raise CheckpointDamaged(
            f"checkpoint file {path} fails its checksum (corrupt or truncated): {len(data)} bytes, "
            f"sha256 {got[:16]}..; the manifest says {want['bytes']} bytes, sha256 {want['sha256'][:16]}..")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def read_manifest(ckpt: str) -> dict[str, Any]:
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"checkpoint manifest {path} cannot be read: {exc}") from exc
    if not isinstance(manifest, dict):
        raise CheckpointDamaged(f"checkpoint manifest {path} cannot be read: not a JSON object")
    if manifest.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(f"checkpoint {ckpt}: format_version {manifest.get('format_version')} "
                              f"is not one this trainer reads ({', '.join(map(str, READABLE_VERSIONS))})")
    return manifest


def write_manifest(tmp: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(tmp, MANIFEST)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
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


def check_schema(ckpt: str, manifest: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise naming every key of SCHEMA_KEYS whose checkpoint value differs from this run's."""
    diff = [f"{k}: checkpoint {manifest.get(k)!r}, this run {schema[k]!r}"
            for k in SCHEMA_KEYS if manifest.get(k) != schema[k]]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt} is incompatible with this run's config: " + "; ".join(diff))


def check_stream_world(ckpt: str, manifest: dict[str, Any], world: int) -> None:
    """Refuse to resume, at another W, a checkpoint whose data order depended on W (data_order_world:
    a Criteo run saved before the order became W-invariant): its saved position (the step) names
    batches that exist only under the saved W's sharding of the blocks."""
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
