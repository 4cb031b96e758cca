"""Data sources: each yields `Batch` objects holding this rank's slice of the global batch.

synthetic: generated Zipf data; criteo: blocks prepared by scripts/prepare_criteo.py, read by DALI
(default) or the memmap reference reader; movielens: MovieLens-100K from the recbole wheel.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Union

from ..config import Config, DataConfig, local_batch_size, table_rows
from .batch import Batch
from .ids import GuardedData, IdGuard, IdRangeError
from .synthetic import SyntheticData

if TYPE_CHECKING:  # the real-data modules are imported only when selected (DALI is heavy)
    from .blocks import CriteoData
    from .movielens import MovieLensData

__all__ = ["Batch", "GuardedData", "IdGuard", "IdRangeError", "SyntheticData", "make_data", "dataset_shape"]


def dataset_shape(d: DataConfig) -> tuple[int, list[int]]:
    """(num_dense, table_rows) of a file-backed dataset, read from its metadata/files.
    Raises FileNotFoundError / ValueError with the path when the data is missing or malformed."""
    if d.name == "criteo":
        from .criteo import read_meta
        meta = read_meta(d.dir)
        return int(meta["num_dense"]), [int(n) for n in meta["table_rows"]]
    if d.name == "movielens":
        from .movielens import shape
        return shape(d.dir)
    raise ValueError(f"data.name={d.name!r} has no file-backed shape")


def _local_gpu(cfg: Config) -> Optional[int]:
    """The GPU a DALI pipeline should run on: the current CUDA device when training on CUDA."""
    import torch
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    return torch.cuda.current_device() if on_cuda else None


def make_data(cfg: Config, rank: int, world: int) -> GuardedData:
    """The data source named by cfg.data.name for this rank, behind the id-range guard
    (data.out_of_range, ids.py). With data.epochs > 0 it also sets cfg.train.steps: this is the
    first place where both the training rows and W are known."""
    data = _make_data(cfg, rank, world)
    if cfg.data.epochs > 0 and cfg.data.name in ("criteo", "movielens"):
        cfg.train.steps = max(1, math.ceil(cfg.data.epochs * data.train_rows / (data.b * world)))
    return GuardedData(data, IdGuard(table_rows(cfg), cfg.data.out_of_range))


def _make_data(cfg: Config, rank: int, world: int) -> Union[SyntheticData, CriteoData, MovieLensData]:
    b = local_batch_size(cfg, world)
    if cfg.data.name == "synthetic":
        return SyntheticData(cfg.data, table_rows(cfg), rank, world, b)
    if cfg.data.name == "criteo":
        from .blocks import CriteoData, memmap_reader
        num_dense = cfg.data.num_dense
        if cfg.data.loader == "dali":
            from .dali import dali_reader
            reader = dali_reader(num_dense, cfg.data.loader_threads, _local_gpu(cfg))
        else:
            reader = memmap_reader(num_dense)
        return CriteoData(cfg.data, table_rows(cfg), rank, world, b, reader)
    if cfg.data.name == "movielens":
        from .movielens import MovieLensData
        return MovieLensData(cfg.data, table_rows(cfg), rank, world, b)
    raise ValueError(f"data.name={cfg.data.name!r} is not supported")
