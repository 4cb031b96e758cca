"""Herald (Zeng et al.): on-demand synchronisation, and the id space it and its partition plan over.

Why global planning: every rank sees every global batch's ids (feed.py), so every rank can compute
the same partition and the same synchronisation plan. No decision, id request or "is it fresh?"
question ever travels: an owner knows which of its rows each worker pulls, which gradients arrive
and which rows come back, in which order.

Partition (HeraldPartition, a worker for each sample): partition.py.

On-demand sync (HeraldPlanner), exact (BSP) for every sparse optimizer:
- a row read in a step by exactly one worker w that is not its owner is *lent* to w: w pulls the
  row with its optimizer state and applies the real optimizer step locally, step after step, with
  no traffic at all while nobody else reads the row;
- the row goes back (value, optimizer state, update count: a "writeback") only when another worker
  (the owner included) reads it in the next step, or on eviction (the holder's LRU cache of lent
  rows is full), or at a flush (eval, checkpoint, exit);
- rows read by several workers in a step follow BSP: non-owners pull the row and push their
  gradient, the owner sums and updates once. A holder among them reads its own copy (just written
  back, so equal to the owner's) instead of pulling it.
The writebacks of step k are sent at the start of step k, before any read: "another worker will
read it" is then certain, not guessed, and a row never goes back earlier than needed.

Counters (naive = contiguous partition, every remote read pulled and its gradient pushed):
pulls, pushes (gradients + writebacks) and the naive baseline, for summary.json and the simulator.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..embedding.dynamic.pool import expired
from ..embedding.sharding import Sharding
from .feed import GlobalBatch, is_member
from .holders import Holders


class IdSpace:
    """The scheduler's view of the id space: flat ids (W-independent, what the feed yields) ->
    fused global ids of the run's sharding, and which rows are replicated (hot, flat ids)."""

    def __init__(self, sharding: Sharding, hot_flat: np.ndarray) -> None:
        self.sharding = sharding
        self.hot = np.asarray(hot_flat, np.int64)
        self.n_ids = sharding.n_ids
        self._is_hot = is_member(self.hot) if self.hot.size else None

    def gids(self, flat: np.ndarray) -> np.ndarray:
        return self.sharding.from_flat(flat)

    def not_hot(self, flat: np.ndarray) -> np.ndarray:
        return np.ones(flat.shape, bool) if self._is_hot is None else ~self._is_hot(flat)

    def owner(self, gids: np.ndarray) -> np.ndarray:
        return self.sharding.owner(gids)

    def owner_order(self, gids: np.ndarray) -> np.ndarray:
        return self.sharding.owner_order(gids)


def unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (a, b) pairs of int64 values (any: dynamic tables' ids fill 63 bits), sorted
    by (a, b)."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    order = np.lexsort((b, a))
    a, b = a[order], b[order]
    first = np.ones(a.size, bool)
    first[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    return a[first], b[first]


def read_pairs(space: IdSpace, gb: GlobalBatch, worker_of: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """(gid [m], worker [m]): the distinct non-replicated rows each worker reads, sorted by gid."""
    keep = space.not_hot(gb.flat)
    return unique_pairs(space.gids(gb.flat[keep]), worker_of[gb.sample[keep]])


def remote_reads(space: IdSpace, gb: GlobalBatch, worker_of: np.ndarray, world: int) -> int:
    """Distinct (row, worker) reads of rows the worker does not own: naive pulls = naive pushes."""
    g, w = read_pairs(space, gb, worker_of, world)
    return int((space.owner(g) != w).sum())


def contiguous(g: int, world: int) -> np.ndarray:
    return np.repeat(np.arange(world), g // world)


@dataclass
class SyncPlan:
    """One step's synchronisation, per worker w (gids in owner order, then ascending):

    writeback[w]: rows w sends back (value, optimizer state, update count) before anyone reads
    pull[w]:      rows w pulls from their owners; lend[w] (bool over pull[w]): with their optimizer
                  state, to keep and update locally
    local[w]:     rows w reads from its own copy; keep[w] (bool over local[w]): w stays the holder
                  and updates it locally, else (just written back, shared) w pushes its gradient
    push[w]:      rows whose gradient w pushes to their owners this step
    expired:      lent rows read this step after more than embedding.ttl_steps steps unread (sorted,
                  every worker's): their id starts a new life at its owner now, so a copy read is
                  read again from the owner and a copy written back goes back to nothing
    reads:        [W, W] the distinct rows (not replicated) worker w reads of owner o's: whether
                  w's request fits blocks of a fixed capacity, known before the step (the
                  fixed-shape mode, embedding/fixed/shapes.py, trains a step that does not fit in
                  exact sizes instead: Herald's sync cannot be trained twice)
    """

    writeback: list[np.ndarray]
    pull: list[np.ndarray]
    lend: list[np.ndarray]
    local: list[np.ndarray]
    keep: list[np.ndarray]
    push: list[np.ndarray]
    expired: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    reads: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))


class HeraldPlanner:
    """The global state of on-demand sync: which worker holds which lent row (LRU per worker)."""

    def __init__(self, world: int, space: IdSpace, capacity: int, ttl: int = 0) -> None:
        self.world, self.space, self.capacity = world, space, int(capacity)
        self.ttl = ttl  # dynamic tables' embedding.ttl_steps (0: rows never expire)
        self.holders = Holders()
        self.returning = np.zeros(0, np.int64)  # the rows the last plan sends back (writebacks)
        self.held = [np.zeros(0, np.int64) for _ in range(world)]
        self.counts = {"pulls": 0, "lend_pulls": 0, "grad_pushes": 0, "writebacks": 0,
                       "local_reads": 0, "naive_remote_reads": 0}

    def plan(self, step: int, gb: GlobalBatch, worker_of: np.ndarray) -> SyncPlan:
        g, w = read_pairs(self.space, gb, worker_of, self.world)
        self.counts["naive_remote_reads"] += remote_reads(self.space, gb, contiguous(gb.keys.size, self.world),
                                                           self.world)  # random partition, no lending
        owner = self.space.owner(g)
        _, inv, cnt = np.unique(g, return_inverse=True, return_counts=True)
        readers = cnt[inv]
        h = self.holders.of(g)
        excl = (readers == 1) & (w != owner)
        back = np.unique(g[(h >= 0) & (w != h)])  # held rows somebody else reads now
        read = np.unique(g[h >= 0])  # a held row's holder was its only reader since it was lent:
        ended = read[expired(self.holders.last_use(read), step, self.ttl)]  # its last use is the id's
        hb = self.holders.of(back)
        wb = [back[hb == k] for k in range(self.world)]
        self.holders.drop(back)
        plan = self._per_worker(step, g, w, owner, h, excl, wb)
        self.returning = np.concatenate(plan.writeback)
        plan.expired = ended
        plan.reads = np.zeros((self.world, self.world), np.int64)
        np.add.at(plan.reads, (w, owner), 1)
        self._count(plan)
        return plan

    def _per_worker(self, step: int, g, w, owner, h, excl, wb) -> SyncPlan:
        out = SyncPlan([], [], [], [], [], [])
        for k in range(self.world):
            mine = w == k
            keep_g = g[mine & excl & (h == k)]  # held, read by k alone: local update
            clean = g[mine & ~excl & (h == k)]  # k held it, others read too: written back above
            shared = g[mine & ~excl & (h != k) & (owner != k)]
            want = g[mine & excl & (h != k)]  # candidates to lend
            held = np.setdiff1d(self.held[k], wb[k], assume_unique=True)
            evict, lends = self._make_room(held, keep_g, want)
            held = np.union1d(np.setdiff1d(held, evict, assume_unique=True), lends)
            self.held[k] = held
            self.holders.drop(evict)
            self.holders.add(lends, k, step)
            self.holders.touch(keep_g, step)
            transient = np.setdiff1d(want, lends, assume_unique=True)
            pull = self.space.owner_order(np.concatenate([shared, want]))
            local = self.space.owner_order(np.concatenate([keep_g, clean]))
            out.writeback.append(self.space.owner_order(np.concatenate([wb[k], evict])))
            out.pull.append(pull)
            out.lend.append(np.isin(pull, lends))
            out.local.append(local)
            out.keep.append(np.isin(local, keep_g))
            out.push.append(self.space.owner_order(np.concatenate([shared, clean, transient])))
        return out

    def _make_room(self, held: np.ndarray, used: np.ndarray, want: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows to evict, rows to lend): LRU victims among held rows not used this step, then as
        many candidates (ascending) as fit the capacity; the rest are transient."""
        over = held.size + want.size - self.capacity
        evict = np.zeros(0, np.int64)
        if over > 0:
            idle = np.setdiff1d(held, used, assume_unique=True)
            order = np.lexsort((idle, self.holders.last_use(idle)))
            evict = np.sort(idle[order[:min(over, idle.size)]])
        room = max(self.capacity - (held.size - evict.size), 0)
        return evict, want[:room]

    def _count(self, p: SyncPlan) -> None:
        c = self.counts
        c["pulls"] += sum(x.size for x in p.pull)
        c["lend_pulls"] += sum(int(x.sum()) for x in p.lend)
        c["grad_pushes"] += sum(x.size for x in p.push)
        c["writebacks"] += sum(x.size for x in p.writeback)
        c["local_reads"] += sum(x.size for x in p.local)

    def flush(self) -> list[np.ndarray]:
        """Every held row goes back to its owner (eval, checkpoint, exit); nothing stays lent."""
        out = [self.space.owner_order(x) for x in self.held]
        self.counts["writebacks"] += sum(x.size for x in out)
        self.holders = Holders()
        self.returning = np.concatenate(out)
        self.held = [np.zeros(0, np.int64) for _ in range(self.world)]
        return out

    def summary(self) -> dict[str, Any]:
        c = dict(self.counts)
        naive = c["naive_remote_reads"]
        pushes = c["grad_pushes"] + c["writebacks"]
        return {**c, "pushes": pushes, "pulls_vs_naive": c["pulls"] / naive if naive else None,
                "pushes_vs_naive": pushes / naive if naive else None, "capacity_rows": self.capacity}
