"""A rank's shard on disk (checkpoint format 2): raw row arrays written and read in bounded pieces,
checksummed per block, laid out so that a reader at another world size reads only its rows.

Why: a shard is most of a rank's memory (rows, their versions, the sparse optimizer's state). The
first format pickled a copy of the whole shard into a buffer and wrote it (three times the shard in
memory), and every rank read and checksummed every saved shard on resume (W times the model read
by the cluster). Here a shard is a directory `shard_RRRRR-of-WWWWW/` of flat little-endian arrays,
one per field (`weight.bin` [n, d], `version.bin` [n] int64, one `state_<name>.bin` per optimizer
state tensor), each with `<file>.sha256`: the sha256 of every BLOCK bytes of it, in order. A save
gathers PIECE_BYTES of rows at a time, writes and hashes them; a load reads the byte ranges it
needs in pieces, verifies the blocks they cover, and copies the rows it owns into its store. Memory
beyond the store: one piece (plus one block at each end of a range).

Row types. Each field's entry in the manifest records its file dtype (numpy's notation) and its
tensor dtype (`torch_dtype`: float32, float16, bfloat16, int64; bfloat16 is written as its raw 2
bytes, numpy having no bfloat16), so the file is the tensor's bytes exactly and reads back bit for
bit. A checkpoint resumed under another embedding.dtype is converted as it is read: to a wider type
exactly, to a narrower one by round to nearest (as the initial rows are), and a row that float16
cannot hold (|value| > 65504) stops the load with a CheckpointError naming the field. The optimizer
state and the versions never change type.

Row order: row_order.py (a reader at another W reads only its rows, in one read per table).
"""
from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ...base.core.stop import StopRequested
from ...sparse.embedding.sharding import rows_on_rank
from ...sparse.embedding.store.shard import ShardStore
from .buckets import BucketedLoad, bucketed_write
from .manifest import CheckpointDamaged, CheckpointError
from .row_order import bit_reverse, first_j, order_bits, q_in_order, q_range

BLOCK = 1 << 20  # bytes per checksummed block
PIECE_BYTES = 64 << 20  # bytes of one field gathered, written or read at a time
VERSION_DTYPE = np.dtype("<i8")


def shard_dir(rank: int, world: int) -> str:
    return f"shard_{rank:05d}-of-{world:05d}"


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class Field:
    """One array of the shard: its file, dtype and values per row."""

    name: str
    dtype: np.dtype
    width: int  # values per row (1: a vector)

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * self.width


