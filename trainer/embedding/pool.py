"""The owner's slot pool of dynamic tables: which id holds which row, admission and eviction.

Why a pool: a dynamic table (embedding.tables=dynamic) takes any id in [0, 2^56), far more ids than
rows; each owner keeps `capacity` rows per table and maps the ids it admitted to them. This class
holds only the bookkeeping (the id -> slot map, each slot's id, its scores, the admission counts,
the counters); the rows and their optimizer state live in the store (embedding/dynamic.py), which
initialises a slot when the pool hands it to a new id.

- map: gid -> slot, one map for all tables of this owner (the gid carries the table, so it is the
  per-table map of (table, id) under one key; kernels.make_id_slot_map: the Triton hash table on
  CUDA, its sorted-array reference elsewhere). No two gids ever share a slot.
- slot_gid [S]: the gid holding each slot (-1: free); last_use [S]: the last step it was read;
  uses [S]: steps it was read (LFU).
- pending (admit_after > 1): gid -> (last step counted << 16 | steps seen) for ids not admitted
  yet; exact counting, an id is counted once per step however many workers read it.
- Table t's slots are [t * capacity, (t + 1) * capacity).

Admission happens where a training step's reads reach the owner (admit), once per step per id:
a row read in step s is stamped s and can never be evicted in step s, so every update of step s
lands on the id that was read. An evicted id's slot is reused at once; the id loses its row, its
count and its scores, and comes back as a new id.
"""
from __future__ import annotations

from typing import Optional

import torch

import kernels
from .sharding import ID_BITS

POOL_COUNTERS = ("admissions", "evictions", "dropped_grads", "rejected")  # [T] each, per owner
_COUNT_BITS = 16  # pending value: (step << 16) | count


def pool_slot_bytes(device: torch.device) -> int:
    """Bytes of a slot's bookkeeping on `device` (SlotPool.bytes_per_slot's total), for the memory
    plan: a Triton hash-table cell (32 B) on CUDA, the reference's sorted arrays (16 B) elsewhere,
    plus the slot's id and scores (24 B)."""
    return (32 if kernels.use_triton(torch.device(device)) else 16) + 24


