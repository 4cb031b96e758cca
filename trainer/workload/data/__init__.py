"""Data sources: each yields `Batch` objects holding this rank's slice of the global batch.

synthetic: generated Zipf data; criteo: blocks prepared by scripts/prepare_criteo.py, read by DALI
(default) or the memmap reference reader; movielens: MovieLens-100K from the recbole wheel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional, Union

from ...base.config import (Config, ConfigError, DataConfig, check_data_source, data_source_error,
                      local_batch_size, run_device, source_rows, table_rows, val_rows)
from .batch import Batch
from .ids import ID_LIMIT, GuardedData, IdGuard, IdRangeError
from .scramble import HashedIds, ScrambledIds
from .source import DataSource, GlobalData, GuardedSource
from .synthetic import SyntheticData

if TYPE_CHECKING:  # the real-data modules are imported only when selected (DALI is heavy)
    from .blocks import CriteoData
    from .movielens import MovieLensData

__all__ = ["Batch", "DataShape", "DataSource", "GlobalData", "GuardedData", "GuardedSource", "IdGuard", "IdRangeError", "SyntheticData", "epoch_rows", "id_rows",
           "make_data", "resolve", "shape_of", "val_slices", "vocab_rows"]


@dataclass(frozen=True)
class DataShape:
    """What a file dataset says about itself; the entry point copies it into the config
    (trainer/run/resolve/configure.py), so the config never reads files and the data never writes the config."""

    num_dense: int  # dense features per sample -> data.num_dense
    table_rows: list[int]  # rows per table as stored, before data.max_table_rows -> data.table_rows
    split_rows: Optional[int] = None  # rows of the training split (validation rows included): the recipe's rule


def resolve(c: Config) -> Optional[DataShape]:
    """The shape of c's file dataset (criteo, movielens) read from its files. None for synthetic
    data: the config itself describes it. Reads c, never writes it. Raises FileNotFoundError /
    ValueError naming the path when the files are missing or malformed."""
    d = c.data
    if d.name == "criteo":
        from .criteo import read_meta
        meta = read_meta(d.dir)
        shape = DataShape(int(meta["num_dense"]), [int(n) for n in meta["table_rows"]])
    elif d.name == "movielens":
        from .movielens import shape as movielens_shape
        shape = DataShape(*movielens_shape(d.dir))
    else:
        return None
    return replace(shape, split_rows=split_rows(d))


def shape_of(c: Config) -> Optional[DataShape]:
    """resolve(c), with a dataset that cannot be read (data=criteo without data.dir, missing
    or malformed files) as a ConfigError naming data.dir."""
    check_data_source(c)
    try:
        return resolve(c)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise data_source_error(c, exc) from exc


def epoch_rows(c: Config, shape: Optional[DataShape]) -> int:
    """Training rows of one epoch (validation rows left out); 0 for an endless synthetic stream.
    shape: shape_of(c) (None: synthetic data, described by the config); its split_rows are not read again."""
    if shape is not None:
        n = shape.split_rows if shape.split_rows is not None else split_rows(c.data)
        return n - val_rows(n, c.data.val_fraction or 0.0)
    n = c.data.train_samples
    return n - val_rows(n, c.data.val_fraction or 0.0) if n > 0 else 0


def split_rows(d: DataConfig) -> int:
    """Rows of a file dataset's training split under d (data.train_samples applied), before a
    validation split is carved from it."""
    if d.name == "criteo":
        from .blocks import split_segments
        from .criteo import read_meta
        return sum(s.rows for s in split_segments(read_meta(d.dir), d.dir, d)[0])
    if d.name == "movielens":
        from .movielens import train_split_rows
        return train_split_rows(d)
    raise ValueError(f"data.name={d.name!r} has no training split of fixed size")


def val_slices(d: DataConfig, count: int) -> list[int]:
    """`count` data.val_slice values spread over the S = floor(training rows / validation rows)
    slices of a file dataset's training split: 1, 1 + S // count, ... (all S when count >= S)."""
    if not d.val_fraction:
        raise ValueError("the run has no validation split (data.val_fraction=0): no slices to spread")
    if count < 1:
        raise ValueError(f"{count} validation slices: must be >= 1")
    n = split_rows(d)
    available = n // val_rows(n, d.val_fraction)
    count = min(count, available)
    return [1 + i * (available // count) for i in range(count)]


def vocab_rows(d: DataConfig) -> list[int]:
    """data=criteo with data.min_count > 0: rows per table of the training rows' vocabulary
    (trainer/workload/data/vocab.py), before data.max_table_rows."""
    if d.name != "criteo":
        raise ValueError(f"data.min_count is a data=criteo option, not data={d.name}")
    from .blocks import train_vocab
    return train_vocab(d).table_rows


def train_rows(d: DataConfig) -> int:
    """Rows of a file dataset's training split under d: the rows make_data's source trains on
    (data.val_fraction's validation rows left out)."""
    n = split_rows(d)
    return n - val_rows(n, d.val_fraction or 0.0)


def _local_gpu(cfg: Config) -> Optional[int]:
    """The GPU a DALI pipeline should run on: the current CUDA device when the run trains on CUDA
    (config.run_device)."""
    import torch
    return torch.cuda.current_device() if run_device(cfg) == "cuda" else None


def make_data(cfg: Config, rank: int, world: int) -> GuardedData:
    """The data source named by cfg.data.name for this rank, behind the id-range guard
    (data.out_of_range, ids.py). It does not touch cfg: the step count data.epochs asks for comes
    from the shape load_config kept, applied by the caller (trainer.run.resolve.recipes.apply_data_steps)."""
    data: DataSource = _make_data(cfg, rank, world)
    if cfg.embedding.kind != "dynamic":
        if cfg.data.hash_rows:  # the same ids as a dynamic table would see, hashed into the rows
            data = HashedIds(ScrambledIds(data, cfg.data.seed) if cfg.data.scramble_ids else data, cfg.data.hash_rows)
        return GuardedData(data, IdGuard(table_rows(cfg), cfg.data.out_of_range))
    if cfg.data.scramble_ids:
        data = ScrambledIds(data, cfg.data.seed)
    # dynamic tables take any id below ID_LIMIT (data.out_of_range: outside it, an error or folded)
    return GuardedData(data, IdGuard(id_rows(cfg), cfg.data.out_of_range))


def id_rows(cfg: Config) -> list[int]:
    """The id space of every table: its rows (fixed tables), or ID_LIMIT each (dynamic ones, whose
    flat ids are then the global ids (table << 56) | id: profiles, plans and the feed use them)."""
    if cfg.embedding.kind == "dynamic":
        return [ID_LIMIT] * len(table_rows(cfg))
    return table_rows(cfg)


def _make_data(cfg: Config, rank: int, world: int) -> Union[SyntheticData, CriteoData, MovieLensData]:
    b = local_batch_size(cfg, world)
    if cfg.data.name == "synthetic":
        return SyntheticData(cfg.data, source_rows(cfg), rank, world, b, pin_memory=_local_gpu(cfg) is not None)
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
