"""HET's per-worker cache of remote rows: slots, versions, pending local updates, eviction policy.

Why a cache: lookups are skewed, so the same remote rows are read step after step. Keeping a copy
(and the owner version it was read at) lets a worker skip pulling rows that are fresh enough and
batch its own updates to a row before pushing them (consistency.py holds the two rules).

Layout: one slot space [C, d] split into per-table regions (capacity per table). Each slot holds the
row, the owner version it was read at, the accumulated local gradient not yet pushed (`pending`), the
number of local updates in it (`count`), and policy metadata (use frequency, last step used). An
id -> slot map finds slots (slotmap.py: a direct array on CPU when the id space is small enough,
the Triton hash table on GPU).

Local updates are applied to the cached copy at once with plain SGD at the sparse learning rate
(copy -= lr * g): the owner keeps the only optimizer state (Adagrad accumulators) and applies the
real optimizer to the pushed sums. Under BSP every updated copy is re-read before its next use, so
this local rule never reaches the model; with bounds > 0 it is the cached view a worker trains on.

Cached rows are float32 whatever the owners' row type (embedding.dtype). Why: a copy is small (a
fraction of the remote rows, per worker), it takes the owner's half row exactly (float32 holds it),
and with bounds > 0 its local SGD updates and pending gradients accumulate in float32 instead of
being rounded away at every step; the owner alone rounds, once per update it applies. Under BSP a
copy is re-read before its next use, so it always equals the owner's row.

Rows needed by the current step are never evicted. When a table's region cannot hold all of a step's
misses, the rest are "transient": used for this step only and their gradients pushed at once.

Cost: every call is a handful of whole-batch tensor operations, never a Python loop per row. Slot
choice is vectorised over tables: a region's free slots are always its last ones (slots are handed
out lowest first and only come back by rollback, which restores the earlier state), so a per-table
count of free slots places misses without scanning; only tables whose region is full run a partial
selection (topk) over their region for victims.

Lives (dynamic tables): every push carries the life of the copy its updates were made on, and a
copy re-read in another life of its id drops its pending updates (consistency.py, "Lives").

Undo (train.nonfinite=skip): the cache holds a CacheJournal (journal.py) over its per-slot fields,
its map and its free counts, and saves each slot it changes into it first (`journal.save`), so a
step's reads can be rolled back exactly (`cache.journal`: begin / commit / rollback).

Nothing here talks to other workers: the simulator (trainer/sparse/sim/) drives the same object.
"""
from __future__ import annotations

import torch

from ....base.core.device import positions
from .journal import CacheJournal
from .consistency import life_changed, life_of, push_due
from .slotmap import id_slot_map
from ..types import Pushes

_NEVER = torch.iinfo(torch.int64).max  # eviction key of entries that must stay
# last_use is a use's tick: step << TICK_BITS | its rank among the cache's uses of that step (touch
# and install, in the order of their slots), so no two live entries share a policy key. Why:
# LRU keys were step numbers, so a region held many equal keys, and torch.topk's pick among equal
# keys is its kernel's: the CPU and CUDA kernels pick differently (seen on an H200, 2026-11-26:
# another run's hits and bytes). With distinct keys every device picks the same victims, at the
# cost of a shift; ties used to go to an arbitrary one of the step's entries, now to the one used
# first. Up to 2^21 uses per step and 2^32 steps (the LFU key below has 53 bits for the tick).
TICK_BITS = 21
LFU_FREQ_CAP = (1 << 10) - 2  # LFU orders by min(freq, cap): 10 bits beside the 53-bit tick


