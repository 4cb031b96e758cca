"""A dynamic tables' shard on disk (embedding.kind=dynamic): the shard directory format of
shard_io.py (flat little-endian arrays, one per field, each with its per-block sha256 index), in
pool slot order, with the pool's own fields beside the rows.

Fields, one value (or row) per pool slot, T x capacity of them: weight, version, the optimizer's
state_<name> (as for fixed tables) and the pool's slot_gid (the id holding each slot, -1: free),
last_use and uses (the eviction scores). Besides them, the admission counts (admit_after > 1,
embedding.admit_counter; admission.py): exact, the ids counted but not admitted yet
(pending_ids.bin, pending_values.bin: (last step counted << 16 | count)); count_min, the sketch's
int16 counters (count_min.bin; its depth, width and halving epoch in the manifest's entry); and the
pool's counters per table (admissions, evictions, dropped gradients, rejected: in the manifest's
entry for the shard, they are T x 4 numbers). The id -> slot map is not saved: it is rebuilt from
slot_gid on load.

Resume at the same number of workers and capacity copies each shard back slot for slot. At
another W (or another embedding.capacity) the ids move to their new owners (hash mod W'): each
rank streams every saved shard's slot ids and scores (24 B per saved slot, a piece at a time),
keeps the ids it now owns, and where a table holds more of them than its capacity keeps the
best-scored ones (LRU: the most recently read, LFU: the most used, decayed as the pool does, then
the most recent; ties: the lower id) and evicts the others (counted in `evictions`, told on stderr); its kept ids take the
table's first slots in id order, and their rows, versions and optimizer state are read from the
saved shards piece by piece (every rank reads every saved shard: the ids are spread by hash). The
exact pending counts follow their ids; a count-min sketch cannot tell its ids apart, so every new
owner's sketch is the element-wise max of all the saved ones (each id's count lived in its old
owner's sketch, so the max never under-counts it, and it adds less of the other owners' ids than
a sum would; an exact checkpoint resumed with count_min puts each pending id's count into its new
owner's sketch; a sketch is never turned back into exact counts: refused). The counters move to rank 0 (their sums over ranks are what
summary.json reports), so admissions - evictions = rows in use still holds.
"""
from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch

from ...sparse.embedding.dynamic.shard import DynamicStore
from ...sparse.embedding.dynamic.pool import POOL_COUNTERS
from ...sparse.embedding.sharding import ID_BITS
from .manifest import CheckpointDamaged, CheckpointError
from .shard_io import PIECE_BYTES, VERSION_DTYPE, Field, _HashedWriter, _to_tensor, VerifiedFile, fields, \
    saved_dtype, shard_dir, torch_name

_POOL = ("slot_gid", "last_use", "uses")
_PENDING = ("pending_ids", "pending_values")
_SKETCH = "count_min"


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
    counts = store.pool.admission
    if counts is not None and counts.kind == _SKETCH:
        arrays = {_SKETCH: counts.cells}
        out[_SKETCH] = {"depth": counts.depth, "width": counts.width, "epoch": counts.epoch}
    else:
        ids, vals = counts.items() if counts is not None else (torch.zeros(0, dtype=torch.int64),) * 2
        arrays = dict(zip(_PENDING, (ids, vals)))
    for name, values in arrays.items():
        w = _HashedWriter(os.path.join(directory, f"{name}.bin"))
        array = values.cpu().contiguous().numpy()
        try:
            w.write(array)
        finally:
            out["pending"][name] = {"dtype": array.dtype.str, "count": int(values.numel()), **w.close()}
    return out


def read_pool_shard(ckpt: str, manifest: dict[str, Any], store: DynamicStore, counter: dict[str, int]) -> int:
    """Load this rank's dynamic shard from a checkpoint into store: the saved shard itself at the
    same W and capacity, else the ids this rank owns now from every saved shard (_reshard; see the
    module docstring); rebuild the id -> slot map and the pending counts; returns the slots set."""
    s = store.sharding
    saved_world = int(manifest["world_size"])
    names = [shard_dir(k, saved_world) for k in range(saved_world)]
    infos = []
    for name in names:
        info = manifest["shards"].get(name)
        if info is None or "pending" not in info:
            raise CheckpointDamaged(f"checkpoint {ckpt}: manifest lists no dynamic shard {name}")
        infos.append(info)
    want = {f.name: t for f, t in pool_fields(store)}
    if set(infos[0]["fields"]) != set(want):
        raise CheckpointError(f"{os.path.join(ckpt, names[0])}: saved fields {sorted(infos[0]['fields'])} do not "
                              f"match this run's {sorted(want)} (another optimizer?)")
    if saved_world != s.world or int(infos[0]["rows"]) != store.weight.shape[0]:
        return _reshard(ckpt, names, infos, store, want, counter, int(manifest.get("step", 0)))
    name, info = names[s.rank], infos[s.rank]
    n = store.weight.shape[0]
    for fname, meta in info["fields"].items():
        f = VerifiedFile(os.path.join(ckpt, name, f"{fname}.bin"), meta, counter)
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
    _read_counts(ckpt, [(name, info)], store, counter, int(manifest.get("step", 0)))
    pool.counters.copy_(torch.tensor(info["counters"], dtype=torch.int64))
    return n


