"""Undo of a dynamic pool's changes within one step (train.nonfinite=skip, fp16's skipped steps),
apart from the pool.

Between `begin()` and `commit()` the pool saves, before it changes them, every slot a step's
admission touches (`save`: the read rows' scores, expired rows' counts, evicted and newly taken
slots: their id, last use and uses), the admission counter journals every count it rewrites
(admission.py: an exact count's old value or that the id had none, 17 B; a sketch's raised cells,
10 B each), and `begin()` keeps the [4, T] counters and the free slots' cursors (a list of T ints
and T tensor references: the hole tensors are replaced, never written). So `rollback()` returns
the pool to exactly its state before the step: which id holds which slot, the id -> slot map,
scores, pending counts, counters and free slots. What is saved is bounded by the step's ids (24 B
per saved slot and the counts above), never by the pool.
The interface: SlotPool (pool.py) holds one PoolJournal, made with the pool (`pool.journal`), and
calls `save` before it changes slots; the journal reads the pool's `slot_gid`, `last_use`, `uses`,
`map`, `admission` and `counters`, keeps its free slots' cursors through `pool.cursors()` and puts
them back with `pool.restore_cursors()`; the store calls begin / commit / rollback. Outside
begin() .. commit() saving costs nothing. The rows' values and versions are the store's to undo
(dynamic.DynamicStore.rollback).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

_SLOT_FIELDS = ("slot_gid", "last_use", "uses")


class PoolJournal:
    """begin / save / commit / rollback over a SlotPool's bookkeeping (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._saved: Optional[list[tuple[torch.Tensor, ...]]] = None  # saved slots while undoable
        self._kept: Optional[tuple[torch.Tensor, list[int], list[torch.Tensor]]] = None  # counters, cursors

    def begin(self) -> None:
        """Start saving everything the coming admissions change (until commit or rollback)."""
        pool = self.pool
        self._saved = []
        if pool.admission is not None:
            pool.admission.begin()
        self._kept = (pool.counters.clone(), *pool.cursors())

    def commit(self) -> None:
        """Keep the changes made since begin() (drop what was saved)."""
        self._saved, self._kept = None, None
        if self.pool.admission is not None:
            self.pool.admission.commit()

    def rollback(self) -> None:
        """Undo every change since begin(): saved slots get their old id and scores back (newest
        save first, so a slot saved twice ends with its oldest values), the map follows (ids that
        moved are erased first, then the old ones put back, so an id evicted and readmitted in
        the step returns to its first slot), then the pending counts, counters and free slots."""
        if self._saved is None:
            raise RuntimeError("SlotPool.rollback() without begin()")
        pool = self.pool
        if self._saved:
            slots = torch.unique(torch.cat([s[0] for s in self._saved]))
            now = pool.slot_gid.index_select(0, slots)
            for saved in reversed(self._saved):
                for name, value in zip(_SLOT_FIELDS, saved[1:]):
                    getattr(pool, name).index_copy_(0, saved[0], value)
            old = pool.slot_gid.index_select(0, slots)
            moved = now != old
            gone = now[moved & (now >= 0)]
            if gone.numel():
                pool.map.erase(gone)
            back = moved & (old >= 0)
            if bool(back.any()):
                ids, at = old[back], slots[back]
                order = torch.argsort(ids)
                pool.map.insert(ids[order], at[order])
        if pool.admission is not None:
            pool.admission.rollback()
        counters, free_from, holes = self._kept
        pool.counters.copy_(counters)  # in place: the per-counter views (SlotPool.c) stay valid
        pool.restore_cursors(free_from, holes)
        self.commit()

    def save(self, slots: torch.Tensor) -> None:
        """Slots [n] about to change: keep their id and scores (while journaling)."""
        if self._saved is not None and slots.numel():
            self._saved.append((slots.clone(),) + tuple(getattr(self.pool, f).index_select(0, slots)
                                                        for f in _SLOT_FIELDS))
