"""The write-back log's file operations of embedding.store=disk's tier (tier.py's DiskTier): the
row cache's changed rows appended to `log.bin` in whole-page O_DIRECT writes (nothing read first, no
page kept in RAM), then merged into `rows.bin` in sequential pieces read and written the same way.
"""
from __future__ import annotations

import math
import mmap
import os

import numpy as np
import torch

CHUNK = mmap.PAGESIZE  # bytes: the unit the file is mapped, read and unmapped in (a page)
APPEND_BYTES = 4 << 20  # the log is appended in writes of at most this (its aligned buffer)


class TierLog:
    """DiskTier's log (a mixin: the files, the buffer and the reads ahead are DiskTier's)."""

    def log_view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Field `name` of the log's records, shaped as `like` (alloc's view of it) per row."""
        return self.view(self.log.tensor, name, like)

    def append(self, parts: dict[str, torch.Tensor]) -> int:
        """Append n records to the log from `parts` ({field: [n, ...] values}); returns the first
        one's index. Every write covers whole pages (the last page's records already written are
        kept in RAM and written again with it), so it goes straight to the disk (O_DIRECT):
        nothing is read first and no page stays in RAM. In pieces of APPEND_BYTES."""
        f, buf = self.log, self._buf
        n = next(iter(parts.values())).shape[0]
        if self.log_end + n > f.tensor.shape[0]:
            raise ValueError(f"tier: {n} records do not fit in the log ({self.log_end} of {f.tensor.shape[0]} used)")
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
        """file[rows] = log[at], rows sorted and distinct: the file is read and written in
        pieces of up to APPEND_BYTES, each one sequential read and one sequential write straight
        to the disk (O_DIRECT), the piece's log records copied by the threads meanwhile. A piece
        whose rows are sparse (under 1 per 16 pages) is written through the mapping instead, its
        pages read by the threads first."""
        f, buf = self.file, self._buf
        self._evict()  # none of the file's pages stay mapped while it is written around the mapping
        rec = f.row_bytes
        unit = rec * CHUNK // math.gcd(rec, CHUNK)  # a piece starts on a page and on a record
        size = APPEND_BYTES // unit * unit
        start = rows.numpy() * rec
        lo, n = 0, rows.numel()
        while lo < n:
            base = int(start[lo]) // unit * unit
            hi = max(lo + 1, int(np.searchsorted(start + rec, base + size, side="right"))) if size else lo + 1
            end = -(-(int(start[hi - 1]) + rec) // CHUNK) * CHUNK
            r = rows[lo:hi]
            logged = self.prefetch(at[lo:hi], log=True, keep=True)  # the piece's log records, copied by the threads
            if not size or end - base > len(buf) or (hi - lo) * 16 < (end - base) // CHUNK:
                self.prefetch(r)
                self.ready()
                f.tensor.index_copy_(0, r, torch.cat([g.result() for g in logged]))
            else:
                span = memoryview(buf)[:end - base]
                full_io(os.preadv, f.fd, span, base, f.path)
                self.ready()
                room = torch.frombuffer(buf, dtype=torch.uint8)[:(end - base) // rec * rec].view(-1, rec)
                room.index_copy_(0, r - base // rec, torch.cat([g.result() for g in logged]))
                full_io(os.pwritev, f.fd, span, base, f.path)
            lo = hi
        self._evict()

    def reset_log(self) -> None:
        """Empty the log (its records merged into the file or no longer wanted): the file is cut
        to nothing and extended again, so its pages leave the page cache unwritten and the next
        appends fill holes (no page read back)."""
        self.ready()
        f = self.log
        self.log_end, self._tail = 0, b""
        os.truncate(f.path, 0)
        os.truncate(f.path, f.nbytes)
        self.mapped_bytes -= int(f.mapped.sum()) * CHUNK
        f.mapped[:] = False


def full_io(call, fd: int, view: memoryview, offset: int, path: str) -> None:
    """os.preadv / os.pwritev of all of `view` at `offset`, or OSError."""
    done = call(fd, [view], offset)
    if done != len(view):
        raise OSError(f"tier: {call.__name__} moved {done} of {len(view)} bytes at {offset} of {path}")
