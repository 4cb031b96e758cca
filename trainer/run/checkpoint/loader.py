"""Reading a checkpoint back: which one to resume, and its rows under this run's W.

resolve() is rank 0's choice (checkpoint.resume: a path, or auto = the newest complete save in
checkpoint.dir), made once for every rank. load() checks the manifest and the schema, then each rank
reads the rows it owns under the current W (a run may resume on any number of workers): at the
saved W its own shard, at 2^m W a 1 / 2^m part of one shard, at a divisor of W the shards it takes
over (shard_io.py), every block it reads checked against its checksum. Checkpoints of format 1
(one pickled file per shard) are still read: every rank reads every shard and keeps its rows.
Every rank runs it; a failure on any rank stops them all (Collectives.all_succeed).

auto never continues from an older state without a word: a damaged checkpoint that may be the
newest save stops it (resolve), naming the newest complete one and the override that continues
from it; a damaged file of the checkpoint it chose names the one saved before it (load).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from ...base.comm import Collectives
from ...base.core.progress import fmt_bytes, say_if_slow
from ...sparse.embedding.store.shard import ShardStore
from .manifest import (TRAINER_FILE, CheckpointDamaged, CheckpointError, check_schema, check_stream_world,
                       complete_checkpoints, latest, read_file, read_manifest, shard_file, unseen_damage)
from .pool_io import read_pool_shard
from .shard_io import read_shards, saved_dtype, torch_name
from .state import load_shard_rows


def resolve(comm: Collectives, resume: str | None, root: str | None) -> str | None:
    """The checkpoint to resume from (rank 0 decides, every rank gets the same answer):
    None -> None; "auto" -> newest complete under root, None (said on stderr) if there is none;
    else the path itself. auto raises CheckpointDamaged when root holds a damaged checkpoint (its
    manifest missing or unreadable) that the newest complete save has not seen: that one may be
    the newest save, and only the user can say to continue from an older one."""
    def decide() -> str | None:  # rank 0
        if resume is None:
            return None
        path = latest(root) if resume == "auto" else resume
        if resume == "auto":
            unseen, seen = unseen_damage(root, path)
            if unseen:
                raise CheckpointDamaged(_auto_stops(root, unseen, path))
            for bad, why in seen:
                print(f"[trainer] warning: checkpoint.resume=auto passes over the damaged checkpoint {bad} "
                      f"({why}): {path} was saved after it", file=sys.stderr)
        if path is None:
            print(f"[trainer] checkpoint.resume=auto: no complete checkpoint in "
                  f"{root or '(no checkpoint.dir and no output dir)'}; starting fresh",
                  file=sys.stderr)
        else:
            print(f"[trainer] resuming from {path}", file=sys.stderr)
        return path
    return comm.root_decides(decide, CheckpointError)


def _auto_stops(root: str | None, unseen: list[tuple[str, str]], newest: str | None) -> str:
    """Why resume=auto stops at damaged checkpoints, and the ways on."""
    bad = "; ".join(f"{path} ({why})" for path, why in unseen)
    head = (f"checkpoint.resume=auto: {'a checkpoint' if len(unseen) == 1 else 'checkpoints'} in {root} "
            f"cannot be read: {bad}. Its place in the save order is unknown, so it may be the newest save "
            "and continuing from an older one would silently drop its steps. ")
    names = " and ".join(path for path, _ in unseen)
    if newest is None:
        return head + (f"There is no complete checkpoint to continue from: run without checkpoint.resume to "
                       f"start fresh, or delete {names}")
    return head + (f"The newest complete checkpoint is {newest}: to continue from it, run with "
                   f"checkpoint.resume={newest} (its saves then pass over {names}, which stays for you to "
                   f"inspect or delete: a save of the same step moves it aside to <name>.damaged-<time>); or delete "
                   f"{names} and run again")


def load(comm: Collectives, ckpt: str, store: ShardStore, schema: dict[str, Any],
         auto_root: str | None = None, counter: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify ckpt (schema, the checksums of what is read), load this rank's rows under the current
    W into store, and return rank 0's trainer state (dense model/optimizer, step, RNG, losses).
    counter["bytes_read"] adds the shard bytes this rank read; counter["interrupt"] (optional) is
    asked before each read (a stop request: every rank raises StopRequested). Collective.
    auto_root: the checkpoint.dir that resume=auto chose ckpt from; a damaged file then also names
    the newest checkpoint saved before ckpt and the override that continues from it."""
    counter = {"bytes_read": 0} if counter is None else counter
    t0 = time.monotonic()

    def local() -> dict[str, Any]:
        try:
            return _load_local(ckpt, store, schema, counter)
        except CheckpointDamaged as exc:
            if auto_root is None:
                raise
            raise CheckpointDamaged(f"{exc}. {_older(auto_root, ckpt)}") from exc
    state = comm.all_succeed(f"loading checkpoint {ckpt}", local, CheckpointError)
    say_if_slow(t0, lambda took: f"{ckpt}: rank 0 read {fmt_bytes(counter['bytes_read'])} and loaded its rows "
                                 f"in {took:.0f} s", comm.rank == 0)
    return state


def _older(root: str, ckpt: str) -> str:
    """resume=auto chose the damaged ckpt: the way on from the newest checkpoint saved before it."""
    found = [path for _, path in complete_checkpoints(root)]
    before = found[:found.index(ckpt)] if ckpt in found else []
    head = f"checkpoint.resume=auto chose it as the newest save in {root}"
    if not before:
        return f"{head}; no complete checkpoint was saved before it: run without checkpoint.resume to start fresh"
    return (f"{head}; the newest checkpoint saved before it is {before[-1]}: to continue from it, run with "
            f"checkpoint.resume={before[-1]}")


def _say_conversion(ckpt: str, manifest: dict[str, Any], store: ShardStore) -> None:
    """Rank 0 says so when the saved rows have another type than this run's embedding.dtype (they
    are converted as they are read, shard_io.py)."""
    shards = manifest.get("shards") or {}
    first = next(iter(shards.values()), None)
    if store.sharding.rank != 0 or not first or "weight" not in first.get("fields", {}):
        return
    saved = saved_dtype(first["fields"]["weight"])
    if saved != store.weight.dtype:
        how = "exactly" if saved.itemsize < store.weight.element_size() else "rounded to nearest"
        print(f"[trainer] {ckpt}: rows saved as {torch_name(saved)} are read as {torch_name(store.weight.dtype)} "
              f"(embedding.dtype), {how}", file=sys.stderr)


def _load_local(ckpt: str, store: ShardStore, schema: dict[str, Any], counter: dict[str, int]) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    check_schema(ckpt, manifest, schema)
    check_stream_world(ckpt, manifest, store.sharding.world)
    state = read_file(ckpt, TRAINER_FILE, manifest)
    with store.raw(write=True):
        if int(manifest.get("format_version", 1)) >= 2:
            _say_conversion(ckpt, manifest, store)
            read = read_pool_shard if store.dynamic else read_shards  # dynamic tables: pool_io.py
            loaded = read(ckpt, manifest, store, counter)
        else:
            loaded = 0
            for r in range(int(manifest["world_size"])):  # one saved shard in memory at a time
                name = shard_file(r, int(manifest["world_size"]))
                loaded += load_shard_rows(store, read_file(ckpt, name, manifest), os.path.join(ckpt, name))
    s = store.sharding
    owned = s.real_rows()  # closed form: a per-row array here was 1.9 GB at 26 x 2M rows
    if loaded != owned:
        raise CheckpointDamaged(f"checkpoint {ckpt} holds {loaded} of the {owned} rows rank {s.rank} owns")
    return state
