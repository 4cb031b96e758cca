"""Herald's location-aware sample partition (Zeng et al.; the on-demand sync is embedding/remote/on_demand.py).

Why: every rank sees every global batch's ids (feed.py), so every rank computes the same
partition from the same inputs and no decision travels.

Partition (HeraldPartition): minimise the distinct (row, worker) reads of rows the worker neither
owns nor holds (lent by remote/on_demand.py's sync). Sample i scores at worker w the ids of i that
are free there (owned, held, and after the first pass also read by the other samples assigned to
w); samples go to their best worker, highest scores first, exactly B per worker. The best of these
passes and of the contiguous (random) partition is kept, so Herald is never worse than random on
its objective. Deterministic: numpy on the same inputs on every rank.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .feed import GlobalBatch
from .herald import HeraldPlanner, IdSpace, contiguous, unique_pairs


def dense_ids(gids: np.ndarray) -> np.ndarray:
    """[m] gids renumbered 0..k-1 in their order (a key gid * W + w cannot overflow then)."""
    return np.unique(gids, return_inverse=True)[1].reshape(-1).astype(np.int64)


class HeraldPartition:
    """Location-aware, exactly balanced assignment of a global batch's samples to workers.

    Objective: the distinct (row, worker) reads of rows the worker neither owns nor holds (each
    one a pull and a push under BSP; replicated rows do not count). Pass 0 scores sample i at
    worker w by the ids of i that w owns or holds; each further pass adds the ids that samples
    already assigned to w read too (co-location), and re-assigns. The best of the passes and of
    the contiguous (random) partition is kept, so Herald is never worse than random on it.
    """

    def __init__(self, world: int, space: IdSpace, planner: Optional[HeraldPlanner] = None,
                 cache_aware: bool = True, passes: int = 2) -> None:
        self.world, self.space, self.planner, self.cache_aware = world, space, planner, cache_aware
        self.passes = passes
        self.remote = 0  # remote reads (the objective) of the partitions chosen so far
        self.random_remote = 0  # ... and of the contiguous (random) partitions of the same batches

    def _pairs(self, gb: GlobalBatch) -> tuple[np.ndarray, np.ndarray]:
        """(sample [m], gid [m]): distinct non-replicated (sample, row) pairs."""
        keep = self.space.not_hot(gb.flat)
        return unique_pairs(gb.sample[keep], self.space.gids(gb.flat[keep]))

    def _free(self, gid: np.ndarray) -> np.ndarray:
        """[m, W] bool: the row is owned (or held, when cache-aware) by each worker."""
        w = self.world
        free = self.space.owner(gid)[:, None] == np.arange(w)[None, :]
        if self.cache_aware and self.planner is not None:
            free |= self.planner.holders.of(gid)[:, None] == np.arange(w)[None, :]
        return free

    def remote_reads(self, sample: np.ndarray, gid: np.ndarray, free: np.ndarray, a: np.ndarray) -> int:
        """The objective for assignment a: distinct (row, worker) reads not free at the worker
        (gid: dense_ids, so gid * W + w fits)."""
        w = a[sample]
        key, first = np.unique(gid * self.world + w, return_index=True)
        return int((~free[first, w[first]]).sum())

    def assign(self, gb: GlobalBatch) -> np.ndarray:
        n, w = gb.keys.size, self.world
        sample, gid = self._pairs(gb)
        free = self._free(gid)
        gid = dense_ids(gid)  # a key from here on
        naive = contiguous(n, w)
        cands = [naive]
        score = np.stack([np.bincount(sample, weights=free[:, k], minlength=n) for k in range(w)], 1)
        a = balanced_greedy(score, n // w)
        cands.append(a)
        for _ in range(self.passes):
            a = balanced_greedy(self._colocated(sample, gid, free, a, n), n // w)
            cands.append(a)
        costs = [self.remote_reads(sample, gid, free, c) for c in cands]
        best = int(np.argmin(costs))  # ties keep the earlier candidate (contiguous first)
        self.remote += costs[best]
        self.random_remote += costs[0]
        return cands[best]

    def _colocated(self, sample: np.ndarray, gid: np.ndarray, free: np.ndarray, a: np.ndarray,
                   n: int) -> np.ndarray:
        """[G, W] ids of each sample free at each worker given assignment a (owned, held, or read
        by another sample assigned there)."""
        w = self.world
        uk, cnt = np.unique(gid * w + a[sample], return_counts=True)
        out = np.empty((n, w))
        for k in range(w):
            key = gid * w + k
            pos = np.searchsorted(uk, key).clip(max=uk.size - 1)
            others = np.where(uk[pos] == key, cnt[pos], 0) - (a[sample] == k)
            out[:, k] = np.bincount(sample, weights=free[:, k] | (others > 0), minlength=n)
        return out


def balanced_greedy(s: np.ndarray, cap: int) -> np.ndarray:
    """[n] worker of each sample, exactly `cap` per worker: in rounds, every unassigned sample
    proposes its best worker with room (lowest index on ties); each worker keeps the highest
    scoring proposals (ties: lower sample index) up to its room. A round fills a worker or ends."""
    n, w = s.shape
    out = np.full(n, -1, np.int64)
    room = np.full(w, cap, np.int64)
    score = s.astype(np.float64)
    while (out < 0).any():
        free = np.nonzero(out < 0)[0]
        masked = np.where(room[None, :] > 0, score[free], -np.inf)
        best = masked.argmax(1)
        val = masked[np.arange(free.size), best]
        order = np.lexsort((free, -val, best))  # by worker, then score desc, then sample
        b_sorted = best[order]
        start = np.searchsorted(b_sorted, np.arange(w))
        rank_in = np.arange(order.size) - start[b_sorted]
        take = rank_in < room[b_sorted]
        out[free[order[take]]] = b_sorted[take]
        room -= np.bincount(b_sorted[take], minlength=w)
    return out
