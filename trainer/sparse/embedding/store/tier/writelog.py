"""embedding.store=disk: the write-back log (WriteLog), TieredStore's (tiered.py), in the tier's
`log.bin` (disk.py: DiskTier makes the file and reads it ahead; this class appends to it, merges it
into `rows.bin` and empties its halves, through the tier's files, reads and merging thread).

Why a log: writing an evicted row back in place costs a random page read and a random page write
for an 80 B record (at ~42k random writes a second, that alone capped the disk store near 0.3 of
the memory store's rate). Appended, the changed rows go out in whole pages straight to the disk
(append_records), and are merged into the file in sorted, sequential pieces (merge_records).

Where a row's newest copy is, the store's one map says (a slot >= 0, else -1 for the file): a
row in the log maps to its record's code, `code(r) = -2 - r`, below both. A record is never
rewritten in place until its half of the log is emptied, so a row appended again gets a new
record and the map points at the newest.

Two halves: rows are appended to one; when it is full, its rows' newest records (a snapshot of
the map) are merged into the file while appends go on in the other. Where the tier reads through
io_uring the merge runs beside the steps (merge_records_beside; a merge rewrites the whole file
in pieces, ~1.5 s for 400 MB, which stalled one step in ~200 when it ran on the step's thread);
it is finished (`settle`) on the step's thread, when done (`poll`, each step) or when needed:
- the other half fills: the merge must be done before that half is reused;
- the file is written otherwise (a direct phase, a call the file serves, the marks' clearing) or
  must hold every row's newest record: `merge` (which also merges the current half, on this
  thread) or `settle`.
Why this is exact while it runs: the merge writes only the file's records of the snapshot's rows
(the rest of each piece is written back as read), and none of those rows is read from the file
meanwhile: each maps to a record of the merging half (unchanged until it is emptied), to a slot
(a row loaded from the log is marked changed, so it goes back to the log, never to "the file has
it"), or to the other half. Settling forgets the snapshot's rows that still map to the record
merged (the file has it now) and keeps the reads ahead's copies it leaves good (readahead.py).
Without io_uring (the threads read through the file's mapping) the merge runs on the step's
thread, as the direct write of pages another thread is faulting in is best avoided.

How it is written: appends go to the current half in whole-page O_DIRECT writes (nothing read
first, no page kept in RAM; the last page's records already written are kept here and written
again with it); a merge rewrites the file in sequential pieces (records.py), or, for a piece whose
rows are scattered (a big file, a small log: one row in tens of pages), only the pages that hold
them, many in flight through the merge's ring (_patch_pages).
"""
from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import Future
from typing import Callable, Optional

import numpy as np
import torch

from kernels import IdSlotMap
from .disk import DiskTier
from .records import APPEND_BYTES, CHUNK, full_io, log_records, piece_buffer

# a page read and written back at random, many in flight, costs about as much as this many pages
# read and written in sequence (this disk: ~100k random 4 KiB reads/s and ~40k writes/s at 64 in
# flight, 1.1-1.5 GB/s sequential: ~35 against ~6 µs a page)
SCATTERED_PAGE_COST = 4


def code(v: torch.Tensor) -> torch.Tensor:
    """Log record r <-> its code in the map (-2 - r): below every slot and below -1 (absent)."""
    return -2 - v


