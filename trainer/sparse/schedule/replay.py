"""A run as the simulator replays it: FeedTrace (the trainer's own global feed, as a trace) and the
simulator spec of a config. Used by the cost-model planner (placement/sca.py) and the simulator's
driver (trainer/tools/simulate.py)."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from ...base.config import Config, cache_capacities, local_batch_size, staleness_bounds, table_rows
from ...workload.data.source import GlobalData
from ..sim import SimSpec
from .feed import Feed, make_order


def spec_from_config(c: Config, workers: int, owners: str = "sharded", plan: Any = None) -> SimSpec:
    """The simulator spec of config `c`; with a placement Plan, its replicated rows and cache capacities."""
    pull, push = staleness_bounds(c)
    caps = cache_capacities(c)
    if plan is not None and plan.cache_rows is not None and c.cache.policy != "none":
        caps = list(plan.cache_rows)
    hot = plan.hot if plan is not None else np.zeros(0, np.int64)
    row_elem = {"fp32": 4, "fp16": 2, "bf16": 2}[c.comm.wire_precision]
    return SimSpec(table_rows(c), workers, caps, pull, push, c.cache.policy, owners,
                   c.cache.pin_threshold, c.model.embedding_dim, hot, row_elem)


class FeedTrace:
    """The trainer's global feed (schedule/feed.py), as a run with a placement or a schedule feeds
    its ranks: the order (the data's own, or FAE's hot/cold batches) and the partition (contiguous
    slices, or Herald's). Worker w's batch of step s is exactly rank w's batch of such a run."""

    def __init__(self, cfg: Config, workers: int, hot_flat: np.ndarray, data: Optional[GlobalData] = None,
                 partition: Any = None, sync: Any = None) -> None:
        self.workers, self.table_rows = workers, table_rows(cfg)
        self.global_batch = local_batch_size(cfg, workers) * workers
        self.description = f"data={cfg.data.preset} placement={cfg.placement.name}"
        if data is None:
            from ...workload.data import make_data
            data = make_data(cfg, 0, workers)
        self.data = data
        order = make_order(self.data, self.global_batch, np.asarray(hot_flat, np.int64), self.table_rows,
                           cfg.placement)
        self.feed = Feed(self.data, order, self.table_rows, 0, workers, hot_flat, partition, sync)
        self.steps = None
        self._at: tuple[int, Any, Any, Any] = (-1, None, None, None)

    def global_step(self, step: int) -> tuple[Any, np.ndarray, np.ndarray]:
        """(GlobalBatch, [G] worker of each sample, [N] table of each id) of `step` (cached)."""
        if self._at[0] != step:
            gb = self.feed.global_batch(step)
            t = gb.lengths.shape[1]
            tables = np.repeat(np.tile(np.arange(t), gb.keys.size), gb.lengths.reshape(-1))
            self._at = (step, gb, self.feed.workers(gb), tables)
        return self._at[1], self._at[2], self._at[3]

    def batch(self, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        gb, owner, tables = self.global_step(step)
        sel = owner[gb.sample] == worker
        return (torch.from_numpy(np.ascontiguousarray(gb.values[sel], np.int64)),
                torch.from_numpy(tables[sel]))
