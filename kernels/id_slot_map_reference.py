"""The id -> slot map of the reference backend (the CPU path): open addressing in vectorised numpy.

Why not sorted arrays (what this was): a sorted key array finds ids with searchsorted, but every
insert re-sorted the whole array and every erase compacted it, so a step's cost grew with the
table (millions of ids), not with the batch: dynamic tables ran 2x slower than fixed ones at
W = 1. Here a lookup, insert or erase of n ids costs O(n) expected work (a few probe rounds, each
one gather over the ids still probing), whatever the table holds.

Layout, as the Triton table (kernels/id_slot_map_triton.py): a power-of-two array of int64 keys
(EMPTY = -1, TOMBSTONE = -2, so ids must be >= 0) and one of int64 values, linear probing from a
mixed hash of the id (splitmix64's finaliser). Differences, since one host thread drives every call:
- insert first finds the ids already present (an update in place), then claims for each absent id
  the first EMPTY *or* TOMBSTONE cell of its chain (no concurrent inserter can hold the same id);
  ids of one round that reach the same free cell are settled by np.maximum.at: the largest id
  wins, the others probe on, so the layout is a pure function of the calls made;
- the table is rebuilt (tombstones dropped, doubled while needed) when live ids + tombstones would
  pass ``max_load`` of the cells, sized so that at most 3/4 of that load is used right after, so a
  rebuild's O(cells) is paid once per Theta(cells) claims of empty cells; it starts at
  ``capacity`` ids (at most 2^20: 32 MiB; past that, memory follows the ids held) and never shrinks;
- items() returns the ids sorted (a checkpoint's pending ids are written in a fixed order).

The arrays are numpy arrays in host memory (numpy's gathers and nonzero are 2-6x faster than
torch's on one CPU thread); on another device, ids are copied to the host and results back (the
Triton table is that device's map; this one is its reference there). Batch semantics are
IdSlotMap's: with a duplicate id in one insert, the last value is kept and its first occurrence is
the one reported new.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
from torch import Tensor

from kernels.id_slot_map_triton import EMPTY, TOMBSTONE, IdSlotMap

# splitmix64: the one definition of its constants (the trainer's torch finaliser, base/core/hashing.py,
# takes them from here)
SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # its increment (the golden ratio)
SPLITMIX_M1 = np.uint64(0xBF58476D1CE4E5B9)  # its finaliser's multipliers
SPLITMIX_M2 = np.uint64(0x94D049BB133111EB)
START_MAX_IDS = 1 << 20  # the table starts sized for at most this many ids (32 MiB of cells)


def splitmix_inplace(h: np.ndarray, t: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 array h, in h (t: scratch of h's shape; wrapping
    arithmetic, no temporaries). The probe hash here; the counter-based random numbers of the
    trainer's data and initial rows (trainer/workload/data/rng.py) too."""
    for shift, mul in ((30, SPLITMIX_M1), (27, SPLITMIX_M2)):
        np.right_shift(h, np.uint64(shift), out=t)
        np.bitwise_xor(h, t, out=h)
        np.multiply(h, mul, out=h)
    np.right_shift(h, np.uint64(31), out=t)
    return np.bitwise_xor(h, t, out=h)


def splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 values x (an array or a scalar), as a new array (a numpy
    scalar for a scalar); x is left as it was."""
    h = np.array(x, dtype=np.uint64)
    h = splitmix_inplace(h, np.empty_like(h))
    return h[()] if h.ndim == 0 else h


def probe_hash(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each id: uint64 [n] (on one copy of the ids)."""
    h = ids.astype(np.uint64)
    return splitmix_inplace(h, np.empty_like(h))


def cells_for(ids: int, load: float) -> int:
    """The fewest power-of-two cells (at least 16) that hold `ids` ids at `load`."""
    cells = 16
    while ids > load * cells:
        cells *= 2
    return cells


def cells_bound(ids: int, max_load: float = 0.5) -> int:
    """The most cells a map made for `ids` ids ever holds while it holds at most that many (its
    start, or a rebuild's size for them at 3/4 of max_load): 16 B each."""
    return max(cells_for(min(max(ids, 8), START_MAX_IDS), max_load), cells_for(ids, 0.75 * max_load))


