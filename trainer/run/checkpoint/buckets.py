"""Saves and loads of a shard on disk (embedding.store=disk) without sweeping it once per piece.

Why: a checkpoint's file holds each table's rows in bit-reversed order (row_order.py), so one piece
of the file (PIECE_BYTES of rows) takes rows from all over the table: every row of the piece is
in another page of the shard. With the shard in memory that costs nothing; with the shard on disk
and a page cache smaller than it, every piece reads (a save) or rewrites (a load) the whole shard.

So a save or a load through the disk tier permutes by buckets, an external sort in two passes:
- a save sweeps the shard in order, one piece of rows at a time, and appends each row's record
  (all its fields), with its position in the file, to the bucket file of the file piece it
  belongs to; then it reads the buckets one by one, sorts each by position and writes each field
  of it as that piece (hashed as always);
- a load appends each row it reads from the checkpoint, with its storage row, to the bucket of the
  shard's piece that holds that row; then it applies the buckets one by one, each to one region of
  the shard.
I/O: the shard read (or written) once in order, the buckets written and read once. The shard's
pieces are read and written around its mapping, a record (all of a row's fields) at a time, in
sequential pieces (the tier's read_records and write: tier/records.py), not through the mapping field
by field. Memory: one piece, plus one bucket's rows (a piece's, give or take the rounding). The
buckets are scratch files in the tier's directory (a local disk), removed when done.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from ...base.core.disk import free_share
from ...base.core.progress import fmt_bytes

if TYPE_CHECKING:
    from ...sparse.embedding.store.tier.disk import DiskTier

INDEX = np.dtype("<i8")  # a row's position (save) or storage row (load) in a bucket


class Buckets:
    """K bucket files per field, each row appended with its key (int64)."""

    def __init__(self, directory: str, k: int, names: list[str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="ht-buckets-", dir=directory)
        self.k, self.names = k, list(names)
        self.rows = np.zeros(k, np.int64)

    def _path(self, b: int, name: str) -> str:
        return os.path.join(self.dir, f"{b}.{name}")

    def add(self, bucket: np.ndarray, key: np.ndarray, values: dict[str, np.ndarray]) -> None:
        """Append rows: their bucket [n], key [n] and each field's values [n, ...] (raw arrays)."""
        order = np.argsort(bucket, kind="stable")
        bucket, key = bucket[order], key[order]
        cuts = np.flatnonzero(np.diff(bucket)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [bucket.size]])
        sorted_values = {n: _gather(v, order) for n, v in values.items()}
        for s, e in zip(starts.tolist(), ends.tolist()):
            if s == e:
                continue
            b = int(bucket[s])
            with open(self._path(b, "key"), "ab") as f:
                f.write(memoryview(np.ascontiguousarray(key[s:e], dtype=INDEX)).cast("B"))
            for n in self.names:
                with open(self._path(b, n), "ab") as f:
                    f.write(memoryview(np.ascontiguousarray(sorted_values[n][s:e])).cast("B"))
            self.rows[b] += e - s

    def take(self, b: int, dtypes: dict[str, np.dtype], widths: dict[str, int]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Bucket b's keys and values, sorted by key; its files are removed."""
        n = int(self.rows[b])
        if n == 0:
            return np.zeros(0, INDEX), {name: np.zeros((0, widths[name]), dtypes[name]) for name in self.names}
        key = np.fromfile(self._path(b, "key"), dtype=INDEX)
        order = np.argsort(key, kind="stable")
        out = {}
        for name in self.names:
            arr = np.fromfile(self._path(b, name), dtype=dtypes[name]).reshape(n, widths[name])
            out[name] = _gather(arr, order)
            os.remove(self._path(b, name))
        os.remove(self._path(b, "key"))
        return key[order], out

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _gather(arr: np.ndarray, order: np.ndarray) -> np.ndarray:
    """arr[order] for [n, width] arrays: rows of bytes gathered by torch (one memcpy a row, where
    numpy's fancy indexing copies element by element)."""
    if arr.ndim != 2 or arr.shape[0] == 0:
        return arr[order]
    rows = torch.from_numpy(np.ascontiguousarray(arr)).view(torch.uint8)
    return rows.index_select(0, torch.from_numpy(order)).numpy().view(arr.dtype)


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, values per row] (a vector: one value per row), also with no rows."""
    return t.reshape(t.shape[0], int(np.prod(t.shape[1:], dtype=np.int64)))


def raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array of the same bytes, [n, width] (bfloat16 as uint16)."""
    t = as_2d(t)
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_raw(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


def bucketed_write(first: int, n: int, rows_per_piece: int, bits: int, first_j: Callable[[int], int],
                   bit_reverse: Callable[[np.ndarray, int], np.ndarray], tensors: dict[str, torch.Tensor],
                   tier: "DiskTier", emit: Callable[[str, np.ndarray], None], spare: Optional[str] = None) -> None:
    """One table segment's rows (storage rows first..first+n) in the checkpoint's file order,
    emitted piece by piece: emit(field, raw values) per field and piece, in file order. tensors:
    the fields saved, the tier's views of its records; first_j(p): the j (bit-reversed position) of
    file row p; a row q's j is rev_bits(q). The buckets hold whole records (one file and one
    gather per piece, not one per field); each field is taken from them as the bucket is emitted.
    They go beside the shard's files, or into `spare` (the save's own directory) when that disk
    has not the room for them (another writer filled it): said once on stderr."""
    k = -(-n // rows_per_piece)
    bounds = np.array([first_j(p * rows_per_piece) for p in range(k)] + [1 << bits], dtype=np.int64)
    flats = {name: as_2d(t) for name, t in tensors.items()}
    fields = {name: tier.name_of(t) for name, t in flats.items()}
    rec = tier.file.row_bytes
    buckets = Buckets(_bucket_dir(tier.dir, n * (rec + INDEX.itemsize), spare), k, ["records"])
    try:
        for lo in range(0, n, rows_per_piece):  # the shard in order, a piece of rows at a time
            q = np.arange(lo, min(lo + rows_per_piece, n), dtype=np.int64)
            j = bit_reverse(q, bits) if bits else q
            bucket = np.searchsorted(bounds, j, side="right") - 1
            buckets.add(bucket, j, {"records": tier.read_records(first + lo, first + lo + q.size).numpy()})
        for b in range(k):
            _, got = buckets.take(b, {"records": np.dtype(np.uint8)}, {"records": rec})
            records = torch.from_numpy(got["records"])
            for name, f in flats.items():
                emit(name, np.ascontiguousarray(raw(tier.view(records, fields[name], f))))
    finally:
        buckets.close()


def _bucket_dir(where: str, need: int, spare: Optional[str]) -> str:
    """`where` when its disk has `need` bytes free, else `spare` (said once a store folder)."""
    free = free_share(where, 1)
    if spare is None or free >= need:
        return where
    if where not in _SAID:  # once a run (a save's directory is new each time)
        _SAID.add(where)
        print(f"[trainer] checkpoint save: embedding.store_dir {os.path.dirname(where)} has {fmt_bytes(free)} free, "
              f"its buckets need {fmt_bytes(need)}: they go into {spare} instead", file=sys.stderr, flush=True)
    return spare


_SAID: set = set()  # the store folders whose buckets went elsewhere, said


class BucketedLoad:
    """A load's rows gathered by the shard's piece they land in (add), then applied piece by piece
    (finish): every region of the shard written once, in order, around its mapping (the tier's
    write: each piece's records read, changed and written back)."""

    def __init__(self, tier: "DiskTier", local_rows: int, rows_per_piece: int, dests: dict[str, torch.Tensor]) -> None:
        self.tier, self.rows_per_piece = tier, rows_per_piece
        self.flats = {name: as_2d(t) for name, t in dests.items()}
        self.fields = {name: tier.name_of(t) for name, t in self.flats.items()}
        self.buckets = Buckets(tier.dir, max(-(-local_rows // rows_per_piece), 1), list(self.flats))
        self.pending: dict[str, torch.Tensor] = {}

    def add(self, name: str, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Field `name`'s values [n, ...] (already of the store's dtype) for storage rows idx [n]:
        kept until every field of the same rows came (the fields of a piece come together)."""
        self.pending[name] = values
        if len(self.pending) < len(self.flats):
            return
        key = idx.numpy().astype(np.int64, copy=False)
        self.buckets.add(key // self.rows_per_piece, key,
                         {n: raw(v) for n, v in self.pending.items()})
        self.pending = {}

    def finish(self) -> None:
        try:
            dtypes = {name: raw(f[:0]).dtype for name, f in self.flats.items()}
            widths = {name: f.shape[1] for name, f in self.flats.items()}
            for b in range(self.buckets.k):
                key, values = self.buckets.take(b, dtypes, widths)
                if key.size:
                    self.tier.write(torch.from_numpy(key), {self.fields[name]: from_raw(values[name], f.dtype)
                                                            for name, f in self.flats.items()})
        finally:
            self.buckets.close()

    def close(self) -> None:
        self.buckets.close()
