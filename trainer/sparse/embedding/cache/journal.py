"""Undo of a HET cache's changes within one step (train.nonfinite=skip), apart from the cache.

Between `begin()` and `commit()` every slot a read changes is saved first (`_save`: touch, refresh,
install + eviction), so `rollback()` returns the cache to exactly its state before the step: rows,
versions, pending updates and counts, policy metadata (every field named in `_FIELDS`), the id map
and the per-table free counts. A mixin of RowCache (cache.py): it reads the cache's `_FIELDS`, `gid`,
`map` and `_free`, and holds nothing else; outside begin() .. commit() saving costs nothing.
"""
from __future__ import annotations

from typing import Any

import torch


class CacheJournal:
    """begin / commit / rollback over a RowCache's fields (see the module docstring)."""

    _FIELDS: tuple[str, ...]
    gid: torch.Tensor
    map: Any
    _free: torch.Tensor

    def init_journal(self) -> None:
        self._journal: list[tuple[torch.Tensor, ...]] | None = None  # saved slots while undoable
        self._journal_free: torch.Tensor | None = None  # the free counts at begin()

    def begin(self) -> None:
        """Start saving every slot the coming changes touch (until commit or rollback)."""
        self._journal = []
        self._journal_free = self._free.clone()

    def commit(self) -> None:
        """Keep the changes made since begin() (drop what was saved)."""
        self._journal, self._journal_free = None, None

    def rollback(self) -> None:
        """Undo every change since begin(): saved slots get their old fields and map entries
        back (newest save first, so a slot saved twice ends with its oldest values)."""
        if self._journal is None:
            raise RuntimeError("RowCache.rollback() without begin()")
        for saved in reversed(self._journal):
            slots, old = saved[0], dict(zip(self._FIELDS, saved[1:]))
            now = self.gid.index_select(0, slots)
            moved = now != old["gid"]
            if bool((moved & (now >= 0)).any()):
                self.map.erase(now[moved & (now >= 0)])
            for name, value in old.items():
                getattr(self, name).index_copy_(0, slots, value)
            back = moved & (old["gid"] >= 0)
            if bool(back.any()):
                self.map.insert(old["gid"][back], slots[back])
        self._free.copy_(self._journal_free)
        self._journal, self._journal_free = None, None

    def _save(self, slots: torch.Tensor) -> None:
        if self._journal is not None and slots.numel():
            self._journal.append((slots.clone(),) + tuple(getattr(self, f).index_select(0, slots)
                                                          for f in self._FIELDS))
