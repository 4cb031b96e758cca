"""LRU-2 for the row buffer's slots (tiered.py): each slot's uses and the choice of those to evict.

A slot keeps the call it was last used in and the use before that in an earlier step (-1: none;
a call is one read or update of rows, a step starts with its lookup). Its key is (the use before,
the last use): the slots with the smallest keys go first, so a row used in one step only since it
was loaded goes before a row used again, then the least recently used; never a slot used in the
call being served. 4 + 4 B a slot.

Choosing n victims among S slots is a selection over all of them. Evictions come every few steps
(n is at least S/32), and most of what one selection sorts out is still true at the next. So a
selection keeps the KEEP x n smallest keys it saw (the kept slots, 8 B each: 1 B a slot at
S/32) and the largest of them (the bound); the slots loaded later join them. A later eviction
chooses among the kept slots alone, by their keys now: when the n-th smallest of those is at
most the bound, they are the n smallest keys of all slots, because a key only grows while its
row stays in its slot (a use raises the last use, and the use before becomes an older last use),
so every slot not kept still has a key at least the bound. Else it selects over all slots again.
"""
from __future__ import annotations

import numpy as np
import torch

KEEP = 4  # a selection over all slots keeps KEEP x the victims it chose of the smallest keys
_NO_BOUND = np.iinfo(np.int64).max


class SlotUses:
    """The uses of n slots and LRU-2's victims among them."""

    def __init__(self, n: int) -> None:
        self.last = torch.zeros(n, dtype=torch.int32)  # the call each slot was last used in (2^31 calls)
        self.before = torch.full((n,), -1, dtype=torch.int32)  # ... the one before, in an earlier step (-1: none)
        self.call = 0
        self.step_call = 0  # the last call before the current step's lookup
        self._kept: np.ndarray | None = None  # slots (int64) with the smallest keys at the last selection, and those loaded since
        self._joined: list[np.ndarray] = []  # slots loaded since, not yet in _kept
        self._bound = _NO_BOUND
        self.selections = 0  # selections over all slots (the rest chose among the kept ones)

    def new_call(self) -> int:
        self.call += 1
        return self.call

    def new_step(self) -> None:
        """The next call is a step's lookup: the calls before it were earlier steps'."""
        self.step_call = self.call

    def touch(self, slots: torch.Tensor) -> None:
        """Slots used by this call: a last use in an earlier step becomes the use before."""
        last = self.last.index_select(0, slots)
        earlier = last <= self.step_call
        self.before.index_copy_(0, slots[earlier], last[earlier])
        self.last.index_fill_(0, slots, self.call)

    def loaded(self, slots: torch.Tensor) -> None:
        """Slots given new rows by this call: used once, no use before."""
        self.last.index_fill_(0, slots, self.call)
        self.before.index_fill_(0, slots, -1)
        if self._kept is not None:
            self._joined.append(slots.numpy().astype(np.int64, copy=True))

    def forget(self) -> None:
        """Every slot was freed: nothing kept."""
        self._kept, self._joined, self._bound = None, [], _NO_BOUND

    def victims(self, rows: np.ndarray, n: int) -> np.ndarray:
        """Up to n slots to evict (n > 0): held (rows >= 0, the storage row in each slot), not used
        in this call, with the smallest keys."""
        got = self._from_kept(rows, n) if self._kept is not None else None
        if got is None:
            got = self._select(rows, n)
        return got

    def _keys(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        last = self.last.numpy()[slots]
        return (self.before.numpy()[slots].astype(np.int64) << 32) | last, last

    def _from_kept(self, rows: np.ndarray, n: int) -> np.ndarray | None:
        kept = self._kept if not self._joined else np.concatenate([self._kept] + self._joined)
        self._joined = []
        kept = kept[rows[kept] >= 0]
        key, last = self._keys(kept)
        can = np.flatnonzero(last < self.call)
        if can.size < n:
            self._kept = kept
            return None
        if can.size > n:
            can = can[np.argpartition(key[can], n - 1)[:n]]
        if key[can].max() > self._bound:  # a slot not kept may have a smaller key
            self._kept = kept
            return None
        stay = np.ones(kept.size, dtype=bool)
        stay[can] = False
        self._kept = kept[stay]
        return kept[can]

    def _select(self, rows: np.ndarray, n: int) -> np.ndarray:
        """A selection over all slots; keeps the KEEP x n smallest keys for the next evictions."""
        self.selections += 1
        held = np.flatnonzero(rows >= 0)
        key, last = self._keys(held)
        m = min(held.size, KEEP * n)
        if m < held.size:
            part = np.argpartition(key, m - 1)[:m]
            self._kept, self._joined, self._bound = held[part], [], int(key[part].max())
        else:
            self._kept, self._joined, self._bound = held, [], _NO_BOUND
        got = self._from_kept(rows, n)
        if got is not None:
            return got
        self.forget()  # fewer than n of the smallest keys may go now (used in this call): over all of them
        ok = last < self.call
        can, key = held[ok], key[ok]
        return can[np.argpartition(key, n - 1)[:n]] if can.size > n else can
