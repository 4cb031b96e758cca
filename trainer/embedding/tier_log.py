"""The file operations of embedding.store=disk's tier (tier.py's DiskTier) that go around the
mapping: the row cache's changed rows appended to `log.bin` in whole-page O_DIRECT writes (nothing
read first, no page kept in RAM), then merged into `rows.bin` in sequential pieces read and written
the same way; a field of every record set the same way (`_fill`).

The log has two halves of `log_half` records (the second starts on a page): the row cache appends
to one while the other, full, is merged into the file, beside the steps where the tier reads
through io_uring (`merge_beside`, on the tier's merging thread with a ring of its own), else on the
step's thread (`merge`). writelog.py says when.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
from concurrent.futures import Future
from typing import Callable

import numpy as np
import torch

CHUNK = mmap.PAGESIZE  # bytes: the unit the file is mapped, read and unmapped in (a page)
APPEND_BYTES = 4 << 20  # the log is appended, and the file merged, in I/Os of at most this (or one record unit)
FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def record_unit(record: int) -> int:
    """Bytes of the smallest run of whole records that starts and ends on a page."""
    return record * CHUNK // math.gcd(record, CHUNK)


def log_records(half: int, record: int) -> int:
    """Records of a log file of two halves of `half` records each, the second starting on a page."""
    per = record_unit(record) // record
    return -(-half // per) * per + half


class TierLog:
    """DiskTier's log (a mixin: the files, the buffers and the reads ahead are DiskTier's)."""

    def log_view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Field `name` of the log's records, shaped as `like` (alloc's view of it) per row."""
        return self.view(self.log.tensor, name, like)

    def rotate(self, half: int) -> None:
        """Appends go to the start of `half` (0 or 1) from now on (empty: reset_half)."""
        self.log_end = self.log_starts[half]
        self.log_limit = self.log_end + self.log_half
        self._tail = b""

    def append(self, parts: dict[str, torch.Tensor]) -> int:
        """Append n records to the log's current half from `parts` ({field: [n, ...] values});
        returns the first one's index. Every write covers whole pages (the last page's records
        already written are kept in RAM and written again with it), so it goes straight to the
        disk (O_DIRECT): nothing is read first and no page stays in RAM. In pieces of APPEND_BYTES."""
        f, buf = self.log, self._buf
        n = next(iter(parts.values())).shape[0]
        if self.log_end + n > self.log_limit:
            raise ValueError(f"tier: {n} records do not fit in the log's half ({self.log_limit - self.log_end} "
                             f"of {self.log_half} free)")
        first, rec = self.log_end, f.row_bytes
        room = torch.frombuffer(buf, dtype=torch.uint8)
        step = max(1, APPEND_BYTES // rec)
        staged = torch.empty(min(step, n), rec, dtype=torch.uint8)
        for lo in range(0, n, step):
            k = min(step, n - lo)
            for name, values in parts.items():
                self.view(staged[:k], name, values).copy_(values[lo:lo + k])
            start = self.log_end * rec
            page = start // CHUNK * CHUNK
            head = start - page  # the last page's bytes already in the log
            buf[:head] = self._tail
            end = head + k * rec
            room[head:end] = staged[:k].view(-1)
            size = -(-end // CHUNK) * CHUNK
            full_io(os.pwritev, f.fd, memoryview(buf)[:size], page, f.path)
            self._tail = bytes(buf[end // CHUNK * CHUNK:end])
            self.log_end += k
        return first

    def merge(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """file[rows] = log[at], rows sorted and distinct, on this (the step's) thread: _merge's
        pieces, each piece's log records read ahead (the tier's ring or threads) while the piece
        is read."""
        self._evict()  # none of the file's pages stay mapped while it is written around the mapping

        def begin(at_piece: torch.Tensor) -> Callable[[], torch.Tensor]:
            futures = self.prefetch(at_piece, log=True, keep=True)
            return lambda: (self.ready(), torch.cat([g.result() for g in futures]))[1]
        self._merge(rows, at, begin)
        self._evict()

    def merge_beside(self, rows: torch.Tensor, at: torch.Tensor) -> Future:
        """merge, on the tier's merging thread (the steps go on): the log's records read through
        its own ring, nothing of the step's reads or mappings touched. Only while neither the
        file's records `rows` nor the log's records `at` are written otherwise (writelog.py)."""
        rec, log = self.log.row_bytes, self.log

        def begin(at_piece: torch.Tensor) -> Callable[[], torch.Tensor]:
            def read() -> torch.Tensor:
                out = torch.empty(at_piece.numel(), rec, dtype=torch.uint8)
                self._merge_ring.read(log.read_fd, at_piece.numpy() * rec, rec, out.data_ptr(), log.path)
                return out
            return read
        return self._merger.submit(self._merge, rows, at, begin)

    def _merge(self, rows: torch.Tensor, at: torch.Tensor, begin) -> None:
        """file[rows] = log[at] in pieces of up to APPEND_BYTES (at least one record unit), each
        rewritten in the merging buffer (_rewrite); begin(at of a piece)() gives the piece's log
        records."""
        f, buf = self.file, self._merge_buf
        rec = f.row_bytes
        unit = record_unit(rec)
        size = max(1, APPEND_BYTES // unit) * unit  # a piece starts on a page and on a record
        start = rows.numpy() * rec
        lo, n = 0, rows.numel()
        while lo < n:
            base = int(start[lo]) // unit * unit
            hi = max(lo + 1, int(np.searchsorted(start + rec, base + size, side="right")))
            end = -(-(int(start[hi - 1]) + rec) // CHUNK) * CHUNK
            records, at_rows = begin(at[lo:hi]), rows[lo:hi] - base // rec
            self._rewrite(buf, base, end, lambda room: room.index_copy_(0, at_rows, records()))
            lo = hi

    def _rewrite(self, buf: mmap.mmap, base: int, end: int, change: Callable[[torch.Tensor], object]) -> None:
        """Bytes [base, end) of the file (pages, starting on a record) read into buf, change(their
        whole records [k, record bytes]) and written back: one sequential read and one write,
        straight to the disk (O_DIRECT) where the file system allows it."""
        f = self.file
        span = memoryview(buf)[:end - base]
        full_io(os.preadv, f.fd, span, base, f.path)
        k = min(f.tensor.shape[0] - base // f.row_bytes, (end - base) // f.row_bytes)
        change(torch.frombuffer(buf, dtype=torch.uint8)[:k * f.row_bytes].view(k, f.row_bytes))
        full_io(os.pwritev, f.fd, span, base, f.path)

    def _fill(self, off: int, nbytes: int, dtype: torch.dtype, fill: float) -> None:
        """Every record's field (off, nbytes, dtype) set to `fill`: the file read and written back in
        sequential pieces (_rewrite), not through the mapping, whose faults would read
        the pages the rows' initial values were written to one 4 KiB read at a time (MADV_RANDOM;
        in a memory cgroup they are no longer in RAM: ~45 MB/s here, against ~1 GB/s)."""
        self.release()  # nothing mapped while the file is written around the mapping
        f, buf = self.file, self._merge_buf
        for base in range(0, f.tensor.shape[0] * f.row_bytes, len(buf)):
            self._rewrite(buf, base, min(base + len(buf), f.nbytes),
                          lambda room: room[:, off:off + nbytes].view(dtype).fill_(fill))

    def reset_half(self, half: int) -> None:
        """Forget the records of the log's `half` (merged into the file): its pages are given back
        (a hole punched: they leave the page cache unwritten and the next appends read nothing
        back); the reads in flight finish first (they may be reading it)."""
        self.ready()
        f, lo = self.log, self.log_starts[half] * self.log.row_bytes
        hi = self.log_starts[1] * f.row_bytes if half == 0 else f.nbytes
        _libc.fallocate(f.fd, FALLOC_PUNCH_HOLE, lo, hi - lo)  # where refused, the records stay (never read again)
        pages = slice(lo // CHUNK, -(-hi // CHUNK))
        self.mapped_bytes -= int(f.mapped[pages].sum()) * CHUNK
        f.mapped[pages] = False


def full_io(call, fd: int, view: memoryview, offset: int, path: str) -> None:
    """os.preadv / os.pwritev of all of `view` at `offset`, or OSError."""
    done = call(fd, [view], offset)
    if done != len(view):
        raise OSError(f"tier: {call.__name__} moved {done} of {len(view)} bytes at {offset} of {path}")