def _columns(ckpt: str, name: str, info: dict[str, Any], names: tuple[str, ...], counter: dict[str, int]):
    """Pieces (lo, {field: [m, width] tensor}) of the named fields of a saved shard, PIECE_BYTES of
    the widest at a time, every block verified."""
    files = {k: VerifiedFile(os.path.join(ckpt, name, f"{k}.bin"), info["fields"][k], counter) for k in names}
    try:
        metas = {k: info["fields"][k] for k in names}
        widths = {k: np.dtype(m["dtype"]).itemsize * m["width"] for k, m in metas.items()}
        n, step = int(info["rows"]), max(PIECE_BYTES // max(widths.values()), 1)
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            out = {}
            for k, f in files.items():
                arr = np.frombuffer(f.read(lo * widths[k], hi * widths[k]), dtype=np.dtype(metas[k]["dtype"]))
                out[k] = _to_tensor(arr.reshape(hi - lo, metas[k]["width"]), saved_dtype(metas[k]))
            yield lo, out
    finally:
        for f in files.values():
            f.close()


def _place_in_group(table: torch.Tensor, num_tables: int) -> torch.Tensor:
    """[n] each entry's position among the entries of its table, for `table` [n] sorted."""
    counts = torch.bincount(table, minlength=num_tables)
    return torch.arange(table.numel()) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)


def _reshard(ckpt: str, names: list[str], infos: list[dict[str, Any]], store: DynamicStore,
             want: dict[str, torch.Tensor], counter: dict[str, int], step: int) -> int:
    """The ids this rank owns under this run's W and capacity, from every saved shard (the module
    docstring says how); `step`: the checkpoint's, from which LFU's decayed uses are seen."""
    s, pool = store.sharding, store.pool
    cap, num_tables, lfu = s.capacity, s.num_tables, pool.eviction == "lfu"
    # 1. candidates: the saved ids this rank owns now, with their scores and where they are
    cand: list[torch.Tensor] = []  # rows of (gid, last_use, uses, saved shard, saved slot)
    for k, (name, info) in enumerate(zip(names, infos)):
        for lo, cols in _columns(ckpt, name, info, _POOL, counter):
            gid = cols["slot_gid"].reshape(-1)
            mine = torch.nonzero((gid >= 0) & (s.owner(gid.clamp(min=0)) == s.rank)).squeeze(1)
            if mine.numel():
                cand.append(torch.stack([gid[mine], cols["last_use"].reshape(-1)[mine], cols["uses"].reshape(-1)[mine],
                                         torch.full_like(mine, k), mine + lo], 1))
    c = torch.cat(cand) if cand else torch.zeros(0, 5, dtype=torch.int64)
    # 2. per table, the best `cap` of them by the pool's score (ties: the lower id)
    order = torch.argsort(c[:, 0])
    order = order[torch.argsort(-c[order, 1], stable=True)]  # most recent first
    if lfu:  # most used first (uses decayed as the pool scores them: embedding.lfu_half_life)
        order = order[torch.argsort(-pool.lfu_scores(c[order, 2], c[order, 1], step), stable=True)]
    c = c[order]
    c = c[torch.argsort(c[:, 0] >> ID_BITS, stable=True)]  # grouped by table, best first in each
    table = c[:, 0] >> ID_BITS
    keep = _place_in_group(table, num_tables) < cap
    evicted = torch.bincount(table[~keep], minlength=num_tables)
    c = c[keep]
    c = c[torch.argsort(c[:, 0])]  # by id: each table's kept ids take its first slots in id order
    table = c[:, 0] >> ID_BITS
    slot = table * cap + _place_in_group(table, num_tables)
    # 3. their fields (rows, versions, optimizer state, scores, slot ids), saved shard by saved shard
    for k, (name, info) in enumerate(zip(names, infos)):
        from_k = torch.nonzero(c[:, 3] == k).squeeze(1)
        if not from_k.numel():
            continue
        src = c[from_k, 4]
        by_src = torch.argsort(src)
        src, dst = src[by_src], slot[from_k][by_src]
        for lo, cols in _columns(ckpt, name, info, tuple(want), counter):
            n_piece = next(iter(cols.values())).shape[0]
            a, b = (int(x) for x in torch.searchsorted(src, torch.tensor([lo, lo + n_piece])))
            if a == b:
                continue
            for fname, values in cols.items():
                dest = _flat(want[fname])
                if values.dtype != dest.dtype:
                    raise CheckpointError(f"{os.path.join(ckpt, name, fname)}.bin: saved as {torch_name(values.dtype)}, "
                                          f"this run holds {torch_name(dest.dtype)} (dynamic tables resume with the same types)")
                with torch.no_grad():
                    dest[dst[a:b].to(dest.device)] = values[src[a:b] - lo].to(dest.device)
    pool.reindex()  # the id -> slot map and the free slots, from the slot ids just read
    # 4. the admission counts of the ids it owns now (at the same W: its own shard's); the counters
    # to rank 0, plus its evictions
    same_owners = len(names) == s.world
    _read_counts(ckpt, [(names[s.rank], infos[s.rank])] if same_owners else list(zip(names, infos)), store,
                 counter, step)
    totals = torch.zeros_like(pool.counters, device="cpu")
    for info in infos:
        totals += torch.tensor(info["counters"], dtype=torch.int64)
    totals = totals if s.rank == 0 else torch.zeros_like(totals)
    totals[POOL_COUNTERS.index("evictions")] += evicted
    pool.counters.copy_(totals)
    if int(evicted.sum()) or s.rank == 0:
        print(f"[trainer] {ckpt}: dynamic tables saved by {len(names)} workers resumed on {s.world} "
              f"(embedding.capacity {cap}): rank {s.rank} holds {c.shape[0]} ids; {int(evicted.sum())} evicted "
              "over capacity by score", file=sys.stderr)
    return store.weight.shape[0]


