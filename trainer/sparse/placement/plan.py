"""Plans: the Plan type, FAE's planner, and plan_run (what rank 0 of a run does).

A planner is a pure function from an access profile (profile.py), the world size, the table shapes,
the optimizer and a per-worker memory budget to a Plan; planners other than FAE live in their own
modules and register here (sca.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

from ...base.config import ConfigError, local_batch_size
from ...workload.data import id_rows
from ...workload.data.source import GlobalData
from ..embedding.sharding import Sharding
from .profile import AccessProfile, profile_stream

PLANNERS = ("none", "fae", "sca")
_REGISTERED: dict[str, Callable[..., "Plan"]] = {}  # planners defined in other modules (sca.py)


def register(name: str, planner: Callable[..., "Plan"]) -> None:
    """Make planner `name` available to make_plan (sca.py registers itself when imported)."""
    _REGISTERED[name] = planner

@dataclass
class Plan:
    """The placement of every row.

    hot:        [H] sorted flat ids replicated on every worker
    cache_rows: per-table cache capacity the planner chose (None: the cache config's)
    predicted:  predicted bytes per global sample by kind (None: the planner does not predict)
    """

    name: str
    hot: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    cache_rows: Optional[list[int]] = None
    predicted: Optional[dict[str, float]] = None
    info: dict[str, Any] = field(default_factory=dict)

    def hot_gids(self, sharding: Sharding) -> torch.Tensor:
        """[H] fused global ids of the hot rows in `sharding` (sorted, like `hot`: the fused layout
        keeps the table order)."""
        return torch.from_numpy(np.asarray(sharding.from_flat(self.hot), np.int64))

    def summary(self) -> dict[str, Any]:
        out = {"name": self.name, "hot_rows": int(self.hot.size), **self.info}
        if self.cache_rows is not None:
            out["cache_rows"] = list(self.cache_rows)
        if self.predicted is not None:
            out["predicted_bytes_per_sample"] = dict(self.predicted)
        return out


ROW_ELEM = {"fp32": 4, "fp16": 2, "bf16": 2}  # bytes of a row element per embedding.dtype


def row_bytes(dim: int, optimizer: str, row_elem: int = 4) -> int:
    """Bytes a replicated row costs one worker: the row (dim x row_elem: embedding.dtype) plus its
    sparse optimizer state (float32 whatever the rows' type)."""
    state = {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 1}[optimizer]
    return dim * row_elem + state * 4


def fae_plan(profile: AccessProfile, budget_bytes: int, per_row: int) -> Plan:
    """FAE: the most read rows (ties: smaller flat id) that fit budget_bytes on every worker."""
    n = min(budget_bytes // per_row, profile.ids.size)
    top = profile.by_frequency()[:n]
    hot = np.sort(profile.ids[top])
    covered = int(profile.counts[top].sum())
    return Plan("fae", hot, info={"budget_bytes": int(budget_bytes), "bytes_per_row": per_row,
                                  "replicated_bytes": int(n * per_row),
                                  "profile": profile.summary(),
                                  "profile_read_coverage": covered / max(int(profile.counts.sum()), 1)})


def make_plan(name: str, profile: AccessProfile | None, **kw: Any) -> Plan:
    """The plan of planner `name` (kw: budget_bytes, per_row, and sca's cost inputs)."""
    if name == "none":
        return Plan("none")
    if profile is None:
        raise ConfigError(f"placement={name!r} needs an access profile")
    if name == "fae":
        return fae_plan(profile, kw["budget_bytes"], kw["per_row"])
    if name in _REGISTERED:
        return _REGISTERED[name](profile, **kw)
    raise ConfigError(f"placement.name={name!r}: must be one of {', '.join(PLANNERS)}")


def plan_run(c: Any, data: GlobalData, world: int, interrupt: Optional[Callable[[], bool]] = None) -> Plan:
    """What rank 0 of a run does (and scripts/plan.py, the simulator): profile the run's training
    stream (`data` offers the global view) and plan with config c's placement for W = world.
    interrupt: a stop request ends the profile (profile_stream)."""
    p = c.placement
    if p.name == "none":
        return Plan("none")
    t0 = time.perf_counter()
    rows = id_rows(c)  # dynamic tables: the profile's flat ids are the global ids
    profile = profile_stream(data, rows, c.train.steps * local_batch_size(c, world) * world,
                             p.profile_fraction, interrupt=interrupt)
    plan = make_plan(p.name, profile, budget_bytes=p.budget_bytes,
                     per_row=row_bytes(c.model.embedding_dim, c.optim.sparse, ROW_ELEM[c.embedding.dtype]), config=c, world=world,
                     data=data)
    plan.info["plan_seconds"] = round(time.perf_counter() - t0, 3)
    return plan
