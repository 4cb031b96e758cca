"""embedding.store=disk: the copies of records the tier reads ahead (tier.DiskTier.prefetch:
through io_uring, or by its threads), for TieredStore's loads.

Why keep them: a read ahead faults the records' pages into the page cache, and in a memory
cgroup the cgroup may reclaim those pages before the step copies the rows into slots, so the step's
own thread read them again (~260 pages a step at Zipf 1.1, a 25% row buffer). The threads' gathers
already produce the records' bytes; keeping them costs ~record bytes per row read ahead, for the
last `calls` reads ahead (O(batch)).

When a copy may be used: only for the row's newest record as it was when read (`where`: -1 for the
file, a log record's code for the log), and only while no record of the file or the log has
changed in place since (`changed()`: a direct phase, a call the file serves, the marks' clearing).
Appending to the log and loading or evicting slots change no record in place, so copies survive
them; a row whose newest copy moved since (into a slot, to another log record) no longer matches
its `where`. A merge of a half of the log (`merged()`) keeps them too: a copy of the record the
merge wrote into the file is now the file's (its `where` becomes -1); a copy of the file's record
of a merged row, and every other copy read from that half (its records are reused), can never
match again.
"""
from __future__ import annotations

import collections
from concurrent.futures import Future

import torch

from .writelog import code

STALE = torch.iinfo(torch.int64).min  # a `where` no row's newest record ever has


class ReadAheadCopies:
    """The last `calls` reads ahead's copies: (rows, where they were read from, futures giving the
    records in the rows' order)."""

    def __init__(self, record_bytes: int, calls: int = 2) -> None:
        self._record = record_bytes
        self._groups: collections.deque = collections.deque(maxlen=calls)
        self._sorted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add(self, rows: torch.Tensor, where: torch.Tensor, futures: list[Future]) -> None:
        if futures:
            self._groups.append((rows, where, futures))
            self._sorted = None

    def changed(self) -> None:
        """Records may change in place: every copy is stale."""
        self._groups.clear()
        self._sorted = None

    def merged(self, rows: torch.Tensor, codes: torch.Tensor, records: tuple[int, int]) -> None:
        """A half of the log merged into the file: rows (sorted, distinct) now hold there the
        records whose codes were `codes`, and the log's records [records) are forgotten (module
        docstring); copies of the log's other records stay as they are."""
        lo, hi = code(torch.tensor(records[1] - 1)), code(torch.tensor(records[0]))
        for i, (grows, gwhere, futures) in enumerate(self._groups):
            merged = was = torch.zeros(grows.shape, dtype=torch.bool)
            if rows.numel():
                pos = torch.searchsorted(rows, grows).clamp_(max=rows.numel() - 1)
                merged = rows.index_select(0, pos) == grows
                was = codes.index_select(0, pos) == gwhere
            gone = ((gwhere >= lo) & (gwhere <= hi)) | (merged & (gwhere == -1))
            where = torch.where(gone, STALE, gwhere)
            self._groups[i] = (grows, torch.where(merged & was, -1, where), futures)
        self._sorted = None

    def take(self, rows: torch.Tensor, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions in rows, their records [k, record bytes]) of the rows a valid copy is kept
        of (read from `where`, the row's newest record now). The reads must be done (ready())."""
        srows, swhere, srecs = self._table()
        if srows.numel() == 0:
            return torch.zeros(0, dtype=torch.int64), srecs
        pos = torch.searchsorted(srows, rows).clamp_(max=srows.numel() - 1)
        ok = (srows.index_select(0, pos) == rows) & (swhere.index_select(0, pos) == where)
        got = torch.nonzero(ok).squeeze(1)
        return got, srecs.index_select(0, pos.index_select(0, got))

    def _table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every kept copy, sorted by row (made once per change of the groups)."""
        if self._sorted is None:
            if self._groups:
                rows, order = torch.sort(torch.cat([g[0] for g in self._groups]))
                self._sorted = (rows, torch.cat([g[1] for g in self._groups]).index_select(0, order),
                                torch.cat([torch.cat([f.result() for f in g[2]]) for g in self._groups]).index_select(0, order))
            else:
                self._sorted = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                torch.zeros(0, self._record, dtype=torch.uint8))
        return self._sorted