class CachePolicy:
    """Eviction order: victims are the evictable slots with the smallest keys."""

    name = "base"
    pins = False  # some entries are never evicted (evictable() is not all True)

    def __init__(self, pin_threshold: int = 0) -> None:
        self.pin_threshold = pin_threshold

    def keys(self, freq: torch.Tensor, last_use: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def evictable(self, freq: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(freq, dtype=torch.bool)


class LRU(CachePolicy):
    name = "lru"

    def keys(self, freq, last_use):
        return last_use  # the last use's tick


class LFU(CachePolicy):
    """Least frequently used (uses while cached, counted up to LFU_FREQ_CAP for the order), ties
    broken by least recent."""

    name = "lfu"

    def keys(self, freq, last_use):  # min(freq, cap) * 2^53 + the last use's tick
        return torch.add(last_use, freq.clamp(max=LFU_FREQ_CAP), alpha=1 << (32 + TICK_BITS))


class LFUPinned(LFU):
    """LFU where an entry used at least pin_threshold times is never evicted (HET's LFUOpt)."""

    name = "lfu_pinned"
    pins = True

    def evictable(self, freq):
        return freq < self.pin_threshold


POLICIES = {p.name: p for p in (LRU, LFU, LFUPinned)}


def make_policy(name: str, pin_threshold: int = 8) -> CachePolicy:
    try:
        return POLICIES[name](pin_threshold)
    except KeyError:
        raise ValueError(f"cache.policy={name!r} is not one of {sorted(POLICIES)}") from None


class RowCache:
    """Cached remote rows of one worker, per-table capacities, one policy."""

    def __init__(self, capacities: list[int], dim: int, policy: CachePolicy, n_ids: int,
                 local_lr: float, device: torch.device | str = "cpu") -> None:
        dev = torch.device(device)
        self.capacities, self.dim, self.policy, self.local_lr = list(capacities), dim, policy, local_lr
        self.num_tables = len(capacities)
        caps = torch.tensor(capacities, dtype=torch.int64)
        self.slot_table = torch.repeat_interleave(torch.arange(self.num_tables), caps).to(dev)  # [C]
        self.bounds = [0] + torch.cumsum(caps, 0).tolist()  # table t's slots: [bounds[t], bounds[t+1])
        self._end = torch.tensor(self.bounds[1:], dtype=torch.int64, device=dev)  # [T] region ends
        self._free = caps.clone().to(dev)  # [T] free slots per region: its last ones, [end - free, end)
        c = int(caps.sum())
        # every per-slot field has one slot more, `dump` = c, past the slots (the fields below are
        # views of the first c): a fixed-shape step (masked.py) writes its masked-off entries
        # there instead of selecting the others (a selection's size would be read back); its gid
        # stays -1, so the journal and the map never see it
        self.dump = c
        self.full = {
            "gid": torch.full((c + 1,), -1, dtype=torch.int64, device=dev),
            "rows": torch.zeros(c + 1, dim, device=dev),
            "pending": torch.zeros(c + 1, dim, device=dev),
            "version": torch.zeros(c + 1, dtype=torch.int64, device=dev),
            "count": torch.zeros(c + 1, dtype=torch.int64, device=dev),
            "freq": torch.zeros(c + 1, dtype=torch.int64, device=dev),
            "last_use": torch.full((c + 1,), -1, dtype=torch.int64, device=dev)}
        self.gid, self.rows, self.pending = (self.full[f][:c] for f in ("gid", "rows", "pending"))
        self.version, self.count, self.freq, self.last_use = (self.full[f][:c] for f in
                                                              ("version", "count", "freq", "last_use"))
        self.map = id_slot_map(n_ids, c, dev)
        self._uses = (-1, 0)  # (step, uses stamped in it so far): the next tick of that step
        self.journal = CacheJournal({f: self.full[f] for f in self._FIELDS}, self.map, self._free)

    _FIELDS = ("gid", "rows", "pending", "version", "count", "freq", "last_use")

    @property
    def size(self) -> int:
        return int(self.gid.numel())

    # ---- reads ---------------------------------------------------------------------------
    def lookup(self, gids: torch.Tensor) -> torch.Tensor:
        """[n] slot of each gid, -1 when not cached."""
        if self.size == 0 or gids.numel() == 0:
            return torch.full_like(gids, -1)
        return self.map.lookup(gids)[0]

    def versions_of(self, slots: torch.Tensor) -> torch.Tensor:
        """[n] version each slot's copy was read at; -1 (no copy) where the slot is -1."""
        if self.size == 0:
            return torch.full_like(slots, -1)
        return torch.where(slots >= 0, self.version.index_select(0, slots.clamp(min=0)), -1)

    def touch(self, slots: torch.Tensor, step: int) -> None:
        """Mark cached slots [k] (>= 0) as used at `step` (protects them from eviction this step)."""
        self.journal.save(slots)
        self.freq.index_add_(0, slots, torch.ones_like(slots))
        self._stamp(slots, step)

    def _stamp(self, slots: torch.Tensor, step: int) -> None:
        """last_use of distinct slots [k] := this step's next k ticks, in slot-list order."""
        done = self._uses[1] if self._uses[0] == step else 0
        k = slots.numel()
        if done + k > 1 << TICK_BITS or not 0 <= step < 1 << 32:
            raise RuntimeError(f"cache: {done + k} uses in step {step}: the eviction keys hold up "
                               f"to {1 << TICK_BITS} uses per step and steps below 2^32")
        self._uses = (step, done + k)
        ticks = torch.arange(k, device=slots.device) + ((step << TICK_BITS) + done)
        self.last_use.index_copy_(0, slots, ticks)

    def refresh(self, slots: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
        """Re-read copies: owner rows [k, d] at `versions`, own pending updates re-applied, unless
        the copy was of an earlier life of its id (dynamic tables: consistency.life_changed): then
        they are dropped, never applied to (or pushed into) the new life. Returns [k] the local
        updates dropped per slot (0 where kept; always 0 for fixed tables)."""
        self.journal.save(slots)
        pending = self.pending.index_select(0, slots)
        count = self.count.index_select(0, slots)
        gone = life_changed(self.version.index_select(0, slots), versions)
        pending.masked_fill_(gone.unsqueeze(1), 0.0)
        dropped = torch.where(gone, count, torch.zeros_like(count))
        self.rows.index_copy_(0, slots, rows - self.local_lr * pending)
        self.pending.index_copy_(0, slots, pending)
        self.count.index_copy_(0, slots, count - dropped)
        self.version.index_copy_(0, slots, versions)
        return dropped

    def install(self, gids: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                versions: torch.Tensor, step: int) -> tuple[torch.Tensor, Pushes]:
        """Cache fetched misses gids [n] (of `tables`) with rows [n, d] read at `versions`.

        Returns (slot of each, -1 = transient; dirty evicted entries whose updates must be pushed).
        """
        return self.install_counted(gids, tables, rows, versions, step)[:2]

    def install_counted(self, gids: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                        versions: torch.Tensor, step: int) -> tuple[torch.Tensor, Pushes, int]:
        """install(), and how many of the misses got a slot (the others are transient)."""
        slots, placed_n, victims_n = self._choose_slots(tables, step)
        if placed_n < slots.numel():  # some are transient: keep the placed ones
            ok = positions(slots >= 0, placed_n)
            placed, gids, rows, versions = (slots.index_select(0, ok), gids.index_select(0, ok),
                                            rows.index_select(0, ok), versions.index_select(0, ok))
        else:
            placed = slots
        if placed_n == 0:
            return slots, Pushes.empty(self.dim, self.rows.device), 0
        self.journal.save(placed)
        # only victims held entries; free slots need no eviction pass
        evicted = self._evict(placed) if victims_n else Pushes.empty(self.dim, self.rows.device)
        self.gid.index_copy_(0, placed, gids)
        self.rows.index_copy_(0, placed, rows)
        self.version.index_copy_(0, placed, versions)
        self.freq.index_fill_(0, placed, 1)
        self._stamp(placed, step)
        self.map.insert(gids, placed)
        return slots, evicted, placed_n

    # ---- writes --------------------------------------------------------------------------
    def record_updates(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """One local update per cached slot [k] (distinct): copy -= lr * g, pending += g."""
        self._update_copies(slots, grads)
        self.pending.index_add_(0, slots, grads)
        self.count.index_add_(0, slots, torch.ones_like(slots))

    def take_due(self, slots: torch.Tensor, push_bound: torch.Tensor) -> Pushes:
        """Pending updates of slots [k] whose count passed their table's push bound [T]."""
        return self._take(slots[self._due(self.count.index_select(0, slots), slots, push_bound)])

    def due_after_update(self, slots: torch.Tensor, push_bound: torch.Tensor) -> torch.Tensor:
        """[k] bool: the distinct cached slots [k] whose updates record_and_take_due(slots, ...)
        will push (known before the gradients are)."""
        return self._due(self.count.index_select(0, slots).add_(1), slots, push_bound)

    def _due(self, count: torch.Tensor, slots: torch.Tensor, push_bound: torch.Tensor) -> torch.Tensor:
        bound = push_bound.to(slots.device).index_select(0, self.slot_table.index_select(0, slots))
        return push_due(count, bound)

    def record_and_take_due(self, slots: torch.Tensor, grads: torch.Tensor,
                            push_bound: torch.Tensor, due_count: int | None = None) -> Pushes:
        """record_updates(slots, grads) then take_due(slots, push_bound), same results, in one
        gather and one scatter per field (a training step's write: slots [k] distinct).
        due_count: how many are due, when the caller knows (no read of the count)."""
        self._update_copies(slots, grads)
        pending = self.pending.index_select(0, slots).add_(grads)
        count = self.count.index_select(0, slots).add_(1)
        due = self._due(count, slots, push_bound)
        at = torch.nonzero(due).squeeze(1) if due_count is None else positions(due, due_count)
        took = slots.index_select(0, at)
        out = Pushes(self.gid.index_select(0, took), pending.index_select(0, at), count.index_select(0, at),
                     life_of(self.version.index_select(0, took)))
        self.pending.index_copy_(0, slots, pending.index_fill_(0, at, 0.0))
        self.count.index_copy_(0, slots, count.index_fill_(0, at, 0))
        return out

    def take_all(self) -> Pushes:
        """Every pending update (flush before eval, checkpoint and exit)."""
        return self._take(torch.nonzero(self.count > 0).squeeze(1))

    def pending_updates(self) -> int:
        return int(self.count.sum())

    # ---- internals -----------------------------------------------------------------------
    def _update_copies(self, slots: torch.Tensor, grads: torch.Tensor) -> None:
        """copy -= lr * g on distinct slots [k]."""
        if self.rows.device.type == "cpu":
            # the CPU index_add_ with alpha != 1 adds row by row; on distinct slots gather, add,
            # scatter computes the very same values (the same add kernel), vectorised
            moved = self.rows.index_select(0, slots).add_(grads, alpha=-self.local_lr)
            self.rows.index_copy_(0, slots, moved)
        else:
            self.rows.index_add_(0, slots, grads, alpha=-self.local_lr)

    def _take(self, slots: torch.Tensor) -> Pushes:
        out = Pushes(self.gid.index_select(0, slots), self.pending.index_select(0, slots),
                     self.count.index_select(0, slots), life_of(self.version.index_select(0, slots)))
        self.pending.index_fill_(0, slots, 0.0)
        self.count.index_fill_(0, slots, 0)
        return out

    def _evict(self, slots: torch.Tensor) -> Pushes:
        """Free slots [k] (some may be empty); return the dirty entries' pending updates."""
        old = self.gid.index_select(0, slots)
        live = slots[old >= 0]
        if live.numel():
            self.map.erase(self.gid.index_select(0, live))
        dirty = live[self.count.index_select(0, live) > 0]
        out = self._take(dirty)
        self.gid.index_fill_(0, live, -1)
        return out

    def _choose_slots(self, tables: torch.Tensor, step: int) -> tuple[torch.Tensor, int, int]:
        """A slot for each miss [n] of `tables`: free slots first, then policy victims among
        entries not used this step; -1 where the table's region has nothing left. Misses of a table
        take its slots in the order they come: its free slots lowest first, then its victims best
        first. Returns (slots [n], how many got a slot, how many of those are victims).

        Vectorised over tables: a miss's rank among its table's misses and the region's free count
        place it; only tables with more misses than free slots look for victims (_victims)."""
        n = tables.numel()
        out = torch.full((n,), -1, dtype=torch.int64, device=tables.device)
        if n == 0 or self.size == 0:
            return out, 0, 0
        out, _, order, first, need, took = self.free_placement(tables)
        # one host read: per table, the misses left after the free slots, where its victims'
        # misses start in `order`, and the free slots taken
        t_ = self.num_tables
        both = torch.cat([need - took, first + took, took]).tolist()
        short, start, took_n = both[:t_], both[t_:2 * t_], both[2 * t_:]
        placed, victims_n = sum(took_n), 0
        if any(short):
            pos, victims = [], []
            for t, v in self._victims(short, took_n, step):
                pos.append(order[start[t]:start[t] + v.numel()])
                victims.append(v)
            if victims:
                victims_t = torch.cat(victims)
                out[torch.cat(pos)] = victims_t
                victims_n = victims_t.numel()
        self._free -= took
        return out, placed + victims_n, victims_n

    def free_placement(self, key: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The free slots of misses: key [n] the table of each miss (num_tables: no miss, an entry
        a fixed-shape step masks off: cache/masked.py). A table's misses take its free slots (its
        region's tail) lowest first, in the order they come. Returns (slot [n], -1 where none is
        free or no miss; rank [n] of each miss among its table's; order [n] the misses grouped by
        table, in order; first [T] where each table's misses start in `order`; need [T] misses per
        table; took [T] free slots they take). Every size is n or T (counts into a fixed [T + 1]:
        bincount's length would depend on the values); the caller takes `took` from _free."""
        t_, n, dev = self.num_tables, key.numel(), key.device
        need = torch.zeros(t_ + 1, dtype=torch.int64, device=dev).index_add_(0, key, torch.ones_like(key))
        order = torch.argsort(key, stable=True)
        first = torch.cumsum(need, 0) - need
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=dev) - first.index_select(0, key.index_select(0, order))
        tab = key.clamp(max=t_ - 1)
        free = self._free.index_select(0, tab)
        slot = torch.where((key < t_) & (rank < free), self._end.index_select(0, tab) - free + rank,
                           torch.full_like(key, -1))
        need = need[:t_]
        return slot, rank, order, first[:t_], need, torch.minimum(need, self._free)

    def _victims(self, short: list[int], free: list[int], step: int) -> list[tuple[int, torch.Tensor]]:
        """(table, its victims) for every table t with short[t] > 0 misses left over once its
        free[t] free slots are taken: up to short[t] slots of its region, best first, the evictable
        entries not used this step with the smallest policy keys. A partial selection (topk) per
        region, never a sort; the keys come from one pass over the whole cache when most regions
        need victims."""
        b = self.bounds
        tables = [t for t, k in enumerate(short) if k and b[t + 1] > b[t]]
        if not tables:
            return []
        if 2 * sum(b[t + 1] - b[t] for t in tables) >= self.size:
            every = self._eviction_keys(0, self.size, step)
            keys = [every[b[t]:b[t + 1]] for t in tables]
        else:
            keys = [self._eviction_keys(b[t], b[t + 1], step) for t in tables]
        for t, key in zip(tables, keys):  # a region's free slots are its tail: never victims
            if free[t]:
                key[key.numel() - free[t]:].fill_(_NEVER)  # a fill (an assignment copies from the host)
        # live entries' keys are distinct (TICK_BITS), so the pick is the same on every device
        best = [torch.topk(key, min(short[t], key.numel()), largest=False, sorted=True)
                for t, key in zip(tables, keys)]
        # a region with fewer evictable entries than that ends its selection with _NEVER: it gives
        # all it has (a topk of exactly that many, so the same pick among equal keys)
        last = torch.stack([v.values[-1] for v in best]).tolist()
        out = []
        for t, key, sel, worst in zip(tables, keys, best, last):
            if worst == _NEVER:
                r = int((sel.values != _NEVER).sum())
                sel = torch.topk(key, r, largest=False, sorted=True) if r else None
            if sel is not None:
                out.append((t, sel.indices + b[t]))
        return out

    def _eviction_keys(self, lo: int, hi: int, step: int) -> torch.Tensor:
        """Policy key of the entries in slots [lo, hi); _NEVER for entries used this step and pinned
        ones (the policy may not evict them). Free slots get theirs from the caller (the region's
        tail)."""
        freq, last = self.freq[lo:hi], self.last_use[lo:hi]
        ok = (last >> TICK_BITS) != step  # not used this step (an empty slot's -1 stays -1)
        if self.policy.pins:
            ok &= self.policy.evictable(freq)
        return torch.where(ok, self.policy.keys(freq, last), _NEVER)