def fields(store: ShardStore) -> list[tuple[Field, torch.Tensor]]:
    """(field, the store's tensor) of everything a shard holds, in file order."""
    w = store.weight
    out = [(Field("weight", _DTYPES[w.dtype], w.shape[1]), w), (Field("version", VERSION_DTYPE, 1), store.version)]
    for k, v in sorted(store.optimizer.state_tensors().items()):
        out.append((Field(f"state_{k}", _DTYPES[v.dtype], int(v.numel() // max(v.shape[0], 1))), v))
    return out


# file dtype of each tensor dtype (bf16 as its raw 2 bytes: numpy has no bfloat16)
_DTYPES = {torch.float32: np.dtype("<f4"), torch.float16: np.dtype("<f2"), torch.bfloat16: np.dtype("<u2"),
           torch.int64: np.dtype("<i8")}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_FROM_FILE = {"<f4": torch.float32, "<f2": torch.float16, "<i8": torch.int64}  # entries without torch_dtype


def torch_name(dtype: torch.dtype) -> str:
    """The manifest's name of a tensor dtype ("float32", "bfloat16", ...)."""
    return str(dtype).removeprefix("torch.")


def saved_dtype(meta: dict[str, Any]) -> torch.dtype:
    """The tensor dtype a field was saved from: its `torch_dtype`, or, in checkpoints written before
    that key (float32 rows only), the one its file dtype implies."""
    name = meta.get("torch_dtype")
    if name is not None:
        if name not in _TORCH:
            raise CheckpointError(f"a shard field has the unknown torch_dtype {name!r}")
        return _TORCH[name]
    return _FROM_FILE.get(meta["dtype"], torch.bfloat16 if meta["dtype"] == "<u2" else torch.float32)


def piece_bytes(store: ShardStore) -> int:
    """Bytes of one field a save or a load holds at a time: PIECE_BYTES, or with the shard on disk
    an eighth of its RAM cache (at least 1 MiB), which is all the memory that run has for rows."""
    if store.tier is None:
        return PIECE_BYTES
    return max(1 << 20, min(PIECE_BYTES, store.tier.total_bytes // 8))


def _segments(store: ShardStore) -> Iterator[tuple[int, int, int]]:
    """(table, first storage slot, real rows n_t) of this rank's segment of every table."""
    s = store.sharding
    offs = s.local_table_offsets.tolist()
    for t, rows in enumerate(s.table_rows):
        yield t, offs[t], rows_on_rank(rows, s.rank, s.world)


class _HashedWriter:
    """A file written sequentially, hashed per BLOCK bytes. The hashing of one piece runs in a
    thread (hashlib and file writes release the GIL) while the caller gathers the next piece: at
    most one piece waits to be hashed, so memory stays bounded and sha256 does not add its time
    to the gather's and the write's."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-hash")

    def __init__(self, path: str) -> None:
        self.path, self.f = path, open(path, "wb")
        self.digests: list[bytes] = []
        self.block = hashlib.sha256()
        self.in_block = 0
        self.bytes = 0
        self.pending: Future | None = None

    def write(self, array: np.ndarray) -> None:
        data = memoryview(array).cast("B")
        self.f.write(data)
        self.bytes += len(data)
        self._wait()
        self.pending = self._pool.submit(self._hash, data, array)

    def _hash(self, data: memoryview, keep: np.ndarray) -> None:  # keep: data's owner, alive till hashed
        pos = 0
        while pos < len(data):
            take = min(BLOCK - self.in_block, len(data) - pos)
            self.block.update(data[pos:pos + take])
            self.in_block += take
            pos += take
            if self.in_block == BLOCK:
                self.digests.append(self.block.digest())
                self.block, self.in_block = hashlib.sha256(), 0

    def _wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> dict[str, Any]:
        try:
            self._wait()
        finally:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
        if self.in_block:
            self.digests.append(self.block.digest())
        index = b"".join(self.digests)
        with open(self.path + ".sha256", "wb") as f:
            f.write(index)
            f.flush()
            os.fsync(f.fileno())
        return {"bytes": self.bytes, "blocks_sha256": hashlib.sha256(index).hexdigest()}


def write_shard(directory: str, store: ShardStore,
                on_piece: Callable[[str, int], None] | None = None) -> dict[str, Any]:
    """Write the rank's shard into `directory` (created): PIECE_BYTES of rows at a time (every
    field's values of the same rows, gathered in file order once per piece), each field appended
    to its file; returns {"fields": {name: {dtype, width, bytes, blocks_sha256}}, "rows": n}.
    on_piece(field, bytes) is called before each field's piece is written (tests: the largest piece
    a save holds)."""
    os.makedirs(directory, exist_ok=True)
    segments = list(_segments(store))
    total = sum(n for _, _, n in segments)
    out: dict[str, Any] = {"rows": total, "fields": {}}
    parts = [(field, tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1),
              _HashedWriter(os.path.join(directory, f"{field.name}.bin"))) for field, tensor in fields(store)]
    rows_per_piece = max(piece_bytes(store) // max(sum(f.row_bytes for f, _, _ in parts), 1), 1)
    writers = {field.name: writer for field, _, writer in parts}

    def emit(name: str, values: np.ndarray) -> None:
        if on_piece is not None:
            on_piece(name, values.nbytes)
        writers[name].write(values)
    try:
        if store.tier is not None:  # the shard on disk: in order, through buckets (buckets.py)
            for _, first, n in segments:
                bits = order_bits(n)
                bucketed_write(first, n, rows_per_piece, bits, lambda p: first_j(n, bits, p), bit_reverse,
                               {field.name: flat for field, flat, _ in parts}, store.tier, emit, spare=directory)
            segments = []
        for _, first, n in segments:
            for start in range(0, n, rows_per_piece):
                q = q_in_order(n, start, min(rows_per_piece, n - start))
                idx = torch.from_numpy(q + first)
                for field, flat, writer in parts:
                    piece = flat.index_select(0, idx.to(flat.device)).cpu().contiguous()
                    if on_piece is not None:
                        on_piece(field.name, piece.numel() * piece.element_size())
                    raw = piece.view(torch.int16) if piece.dtype == torch.bfloat16 else piece
                    writer.write(raw.numpy())
    finally:
        infos = [writer.close() for _, _, writer in parts]
    for (field, flat, _), info in zip(parts, infos):
        out["fields"][field.name] = {"dtype": field.dtype.str, "torch_dtype": torch_name(flat.dtype),
                                     "width": field.width, **info}
    return out


# ---------------------------------------------------------------------------------------------
# Reading


class VerifiedFile:
    """A field file of a saved shard, read by byte ranges whose blocks are checked against its
    block index (itself checked against the manifest) the first time they are read. counter: the
    load's context, shared by its files: "bytes_read" (added to), and optionally "interrupt", asked
    before each read: True raises StopRequested (a stop signal during a resume's load)."""

    def __init__(self, path: str, info: dict[str, Any], counter: dict[str, Any]) -> None:
        self.path, self.info, self.counter = path, info, counter
        try:
            with open(path + ".sha256", "rb") as f:
                index = f.read()
            self.size = os.path.getsize(path)
        except OSError as exc:
            raise CheckpointDamaged(f"checkpoint file {path} cannot be read: {exc}") from exc
        if hashlib.sha256(index).hexdigest() != info["blocks_sha256"] or self.size != info["bytes"]:
            raise CheckpointDamaged(f"checkpoint file {path} fails its checksum (corrupt or truncated): "
                                  f"{self.size} bytes, the manifest says {info['bytes']}; or its block index differs")
        self.digests = [index[i:i + 32] for i in range(0, len(index), 32)]
        self.f = open(path, "rb", buffering=0)

    def read(self, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) of the file (a view of a new writable buffer: no further copy), every
        block they touch verified."""
        interrupt = self.counter.get("interrupt")
        if interrupt is not None and interrupt():
            raise StopRequested("the resume's load")
        b0, b1 = lo // BLOCK, -(-hi // BLOCK)
        start = b0 * BLOCK
        buf = bytearray(min(b1 * BLOCK, self.size) - start)
        data = memoryview(buf)
        got = os.preadv(self.f.fileno(), [data], start) if len(buf) else 0
        self.counter["bytes_read"] += got
        if got != len(buf):
            raise CheckpointDamaged(f"checkpoint file {self.path} fails its checksum (corrupt or truncated): "
                                    f"read {got} of {len(buf)} bytes at {start}")
        for b in range(b0, b1):
            chunk = data[(b - b0) * BLOCK:(b - b0 + 1) * BLOCK]
            if b >= len(self.digests) or hashlib.sha256(chunk).digest() != self.digests[b]:
                raise CheckpointDamaged(f"checkpoint file {self.path} fails its checksum (corrupt or truncated) "
                                      f"in bytes {b * BLOCK}..{b * BLOCK + len(chunk)}")
        return data[lo - start:hi - start]

    def close(self) -> None:
        self.f.close()


def files_damage(ckpt: str, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the files of a checkpoint whose manifest reads (one missing, of another
    size, or failing its sha256: the trainer file whole, a shard's block index and every block), or
    None when every file checks. Each file is read in BLOCK pieces (no copy of a shard); a save
    over an existing step asks it (saver.py), so a damaged checkpoint is moved aside, never
    overwritten."""
    for name, want in (manifest.get("files") or {}).items():
        path = os.path.join(ckpt, name)
        try:
            h, size = hashlib.sha256(), 0
            with open(path, "rb") as f:
                while chunk := f.read(BLOCK):
                    h.update(chunk)
                    size += len(chunk)
        except OSError as exc:
            return f"{path} cannot be read: {exc}"
        if size != want.get("bytes") or h.hexdigest() != want.get("sha256"):
            return f"{path} fails its checksum ({size} bytes, the manifest says {want.get('bytes')})"
    for shard, info in (manifest.get("shards") or {}).items():
        for part in ("fields", "pending"):
            for k, want in (info.get(part) or {}).items():
                if not isinstance(want, dict) or "blocks_sha256" not in want:
                    continue
                path = os.path.join(ckpt, shard, f"{k}.bin")
                try:
                    f = VerifiedFile(path, want, {"bytes_read": 0})
                    try:
                        for lo in range(0, f.size, PIECE_BYTES):
                            f.read(lo, min(lo + PIECE_BYTES, f.size))
                    finally:
                        f.close()
                except (CheckpointDamaged, OSError) as exc:
                    return str(exc)
    return None


def _plan(saved_world: int, rank: int, world: int) -> list[tuple[int, int, int]]:
    """What rank `rank` of `world` reads of a checkpoint saved at `saved_world`: (saved rank r, m,
    c): from shard r, the rows with q = c (mod 2^m) of every table (m = -1: every row, kept by
    ownership piece by piece)."""
    if world % saved_world == 0 and (world // saved_world) & (world // saved_world - 1) == 0:
        k = world // saved_world  # W' = 2^m W: one shard, a contiguous part of each table
        r = rank % saved_world
        return [(r, k.bit_length() - 1, (rank - r) // saved_world)]
    if saved_world % world == 0:  # W' divides W: whole shards
        return [(r, 0, 0) for r in range(rank, saved_world, world)]
    g = math.gcd(saved_world, world)
    return [(r, -1, 0) for r in range(saved_world) if (r - rank) % g == 0]


def read_shards(ckpt: str, manifest: dict[str, Any], store: ShardStore, counter: dict[str, int]) -> int:
    """Copy the rows this rank owns from the saved shards into store; returns how many."""
    saved_world = int(manifest["world_size"])
    table_rows = list(manifest["table_rows"])
    s = store.sharding
    loaded = 0
    want = {f.name: t for f, t in fields(store)}
    sink = None
    if store.tier is not None:  # the shard on disk: every region written once, through buckets (buckets.py)
        per_row = sum(t.element_size() * max(t[:1].numel(), 1) for t in want.values())
        sink = BucketedLoad(store.tier, s.local_rows, max(piece_bytes(store) // per_row, 1), want)
    try:
        loaded = _read_shards(ckpt, manifest, store, counter, want, sink, saved_world, table_rows)
        if sink is not None:
            sink.finish()
    finally:
        if sink is not None:
            sink.close()
    return loaded


def _read_shards(ckpt: str, manifest: dict[str, Any], store: ShardStore, counter: dict[str, int],
                 want: dict[str, torch.Tensor], sink: BucketedLoad | None, saved_world: int, table_rows: list[int]) -> int:
    s = store.sharding
    loaded = 0
    for r, m, c in _plan(saved_world, s.rank, s.world):
        name = shard_dir(r, saved_world)
        info = manifest["shards"].get(name)
        if info is None:
            raise CheckpointDamaged(f"checkpoint {ckpt}: manifest lists no shard {name}")
        if set(info["fields"]) != set(want):
            raise CheckpointError(f"{os.path.join(ckpt, name)}: saved fields {sorted(info['fields'])} do not "
                                  f"match this run's {sorted(want)} (another sparse optimizer?)")
        files = {k: VerifiedFile(os.path.join(ckpt, name, f"{k}.bin"), v, counter) for k, v in info["fields"].items()}
        try:
            loaded += _read_one(files, info, table_rows, saved_world, r, m, c, store, want, sink)
        finally:
            for f in files.values():
                f.close()
    return loaded


def _pieces(table_rows: list[int], saved_world: int, r: int, m: int, c: int,
            step: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(table, its rows in shard r, the table's first row in the shard's files, first q, count)
    of every piece this reader takes from shard r, in file order."""
    seg_start = 0
    for t, rows in enumerate(table_rows):
        n = rows_on_rank(rows, r, saved_world)
        lo, hi = (0, n) if m <= 0 else q_range(n, m, c)
        for start in range(lo, hi, step):
            yield t, n, seg_start, start, min(step, hi - start)
        seg_start += n


def _read_piece(files: dict[str, VerifiedFile], info: dict[str, Any], first: int,
                count: int) -> dict[str, torch.Tensor]:
    """Rows first..first+count-1 of every field file, verified, as tensors of their saved dtype."""
    out = {}
    for name, f in files.items():
        meta = info["fields"][name]
        dtype, width = np.dtype(meta["dtype"]), meta["width"]
        rb = dtype.itemsize * width
        arr = np.frombuffer(f.read(first * rb, (first + count) * rb), dtype=dtype)
        out[name] = _to_tensor(arr.reshape(count, width) if width > 1 else arr, saved_dtype(meta))
    return out


_read_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-read")


def _read_one(files: dict[str, VerifiedFile], info: dict[str, Any], table_rows: list[int], saved_world: int,
              r: int, m: int, c: int, store: ShardStore, want: dict[str, torch.Tensor],
              sink: BucketedLoad | None = None) -> int:
    """The rows of shard r this rank takes. The next piece is read and verified in a thread (file
    reads and sha256 release the GIL) while this one is scattered: two pieces of rows in memory at
    most, each at most PIECE_BYTES per field."""
    s = store.sharding
    loaded = 0
    widest = max(np.dtype(v["dtype"]).itemsize * v["width"] for v in info["fields"].values())
    pieces = list(_pieces(table_rows, saved_world, r, m, c, max(piece_bytes(store) // widest, 1)))
    pending: Future | None = None
    try:
        for k, (t, n, seg_start, start, count) in enumerate(pieces):
            if pending is None:
                pending = _read_pool.submit(_read_piece, files, info, seg_start + start, count)
            values_of, pending = pending.result(), None
            if k + 1 < len(pieces):
                _, _, seg2, start2, count2 = pieces[k + 1]
                pending = _read_pool.submit(_read_piece, files, info, seg2 + start2, count2)
            q = q_in_order(n, start, count)
            ids = torch.from_numpy(r + q * saved_world)
            gids = s.global_ids(ids, torch.full_like(ids, t))
            keep = s.owner(gids) == s.rank if m < 0 else None
            idx = s.local_index(gids if keep is None else gids[keep])
            for name, values in values_of.items():
                if keep is not None:
                    values = values[keep]
                dest = want[name]
                values = _converted(values, dest.dtype, files[name].path)
                if sink is not None:
                    sink.add(name, idx, values)
                    continue
                with torch.no_grad():
                    flat = dest.reshape(dest.shape[0], -1) if dest.dim() > 1 else dest
                    flat.index_copy_(0, idx.to(dest.device), values.reshape((-1,) + tuple(flat.shape[1:])).to(dest.device))
            loaded += int(idx.numel())
    finally:
        if pending is not None:  # an error here: the read in flight ends before its files close
            pending.exception()
    return loaded


def _to_tensor(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The saved values as a tensor of the dtype they were saved from (bf16 from its raw 2 bytes);
    a writable array is used in place, a read-only one copied."""
    if not arr.flags.writeable:
        arr = arr.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _converted(values: torch.Tensor, dtype: torch.dtype, path: str) -> torch.Tensor:
    """Saved values as this run's dtype (see the module doc: exact when wider, to nearest when
    narrower; a value float16 cannot hold is refused). The same dtype: the values themselves."""
    if values.dtype == dtype:
        return values
    out = values.to(dtype)
    if dtype.is_floating_point and not bool(torch.isfinite(out).eq(torch.isfinite(values)).all()):
        worst = float(values.float().abs().max())
        raise CheckpointError(f"{path}: saved {torch_name(values.dtype)} values (|value| up to {worst:.6g}) "
                              f"do not fit in {torch_name(dtype)}: resume with the embedding.dtype they were "
                              "saved with")
    return out
