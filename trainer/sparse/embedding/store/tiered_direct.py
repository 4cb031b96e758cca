"""The direct phases of embedding.store=disk's row cache (tiered.py's TieredStore): checkpoints,
snapshots and whole-table gathers index the shard's arrays (`weight`, `version`, `touched`, the
optimizer's state), which are the tier's files, not the slots.

Inside `raw(write)` the changed rows are written back first (the log merged into the file, then
the changed slots in place), and after a write phase the slots are forgotten (the file may hold
newer records than they do); outside it, any access to those attributes empties the cache first
(always correct, only slower).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

FLUSH_ROWS = 1 << 18  # changed slots copied out and written back at a time (~20 MB at d = 16)


class DirectPhases:
    """TieredStore's direct access to its files' arrays (a mixin: the slots' arrays, the map,
    the log and the counts are TieredStore's)."""

    # ---- direct access to the files' arrays --------------------------------------------------
    def _direct(name: str):  # noqa: N805 (a property factory for the class body)
        def get(self):
            if self._slots_n and not self._in_raw:
                self._empty()
            return self.__dict__["_" + name]

        def put(self, value):
            self.__dict__["_" + name] = value
        return property(get, put)

    weight = _direct("weight")
    version = _direct("version")
    touched = _direct("touched")
    del _direct

    @contextlib.contextmanager
    def raw(self, write: bool) -> Iterator[None]:
        self._flush()
        outer, self._in_raw = self._in_raw, True  # phases may nest
        self.tier.sequential(True)  # a phase reads or writes the shard in order
        try:
            yield
        finally:
            self._in_raw = outer
            self.tier.sequential(outer)
            if write:
                self._changed()
                if self._nfree < self._slots_n:
                    self._forget()
                    self.counts["forgotten"] += 1

    def _empty(self) -> None:
        """Write every changed row back and forget every slot (the files are then the shard)."""
        if self._nfree == self._slots_n and self._log.empty:
            return
        self._flush()
        self._forget()
        self.counts["emptied"] += 1

    def _flush(self) -> None:
        """Make the file the shard: the log merged into it, then the changed slots written in
        place (sorted by row, in sequential pieces: tier_io.py; FLUSH_ROWS of them copied out at a
        time); the slots stay, unchanged now."""
        self._log.merge()
        self._changed()  # the file is written in place
        slots = torch.nonzero(self._dirty).squeeze(1)
        if slots.numel():
            rows, order = torch.sort(self._rid.index_select(0, slots))
            slots = slots.index_select(0, order)
            for lo in range(0, rows.numel(), FLUSH_ROWS):
                self.tier.write(rows[lo:lo + FLUSH_ROWS], self._parts(slots[lo:lo + FLUSH_ROWS]))
            self._dirty.zero_()
            self.counts["written"] += slots.numel()

    def _forget(self) -> None:
        """Free every slot (some are held; their changes are in the file) and drop the log (merged
        already, or older than what was just written into the file)."""
        self._changed()
        self._memo = None
        self._uses.forget()
        self._map.erase(self._rid[self._rid >= 0])
        self._rid.fill_(-1)
        self._dirty.zero_()
        self._free = torch.arange(self._slots_n - 1, -1, -1, dtype=torch.int64)
        self._nfree = self._slots_n
        self._log.drop()
