"""Reading a checkpoint back: which one to resume, and its rows under this run's W.

resolve() is rank 0's choice (checkpoint.resume: a path, or auto = the newest complete save in
checkpoint.dir), made once for every rank. load() checks the manifest and the schema, then each rank
reads the rows it owns under the current W (a run may resume on any number of workers): at the
saved W its own shard, at 2^m W a 1 / 2^m part of one shard, at a divisor of W the shards it takes
over (shard_io.py), every block it reads checked against its checksum. Checkpoints of format 1
(one pickled file per shard) are still read: every rank reads every shard and keeps its rows.
Every rank runs it; a failure on any rank stops them all (Collectives.all_succeed).
"""
from __future__ import annotations

import os
import sys
from typing import Any

from ..comm import Collectives
from ..embedding.store import ShardStore
from .manifest import (TRAINER_FILE, CheckpointError, check_schema, check_stream_world, latest, read_file,
                       read_manifest, shard_file)
from .shard_io import read_shards
from .state import load_shard_rows


def resolve(comm: Collectives, resume: str | None, root: str | None) -> str | None:
    """The checkpoint to resume from (rank 0 decides, every rank gets the same answer):
    None -> None; "auto" -> newest complete under root, None (said on stderr) if there is none;
    else the path itself."""
    def decide() -> str | None:  # rank 0
        if resume is None:
            return None
        path = latest(root) if resume == "auto" else resume
        if path is None:
            print(f"[trainer] checkpoint.resume=auto: no complete checkpoint in "
                  f"{root or '(no checkpoint.dir and no output dir)'}; starting fresh",
                  file=sys.stderr)
        else:
            print(f"[trainer] resuming from {path}", file=sys.stderr)
        return path
    return comm.root_decides(decide, CheckpointError)


def load(comm: Collectives, ckpt: str, store: ShardStore, schema: dict[str, Any],
         counter: dict[str, int] | None = None) -> dict[str, Any]:
    """Verify ckpt (schema, the checksums of what is read), load this rank's rows under the current
    W into store, and return rank 0's trainer state (dense model/optimizer, step, RNG, losses).
    counter["bytes_read"] adds the shard bytes this rank read. Collective."""
    counter = {"bytes_read": 0} if counter is None else counter
    return comm.all_succeed(f"loading checkpoint {ckpt}", lambda: _load_local(ckpt, store, schema, counter),
                            CheckpointError)


def _load_local(ckpt: str, store: ShardStore, schema: dict[str, Any], counter: dict[str, int]) -> dict[str, Any]:
    manifest = read_manifest(ckpt)
    check_schema(ckpt, manifest, schema)
    check_stream_world(ckpt, manifest, store.sharding.world)
    state = read_file(ckpt, TRAINER_FILE, manifest)
    if int(manifest.get("format_version", 1)) >= 2:
        loaded = read_shards(ckpt, manifest, store, counter)
    else:
        loaded = 0
        for r in range(int(manifest["world_size"])):  # one saved shard in memory at a time
            name = shard_file(r, int(manifest["world_size"]))
            loaded += load_shard_rows(store, read_file(ckpt, name, manifest), os.path.join(ckpt, name))
    s = store.sharding
    owned = int(s.valid(s.local_gids()).sum())
    if loaded != owned:
        raise CheckpointError(f"checkpoint {ckpt} holds {loaded} of the {owned} rows rank {s.rank} owns")
    return state
