"""embedding.store=disk: the write-back log of TieredStore (tiered.py) over the tier's `log.bin`.

Why a log: writing an evicted row back in place costs a random page read and a random page write
for an 80 B record (at ~42k random writes a second, that alone capped the disk store near 0.3 of
the memory store's rate). Appended, the changed rows go out in whole pages straight to the disk
(DiskTier.append), and are merged into the file in sorted, sequential pieces (DiskTier.merge).

Where a row's newest copy is, the store's one map says (a slot >= 0, else -1 for the file): a
row in the log maps to its record's code, `code(r) = -2 - r`, below both. A record is never
rewritten in place until its half of the log is emptied, so a row appended again gets a new
record and the map points at the newest.

Two halves: rows are appended to one; when it is full, its rows' newest records (a snapshot of
the map) are merged into the file while appends go on in the other. Where the tier reads through
io_uring the merge runs beside the steps (DiskTier.merge_beside; a merge rewrites the whole file
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
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from kernels import IdSlotMap
from .disk import DiskTier


def code(v: torch.Tensor) -> torch.Tensor:
    """Log record r <-> its code in the map (-2 - r): below every slot and below -1 (absent)."""
    return -2 - v


class WriteLog:
    """The tier's log of two halves of `capacity` records; `where` is the store's map (rows ->
    slots or codes); `changed` is called before any record of the file or the log changes in place,
    but for a merge: `merged(rows, codes, records)` after it (rows, sorted, now hold in the file the
    records whose codes were `codes`; the log's records [records) are forgotten)."""

    def __init__(self, tier: DiskTier, where: IdSlotMap, changed: Callable[[], None],
                 merged: Callable[[torch.Tensor, torch.Tensor, tuple[int, int]], None]) -> None:
        self.tier, self.where, self._changed, self._merged = tier, where, changed, merged
        self.capacity = tier.log_half
        self.half = 0  # the half appended to
        self.beside = tier.reader == "io_uring"  # merges beside the steps (module docstring)
        self._merging: Optional[tuple] = None  # (future, rows, codes, half) of the merge running beside
        self.counts = {"appended": 0, "merges": 0, "merged": 0, "beside": 0, "wait_s": 0.0}

    @property
    def used(self) -> int:
        """Records appended to the current half since it was last emptied (the tier's append point)."""
        return self.tier.log_end - self.tier.log_starts[self.half]

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
            first = self.tier.append({name: p[lo:lo + k] for name, p in parts.items()})
            self.where.insert(rows[lo:lo + k], code(torch.arange(first, first + k)))
            self.counts["appended"] += k

    def _records(self, half: int) -> tuple[int, int]:
        first = self.tier.log_starts[half]
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
        self._merging = (self.tier.merge_beside(rows, at), rows, code(at), self.half)
        self.counts["beside"] += 1
        self.half = 1 - self.half
        self.tier.rotate(self.half)

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
        self.tier.reset_half(half)
        self.counts["merges"] += 1
        self.counts["merged"] += rows.numel()

    def _merge_now(self) -> None:
        """The current half merged into the file on this thread, then emptied (appends start it again)."""
        rows, at = self._snapshot(self.half)
        if rows.numel():
            try:
                self.tier.merge(rows, at)
            except BaseException:
                self._changed()
                raise
        self._finish(rows, code(at), self.half)
        self.tier.rotate(self.half)

    def merge(self) -> None:
        """The log's newest record of each row into the file (by row, the file in order: the
        tier's merge), then the log emptied."""
        self.settle()
        if self.used:
            self._merge_now()

    def drop(self) -> None:
        """Forget every record (older than what the file holds now)."""
        self.settle()
        if self.used:
            self._changed()
            self.where.erase(self._snapshot(self.half)[0])
            self.tier.reset_half(self.half)
            self.tier.rotate(self.half)
