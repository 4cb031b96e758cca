"""embedding.store=disk: the tier's records read and written around the mapping, in sequential
pieces of whole pages (O_DIRECT where the file system has it), for everything that reads or writes
much of the file at once: the initial rows, the optimizer state's initial value, the changed
slots written back before a direct phase, a checkpoint's save (`read_records`) and load (`write`),
the best-model snapshot's marks (`fill`), and the log's merges (tier_log.py).

Why not through the mapping: under MADV_RANDOM (the steps' reads are scattered) each 4 KiB fault is
one read, ~35-45 MB/s in a memory cgroup here, where the pages are no longer in RAM; under
MADV_SEQUENTIAL faults read ahead but still one page table entry at a time, 23-200 MB/s, and
every page touched stays mapped (charged to the process's RSS) until it is unmapped. A piece here
is one read and at most one write of up to APPEND_BYTES, ~1 GB/s, with nothing mapped and nothing
left in the page cache; memory: one piece buffer (`_io_buf`).

A piece starts on a page and on a record (a record unit: record_unit), and for scattered rows it
spans only the pages from its first row to its last, so a few rows cost a few small I/Os, not a
sweep of the file.
"""
from __future__ import annotations

import math
import mmap
import os
from typing import Callable, Iterator

import numpy as np
import torch

CHUNK = mmap.PAGESIZE  # bytes: the unit the file is mapped, read and unmapped in (a page)
APPEND_BYTES = 4 << 20  # the log is appended, and the file read and written, in I/Os of at most this (or one record unit)


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


class TierIO:
    """DiskTier's sequential pieces (a mixin: the files, the layout and the mappings are DiskTier's)."""

    def name_of(self, t: torch.Tensor) -> str:
        """The field whose view of the file's records (alloc's) t is, [rows, ...] as alloc shaped
        it or flattened to [rows, values]; ValueError for any other tensor."""
        records = self.file.tensor
        off = t.data_ptr() - records.data_ptr()
        size = t.element_size()
        for name, (foff, nbytes, dtype) in self._fields.items():
            if foff == off and dtype == t.dtype and t.shape[0] == records.shape[0] and \
                    (t.shape[0] < 2 or t.stride(0) * size == records.shape[1]) and \
                    int(np.prod(t.shape[1:], dtype=np.int64)) * size == nbytes:
                return name
        raise ValueError(f"tier: a tensor {tuple(t.shape)} {t.dtype} at byte {off} of the records is not one of "
                         f"the file's fields ({sorted(self._fields)})")

    def read_records(self, lo: int, hi: int) -> torch.Tensor:
        """[hi - lo, record bytes] copies of the file's records lo..hi-1, read in sequential pieces
        (the changed slots must be in the file: a direct phase)."""
        f = self.file
        rec = f.row_bytes
        out = torch.empty(hi - lo, rec, dtype=torch.uint8)
        if hi <= lo:
            return out

        def copy(first: int) -> Callable[[torch.Tensor], None]:
            def take(room: torch.Tensor) -> None:
                a, b = max(lo, first), min(hi, first + room.shape[0])
                out[a - lo:b - lo] = room[a - first:b - first]
            return take
        for base, end in self._range(lo, hi):
            self._rewrite(f, self._io_buf, base, end, copy(base // rec), write=False)
        return out

    def write(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Records `rows` (sorted, distinct) of the file set from `parts` ({field: [n, ...]
        values}), the other fields kept: each piece of the file that holds some of them read,
        changed and written back. Nothing of the file stays mapped (what was is unmapped first: it
        is written around the mapping)."""
        if rows.numel() == 0:
            return
        self._evict()
        f = self.file
        rec = f.row_bytes
        for lo, hi, base, end in self._spans(rows.numpy() * rec):
            at = rows[lo:hi] - base // rec

            def change(room: torch.Tensor, at=at, a=lo, b=hi) -> None:
                for name, values in parts.items():
                    self.view(room, name, values).index_copy_(0, at, values[a:b])
            self._rewrite(f, self._io_buf, base, end, change)

    def fill(self, name: str, value: float, log: bool = False, lo: int = 0, hi: int | None = None) -> None:
        """Field `name` of records lo..hi-1 (default: all) of the file (of the log: `log`) set to
        `value`, in sequential pieces."""
        off, nbytes, dtype = self._fields[name]
        self._evict()  # nothing mapped while the file is written around the mapping
        f = self.log if log else self.file
        rec = f.row_bytes
        hi = f.tensor.shape[0] if hi is None else hi
        if hi <= lo:
            return

        def change(first: int) -> Callable[[torch.Tensor], None]:
            def put(room: torch.Tensor) -> None:
                a, b = max(lo, first) - first, min(hi, first + room.shape[0]) - first
                room[a:b, off:off + nbytes].view(dtype).fill_(value)
            return put
        for base, end in self._range(lo, hi):
            self._rewrite(f, self._io_buf, base, end, change(base // rec))

    def _spans(self, starts: np.ndarray) -> Iterator[tuple[int, int, int, int]]:
        """(lo, hi, base, end): the records at byte offsets starts[lo:hi] (sorted) lie in the file's
        bytes [base, end), a piece that starts on a record unit, holds at most the piece buffer and
        ends on the page after its last record (scattered rows: a few small pieces)."""
        rec = self.file.row_bytes
        unit, size = record_unit(rec), piece_size(rec)
        lo, n = 0, starts.size
        while lo < n:
            base = int(starts[lo]) // unit * unit
            hi = max(lo + 1, int(np.searchsorted(starts + rec, base + size, side="right")))
            yield lo, hi, base, -(-(int(starts[hi - 1]) + rec) // CHUNK) * CHUNK
            lo = hi

    def _range(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """[base, end) byte ranges of the pieces covering every record lo..hi-1 (hi > lo), in order."""
        rec = self.file.row_bytes
        unit, size = record_unit(rec), piece_size(rec)
        last = hi * rec
        for base in range(lo * rec // unit * unit, last, size):
            yield base, min(-(-last // CHUNK) * CHUNK, base + size)

    def _rewrite(self, f, buf: mmap.mmap, base: int, end: int, change: Callable[[torch.Tensor], object],
                 write: bool = True) -> None:
        """Bytes [base, end) of file f (pages, starting on a record) read into buf, change(their
        whole records [k, record bytes]) and written back (write): one sequential read and one
        write, straight to the disk (O_DIRECT) where the file system allows it."""
        span = memoryview(buf)[:end - base]
        full_io(os.preadv, f.fd, span, base, f.path)
        k = min(f.tensor.shape[0] - base // f.row_bytes, (end - base) // f.row_bytes)
        change(torch.frombuffer(buf, dtype=torch.uint8)[:k * f.row_bytes].view(k, f.row_bytes))
        if write:
            full_io(os.pwritev, f.fd, span, base, f.path)


def full_io(call, fd: int, view: memoryview, offset: int, path: str) -> None:
    """os.preadv / os.pwritev of all of `view` at `offset`, or OSError."""
    done = call(fd, [view], offset)
    if done != len(view):
        raise OSError(f"tier: {call.__name__} moved {done} of {len(view)} bytes at {offset} of {path}")