def _read_counts(ckpt: str, shards: list[tuple[str, dict[str, Any]]], store: DynamicStore,
                 counter: dict[str, int], step: int) -> None:
    """The admission counts of the ids this rank owns, from the saved shards (name, manifest
    entry) that may hold them (the module docstring says how); `step`: the checkpoint's."""
    s, counts = store.sharding, store.pool.admission
    if counts is None:
        return
    sketches, ids, vals = [], [], []
    for name, info in shards:
        read = {k: _read_all(os.path.join(ckpt, name, f"{k}.bin"), meta, counter) for k, meta in info["pending"].items()}
        if _SKETCH in info:
            if counts.kind != _SKETCH:
                raise CheckpointError(f"{os.path.join(ckpt, name)}: admission counted by a count-min sketch, which "
                                      f"cannot give exact counts: resume with embedding.admit_counter={_SKETCH}")
            meta = info[_SKETCH]
            if (meta["depth"], meta["width"]) != (counts.depth, counts.width):
                raise CheckpointError(f"{os.path.join(ckpt, name)}: a count-min sketch of {meta['depth']} x "
                                      f"{meta['width']} counters, this run's is {counts.depth} x {counts.width}: resume "
                                      "with the same embedding.count_min_bytes and count_min_depth")
            sketches.append((read[_SKETCH], int(meta["epoch"])))
            continue
        mine = s.owner(read["pending_ids"]) == s.rank if read["pending_ids"].numel() else read["pending_ids"].bool()
        ids.append(read["pending_ids"][mine])
        vals.append(read["pending_values"][mine])
    device = store.pool.slot_gid.device
    exact = (torch.cat(ids).to(device), torch.cat(vals).to(device)) if ids else None
    if counts.kind == _SKETCH:
        counts.load(sketches, exact, step)
    else:
        counts.load(*exact)


def _read_all(path: str, meta: dict[str, Any], counter: dict[str, int]) -> torch.Tensor:
    f = VerifiedFile(path, meta, counter)
    try:
        return torch.from_numpy(np.frombuffer(f.read(0, meta["bytes"]), dtype=np.dtype(meta["dtype"])).copy())
    finally:
        f.close()
