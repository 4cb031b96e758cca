"""embedding.store=disk: one file of fixed-size records (RecordFile), mapped into memory and read
and written around the mapping in sequential pieces of whole pages (O_DIRECT where the file system
has it). DiskTier (disk.py) holds two of them, `rows.bin` and the write-back log's `log.bin`
(writelog.py), and everything that reads or writes much of a file at once goes through these
pieces: the initial rows, the optimizer state's initial value, the changed slots written back
before a direct phase, a checkpoint's save (`DiskTier.read_records`) and load (`DiskTier.write`),
the best-model snapshot's marks (`DiskTier.fill`), and the log's merges (WriteLog).

Why not through the mapping: under MADV_RANDOM (the steps' reads are scattered) each 4 KiB fault is
one read, ~35-45 MB/s in a memory cgroup here, where the pages are no longer in RAM; under
MADV_SEQUENTIAL faults read ahead but still one page table entry at a time, 23-200 MB/s, and
every page touched stays mapped (charged to the process's RSS) until it is unmapped. A piece here
is one read and at most one write of up to APPEND_BYTES, ~1 GB/s, with nothing mapped and nothing
left in the page cache; memory: one piece buffer (`piece_buffer`) per user.

A piece starts on a page and on a record (a record unit: record_unit), and for scattered rows it
spans only the pages from its first row to its last, so a few rows cost a few small I/Os, not a
sweep of the file.
"""
from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .....base.core.disk import free_share
from .....base.core.errors import ResumeAdvised
from .....base.core.progress import fmt_bytes

CHUNK = mmap.PAGESIZE  # bytes: the unit the file is mapped, read and unmapped in (a page)
APPEND_BYTES = 4 << 20  # the log is appended, and the file read and written, in I/Os of at most this (or one record unit)
MADV_RANDOM = 1  # a fault reads its page only (not the kernel's read-around window, 128 KiB)
MADV_SEQUENTIAL = 2  # a fault reads ahead (a direct phase: sequential)
MADV_DONTNEED = 4
FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
FALLOC_ZERO_RANGE = 0x01 | 0x10  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_ZERO_RANGE: zeros, the blocks kept

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def madvise(addr: int, length: int, advice: int) -> int:
    """0, or the errno of madvise(addr, length, advice)."""
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def record_unit(record: int) -> int:
    """Bytes of the smallest run of whole records that starts and ends on a page."""
    return record * CHUNK // math.gcd(record, CHUNK)


