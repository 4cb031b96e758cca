"""embedding.store=disk: the write-back log of TieredStore (tiered.py) over the tier's `log.bin`.

Why a log: writing an evicted row back in place costs a random page read and a random page write
for an 80 B record (at ~42k random writes a second, that alone capped the disk store near 0.3 of
the memory store's rate). Appended, the changed rows go out in whole pages straight to the disk
(DiskTier.append), and are merged into the file in sorted, sequential pieces when the log is
full (DiskTier.merge).

Where a row's newest copy is, the store's one map says (a slot >= 0, else -1 for the file): a
row in the log maps to its record's code, `code(r) = -2 - r`, below both. A record is never
rewritten in place until the log is emptied (merged or dropped), so a row appended again gets a
new record and the map points at the newest.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.id_slot_map_triton import IdSlotMap
from .tier import DiskTier


def code(v: torch.Tensor) -> torch.Tensor:
    """Log record r <-> its code in the map (-2 - r): below every slot and below -1 (absent)."""
    return -2 - v


class WriteLog:
    """The tier's log of `capacity` records; `where` is the store's map (rows -> slots or codes);
    `changed` is called before any record of the file or the log changes in place."""

    def __init__(self, tier: DiskTier, where: IdSlotMap, changed: Callable[[], None]) -> None:
        self.tier, self.where, self._changed = tier, where, changed
        self.capacity = tier.log.tensor.shape[0]
        self.used = 0  # records appended since the log was last emptied
        self.counts = {"appended": 0, "merges": 0, "merged": 0}

    def append(self, rows: torch.Tensor, parts: dict[str, torch.Tensor]) -> None:
        """Rows (distinct) with their records' parts ({field: [n, ...]}) appended, the map pointing
        at them; the log merged into the file first whenever they would not fit."""
        n = rows.numel()
        for lo in range(0, n, self.capacity):
            k = min(self.capacity, n - lo)
            if self.used + k > self.capacity:
                self.merge()
            first = self.tier.append({name: p[lo:lo + k] for name, p in parts.items()})
            self.where.insert(rows[lo:lo + k], code(torch.arange(first, first + k)))
            self.used = first + k
            self.counts["appended"] += k

    def logged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, their newest log records) of every row whose newest copy is in the log."""
        rows, v = self.where.items()
        inlog = v <= -2
        return rows[inlog], code(v[inlog])

    def merge(self) -> None:
        """The log's newest record of each row into the file, by row (the file in order: the
        tier's merge), then the log emptied."""
        if self.used == 0:
            return
        rows, at = self.logged()
        rows, order = torch.sort(rows)
        self._changed()
        self.tier.merge(rows, at.index_select(0, order))
        self.counts["merges"] += 1
        self.counts["merged"] += rows.numel()
        self.drop()

    def drop(self) -> None:
        """Forget every record (merged, or older than what the file holds now)."""
        if self.used:
            self._changed()
            self.where.erase(self.logged()[0])
            self.used = 0
            self.tier.reset_log()