def _pages_of(starts: np.ndarray, record: int) -> np.ndarray:
    """The distinct pages (sorted) that hold the records at byte offsets `starts`."""
    return np.unique(np.concatenate([starts // CHUNK, (starts + record - 1) // CHUNK]))


class WriteLog:
    """The tier's log of two halves of `capacity` records (the tier's log_rows); `where` is the
    store's map (rows -> slots or codes); `changed` is called before any record of the file or the
    log changes in place, but for a merge: `merged(rows, codes, records)` after it (rows, sorted,
    now hold in the file the records whose codes were `codes`; the log's records [records) are
    forgotten)."""

    def __init__(self, tier: DiskTier, where: IdSlotMap, changed: Callable[[], None],
                 merged: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], None]) -> None:
        self.tier, self.where, self._changed, self._merged = tier, where, changed, merged
        self.capacity = tier.log_rows
        rec = tier.log_file.row_bytes
        self.starts = (0, log_records(self.capacity, rec) - self.capacity)  # the halves' first records
        self.end = self.limit = 0  # the next record appended, the end of its half
        self._tail = b""  # the log's last page as far as it is written (a page-aligned write rewrites it)
        self._buf = mmap.mmap(-1, APPEND_BYTES + CHUNK + -(-rec // CHUNK) * CHUNK)  # the appends' page-aligned buffer
        self._merge_buf = piece_buffer(rec)  # the merges' pieces
        self.start(0)
        self.half = 0  # the half appended to
        self.beside = tier.reader == "io_uring"  # merges beside the steps (module docstring)
        self._merging: Optional[tuple] = None  # (future, rows, codes, half) of the merge running beside
        self.counts = {"appended": 0, "merges": 0, "merged": 0, "beside": 0, "wait_s": 0.0}

    @property
    def used(self) -> int:
        """Records appended to the current half since it was last emptied (the append point: `end`)."""
        return self.end - self.starts[self.half]

    @property
    def empty(self) -> bool:
        """No row's newest record is in the log."""
        return self.used == 0 and self._merging is None

    def append(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Rows (distinct) with their records' parts ({field: [n, ...]}) appended, the map pointing
        at them; the half rotated (its rows merged) whenever they would not fit."""
        n = rows.numel()
        for lo in range(0, n, self.capacity):
            k = min(self.capacity, n - lo)
            if self.used + k > self.capacity:
                self._rotate()
            first = self.append_records({name: p[lo:lo + k] for name, p in parts.items()})
            self.where.insert(rows[lo:lo + k], code(torch.arange(first, first + k)))
            self.counts["appended"] += k

    def _records(self, half: int) -> tuple[int, int]:
        first = self.starts[half]
        return first, first + self.capacity

    def _snapshot(self, half: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, sorted, and their records) of every row whose newest record is in `half`."""
        rows, v = self.where.items()
        lo, hi = self._records(half)
        at = code(v)
        mine = (v <= -2) & (at >= lo) & (at < hi)
        rows, order = torch.sort(rows[mine])
        return rows, at[mine].index_select(0, order)

    def _rotate(self) -> None:
        """The current half is full: its rows merged into the file (beside the steps where the
        tier can), appends going to the other half."""
        self.settle()  # the other half's merge: that half is needed now
        if not self.beside:
            return self._merge_now()
        rows, at = self._snapshot(self.half)
        self._merging = (self.merge_records_beside(rows, at), rows, code(at), self.half)
        self.counts["beside"] += 1
        self.half = 1 - self.half
        self.start(self.half)

    def poll(self) -> None:
        """Settle the merge running beside the steps if it is done (a step's start)."""
        if self._merging is not None and self._merging[0].done():
            self.settle()

    def settle(self) -> None:
        """Wait for the merge running beside the steps, if any, and finish it (_finish)."""
        if self._merging is None:
            return
        fut, rows, codes, half = self._merging
        self._merging = None
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException:
            self._changed()  # some pieces written: no copy is known good
            raise
        self.counts["wait_s"] += time.perf_counter() - t0
        self._finish(rows, codes, half)

    def _finish(self, rows: torch.Tensor, codes: torch.Tensor, half: int) -> None:
        """`half` merged: its rows whose newest record is still the one merged read from the file
        now; the copies kept of its records remapped; its records forgotten."""
        now, _ = self.where.lookup(rows)
        self.where.erase(rows[now == codes])
        self._merged(rows, codes, self._records(half))
        self.punch_half(half)
        self.counts["merges"] += 1
        self.counts["merged"] += rows.numel()

    def _merge_now(self) -> None:
        """The current half merged into the file on this thread, then emptied (appends start it again)."""
        rows, at = self._snapshot(self.half)
        if rows.numel():
            try:
                self.merge_records(rows, at)
            except BaseException:
                self._changed()
                raise
        self._finish(rows, code(at), self.half)
        self.start(self.half)

    def merge(self) -> None:
        """The log's newest record of each row into the file (by row, the file in order:
        merge_records), then the log emptied."""
        self.settle()
        if self.used:
            self._merge_now()

    def drop(self) -> None:
        """Forget every record (older than what the file holds now)."""
        self.settle()
        if self.used:
            self._changed()
            self.where.erase(self._snapshot(self.half)[0])
            self.punch_half(self.half)
            self.start(self.half)

    # ---- the log's file ----------------------------------------------------------------------
    def start(self, half: int) -> None:
        """Appends go to the start of `half` (0 or 1) from now on (empty: punch_half)."""
        self.end = self.starts[half]
        self.limit = self.end + self.capacity
        self._tail = b""

    def append_records(self, parts: dict[str, torch.Tensor]) -> int:
        """Append n records to the log's current half from `parts` ({field: [n, ...] values});
        returns the first one's index. Every write covers whole pages (the last page's records
        already written are kept in RAM and written again with it), so it goes straight to the
        disk (O_DIRECT): nothing is read first and no page stays in RAM. In pieces of APPEND_BYTES."""
        f, buf = self.tier.log_file, self._buf
        n = next(iter(parts.values())).shape[0]
        if self.end + n > self.limit:
            raise ValueError(f"tier: {n} records do not fit in the log's half ({self.limit - self.end} "
                             f"of {self.capacity} free)")
        first, rec = self.end, f.row_bytes
        room = torch.frombuffer(buf, dtype=torch.uint8)
        step = max(1, APPEND_BYTES // rec)
        staged = torch.empty(min(step, n), rec, dtype=torch.uint8)
        for lo in range(0, n, step):
            k = min(step, n - lo)
            for name, values in parts.items():
                self.tier.view(staged[:k], name, values).copy_(values[lo:lo + k])
            self.tier.seal.stamp(staged[:k])
            start = self.end * rec
            page = start // CHUNK * CHUNK
            head = start - page  # the last page's bytes already in the log
            buf[:head] = self._tail
            end = head + k * rec
            room[head:end] = staged[:k].view(-1)
            size = -(-end // CHUNK) * CHUNK
            full_io(os.pwritev, f.fd, memoryview(buf)[:size], page, f.path)
            self._tail = bytes(buf[end // CHUNK * CHUNK:end])
            self.end += k
        return first

    def merge_records(self, rows: torch.Tensor, at: torch.Tensor) -> None:
        """file[rows] = log[at], rows sorted and distinct, on this (the step's) thread: _merge's
        pieces, each piece's log records read ahead (the tier's ring or threads) while the piece
        is read."""
        tier = self.tier
        tier.release()  # none of the file's pages stay mapped while it is written around the mapping

        def begin(at_piece: torch.Tensor) -> Callable[[], torch.Tensor]:
            futures = tier.prefetch(at_piece, log=True)
            return lambda: (tier.ready(), torch.cat([g.result() for g in futures]))[1]
        self._merge(rows, at, begin)
        tier.release()

    def merge_records_beside(self, rows: torch.Tensor, at: torch.Tensor) -> Future:
        """merge_records, on the tier's merging thread (the steps go on): the log's records read
        through its own ring, nothing of the step's reads or mappings touched. Only while neither
        the file's records `rows` nor the log's records `at` are written otherwise (module docstring)."""
        log = self.tier.log_file
        rec, ring = log.row_bytes, self.tier.merge_ring

        def begin(at_piece: torch.Tensor) -> Callable[[], torch.Tensor]:
            def read() -> torch.Tensor:
                out = torch.empty(at_piece.numel(), rec, dtype=torch.uint8)
                ring.read(log.read_fd, at_piece.numpy() * rec, rec, out.data_ptr(), log.path)
                self.tier.seal.check(out, lambda i: (log.path, int(at_piece[i])))
                return out
            return read
        return self.tier.beside(self._merge, rows, at, begin)

    def _merge(self, rows: torch.Tensor, at: torch.Tensor, begin) -> None:
        """file[rows] = log[at] in pieces of up to APPEND_BYTES (at least one record unit), each
        rewritten in the merging buffer (RecordFile.rewrite), or, where its rows are scattered
        (fewer than 1/SCATTERED_PAGE_COST of its pages hold one) and the merge has a ring, only
        the pages that hold them (_patch_pages); begin(at of a piece)() gives the piece's log
        records."""
        f = self.tier.file
        starts = rows.numpy() * f.row_bytes
        for lo, hi, base, end in f.spans(starts):
            records, at_rows = begin(at[lo:hi]), rows[lo:hi] - base // f.row_bytes
            # n records hold at least n x record / page pages: no count needed where that is dense already
            sparse = self.tier.merge_ring is not None and \
                (hi - lo) * f.row_bytes // CHUNK * SCATTERED_PAGE_COST < (end - base) // CHUNK
            pages = _pages_of(starts[lo:hi], f.row_bytes) if sparse else None
            if pages is not None and pages.size * SCATTERED_PAGE_COST < (end - base) // CHUNK:
                self._patch_pages(f, starts[lo:hi], pages, records)
            else:
                f.rewrite(self._merge_buf, base, end, lambda room: room.index_copy_(0, at_rows, records()))

    def _patch_pages(self, f, starts: np.ndarray, pages: np.ndarray, records: Callable[[], torch.Tensor]) -> None:
        """The records at byte offsets `starts` of file f set to records() [n, record bytes]: the
        pages that hold them (`pages`, sorted, at most a piece buffer of them) read into the
        merging buffer, one after the other, through the merge's ring (many in flight), the
        records set there, the pages written back the same way."""
        room = torch.frombuffer(self._merge_buf, dtype=torch.uint8)
        addr, ring = room.data_ptr(), self.tier.merge_ring
        ring.read(f.fd, pages * CHUNK, CHUNK, addr, f.path)
        first = starts // CHUNK  # a record's first page; its second, if any, follows it in `pages`
        at = np.searchsorted(pages, first) * CHUNK + (starts - first * CHUNK)  # where the record is in the buffer
        where = torch.from_numpy(at)[:, None] + torch.arange(f.row_bytes)
        room[where.view(-1)] = records().reshape(-1)
        ring.write(f.fd, pages * CHUNK, CHUNK, addr, f.path)

    def punch_half(self, half: int) -> None:
        """Forget the records of the log's `half` (merged into the file): its pages given back
        (DiskTier.drop_log: the reads in flight finish first, a hole punched)."""
        lo = self.starts[half] * self.tier.log_file.row_bytes
        hi = self.starts[1] * self.tier.log_file.row_bytes if half == 0 else self.tier.log_file.nbytes
        self.tier.drop_log(lo, hi)