class SlotPool:
    """Slots of `capacity` rows per table for `num_tables` dynamic tables (see the module docstring)."""

    def __init__(self, num_tables: int, capacity: int, admit_after: int, eviction: str,
                 device: torch.device) -> None:
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"embedding.eviction={eviction!r} is not one of lru, lfu")
        self.num_tables, self.capacity, self.admit_after, self.eviction = num_tables, capacity, admit_after, eviction
        n = num_tables * capacity
        self.map = kernels.make_id_slot_map(n, device)
        self.pending = kernels.make_id_slot_map(1024, device) if admit_after > 1 else None
        self.slot_gid = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.uses = torch.zeros(n, dtype=torch.int64, device=device)
        self.counters = torch.zeros(len(POOL_COUNTERS), num_tables, dtype=torch.int64, device=device)
        self.c = {k: self.counters[i] for i, k in enumerate(POOL_COUNTERS)}

    def lookup(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [n], -1 where absent; miss [n] bool) of gids."""
        return self.map.lookup(gids)

    def rows_in_use(self) -> torch.Tensor:
        """[T] slots holding an id, per table."""
        return (self.slot_gid >= 0).view(self.num_tables, self.capacity).sum(1)

    def pending_ids(self) -> int:
        """Ids counted but not admitted (admit_after > 1)."""
        return 0 if self.pending is None else len(self.pending)

    def count_dropped(self, gids: torch.Tensor) -> None:
        """Gradients of gids [n] (distinct) that had no row: dropped, counted per table."""
        t = gids >> ID_BITS
        self.c["dropped_grads"].index_add_(0, t, torch.ones_like(t))

    def admit(self, gids: torch.Tensor, step: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A training step's reads of gids [n] (repeats allowed) reach their owner: stamp the ids
        that hold a row, count the others (once per step), give a slot to each that has now been
        seen admit_after times (evicting the pool's lowest-scored rows not read in this step when
        the table is full; ids beyond that stay out, counted as `rejected`). Returns the new
        (gids [m], slots [m]), sorted by gid, for the store to initialise; None when none."""
        u = torch.unique(gids)
        slots, miss = self.map.lookup(u)
        hit = slots[~miss]
        self.last_use[hit] = step
        self.uses[hit] += 1
        new = u[miss]
        if new.numel() and self.pending is not None:
            val, absent = self.pending.lookup(new)
            seen = val & ((1 << _COUNT_BITS) - 1)
            counted = (val >> _COUNT_BITS) == step
            cnt = torch.where(absent, torch.ones_like(val), torch.where(counted, seen, seen + 1))
            self.pending.insert(new, (step << _COUNT_BITS) | cnt)
            new = new[cnt >= self.admit_after]
        if not new.numel():
            return None
        table = new >> ID_BITS  # sorted by gid, so grouped by table
        need = torch.bincount(table, minlength=self.num_tables).tolist()
        got_ids, got_slots, lo_id = [], [], 0
        for t, n in enumerate(need):
            if n:
                s = self._slots_for(t, n, step)
                got_ids.append(new[lo_id:lo_id + s.numel()])
                got_slots.append(s)
                self.c["rejected"][t] += n - s.numel()
            lo_id += n
        ids, slots = torch.cat(got_ids), torch.cat(got_slots)
        if not ids.numel():
            return None
        self.map.insert(ids, slots)
        self.slot_gid[slots] = ids
        self.last_use[slots] = step
        self.uses[slots] = 1
        if self.pending is not None:
            self.pending.erase(ids)
        self.c["admissions"].index_add_(0, ids >> ID_BITS, torch.ones_like(ids))
        return ids, slots

    def _slots_for(self, t: int, n: int, step: int) -> torch.Tensor:
        """Up to n slots of table t: free ones first (lowest first), then evicted ones (lowest
        score first; never a row read in this step)."""
        lo, hi = t * self.capacity, (t + 1) * self.capacity
        owner = self.slot_gid[lo:hi]
        free = torch.nonzero(owner < 0).squeeze(1)[:n] + lo
        short = n - free.numel()
        if short <= 0:
            return free
        victims = self._victims(lo, hi, short, step)
        if victims.numel():
            self.map.erase(self.slot_gid[victims])
            self.slot_gid[victims] = -1
            self.c["evictions"][t] += victims.numel()
        return torch.cat([free, victims])

    def _victims(self, lo: int, hi: int, m: int, step: int) -> torch.Tensor:
        """Up to m occupied slots of [lo, hi) not read in `step`, lowest score first: LRU = least
        recently read (ties: lowest slot); LFU = fewest uses, ties least recent."""
        last = self.last_use[lo:hi]
        cand = torch.nonzero((self.slot_gid[lo:hi] >= 0) & (last < step)).squeeze(1)
        if not cand.numel():
            return cand
        recency = last[cand] * (hi - lo) + cand  # distinct keys: the same choice on every device
        order = torch.argsort(recency)
        if self.eviction == "lfu":
            order = order[torch.argsort(self.uses[lo:hi][cand][order], stable=True)]
        return cand[order[:m]] + lo

    def bytes_per_slot(self) -> dict[str, int]:
        """What the pool costs per row slot beyond the row: its map entry (a hash-table cell of
        int64 key + int64 value at load <= 1/2: <= 32 B; the reference's sorted arrays: 16 B),
        the slot's id (8 B), its scores (last use and uses: 16 B)."""
        cell = pool_slot_bytes(self.map.device) - 24
        return {"map": cell, "slot_id": 8, "scores": 16, "total": cell + 24}

    def pending_bytes_per_id(self) -> int:
        """Exact admission counting: one map entry per id not admitted yet (key + packed step and
        count), as bytes_per_slot's map cell."""
        return 0 if self.pending is None else pool_slot_bytes(self.pending.device) - 24
