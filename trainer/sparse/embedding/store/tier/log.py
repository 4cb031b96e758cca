"""The write-back log of embedding.store=disk's tier (tier.py's DiskTier), written around the
mapping: the row cache's changed rows appended to `log.bin` in whole-page O_DIRECT writes (nothing
read first, no page kept in RAM), then merged into `rows.bin` in sequential pieces read and written
the same way (tier_io.py), or, for a piece whose rows are scattered (a big file, a small log: one
row in tens of pages), only the pages that hold them, many in flight through the merge's ring.

The log has two halves of `log_half` records (the second starts on a page): the row cache appends
to one while the other, full, is merged into the file, beside the steps where the tier reads
through io_uring (`merge_beside`, on the tier's merging thread with a ring of its own), else on the
step's thread (`merge`). writelog.py says when.
"""
from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future
from typing import Callable

import numpy as np
import torch

from .records import APPEND_BYTES, CHUNK, full_io, record_unit

FALLOC_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


# a page read and written back at random, many in flight, costs about as much as this many pages
# read and written in sequence (this disk: ~100k random 4 KiB reads/s and ~40k writes/s at 64 in
# flight, 1.1-1.5 GB/s sequential: ~35 against ~6 µs a page)
SCATTERED_PAGE_COST = 4


def _pages_of(starts: np.ndarray, record: int) -> np.ndarray:
    """The distinct pages (sorted) that hold the records at byte offsets `starts`."""
    return np.unique(np.concatenate([starts // CHUNK, (starts + record - 1) // CHUNK]))


def log_records(half: int, record: int) -> int:
    """Records of a log file of two halves of `half` records each, the second starting on a page."""
    per = record_unit(record) // record
    return -(-half // per) * per + half


class TierLog:
    """DiskTier's log (a mixin: the files, the buffers and the reads ahead are DiskTier's)."""

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
            futures = self.prefetch(at_piece, log=True)
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
        rewritten in the merging buffer (tier_io's _rewrite), or, where its rows are scattered
        (fewer than 1/SCATTERED_PAGE_COST of its pages hold one) and the merge has a ring, only
        the pages that hold them (_patch_pages); begin(at of a piece)() gives the piece's log
        records."""
        f = self.file
        starts = rows.numpy() * f.row_bytes
        for lo, hi, base, end in self._spans(starts):
            records, at_rows = begin(at[lo:hi]), rows[lo:hi] - base // f.row_bytes
            # n records hold at least n x record / page pages: no count needed where that is dense already
            sparse = self._merge_ring is not None and \
                (hi - lo) * f.row_bytes // CHUNK * SCATTERED_PAGE_COST < (end - base) // CHUNK
            pages = _pages_of(starts[lo:hi], f.row_bytes) if sparse else None
            if pages is not None and pages.size * SCATTERED_PAGE_COST < (end - base) // CHUNK:
                self._patch_pages(f, starts[lo:hi], pages, records)
            else:
                self._rewrite(f, self._merge_buf, base, end, lambda room: room.index_copy_(0, at_rows, records()))

    def _patch_pages(self, f, starts: np.ndarray, pages: np.ndarray, records: Callable[[], torch.Tensor]) -> None:
        """The records at byte offsets `starts` of file f set to records() [n, record bytes]: the
        pages that hold them (`pages`, sorted, at most a piece buffer of them) read into the
        merging buffer, one after the other, through the merge's ring (many in flight), the
        records set there, the pages written back the same way."""
        room = torch.frombuffer(self._merge_buf, dtype=torch.uint8)
        addr = room.data_ptr()
        self._merge_ring.read(f.fd, pages * CHUNK, CHUNK, addr, f.path)
        first = starts // CHUNK  # a record's first page; its second, if any, follows it in `pages`
        at = np.searchsorted(pages, first) * CHUNK + (starts - first * CHUNK)  # where the record is in the buffer
        where = torch.from_numpy(at)[:, None] + torch.arange(f.row_bytes)
        room[where.view(-1)] = records().reshape(-1)
        self._merge_ring.write(f.fd, pages * CHUNK, CHUNK, addr, f.path)

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

