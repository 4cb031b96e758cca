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
# data sources whose stream position depends on W: a step's batch is only defined at the saved W
# (Criteo: DALI's reader splits the blocks into W contiguous shards, trainer/data/blocks.py)
WORLD_BOUND_DATA = ("criteo",)
STEP_DIR = re.compile(r"^step_(\d+)$")
WORK_DIR = re.compile(r"^step_\d+\.(tmp|old)-(?P<run>[0-9a-f]+)-[0-9a-f]+$")  # a save in progress


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (corrupt, truncated, incompatible); names the file."""


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
        m = STEP_DIR.match(name)
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


def file_info(digest: torch.Tensor) -> dict[str, Any]:
    """{"bytes", "sha256"} from one rank's [1 + 32] digest row (see Checkpointer._write_shard)."""
    return {"bytes": int(digest[0]), "sha256": bytes(digest[1:].tolist()).hex()}


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
