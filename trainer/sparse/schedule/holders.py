"""Who holds each row Herald lent (trainer/sparse/schedule/herald.py's planner state), kept over the lent
rows alone: every rank plans with it, so it must not grow with the model (dynamic tables have
2^56 ids per table).
"""
from __future__ import annotations

import numpy as np


class Holders:
    """Which worker holds each lent row and the last step it used it: sorted arrays over the lent
    rows alone (at most W x capacity; 24 B per lent row on every rank), never over the id space
    (dynamic tables have 2^56 ids per table)."""

    def __init__(self) -> None:
        self.gid = self.who = self.last = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return int(self.gid.size)

    def _at(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.searchsorted(self.gid, g).clip(max=max(self.gid.size - 1, 0))
        return pos, (self.gid[pos] == g) if self.gid.size else np.zeros(np.shape(g), bool)

    def of(self, g: np.ndarray) -> np.ndarray:
        """[n] the holder of each gid, -1 where none."""
        pos, hit = self._at(g)
        return np.where(hit, self.who[pos] if self.gid.size else -1, -1)

    def last_use(self, g: np.ndarray) -> np.ndarray:
        """[n] the last step each (held) gid was used by its holder."""
        return self.last[self._at(g)[0]]

    def touch(self, g: np.ndarray, step: int) -> None:
        pos, hit = self._at(g)
        self.last[pos[hit]] = step

    def drop(self, g: np.ndarray) -> None:
        keep = ~np.isin(self.gid, g)
        self.gid, self.who, self.last = self.gid[keep], self.who[keep], self.last[keep]

    def add(self, g: np.ndarray, worker: int, step: int) -> None:
        """Lend gids g (held by nobody) to `worker` at `step`."""
        gid = np.concatenate([self.gid, g])
        order = np.argsort(gid, kind="stable")
        self.gid = gid[order]
        self.who = np.concatenate([self.who, np.full(g.size, worker, np.int64)])[order]
        self.last = np.concatenate([self.last, np.full(g.size, step, np.int64)])[order]
