"""Belady's optimal offline policy (MIN), the yardstick the cache simulator reports hit rates against."""
from __future__ import annotations

import heapq

import numpy as np


def next_use(seq: np.ndarray) -> np.ndarray:
    """[n] index of the next access to the same id after each position (n = never again)."""
    n = seq.size
    order = np.argsort(seq, kind="stable")  # positions grouped by id, ascending within an id
    s = seq[order]
    nxt = np.full(n, n, dtype=np.int64)
    same = s[1:] == s[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def belady_hits(seq: np.ndarray, capacity: int, bypass: bool = False) -> np.ndarray:
    """[n] bool: which accesses of `seq` hit under Belady's MIN with `capacity` slots.

    Miss with a full cache: evict the cached id with the farthest next use (never = infinity).
    bypass=True: the incoming id competes too (not inserted when its next use is the farthest).
    O(n log n): next uses by a stable argsort, the cache as a max-heap with lazy deletion.
    """
    seq = np.asarray(seq, dtype=np.int64).reshape(-1)
    n = seq.size
    if capacity <= 0 or n == 0:
        return np.zeros(n, dtype=bool)
    uniq, codes = np.unique(seq, return_inverse=True)
    if uniq.size <= capacity:  # everything fits: only first accesses miss
        first = np.zeros(n, dtype=bool)
        first[np.unique(codes, return_index=True)[1]] = True
        return ~first
    return _min_loop(codes.reshape(-1).tolist(), next_use(codes.reshape(-1)).tolist(), int(uniq.size),
                     capacity, bypass)


def _min_loop(codes: list[int], nxt: list[int], k: int, capacity: int, bypass: bool) -> np.ndarray:
    """The MIN loop over compact ids 0..k-1; heap keys -(next_use * k + id), stale keys skipped."""
    hit = np.zeros(len(codes), dtype=bool)
    cached = [-1] * k  # next use of each cached id, -1 = not cached
    heap: list[int] = []
    size = 0
    for i, (x, nu) in enumerate(zip(codes, nxt)):
        if cached[x] >= 0:
            hit[i] = True
        elif size < capacity:
            size += 1
        else:
            while True:  # drop stale heap entries until the top is a cached id's current key
                far, y = divmod(-heap[0], k)
                if cached[y] == far:
                    break
                heapq.heappop(heap)
            if bypass and nu >= far:
                continue
            heapq.heappop(heap)
            cached[y] = -1
        cached[x] = nu
        heapq.heappush(heap, -(nu * k + x))
    return hit


def opt_hits_by_table(worker: np.ndarray, table: np.ndarray, gid: np.ndarray, caps: list[int],
                      bypass: bool = False) -> np.ndarray:
    """[T] OPT hits summed over workers; each (worker, table) stream keeps its order in `gid`."""
    out = np.zeros(len(caps), dtype=np.int64)
    key = worker * len(caps) + table
    order = np.argsort(key, kind="stable")
    bounds = np.searchsorted(key[order], np.arange(key.max() + 2 if key.size else 1))
    for k in range(bounds.size - 1):
        lo, hi = bounds[k], bounds[k + 1]
        if hi > lo:
            t = k % len(caps)
            out[t] += int(belady_hits(gid[order[lo:hi]], caps[t], bypass).sum())
    return out
