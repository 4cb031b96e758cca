"""Data sources: each yields `Batch` objects holding this rank's slice of the global batch."""
from __future__ import annotations

from ..config import Config, local_batch_size, table_rows
from .batch import Batch
from .synthetic import SyntheticData

__all__ = ["Batch", "SyntheticData", "make_data"]


def make_data(cfg: Config, rank: int, world: int) -> SyntheticData:
    """The data source named by cfg.data.name for this rank."""
    if cfg.data.name == "synthetic":
        return SyntheticData(cfg.data, table_rows(cfg), rank, world, local_batch_size(cfg, world))
    raise ValueError(f"data.name={cfg.data.name!r} is not supported")
