"""data.scramble_ids: a data source whose ids look like raw 56-bit hashes (dynamic tables' tests).

Why: dynamic tables (embedding.tables=dynamic) take any id in [0, 2^56); the synthetic presets draw
ids in [0, table_rows). ScrambledIds maps table t's id i to scramble(t, i), a bijection of
[0, 2^56) per table (multiply by an odd constant, xor-shift, multiply again, add a per-table
constant, all mod 2^56), so the data is the same data (same samples, same labels, no two ids of a
table merged) with ids spread over the whole space, as production hashes are.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from .batch import Batch
from .ids import ID_BITS

_MASK = (1 << ID_BITS) - 1
_A, _B = 0x9E3779B97F4A7C15 & _MASK | 1, 0xBF58476D1CE4E5B9 & _MASK | 1  # odd: invertible mod 2^56
_SHIFT = ID_BITS // 2


def _salt(seed: int, table: torch.Tensor) -> torch.Tensor:
    return ((table + 1) * (0x94D049BB133111EB & _MASK) + (seed * 0x2545F4914F6CDD1D & _MASK)) & _MASK


def scramble(values: torch.Tensor, table: torch.Tensor, seed: int) -> torch.Tensor:
    """[N] ids in [0, 2^56) of ids `values` [N] (in [0, 2^56)) of tables `table` [N]; a bijection
    per (table, seed). int64 arithmetic wraps, and the low 56 bits of a wrapped product are exact."""
    x = (values * _A) & _MASK
    x = x ^ (x >> _SHIFT)
    x = (x * _B) & _MASK
    return (x + _salt(seed, table)) & _MASK


class ScrambledIds:
    """A data source whose every batch (and global-view id list) has its ids scrambled; every
    other attribute is the wrapped source's."""

    def __init__(self, data: Any, seed: int) -> None:
        self._data, self.seed = data, seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)

    def _batch(self, b: Batch) -> Batch:
        return Batch(b.dense, scramble(b.values, b.table_index(), self.seed), b.lengths, b.labels)

    def train_batch(self, step: int) -> Batch:
        return self._batch(self._data.train_batch(step))

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        for b in self._data.eval_batches(split):
            yield self._batch(b)

    def sample_batch(self, keys: np.ndarray) -> Batch:
        return self._batch(self._data.sample_batch(keys))

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values, lengths = self._data.sample_ids(keys)
        t = np.repeat(np.tile(np.arange(lengths.shape[1]), lengths.shape[0]), lengths.reshape(-1))
        out = scramble(torch.from_numpy(np.asarray(values, np.int64)), torch.from_numpy(t), self.seed)
        return out.numpy(), lengths
