"""What a checkpoint holds of a rank besides its shard (shard_io.py): its RNG states; and the reader
of format 1's shards (a pickled dict per rank: its real rows keyed by (table, id) with their
versions and sparse optimizer state), so checkpoints written before format 2 still resume. The RNG
states are plain values and tensors, so torch.load(weights_only=True) reads them back.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ...sparse.embedding.store.shard import ShardStore
from .manifest import CheckpointError


def load_shard_rows(store: ShardStore, saved: dict[str, Any], name: str) -> int:
    """Copy the rows of one saved shard that this rank owns (under its W) into store; returns how
    many. Row, version and every optimizer state tensor move together."""
    s = store.sharding
    gids = s.global_ids(saved["id"], saved["table"])
    mine = s.owner(gids) == s.rank
    idx = s.local_index(gids[mine]).to(store.device)
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
