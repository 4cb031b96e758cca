"""data.scramble_ids: a data source whose ids look like raw 56-bit hashes (dynamic tables' tests);
data.hash_rows: the same ids hashed into N rows per table (fixed tables, the same-memory baseline).

Why: dynamic tables (embedding.kind=dynamic) take any id in [0, 2^56); the synthetic presets draw
ids in [0, table_rows). ScrambledIds maps table t's id i to scramble(t, i), a bijection of
[0, 2^56) per table (multiply by an odd constant, xor-shift, multiply again, add a per-table
constant, all mod 2^56), so the data is the same data (same samples, same labels, no two ids of a
table merged) with ids spread over the whole space, as production hashes are.
"""
from __future__ import annotations

import numpy as np
import torch

from ...base.core.hashing import mix64
from .batch import Batch
from .ids import ID_BITS, MappedData
from .source import DataSource

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


class ScrambledIds(MappedData):
    """A data source whose every batch (and global-view id list) has its ids scrambled."""

    def __init__(self, data: DataSource, seed: int) -> None:
        super().__init__(data)
        self.seed = seed

    def map_batch(self, b: Batch, where: str) -> Batch:
        return Batch(b.dense, scramble(b.values, b.table_index(), self.seed), b.lengths, b.labels)

    def map_ids(self, values: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        t = np.repeat(np.tile(np.arange(lengths.shape[1]), lengths.shape[0]), lengths.reshape(-1))
        return scramble(torch.from_numpy(np.asarray(values, np.int64)), torch.from_numpy(t), self.seed).numpy()


class HashedIds(MappedData):
    """data.hash_rows = N (fixed tables): table t's id i becomes splitmix64((t << 56) | i) mod N, as
    prepare_criteo.py --hash-rows folds raw Criteo values: ids that collide share a row. With drift
    or scrambled ids this is the baseline a dynamic table of N rows is measured against (the same
    rows, so the same memory for the rows)."""

    def __init__(self, data: DataSource, rows: int) -> None:
        super().__init__(data)
        self.rows = rows

    def fold(self, values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return (mix64(values | (table << ID_BITS)) & 0x7FFFFFFFFFFFFFFF) % self.rows

    def map_batch(self, b: Batch, where: str) -> Batch:
        return Batch(b.dense, self.fold(b.values, b.table_index()), b.lengths, b.labels)

    def map_ids(self, values: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        t = np.repeat(np.tile(np.arange(lengths.shape[1]), lengths.shape[0]), lengths.reshape(-1))
        return self.fold(torch.from_numpy(np.asarray(values, np.int64)), torch.from_numpy(t)).numpy()
