"""Undo of a HET cache's changes within one step (train.nonfinite=skip), apart from the cache.

Between `begin()` and `commit()` every slot a read changes is saved first (`save`, called by the
cache: touch, refresh, install + eviction), so `rollback()` returns the cache to exactly its state
before the step: rows, versions, pending updates and counts, policy metadata (every per-slot field
the cache hands over), the id map and the per-table free counts. The interface: RowCache (rows.py)
builds one CacheJournal over its per-slot tensors (`fields`, "gid" among them), its id -> slot map
and its free counts, all changed in place only, and holds it as `cache.journal`; the step's owner
calls begin / commit / rollback on it. Outside begin() .. commit() saving costs nothing.
"""
from __future__ import annotations

from typing import Any

import torch


class CacheJournal:
    """begin / save / commit / rollback over a RowCache's fields (see the module docstring)."""

    def __init__(self, fields: dict[str, torch.Tensor], id_map: Any, free: torch.Tensor) -> None:
        """fields: {name: [C, ...] per-slot tensor} ("gid" the slots' ids); id_map: the cache's
        id -> slot map (erase / insert); free: [T] free slots per region."""
        self.fields, self.map, self.free = fields, id_map, free
        self._saved: list[tuple[torch.Tensor, ...]] | None = None  # saved slots while undoable
        self._saved_free: torch.Tensor | None = None  # the free counts at begin()

    def begin(self) -> None:
        """Start saving every slot the coming changes touch (until commit or rollback)."""
        self._saved = []
        self._saved_free = self.free.clone()

    @property
    def open(self) -> bool:
        """Whether changes are being saved (begin() .. commit() or rollback())."""
        return self._saved is not None

    def commit(self) -> None:
        """Keep the changes made since begin() (drop what was saved)."""
        self._saved, self._saved_free = None, None

    def rollback(self) -> None:
        """Undo every change since begin(): saved slots get their old fields and map entries
        back (newest save first, so a slot saved twice ends with its oldest values)."""
        if self._saved is None:
            raise RuntimeError("RowCache.rollback() without begin()")
        gid = self.fields["gid"]
        for saved in reversed(self._saved):
            slots, old = saved[0], dict(zip(self.fields, saved[1:]))
            now = gid.index_select(0, slots)
            moved = now != old["gid"]
            if bool((moved & (now >= 0)).any()):
                self.map.erase(now[moved & (now >= 0)])
            for name, value in old.items():
                self.fields[name].index_copy_(0, slots, value)
            back = moved & (old["gid"] >= 0)
            if bool(back.any()):
                self.map.insert(old["gid"][back], slots[back])
        self.free.copy_(self._saved_free)
        self._saved, self._saved_free = None, None

    def save(self, slots: torch.Tensor) -> None:
        """Keep `slots`' fields as they are now (the cache is about to change them)."""
        if self._saved is not None and slots.numel():
            self._saved.append((slots.clone(),) + tuple(t.index_select(0, slots) for t in self.fields.values()))
