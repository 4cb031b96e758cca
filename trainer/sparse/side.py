"""Sparse: one rank's sparse side as a value, what the step, the reports and the evaluation are
handed (trainer/run/build.py's build_sparse assembles it from the config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .embedding import HybridEmbedding
from .embedding.cache.consistency import Bounds
from .embedding.sharding import Sharding
from .placement import Plan
from .schedule import Feed
from .schedule.herald import HeraldPlanner

__all__ = ["Sparse"]


@dataclass
class Sparse:
    """One rank's sparse side, as assembled by build_sparse."""

    sharding: Sharding
    emb: HybridEmbedding
    plan: Plan
    bounds: Bounds  # the staleness bounds in force (all 0 without a cache: exact)
    feed: Optional[Feed]  # the scheduler's global view (placement / schedule), else None
    herald: Optional[HeraldPlanner]
