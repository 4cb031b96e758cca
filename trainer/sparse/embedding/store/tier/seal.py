"""embedding.store=disk: each record's checksum (Seal), so that a record changed by anything but
this run (a disk or memory fault, another process writing the file) is reported as what it is,
naming the file and the record, instead of training on its bytes (random bytes over `rows.bin`
read as rows: the loss went nan and the run blamed the learning rate).

The sum: a record's 4-byte words w_j (its `sum` field, the last of the record, left out) weighed
by fixed odd constants K_j, sum(w_j * K_j) mod 2^32, in one vectorized pass over [n, words] (no
per-record loop: ~2.5 GB/s on one core here). Linear mod 2^32 with odd weights, so any one changed word
changes the sum and random bytes pass with probability 2^-32; distinct weights catch words moved
within a record. A record of zeros sums to zero: rows never written (a sparse file's holes) pass.

Who stamps, who checks (DiskTier, WriteLog, TieredStore):
- stamped where a record is built or changed around the mapping: the pieces of `DiskTier.write`
  and `fill` (the changed records only), the log's appends; records the store changed through
  the mapping itself (an update of rows no slot can hold: `reseal_rows`; a direct write phase, or
  the arrays handed out outside one: `reseal`, a sweep that rewrites only the pieces whose sums
  changed) before anything reads the file again;
- checked where records come from the disk: every read ahead and read (io_uring or the threads),
  the log's records a merge copies into the file, a checkpoint's save (`read_records`), the rows
  an update through the mapping changes;
- copied as they are: a merge moves whole records (their sums with them).
Cost: 4 bytes a record (often none: the record is padded to 8 bytes anyway).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from .....base.core.errors import ResumeAdvised

FIELD = ("sum", (), torch.int32)  # the record's last field (DiskTier.define adds it)
_MIX = 0x9E3779B1  # odd: the weights K_j = (2j + 1) * _MIX mod 2^31, odd and distinct for j < 2^30


class StoreCorrupt(ResumeAdvised):
    """A record of the store's files fails its checksum: one line naming the file, the record
    and what to do (the run's newest checkpoint is added where the run knows it: runner.py)."""

    def __init__(self, path: str, record: int, bad: int) -> None:
        more = f" (and {bad - 1} more of the records read with it)" if bad > 1 else ""
        super().__init__(
            f"embedding.store_dir: {path}: record {record}{more} fails its checksum: the file was changed by "
            "something other than this run (a disk or memory fault, another process writing it), so its rows cannot "
            "be trusted; nothing read from it was trained on. Check that disk, then resume from the newest "
            "checkpoint (checkpoint.resume=auto)")
        self.path, self.record = path, record


class Seal:
    """The checksum of records of `record` bytes whose `sum` field (int32) is at byte `offset`."""

    def __init__(self, record: int, offset: int) -> None:
        if record % 4 or offset % 4:
            raise ValueError(f"tier: a sealed record must be whole 4-byte words ({record} B, sum at {offset})")
        words = record // 4
        k = (torch.arange(words, dtype=torch.int64) * 2 + 1) * _MIX % (1 << 31)
        k[offset // 4] = 0  # the sum does not sum itself
        self.weights, self.offset = k.to(torch.int32), offset

    def sums(self, records: torch.Tensor) -> torch.Tensor:
        """[n] int32: the sums records [n, record bytes] (uint8) should carry: int32 products and
        sum, which wrap mod 2^32 (twice as fast as in int64; the same bits: test_store_seal)."""
        if records.shape[0] == 0:
            return torch.zeros(0, dtype=torch.int32)
        return (records.view(torch.int32) * self.weights).sum(1, dtype=torch.int32)

    def carried(self, records: torch.Tensor) -> torch.Tensor:
        """[n] int32 view of the sums records carry."""
        return records[:, self.offset:self.offset + 4].view(torch.int32).view(-1)

    def stamp(self, records: torch.Tensor) -> None:
        """Records (a view that may be written) given their sums."""
        self.carried(records).copy_(self.sums(records))

    def stamp_rows(self, records: torch.Tensor, at: torch.Tensor) -> None:
        """Records `at` of [k, record bytes] `records` given their sums, the rest untouched."""
        if at.numel():
            self.carried(records).index_copy_(0, at, self.sums(records.index_select(0, at)))

    def bad(self, records: torch.Tensor) -> torch.Tensor:
        """Positions of the records whose sums do not match."""
        return torch.nonzero(self.sums(records) != self.carried(records)).squeeze(1)

    def check(self, records: torch.Tensor, where: Callable[[int], tuple[str, int]]) -> None:
        """StoreCorrupt unless every record carries its sum; where(i) = (file, record number) of
        position i."""
        bad = self.bad(records)
        if bad.numel():
            path, record = where(int(bad[0]))
            raise StoreCorrupt(os.path.abspath(path), record, int(bad.numel()))