def piece_size(record: int) -> int:
    """Bytes of a piece: whole record units, about APPEND_BYTES (at least one unit)."""
    unit = record_unit(record)
    return max(1, APPEND_BYTES // unit) * unit


def piece_buffer(record: int) -> mmap.mmap:
    """A page-aligned buffer of one piece."""
    return mmap.mmap(-1, piece_size(record))


def log_records(half: int, record: int) -> int:
    """Records of a log file of two halves of `half` records each, the second starting on a page."""
    per = record_unit(record) // record
    return -(-half // per) * per + half


def record_layout(fields: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[dict[str, tuple[int, int, torch.dtype]], int]:
    """({name: (offset, bytes, dtype)}, record bytes) of DiskTier.define's record: each field at an
    offset aligned to its element size, the record padded to the largest; empty fields left out."""
    off, align, layout = 0, 1, {}
    for name, tail, dtype in fields:
        size = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(np.prod(tail, dtype=np.int64)) * size
        if nbytes == 0:
            continue
        off = -(-off // size) * size
        layout[name] = (off, nbytes, dtype)
        off, align = off + nbytes, max(align, size)
    return layout, max(-(-off // align) * align, 1)


def field_view(records: torch.Tensor, off: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The strided view of one field (offset, bytes, dtype) of [rows, record bytes] `records`."""
    return records[:, off:off + nbytes].view(dtype).view(shape)


class RecordFile:
    """A new sparse file of `rows` records of `row_bytes` (whole pages: the log's last one is
    written whole), mapped (MADV_RANDOM): the [rows, record bytes] tensor over the mapping, which
    of its pages are held mapped (`mapped`: the tier's page budget keeps it), and its whole-page
    reads and writes around the mapping (`pieces`, `spans`, `rewrite`, `punch`)."""

    def __init__(self, directory: str, name: str, rows: int, row_bytes: int) -> None:
        self.path = os.path.join(directory, name)
        self.row_bytes = row_bytes
        self.nbytes = -(-max(rows * row_bytes, 1) // CHUNK) * CHUNK
        with open(self.path, "wb") as f:
            f.truncate(self.nbytes)
            # the file's blocks taken now (ext4, xfs, tmpfs: fallocate), so a disk that cannot hold
            # the store fails here, with nothing trained, and never under a write of a later step
            # (another writer filling the disk meanwhile); where refused, it stays sparse
            self.reserved = _reserve(f.fileno(), 0, self.nbytes, self.path)
        self.array: Any = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(self.nbytes,))  # kept alive: the tensor shares its memory
        self.tensor = torch.from_numpy(self.array)[:rows * row_bytes].view(rows, row_bytes)
        self.addr = self.array.ctypes.data
        madvise(self.addr, self.nbytes, MADV_RANDOM)
        self.mapped = np.zeros(-(-self.nbytes // CHUNK), bool)  # pages we hold mapped
        self.fd = _open_direct(self.path)  # whole-page reads and writes (O_DIRECT where the file system has it)
        self.read_fd = _open_random(self.path)  # the ring's reads of single records (through the page cache)

    def chunks_of(self, rows: np.ndarray) -> np.ndarray:
        """Sorted distinct chunks holding rows (a row may straddle two)."""
        first = rows * self.row_bytes // CHUNK
        last = (rows * self.row_bytes + self.row_bytes - 1) // CHUNK
        both = first if CHUNK % self.row_bytes == 0 else np.concatenate([first, last])
        return np.unique(both)

    def spans(self, starts: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
        """(lo, hi, base, end): the records at byte offsets starts[lo:hi] (sorted) lie in the file's
        bytes [base, end), a piece that starts on a record unit, holds at most the piece buffer and
        ends on the page after its last record (scattered rows: a few small pieces)."""
        rec = self.row_bytes
        unit, size = record_unit(rec), piece_size(rec)
        lo, n = 0, starts.size
        while lo < n:
            base = int(starts[lo]) // unit * unit
            hi = max(lo + 1, int(np.searchsorted(starts + rec, base + size, side="right")))
            yield lo, hi, base, -(-(int(starts[hi - 1]) + rec) // CHUNK) * CHUNK
            lo = hi

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """[base, end) byte ranges of the pieces covering every record lo..hi-1 (hi > lo), in order."""
        rec = self.row_bytes
        unit, size = record_unit(rec), piece_size(rec)
        last = hi * rec
        for base in range(lo * rec // unit * unit, last, size):
            yield base, min(-(-last // CHUNK) * CHUNK, base + size)

    def rewrite(self, buf: mmap.mmap, base: int, end: int, change: Callable[[torch.Tensor], object],
                write: bool | None = True) -> None:
        """Bytes [base, end) (pages, starting on a record) read into buf, change(their whole
        records [k, record bytes]) and written back (write; None: where change returned true):
        one sequential read and one write, straight to the disk (O_DIRECT) where the file system
        allows it."""
        span = memoryview(buf)[:end - base]
        full_io(os.preadv, self.fd, span, base, self.path)
        k = min(self.tensor.shape[0] - base // self.row_bytes, (end - base) // self.row_bytes)
        changed = change(torch.frombuffer(buf, dtype=torch.uint8)[:k * self.row_bytes].view(k, self.row_bytes))
        if write or (write is None and changed):
            full_io(os.pwritev, self.fd, span, base, self.path)

    def punch(self, lo: int, hi: int) -> None:
        """Bytes [lo, hi) zeroed: their pages leave the page cache unwritten and read zeros. A
        reserved file keeps its blocks (FALLOC_FL_ZERO_RANGE; where the file system has no such
        call, a hole punched and the blocks taken again at once: StoreFull if another writer took
        them meanwhile); where refused, they stay as they are."""
        if self.reserved and _libc.fallocate(self.fd, FALLOC_ZERO_RANGE, lo, hi - lo) == 0:
            return
        _libc.fallocate(self.fd, FALLOC_PUNCH_HOLE, lo, hi - lo)
        if self.reserved:
            _reserve(self.fd, lo, hi - lo, self.path)

    def close(self) -> None:
        """Close the descriptors and drop the mapping (a tensor still sharing it keeps it until exit)."""
        os.close(self.fd)
        os.close(self.read_fd)
        self.tensor = torch.empty(0)
        mm = getattr(self.array, "_mmap", None)
        self.array = None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError):
                pass  # a tensor still shares it: the mapping goes with the process


def full_io(call, fd: int, view: memoryview, offset: int, path: str) -> None:
    """os.preadv / os.pwritev of all of `view` at `offset`, or OSError (StoreFull where the disk
    of the store's files is full)."""
    done = 0
    try:
        while done < len(view):  # a short write is followed by the error that cut it (a full disk)
            moved = call(fd, [view[done:]], offset + done)
            if moved <= 0:
                break
            done += moved
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFull(os.path.dirname(path), path, len(view)) from exc
        raise
    if done != len(view):
        raise OSError(f"tier: {call.__name__} moved {done} of {len(view)} bytes at {offset} of {path}")


def _reserve(fd: int, offset: int, length: int, path: str) -> bool:
    """Take the blocks of bytes [offset, offset + length) of a file (fallocate, mode 0: they read
    zeros, the size unchanged within it): True; False where the file system refuses the call;
    StoreFull where its disk has no room for them."""
    if length <= 0:
        return True
    if _libc.fallocate(fd, 0, offset, length) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSPC, errno.EDQUOT):
        raise StoreFull(os.path.dirname(path), path, length)
    return False


class StoreFull(ResumeAdvised):
    """The disk of embedding.store_dir is full (ENOSPC or the quota): one line naming the folder,
    the file, its disk's free space and what the store's files take there."""

    def __init__(self, folder: str, path: str, nbytes: int) -> None:
        size = written = 0
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            try:
                st = os.stat(os.path.join(folder, name))
            except OSError:
                continue
            size, written = size + st.st_size, written + st.st_blocks * 512
        try:
            free = fmt_bytes(free_share(folder, 1))
        except OSError:
            free = "?"
        super().__init__(
            f"embedding.store_dir {os.path.dirname(folder)}: no space left on its disk ({free} free) writing "
            f"{fmt_bytes(nbytes)} into {path}; this rank's store files there take up to {fmt_bytes(size)} "
            f"({fmt_bytes(written)} written so far): free space on that disk or set embedding.store_dir to one "
            "with room, then resume from the newest checkpoint (checkpoint.resume=auto)")


def _open_direct(path: str) -> int:
    """path opened for reading and writing with O_DIRECT, or without it where the file system
    refuses it (tmpfs): then through the page cache, with the same results."""
    try:
        return os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDWR)


def _open_random(path: str) -> int:
    """path opened for reading single records through the page cache, its read-ahead window off
    (POSIX_FADV_RANDOM: a read brings its page only, as MADV_RANDOM does for the mapping; without
    it the ring's reads read ~1.8x the pages)."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd
