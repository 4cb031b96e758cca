"""The owner's slot pool of dynamic tables: which id holds which row, admission and eviction.

Why a pool: a dynamic table (embedding.kind=dynamic) takes any id in [0, 2^56), far more ids than
rows; each owner keeps `capacity` rows per table and maps the ids it admitted to them. This class
holds only the bookkeeping (the id -> slot map, each slot's id, its scores, the admission counts,
the counters); the rows and their optimizer state live in the store (embedding/dynamic.py), which
initialises a slot when the pool hands it to a new id.

- map: gid -> slot, one map for all tables of this owner (the gid carries the table, so it is the
  per-table map of (table, id) under one key; kernels.make_id_slot_map: the Triton hash table on
  CUDA, the open-addressing reference of kernels/id_slot_map_reference.py elsewhere). No two gids ever share
  a slot. A step's bookkeeping costs in proportion to its ids, except eviction: free slots are a
  cursor per table (plus the holes a checkpoint load may leave), the map's last two answers are
  remembered (a step asks for the same ids in admit, rows and apply); a table that evicts pays
  O(capacity) (topk / kthvalue over its scores, no sort).
- slot_gid [S]: the gid holding each slot (-1: free); last_use [S]: the last step it was read;
  uses [S]: steps it was read (LFU).
- admission (admit_after > 1): the counts of ids not admitted yet, exact or a count-min sketch
  (admission.py, embedding.admit_counter); an id is counted once per step however many workers
  read it.
- Table t's slots are [t * capacity, (t + 1) * capacity).

Admission happens where a training step's reads reach the owner (admit), once per step per id:
a row read in step s is stamped s and can never be evicted in step s, so every update of step s
lands on the id that was read. An evicted id's slot is reused at once; the id loses its row, its
count and its scores, and comes back as a new id.

Pinned rows (`pins`): ids of which another worker holds a copy that it updates (a replicated hot
row, placement; a row Herald lent out) are never evicted while that copy lives, so no copy
outlives its id's life here. The pins are asked for only when a table evicts (O(capacity) then).
Expiry (embedding.ttl_steps) is not eviction: a copied id expires too, and its copies follow it,
deciding by the same rule (`expired`) from the same last reads.

Undo (train.nonfinite=skip, fp16's skipped steps): the pool holds a PoolJournal (pool_journal.py,
`pool.journal`) and saves into it each slot it changes first, the counter each count, so a skipped
step's admissions, evictions and counts roll back.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import kernels
from kernels import cells_bound
from .admission import Counting, make_counter
from .pool_journal import PoolJournal
from ..sharding import ID_BITS

POOL_COUNTERS = ("admissions", "evictions", "dropped_grads", "rejected")  # [T] each, per owner


def _ascending(gids: torch.Tensor) -> bool:
    """Whether gids [n] are strictly ascending (sorted and distinct)."""
    return gids.numel() < 2 or bool((gids[1:] > gids[:-1]).all())


def expired(last_read: Any, step: int, ttl: int) -> Any:
    """embedding.ttl_steps' rule: rows last read at `last_read` (a torch or numpy array) have
    expired when read at `step` (unread for more than ttl steps; ttl 0: never). The owner's pool
    applies it, and so does every copy of a row held elsewhere (the replica, Herald's planner),
    from the same last reads: all decide alike, with no message."""
    return (step - last_read > ttl) & (ttl > 0)


def pool_slot_bytes(device: torch.device, slots: int) -> int:
    """Bytes of a slot's bookkeeping on `device` for a pool of `slots` slots (SlotPool.bytes_per_slot's
    total), for the memory plan: the slot's id and scores (24 B) and its share of the map: a Triton
    hash-table cell (32 B, at load 1/2) on CUDA; on the CPU the reference map's most cells for
    that many ids (16 B each over 2.7-5.3 cells per id below 2^20 slots: 43-86 B)."""
    if kernels.use_triton(torch.device(device)):
        return 32 + 24
    return -(-16 * cells_bound(max(slots, 1)) // max(slots, 1)) + 24


class SlotPool:
    """Slots of `capacity` rows per table for `num_tables` dynamic tables (see the module docstring)."""

    def __init__(self, num_tables: int, capacity: int, admit_after: int, eviction: str,
                 device: torch.device, lfu_half_life: int = 0, ttl_steps: int = 0,
                 counting: Counting = Counting()) -> None:
        if eviction not in ("lru", "lfu"):
            raise ValueError(f"embedding.eviction={eviction!r} is not one of lru, lfu")
        self.num_tables, self.capacity, self.admit_after, self.eviction = num_tables, capacity, admit_after, eviction
        self.half_life = lfu_half_life  # LFU: a row's uses count half per this many steps unread (0: never)
        self.ttl = ttl_steps  # a row unread for more than this many steps expires (0: never)
        n = num_tables * capacity
        self.map = kernels.make_id_slot_map(n, device)
        self.admission = make_counter(admit_after, device, counting)  # None: admitted at once
        self.slot_gid = torch.full((n,), -1, dtype=torch.int64, device=device)
        # a slot's scores side by side (one cache line: a step reads and stamps them for every id)
        scores = torch.zeros(n, 2, dtype=torch.int64, device=device)
        self.last_use, self.uses = scores[:, 0].fill_(-1), scores[:, 1]
        self.counters = torch.zeros(len(POOL_COUNTERS), num_tables, dtype=torch.int64, device=device)
        self.c = {k: self.counters[i] for i, k in enumerate(POOL_COUNTERS)}
        # free slots of table t, lowest first: _holes[t] (sorted; only after a load), then every
        # slot from _free_from[t] up (a slot is freed only to be reused at once, by _slots_for)
        self._free_from = [t * capacity for t in range(num_tables)]
        self._holes = [self.slot_gid[:0]] * num_tables
        # the map's last two answers (gids, slots, miss, gids sorted?, step asked in), kept exact: a
        # step asks for the same ids up to three times (admit, rows, apply); an insert updates the
        # sorted ones asked in this step (drops the others: answers for an earlier step are rarely
        # asked again), an erase drops all
        self._memo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool, int]] = []
        self._clock = -1  # the step of the last admit (the memo's current step)
        self.stale_copies = 0  # copies that came back to another life of their id, dropped (0: pins hold)
        # callables giving gids (any order, any owner) never to be evicted now (module docstring)
        self.pins: list[Callable[[], torch.Tensor]] = []
        self.journal = PoolJournal(self)  # undo within a step (begin / commit / rollback)

    def reindex(self) -> None:
        """Rebuild the id -> slot map and the free slots from slot_gid (after a checkpoint load)."""
        self._memo.clear()
        self.map.erase(self.map.items()[0])
        held = torch.nonzero(self.slot_gid >= 0).squeeze(1)
        self.map.insert(self.slot_gid[held], held)
        for t in range(self.num_tables):
            lo, hi = t * self.capacity, (t + 1) * self.capacity
            taken = torch.nonzero(self.slot_gid[lo:hi] >= 0).squeeze(1)
            self._free_from[t] = lo + (int(taken[-1]) + 1 if taken.numel() else 0)
            self._holes[t] = torch.nonzero(self.slot_gid[lo:self._free_from[t]] < 0).squeeze(1) + lo

    def cursors(self) -> tuple[list[int], list[torch.Tensor]]:
        """The free slots' cursors as they are now (copies of the lists; the hole tensors are
        replaced, never written): what PoolJournal keeps at begin()."""
        return list(self._free_from), list(self._holes)

    def restore_cursors(self, free_from: list[int], holes: list[torch.Tensor]) -> None:
        """The free slots' cursors put back (PoolJournal.rollback); the map's remembered answers
        forgotten (the map changed under them)."""
        self._memo.clear()
        self._free_from[:], self._holes[:] = free_from, holes

    def lookup(self, gids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots [n], -1 where absent; miss [n] bool) of gids (not to be modified: the same
        tensors answer the same gids again while the map is unchanged)."""
        if not gids.numel():
            return self.map.lookup(gids)
        for i, m in enumerate(self._memo):
            if m[0].numel() == gids.numel() and torch.equal(m[0], gids):
                self._memo.insert(0, self._memo.pop(i))
                return m[1], m[2]
        if len(self._memo) == 2:  # the owner's update asks for its own ids then its peers' (W > 1)
            for x, y in (self._memo, self._memo[::-1]):
                k = x[0].numel()
                if k + y[0].numel() == gids.numel() and torch.equal(x[0], gids[:k]) and torch.equal(y[0], gids[k:]):
                    return torch.cat([x[1], y[1]]), torch.cat([x[2], y[2]])
        slots, miss = self.map.lookup(gids)
        self._memo = [(gids.clone(), slots, miss, _ascending(gids), self._clock), *self._memo[:1]]
        return slots, miss

    def _insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Map ids [m] (ascending, none in the map) to slots [m]; the remembered answers learn them."""
        self.map.insert_absent(ids, slots)
        memo = []
        for g, s, miss, ascending, step in self._memo:
            if ascending and step == self._clock:
                at = torch.searchsorted(g, ids).clamp_(max=g.numel() - 1)
                there = g[at] == ids
                at = at[there]
                memo.append((g, s.index_copy(0, at, slots[there]), miss.index_fill(0, at, False), True, step))
        self._memo = memo

    def rows_in_use(self) -> torch.Tensor:
        """[T] slots holding an id, per table."""
        return (self.slot_gid >= 0).view(self.num_tables, self.capacity).sum(1)

    def pending_ids(self) -> int:
        """Ids counted but not admitted (admit_after > 1; count_min: an estimate, admission.py)."""
        return 0 if self.admission is None else self.admission.pending_ids()

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
        if not gids.numel():
            return None
        self._clock = step
        u = gids if _ascending(gids) else torch.unique(gids)  # a plan's owned ids are already
        slots_u, miss_u = self.lookup(u)
        hit = slots_u[~miss_u]
        self.journal.save(hit)
        reborn = self._expire(u[~miss_u], hit, step) if self.ttl else None
        self.last_use.index_fill_(0, hit, step)
        self.uses.index_add_(0, hit, torch.ones_like(hit))
        got = self._admit_new(u[miss_u], step)
        if reborn is None or got is None:
            return got if reborn is None else reborn
        ids, slots = torch.cat([got[0], reborn[0]]), torch.cat([got[1], reborn[1]])
        order = torch.argsort(ids)
        return ids[order], slots[order]

    def _expire(self, ids: torch.Tensor, slots: torch.Tensor, step: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """embedding.ttl_steps: the ids among the read ones [n] (holding `slots`) whose rows were
        not read for more than ttl steps start a new life in the same slot (returned for the
        store to initialise; counted as an eviction and an admission): an expired row is never
        read again. Decided by each id's own last read and the step: the same at any W."""
        stale = expired(self.last_use[slots], step, self.ttl)
        if not bool(stale.any()):
            return None
        ids, slots = ids[stale], slots[stale]
        self.uses.index_fill_(0, slots, 0)  # the read below makes it 1: a new life's count
        t = ids >> ID_BITS
        self.c["evictions"].index_add_(0, t, torch.ones_like(t))
        self.c["admissions"].index_add_(0, t, torch.ones_like(t))
        return ids, slots

    def _admit_new(self, new: torch.Tensor, step: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """admit's ids without a row, new [m] (ascending): count them (admit_after > 1), place
        the ones due (evicting where a table is full); (gids, slots) of those admitted, or None."""
        if new.numel() and self.admission is not None:
            new = new[self.admission.count(new, step)]
        if not new.numel():
            return None
        ids, slots = self._place(new, step)
        if not ids.numel():
            return None
        self.journal.save(slots)
        self._insert(ids, slots)
        self.slot_gid.index_copy_(0, slots, ids)
        self.last_use.index_fill_(0, slots, step)
        self.uses.index_fill_(0, slots, 1)
        if self.admission is not None:
            self.admission.admitted(ids)
        self.c["admissions"].index_add_(0, ids >> ID_BITS, torch.ones_like(ids))
        return ids, slots

    def _place(self, new: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots for the ids due, new [m] (ascending, so grouped by table): (ids that got one,
        their slots). Where every table's ids fit its free tail (the usual step until a pool
        fills), all at once; else table by table (_slots_for: holes, tail, evictions)."""
        table = new >> ID_BITS
        need = torch.bincount(table, minlength=self.num_tables)
        start = torch.tensor(self._free_from, device=new.device)
        room = torch.arange(1, self.num_tables + 1, device=new.device) * self.capacity - start
        if not any(h.numel() for h in self._holes) and bool((need <= room).all()):
            first = torch.cumsum(need, 0) - need  # each table's first position in new
            slots = start.index_select(0, table) + torch.arange(new.numel(), device=new.device) \
                - first.index_select(0, table)
            self._free_from = (start + need).tolist()
            return new, slots
        got_ids, got_slots, lo_id = [], [], 0
        for t, n in enumerate(need.tolist()):
            if n:
                s = self._slots_for(t, n, step)
                got_ids.append(new[lo_id:lo_id + s.numel()])
                got_slots.append(s)
                self.c["rejected"][t] += n - s.numel()
            lo_id += n
        return torch.cat(got_ids), torch.cat(got_slots)

    def _slots_for(self, t: int, n: int, step: int) -> torch.Tensor:
        """Up to n slots of table t: free ones first (lowest first), then evicted ones (lowest
        score first; never a row read in this step)."""
        lo, hi = t * self.capacity, (t + 1) * self.capacity
        holes = self._holes[t]
        free = holes[:n]
        self._holes[t] = holes[n:]
        take = min(n - free.numel(), hi - self._free_from[t])
        if take > 0:
            free = torch.cat([free, torch.arange(self._free_from[t], self._free_from[t] + take,
                                                 device=self.slot_gid.device)])
            self._free_from[t] += take
        short = n - free.numel()
        if short <= 0:
            return free
        victims = self._victims(lo, hi, short, step)
        if victims.numel():
            self.journal.save(victims)
            self._memo.clear()
            self.map.erase(self.slot_gid[victims])
            self.slot_gid[victims] = -1
            self.c["evictions"][t] += victims.numel()
        return torch.cat([free, victims])

    def _victims(self, lo: int, hi: int, m: int, step: int) -> torch.Tensor:
        """Up to m occupied slots of [lo, hi) not read in `step`, lowest score first: LRU = least
        recently read (ties: lowest slot); LFU = fewest uses, ties least recent (then lowest slot).
        O(capacity), no sort of the table (topk / kthvalue)."""
        c = hi - lo
        last = self.last_use[lo:hi]
        ok = (last < step) & (self.slot_gid[lo:hi] >= 0)  # (slots just taken free hold no id yet)
        if self.pins:  # held elsewhere (a replica, a lent row): never evicted
            ok &= ~torch.isin(self.slot_gid[lo:hi], torch.cat([p().to(last.device) for p in self.pins]))
        recency = last * c + torch.arange(c, device=last.device)  # distinct keys: one order everywhere
        never = torch.iinfo(torch.int64).max
        m = min(m, int(ok.sum()))
        if m == 0:
            return recency[:0]
        if self.eviction == "lfu":
            uses = self.lfu_scores(self.uses[lo:hi], last, step).masked_fill(~ok, never)
            cut = int(torch.kthvalue(uses, m).values)  # the m-th fewest uses: take all below it,
            below = torch.nonzero(uses < cut).squeeze(1)  # then the least recent of those at it
            at = torch.nonzero(uses == cut).squeeze(1)
            tie = at[torch.topk(recency[at], m - below.numel(), largest=False).indices]
            pick = torch.cat([below, tie])
            key = torch.stack([uses[pick], recency[pick]])
            order = torch.argsort(key[1])
            order = order[torch.argsort(key[0][order], stable=True)]
            return pick[order] + lo
        return torch.topk(recency.masked_fill(~ok, never), m, largest=False, sorted=True).indices + lo

    def lfu_scores(self, uses: torch.Tensor, last_use: torch.Tensor, step: int) -> torch.Tensor:
        """LFU's score of rows with `uses` reads, last read at `last_use`, seen from `step`: the
        uses, halved for every `half_life` steps since the last read (embedding.lfu_half_life;
        0: the uses themselves). A function of the saved scores and the step alone: the same on
        every owner and after a resume."""
        if not self.half_life:
            return uses
        idle = ((step - last_use).clamp(min=0) // self.half_life).clamp(max=62)
        return uses >> idle

    def bytes_per_slot(self) -> dict[str, int]:
        """What the pool costs per row slot beyond the row: its share of the map (pool_slot_bytes:
        a hash-table cell of int64 key + int64 value, 32 B at load 1/2 in the Triton table; the
        CPU map's bound), the slot's id (8 B), its scores (last use and uses: 16 B)."""
        cell = pool_slot_bytes(self.map.device, self.slot_gid.numel()) - 24
        return {"map": cell, "slot_id": 8, "scores": 16, "total": cell + 24}
