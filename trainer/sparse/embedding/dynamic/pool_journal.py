"""Undo of a dynamic pool's changes within one step (train.nonfinite=skip, fp16's skipped steps),
apart from the pool.

Between `begin()` and `commit()` the pool saves, before it changes them, every slot a step's
admission touches (`_save`: the read rows' scores, expired rows' counts, evicted and newly taken
slots: their id, last use and uses), the admission counter journals every count it rewrites
(admission.py: an exact count's old value or that the id had none, 17 B; a sketch's raised cells,
10 B each), and `begin()` keeps the [4, T] counters and the free slots' cursors (a list of T ints
and T tensor references: the hole tensors are replaced, never written). So `rollback()` returns
the pool to exactly its state before the step: which id holds which slot, the id -> slot map,
scores, pending counts, counters and free slots. What is saved is bounded by the step's ids (24 B
per saved slot and the counts above), never by the pool.
A mixin of SlotPool (pool.py): it reads the pool's `slot_gid`, `last_use`, `uses`, `map`,
`admission`, `counters`, `_free_from`, `_holes` and `_memo`, and holds nothing else; outside
begin() .. commit() saving costs nothing. The rows' values and versions are the store's to undo
(dynamic.DynamicStore.rollback).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

_SLOT_FIELDS = ("slot_gid", "last_use", "uses")


class PoolJournal:
    """begin / commit / rollback over a SlotPool's bookkeeping (see the module docstring)."""

    slot_gid: torch.Tensor
    last_use: torch.Tensor
    uses: torch.Tensor
    map: Any
    admission: Any
    counters: torch.Tensor
    _free_from: list[int]
    _holes: list[torch.Tensor]
    _memo: list

    def init_journal(self) -> None:
        self._journal: Optional[list[tuple[torch.Tensor, ...]]] = None  # saved slots while undoable
        self._journal_keep: Optional[tuple[torch.Tensor, list[int], list[torch.Tensor]]] = None

    @property
    def journaling(self) -> bool:
        return self._journal is not None

    def begin(self) -> None:
        """Start saving everything the coming admissions change (until commit or rollback)."""
        self._journal = []
        if self.admission is not None:
            self.admission.begin()
        self._journal_keep = (self.counters.clone(), list(self._free_from), list(self._holes))

    def commit(self) -> None:
        """Keep the changes made since begin() (drop what was saved)."""
        self._journal, self._journal_keep = None, None
        if self.admission is not None:
            self.admission.commit()

    def rollback(self) -> None:
        """Undo every change since begin(): saved slots get their old id and scores back (newest
        save first, so a slot saved twice ends with its oldest values), the map follows (ids that
        moved are erased first, then the old ones put back, so an id evicted and readmitted in
        the step returns to its first slot), then the pending counts, counters and free slots."""
        if self._journal is None:
            raise RuntimeError("SlotPool.rollback() without begin()")
        self._memo.clear()
        if self._journal:
            slots = torch.unique(torch.cat([s[0] for s in self._journal]))
            now = self.slot_gid.index_select(0, slots)
            for saved in reversed(self._journal):
                for name, value in zip(_SLOT_FIELDS, saved[1:]):
                    getattr(self, name).index_copy_(0, saved[0], value)
            old = self.slot_gid.index_select(0, slots)
            moved = now != old
            gone = now[moved & (now >= 0)]
            if gone.numel():
                self.map.erase(gone)
            back = moved & (old >= 0)
            if bool(back.any()):
                ids, at = old[back], slots[back]
                order = torch.argsort(ids)
                self.map.insert(ids[order], at[order])
        if self.admission is not None:
            self.admission.rollback()
        counters, free_from, holes = self._journal_keep
        self.counters.copy_(counters)  # in place: the per-counter views (SlotPool.c) stay valid
        self._free_from[:], self._holes[:] = free_from, holes
        self.commit()

    def _save(self, slots: torch.Tensor) -> None:
        """Slots [n] about to change: keep their id and scores (while journaling)."""
        if self._journal is not None and slots.numel():
            self._journal.append((slots.clone(),) + tuple(getattr(self, f).index_select(0, slots)
                                                          for f in _SLOT_FIELDS))