class ReferenceIdSlotMap(IdSlotMap):
    """Open-addressing id -> slot map, vectorised (see the module docstring). ``capacity``: ids
    the table is sized for at first (capped at START_MAX_IDS; it grows past them)."""

    def __init__(self, capacity: int = 0, device: torch.device | str = "cpu", max_load: float = 0.5) -> None:
        if not 0.0 < max_load < 1.0:
            raise ValueError("max_load must be in (0, 1)")
        self._device = torch.device(device)
        self._max_load = max_load
        self._reset(cells_for(min(max(int(capacity), 8), START_MAX_IDS), self._max_load))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity(self) -> int:
        """Number of cells (a power of two)."""
        return self._keys.size

    def _reset(self, cells: int) -> None:
        self._keys = np.full(cells, EMPTY, dtype=np.int64)
        self._vals = np.full(cells, -1, dtype=np.int64)
        self._live = 0  # ids held
        self._used = 0  # cells not EMPTY (live + tombstones)

    def __len__(self) -> int:
        return self._live

    def _host(self, t: Tensor) -> np.ndarray:
        return self._prepare(t).cpu().numpy()

    def _out(self, a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).to(self._device)

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The cell of each id, -1 where absent. ids [n] int64 -> [n] int64."""
        wrap = self._keys.size - 1
        pos = probe_hash(ids).view(np.int64)
        np.bitwise_and(pos, wrap, out=pos)
        key = self._keys.take(pos)
        hit = key == ids
        cell = np.where(hit, pos, -1)  # the first probe settles most ids
        on = np.flatnonzero(~hit & (key != EMPTY))
        at, want, pos = on, ids.take(on), (pos.take(on) + 1) & wrap
        while at.size:
            key = self._keys.take(pos)
            hit = key == want
            cell[at[hit]] = pos[hit]
            on = np.flatnonzero(~hit & (key != EMPTY))
            at, want, pos = at.take(on), want.take(on), (pos.take(on) + 1) & wrap
        return cell

    def lookup(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
        cell = self._find(self._host(ids))
        miss = cell < 0
        slots = np.where(miss, -1, self._vals.take(np.maximum(cell, 0)))
        return self._out(slots), self._out(miss)

    def insert(self, ids: Tensor, slots: Tensor) -> Tensor:
        ids, slots = self._host(ids), self._host(slots)
        if ids.shape != slots.shape:
            raise ValueError("ids and slots must have the same length")
        if not ids.size:
            return self._out(np.zeros(0, dtype=bool))
        if ids.size == 1 or bool(np.all(ids[1:] > ids[:-1])):  # distinct and sorted: the usual call
            order, first = None, np.ones(ids.size, dtype=bool)
            uids, uvals = ids, slots
        else:
            order = np.argsort(ids, kind="stable")
            sid = ids[order]
            first = np.ones(ids.size, dtype=bool)
            first[1:] = sid[1:] != sid[:-1]
            last = np.ones(ids.size, dtype=bool)
            last[:-1] = first[1:]
            uids, uvals = sid[last], slots[order][last]  # each id once, with its last value
        cell = self._find(uids)
        absent = cell < 0
        self._vals[cell[~absent]] = uvals[~absent]
        self._claim(uids[absent], uvals[absent])
        new = np.zeros(ids.size, dtype=bool)
        new[first] = absent  # at each id's first place in sorted order: the id's first occurrence
        if order is not None:
            new[order] = new.copy()
        return self._out(new)

    def insert_absent(self, ids: Tensor, slots: Tensor) -> None:
        ids, slots = self._host(ids), self._host(slots)
        if ids.shape != slots.shape:
            raise ValueError("ids and slots must have the same length")
        self._claim(ids, slots)  # no _find: none of them is here

    def _claim(self, ids: np.ndarray, vals: np.ndarray) -> None:
        """Put distinct absent ids [m] in the first free (EMPTY or TOMBSTONE) cell of their chains."""
        m = ids.size
        if not m:
            return
        if self._used + m > self._max_load * self._keys.size:
            self._rebuild(m)
        wrap = self._keys.size - 1
        pos = probe_hash(ids).view(np.int64) & wrap
        while ids.size:
            key = self._keys.take(pos)
            free = np.flatnonzero(key < 0)
            cp, ci = pos.take(free), ids.take(free)
            np.maximum.at(self._keys, cp, ci)  # free cells hold < 0: the largest id of a cell wins
            won = free[self._keys.take(cp) == ci]
            self._vals[pos.take(won)] = vals.take(won)
            self._used += int(np.count_nonzero(key.take(won) == EMPTY))
            on = np.ones(ids.size, dtype=bool)
            on[won] = False
            ids, vals, pos = ids[on], vals[on], (pos[on] + 1) & wrap
        self._live += m

    def _rebuild(self, incoming: int) -> None:
        """Drop the tombstones; cells for (live + incoming) ids at 3/4 of max_load, at least."""
        live = self._keys >= 0
        keys, vals = self._keys[live], self._vals[live]
        cells = max(cells_for(keys.size + incoming, 0.75 * self._max_load), self._keys.size)
        self._reset(cells)
        self._claim(keys, vals)

    def erase(self, ids: Tensor) -> Tensor:
        cell = self._find(self._host(ids))
        found = cell >= 0
        gone = np.unique(cell[found])
        self._keys[gone] = TOMBSTONE
        self._vals[gone] = -1
        self._live -= gone.size
        return self._out(found)

    def items(self) -> Tuple[Tensor, Tensor]:
        live = np.flatnonzero(self._keys >= 0)
        keys = self._keys.take(live)
        order = np.argsort(keys)
        return self._out(keys.take(order)), self._out(self._vals.take(live).take(order))
