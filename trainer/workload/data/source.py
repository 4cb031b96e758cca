"""What the trainer calls on a data object: the protocols SyntheticData, CriteoData and MovieLensData
(and the wrappers around them, ids.MappedData: GuardedData, ScrambledIds, HashedIds) satisfy.

GlobalData: random access to the training stream by position, the global view the scheduler plans
from (sparse/schedule/feed.py) and the placement profiles (sparse/placement/profile.py).
DataSource: GlobalData and this rank's batches: the step's training batch (the loop without a
feed), the test / validation batches (the evaluation) and the validation split's size.
GuardedSource: a DataSource behind the id-range guard (make_data's), which counts the ids it folded
(the reports' ids_hashed).
"""
from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np

from .batch import Batch


class GlobalData(Protocol):
    """Random access to the training stream: the keys of stream positions, the ids of the samples
    of keys (values sample-major, lengths [G, T]) and the batch of the samples of keys."""

    def stream_keys(self, pos: np.ndarray) -> np.ndarray: ...

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def sample_batch(self, keys: np.ndarray) -> Batch: ...


class DataSource(GlobalData, Protocol):
    """A data source of one rank: its slice of each global batch and of the evaluation splits."""

    @property
    def val_rows(self) -> int:
        """Rows of the validation split, all ranks together (0: the run has none)."""
        ...

    def train_batch(self, step: int) -> Batch:
        """This rank's slice of global batch `step` in the data's own order."""
        ...

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        """This rank's batches of split test or val; every rank yields as many (some may be empty)."""
        ...


class GuardedSource(DataSource, Protocol):
    """A data source behind the id-range guard (make_data's GuardedData)."""

    @property
    def ids_hashed(self) -> int:
        """Ids folded into their table so far (data.out_of_range=hash)."""
        ...
