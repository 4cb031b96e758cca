"""A dynamic tables' shard on disk (embedding.tables=dynamic): the shard directory format of
shard_io.py (flat little-endian arrays, one per field, each with its per-block sha256 index), in
pool slot order, with the pool's own fields beside the rows.

Fields, one value (or row) per pool slot, T x capacity of them: weight, version, the optimizer's
state_<name> (as for fixed tables) and the pool's slot_gid (the id holding each slot, -1: free),
last_use and uses (the eviction scores). Besides them, the ids counted but not admitted yet
(pending_ids.bin, pending_values.bin: (last step counted << 16 | count), admit_after > 1) and the
pool's counters per table (admissions, evictions, dropped gradients, rejected: in the manifest's
entry for the shard, they are T x 4 numbers). The id -> slot map is not saved: it is rebuilt from
slot_gid on load.

Resume is at the same number of workers only (the owner of an id is hash mod W; moving ids to the
owners of another W, and evicting by score where one is over full, is not written yet): another W
stops the load with a CheckpointError naming both.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ..embedding.dynamic import DynamicStore
from .manifest import CheckpointDamaged, CheckpointError
from .shard_io import PIECE_BYTES, VERSION_DTYPE, Field, _HashedWriter, _to_tensor, _VerifiedFile, fields, \
    saved_dtype, shard_dir, torch_name

_POOL = ("slot_gid", "last_use", "uses")
_PENDING = ("pending_ids", "pending_values")


def pool_fields(store: DynamicStore) -> list[tuple[Field, torch.Tensor]]:
    """(field, tensor) of every per-slot array of a dynamic shard, in file order."""
    pool = store.pool
    return fields(store) + [(Field(name, VERSION_DTYPE, 1), getattr(pool, name)) for name in _POOL]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() > 1 else t.reshape(-1, 1)


def write_pool_shard(directory: str, store: DynamicStore) -> dict[str, Any]:
    """Write the rank's dynamic shard into `directory` (created), PIECE_BYTES of slots at a time;
    returns its manifest entry: {"rows", "fields", "pending", "counters"}."""
    os.makedirs(directory, exist_ok=True)
    parts = [(f, _flat(t), _HashedWriter(os.path.join(directory, f"{f.name}.bin"))) for f, t in pool_fields(store)]
    n = store.weight.shape[0]
    per_piece = max(PIECE_BYTES // max(sum(f.row_bytes for f, _, _ in parts), 1), 1)
    try:
        for lo in range(0, n, per_piece):
            for _, flat, writer in parts:
                piece = flat[lo:lo + per_piece].cpu().contiguous()
                writer.write((piece.view(torch.int16) if piece.dtype == torch.bfloat16 else piece).numpy())
    finally:
        infos = [w.close() for _, _, w in parts]
    out: dict[str, Any] = {"rows": n, "fields": {}, "pending": {},
                           "counters": store.pool.counters.cpu().tolist()}
    for (f, flat, _), info in zip(parts, infos):
        out["fields"][f.name] = {"dtype": f.dtype.str, "torch_dtype": torch_name(flat.dtype), "width": f.width, **info}
    pending = store.pool.pending
    ids, vals = pending.items() if pending is not None else (torch.zeros(0, dtype=torch.int64),) * 2
    for name, values in zip(_PENDING, (ids, vals)):
        w = _HashedWriter(os.path.join(directory, f"{name}.bin"))
        try:
            w.write(values.cpu().contiguous().numpy())
        finally:
            out["pending"][name] = {"dtype": VERSION_DTYPE.str, "count": int(values.numel()), **w.close()}
    return out


def read_pool_shard(ckpt: str, manifest: dict[str, Any], store: DynamicStore, counter: dict[str, int]) -> int:
    """Copy this rank's saved dynamic shard into store (same W only), rebuild the id -> slot map
    and the pending counts; returns the slots read."""
    s = store.sharding
    saved_world = int(manifest["world_size"])
    if saved_world != s.world:
        raise CheckpointError(f"checkpoint {ckpt}: dynamic tables were saved by {saved_world} workers and "
                              f"resume on the same number only (this run has {s.world})")
    name = shard_dir(s.rank, saved_world)
    info = manifest["shards"].get(name)
    if info is None or "pending" not in info:
        raise CheckpointDamaged(f"checkpoint {ckpt}: manifest lists no dynamic shard {name}")
    want = {f.name: t for f, t in pool_fields(store)}
    if set(info["fields"]) != set(want) or int(info["rows"]) != store.weight.shape[0]:
        raise CheckpointError(f"{os.path.join(ckpt, name)}: saved fields {sorted(info['fields'])} of "
                              f"{info['rows']} slots do not match this run's {sorted(want)} of "
                              f"{store.weight.shape[0]} (another optimizer or embedding.capacity?)")
    n = store.weight.shape[0]
    for fname, meta in info["fields"].items():
        f = _VerifiedFile(os.path.join(ckpt, name, f"{fname}.bin"), meta, counter)
        try:
            dtype, width = np.dtype(meta["dtype"]), meta["width"]
            rb = dtype.itemsize * width
            step = max(PIECE_BYTES // rb, 1)
            dest = _flat(want[fname])
            for lo in range(0, n, step):
                hi = min(lo + step, n)
                arr = np.frombuffer(f.read(lo * rb, hi * rb), dtype=dtype).reshape(hi - lo, width)
                values = _to_tensor(arr, saved_dtype(meta))
                if values.dtype != dest.dtype:
                    raise CheckpointError(f"{f.path}: saved as {torch_name(values.dtype)}, this run holds "
                                          f"{torch_name(dest.dtype)} (dynamic tables resume with the same types)")
                with torch.no_grad():
                    dest[lo:hi].copy_(values.to(dest.device))
        finally:
            f.close()
    pool = store.pool
    pool.reindex()
    pending = [_read_all(os.path.join(ckpt, name, f"{k}.bin"), info["pending"][k], counter) for k in _PENDING]
    if pool.pending is not None:
        pool.pending.erase(pool.pending.items()[0])
        if pending[0].numel():
            pool.pending.insert(pending[0].to(pool.slot_gid.device), pending[1].to(pool.slot_gid.device))
    pool.counters.copy_(torch.tensor(info["counters"], dtype=torch.int64))
    return n


def _read_all(path: str, meta: dict[str, Any], counter: dict[str, int]) -> torch.Tensor:
    f = _VerifiedFile(path, meta, counter)
    try:
        return torch.from_numpy(np.frombuffer(f.read(0, meta["bytes"]), dtype=VERSION_DTYPE).copy())
    finally:
        f.close()
