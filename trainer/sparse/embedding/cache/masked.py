"""MaskedCache: a RowCache's step over a fixed set of entries, masked (train.cuda_graph=on at W > 1).

Why: RowCache's calls (rows.py) take the rows they act on as selections (the hits, the stale
copies, the misses, the due rows), each sized by a count read back from the device, and its slot
choice reads the free slots and victims per table back once a step. A fixed-shape step
(fixed/het.py) has every remote entry of its request at a fixed place ([W x C] entries, most of
them padding or owned) and must read nothing back, so here the same operations run over all
entries with a mask: masked-off entries write to the cache's dump slot (RowCache.dump, past the
slots, gid -1), never selected out.

The same state changes, in the same order, with the same values, as RowCache's calls in the
exact-size HET step (HetRemote.read and write_start): touch the hits (use ticks in entry order),
refresh the stale copies, install the misses (free slots lowest first, then victims, best
first), record the updates and take the due ones; so the cache, its eviction order and every
push are the exact step's (tests/distributed/test_padded_step.py). The victims: per table one
top-k of a fixed k (the fewer of its region and the most misses one step can have there) over
the eviction keys, of which a miss of rank r past the free slots takes entry r - free; live keys
are distinct (rows.py, TICK_BITS), so the first j entries of a top-k are the top-j the exact step
takes. The journal (train.nonfinite=skip) saves the entries' slots, the dump slot among them.

The id -> slot map's inserts and erases of the masked entries (IdSlotMap.insert_where /
erase_where): masked inside the kernels on a GPU (Triton's map) and in place on the CPU's direct
map; the CPU's reference hash map (large id spaces) selects them, a read it makes anyway (its
table lives in host memory).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .rows import _NEVER, TICK_BITS, RowCache

__all__ = ["Evicted", "MaskedCache"]


@dataclass
class Evicted:
    """The dirty entries a masked install evicted, one per entry ([n] each; valid: an entry is one):
    their ids, pending gradients [n, d] and update counts."""

    gids: torch.Tensor
    pending: torch.Tensor
    counts: torch.Tensor
    valid: torch.Tensor


class MaskedCache:
    """RowCache's operations over fixed entry sets (see the module docstring). `most_misses`: per
    table the most misses one step can have (the k of its victims' top-k)."""

    def __init__(self, cache: RowCache, most_misses: list[int]) -> None:
        self.cache = cache
        b = cache.bounds
        self.k = [min(b[t + 1] - b[t], m) for t, m in enumerate(most_misses)]
        # the tables that can have victims, and where each one's top-k starts among their concatenation
        self.with_k = [t for t in range(cache.num_tables) if self.k[t] > 0]
        offs, at = [0] * cache.num_tables, 0
        for t in self.with_k:
            offs[t], at = at, at + self.k[t]
        dev = cache.rows.device
        self.k_of = torch.tensor(self.k, dtype=torch.int64).to(dev)
        self.k_start = torch.tensor(offs, dtype=torch.int64).to(dev)
        self.k_total = at
        # each slot's table, the dump slot's 0 (read for masked-off entries too)
        self.slot_table = torch.cat([cache.slot_table, cache.slot_table.new_zeros(1)])
        self.uses: Optional[torch.Tensor] = None  # [] uses stamped in the current step (device)
        self.step = -1

    # ---- helpers ---------------------------------------------------------------------------
    def _at(self, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each entry's slot where mask holds, the dump slot elsewhere."""
        return torch.where(mask, slots, self.cache.dump)

    def _stamp(self, at: torch.Tensor, mask: torch.Tensor, step: int) -> None:
        """last_use of the masked entries' distinct slots := this step's next ticks, in entry order
        (RowCache._stamp); the count of uses stays on the device."""
        if not 0 <= step < 1 << 32:
            raise RuntimeError(f"cache: step {step}: the eviction keys hold steps below 2^32")
        if step != self.step:
            self.step, self.uses = step, torch.zeros((), dtype=torch.int64, device=at.device)
        rank = torch.cumsum(mask.long(), 0) - 1
        self.cache.full["last_use"].index_copy_(0, at, rank + self.uses + (step << TICK_BITS))
        self.uses = self.uses + mask.sum()
        torch._assert_async(self.uses <= 1 << TICK_BITS, "cache: more uses in one step than the eviction keys hold")
        self.cache._uses = (-1, 0)  # the exact-size calls' own count does not know these

    def _push_bound(self, at: torch.Tensor, push_bound: torch.Tensor) -> torch.Tensor:
        """[n] the push bound of each slot's table (push_bound [T])."""
        return push_bound.to(at.device).index_select(0, self.slot_table.index_select(0, at))

    # ---- reads ---------------------------------------------------------------------------
    def lookup(self, gids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[n] slot of each masked entry's gid (-1: not cached, or masked off)."""
        if self.cache.size == 0:
            return torch.full_like(gids, -1)
        return torch.where(mask, self.cache.map.lookup(gids)[0], -1)

    def touch(self, slots: torch.Tensor, hit: torch.Tensor, step: int) -> None:
        """RowCache.touch of the hits' slots, in entry order."""
        at = self._at(slots, hit)
        self.cache.journal.save(at)
        self.cache.full["freq"].index_add_(0, at, torch.ones_like(at))
        self._stamp(at, hit, step)

    def refresh(self, slots: torch.Tensor, stale: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor) -> None:
        """RowCache.refresh of the stale entries' copies (fixed tables: no life changes)."""
        c, at = self.cache, self._at(slots, stale)
        c.journal.save(at)
        pending = c.full["pending"].index_select(0, at)
        c.full["rows"].index_copy_(0, at, rows - c.local_lr * pending)
        c.full["version"].index_copy_(0, at, versions)

    def install(self, gids: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor,
                miss: torch.Tensor, step: int) -> tuple[torch.Tensor, Evicted]:
        """RowCache.install of the missed entries: (slot of each entry, -1 where it is no miss or
        transient; the dirty entries evicted to make room)."""
        c = self.cache
        slots, victim = self._choose(tables, miss, step)
        placed = slots >= 0
        at = self._at(slots, placed)
        c.journal.save(at)
        f = c.full
        old = f["gid"].index_select(0, at)
        if c.size:
            c.map.erase_where(old, victim)
        count = f["count"].index_select(0, at)
        dirty = victim & (count > 0)
        evicted = Evicted(old, f["pending"].index_select(0, at), count, dirty)
        f["pending"].index_fill_(0, at, 0.0)  # RowCache._take's, where dirty; zero already elsewhere
        f["count"].index_fill_(0, at, 0)
        f["gid"].index_copy_(0, at, torch.where(placed, gids, -1))  # the dump slot's stays -1
        f["rows"].index_copy_(0, at, rows)
        f["version"].index_copy_(0, at, versions)
        f["freq"].index_fill_(0, at, 1)
        self._stamp(at, placed, step)
        if c.size:
            c.map.insert_where(gids, slots, placed)
        return slots, evicted

    def _choose(self, tables: torch.Tensor, miss: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RowCache._choose_slots of the missed entries, in entry order: (slot [n], -1 where none
        or no miss; [n] bool the slot was a victim's). Free slots first, lowest first; then per
        table the victims of one fixed top-k (module docstring)."""
        c = self.cache
        n, t_, dev = tables.numel(), c.num_tables, tables.device
        none = torch.full((n,), -1, dtype=torch.int64, device=dev)
        if c.size == 0:
            return none, torch.zeros(n, dtype=torch.bool, device=dev)
        out, rank, _, _, need, took = c.free_placement(torch.where(miss, tables, t_))
        tab = tables.clamp(max=t_ - 1)
        short = need - took
        victim = torch.zeros(n, dtype=torch.bool, device=dev)
        if self.with_k:
            keys = c._eviction_keys(0, c.size, step)
            # a region's free slots are its tail, never victims (as RowCache._victims)
            tail = torch.arange(c.size, device=dev) >= (c._end - c._free).index_select(0, c.slot_table)
            keys = torch.where(tail, _NEVER, keys)
            b = c.bounds
            vals, idx = [], []
            for t in self.with_k:
                best = torch.topk(keys[b[t]:b[t + 1]], self.k[t], largest=False, sorted=True)
                vals.append(best.values)
                idx.append(best.indices + b[t])
            vals, idx = torch.cat(vals), torch.cat(idx)
            k = self.k_of.index_select(0, tab)
            j = rank - took.index_select(0, tab)  # the entry of the table's top-k this miss takes
            flat = (self.k_start.index_select(0, tab) + j.clamp(min=0)).clamp(max=self.k_total - 1)
            victim = (miss & (j >= 0) & (j < short.index_select(0, tab)) & (j < k)
                      & (vals.index_select(0, flat) != _NEVER))
            out = torch.where(victim, idx.index_select(0, flat), out)
        c._free -= took
        return out, victim

    def due_after_record(self, slots: torch.Tensor, cached: torch.Tensor, push_bound: torch.Tensor) -> torch.Tensor:
        """[n] bool: the cached entries whose updates record_and_take_due will push (known before
        the gradients are; changes nothing)."""
        at = self._at(slots, cached)
        count = self.cache.full["count"].index_select(0, at) + 1
        bound = self._push_bound(at, push_bound)
        return cached & (count > bound)

    # ---- writes --------------------------------------------------------------------------
    def record_and_take_due(self, slots: torch.Tensor, cached: torch.Tensor, grads: torch.Tensor,
                            push_bound: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """RowCache.record_and_take_due of the cached entries: (gid [n], pending [n, d], count [n])
        of each entry, and [n] bool the entry's updates are due (pushed now; their pending
        updates taken)."""
        c = self.cache
        at = self._at(slots, cached)
        c.journal.save(at)  # a push block that overflows undoes the step (FixedHet: the journal is open)
        f = c.full
        if c.rows.device.type == "cpu":  # as RowCache._update_copies
            f["rows"].index_copy_(0, at, f["rows"].index_select(0, at).add_(grads, alpha=-c.local_lr))
        else:
            f["rows"].index_add_(0, at, grads, alpha=-c.local_lr)
        pending = f["pending"].index_select(0, at).add_(grads)
        count = f["count"].index_select(0, at).add_(1)
        bound = self._push_bound(at, push_bound)
        due = cached & (count > bound)
        gid = f["gid"].index_select(0, at)
        f["pending"].index_copy_(0, at, pending.masked_fill(due.unsqueeze(1), 0.0))
        f["count"].index_copy_(0, at, count.masked_fill(due, 0))
        return gid, pending, count, due
