"""The global feed: every rank sees every global batch's ids, so schedules can be planned locally
and agree without communication.

Why a global view: FAE's scheduler must know that *every* id of a global batch is replicated to
skip the alltoall (all ranks must agree), the replicated rows' allreduce needs the union of hot rows
the global batch touches (the same list on every rank), and Herald partitions the global batch by
where rows live and plans pushes by who reads what next. Each rank generates the ids of the whole
global batch (cheap: no features) and the features of its own samples only.

Semantics are unchanged: the global batch of step k is a set of G samples; an order (StreamOrder:
the data's own order; HotColdOrder: FAE's hot and cold batches) decides which set, a partition
decides which worker trains which of its samples. The single-process reference (W = 1) runs the
same order, so W workers still reproduce it exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from ...workload.data.batch import Batch
from ...workload.data.source import GlobalData
from ..embedding.sharding import flat_ids
from ..embedding.types import GlobalStep


@dataclass
class GlobalBatch:
    """The ids of one global batch: keys [G], values [N] (sample-major), lengths [G, T],
    flat [N] flat ids, sample [N] the sample of each id, and whether it is a hot batch."""

    keys: np.ndarray
    values: np.ndarray
    lengths: np.ndarray
    flat: np.ndarray
    sample: np.ndarray
    hot: bool = False


class StreamOrder:
    """The data's own order: global batch k = stream positions [k G, (k + 1) G)."""

    def __init__(self, data: GlobalData, global_batch: int) -> None:
        self.data, self.g = data, global_batch

    def batch(self, step: int) -> tuple[np.ndarray, bool]:
        """(keys [G], hot) of global batch `step`."""
        return self.data.stream_keys(np.arange(step * self.g, (step + 1) * self.g, dtype=np.int64)), False


class HotColdOrder:
    """FAE's scheduler: within each window of M global batches, samples whose ids are all
    replicated form hot batches, the others cold batches; at most hot_rate * M of the window's
    batches are hot (hot samples beyond that train in cold batches), spread evenly among the cold
    ones. Within a batch samples keep their stream order. Deterministic, identical on every rank
    and for every W."""

    def __init__(self, data: GlobalData, global_batch: int, is_hot: Callable[[np.ndarray], np.ndarray],
                 table_rows: list[int], window: int, hot_rate: float) -> None:
        self.data, self.g, self.is_hot, self.rows = data, global_batch, is_hot, list(table_rows)
        self.window, self.hot_rate = window, hot_rate
        self._cached: tuple[int, list[tuple[np.ndarray, bool]]] = (-1, [])
        self.hot_samples = 0  # hot samples seen in the windows built so far
        self.samples = 0

    def batch(self, step: int) -> tuple[np.ndarray, bool]:
        w, i = divmod(step, self.window)
        if self._cached[0] != w:
            self._cached = (w, self._build(w))
        return self._cached[1][i]

    def _build(self, w: int) -> list[tuple[np.ndarray, bool]]:
        m, g = self.window, self.g
        keys = self.data.stream_keys(np.arange(w * m * g, (w + 1) * m * g, dtype=np.int64))
        values, lengths = self.data.sample_ids(keys)
        hot_id = self.is_hot(flat_ids(values, lengths, self.rows))
        sample = np.repeat(np.arange(keys.size), lengths.sum(1))
        cold_ids = np.bincount(sample[~hot_id], minlength=keys.size)
        hot = cold_ids == 0
        self.hot_samples, self.samples = self.hot_samples + int(hot.sum()), self.samples + keys.size
        n_hot = min(int(hot.sum()) // g, int(self.hot_rate * m))
        idx = np.arange(keys.size)
        hot_keys = keys[idx[hot][:n_hot * g]]
        cold_keys = keys[np.sort(np.concatenate([idx[~hot], idx[hot][n_hot * g:]]))]  # stream order
        at = set(int((j + 0.5) * m / n_hot) for j in range(n_hot)) if n_hot else set()
        out, h, c = [], 0, 0
        for i in range(m):
            if i in at:
                out.append((hot_keys[h * g:(h + 1) * g], True))
                h += 1
            else:
                out.append((cold_keys[c * g:(c + 1) * g], False))
                c += 1
        return out


def is_member(sorted_ids: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """x -> [x in sorted_ids] elementwise (sorted_ids sorted, non-empty)."""
    def member(x: np.ndarray) -> np.ndarray:
        pos = np.searchsorted(sorted_ids, x).clip(max=sorted_ids.size - 1)
        return sorted_ids[pos] == x
    return member


def make_order(data: GlobalData, global_batch: int, hot_flat: np.ndarray, table_rows: list[int],
               placement: Any) -> "StreamOrder | HotColdOrder":
    """The order a run with `placement` (PlacementConfig) uses: FAE's hot/cold batches when
    placement.hot_batches and rows are replicated, else the data's own. The trainer and the
    simulator both build their order here."""
    if placement.hot_batches and hot_flat.size:
        return HotColdOrder(data, global_batch, is_member(hot_flat), table_rows,
                            placement.window_batches, placement.hot_rate)
    return StreamOrder(data, global_batch)


class Feed:
    """Per step: this rank's Batch and the GlobalStep every rank agrees on."""

    def __init__(self, data: GlobalData, order: Any, table_rows: list[int], rank: int, world: int,
                 hot_flat: Optional[np.ndarray] = None, partition: Any = None, sync: Any = None) -> None:
        self.data, self.order, self.rows = data, order, list(table_rows)
        self.rank, self.world = rank, world
        self.hot_flat = hot_flat if hot_flat is not None else np.zeros(0, np.int64)
        self.partition, self.sync = partition, sync
        self.hot_steps = 0

    def global_batch(self, step: int) -> GlobalBatch:
        keys, hot = self.order.batch(step)
        values, lengths = self.data.sample_ids(keys)
        flat = flat_ids(values, lengths, self.rows)
        sample = np.repeat(np.arange(keys.size), lengths.sum(1))
        return GlobalBatch(keys, values, lengths, flat, sample, hot)

    def workers(self, gb: GlobalBatch) -> np.ndarray:
        """[G] worker of each sample: contiguous equal slices, or the partition's choice."""
        if self.partition is None or gb.hot:
            return np.repeat(np.arange(self.world), gb.keys.size // self.world)
        return self.partition.assign(gb)

    def step(self, step: int) -> tuple[Batch, GlobalStep]:
        gb = self.global_batch(step)
        owner = self.workers(gb)
        mine = gb.keys[owner == self.rank]
        hot_slots = None
        if self.hot_flat.size:
            pos = np.searchsorted(self.hot_flat, gb.flat).clip(max=self.hot_flat.size - 1)
            hit = self.hot_flat[pos] == gb.flat
            hot_slots = torch.from_numpy(np.unique(pos[hit]).astype(np.int64))
        self.hot_steps += int(gb.hot)
        sync = self.sync.plan(step, gb, owner) if (self.sync is not None and not gb.hot) else None
        return self.data.sample_batch(mine), GlobalStep(gb.hot, hot_slots, sync)
