"""Ids outside their table, caught where ids enter the trainer: rejected or folded in by config.

Why at the data boundary: the embedding adds a table's offset to each id to get a row of the fused
global id space (embedding/sharding.py), so an id >= the table's rows (or < 0) would silently read
and train another table's row, or a padding row. Every batch a data source yields passes one guard
before anything sees it (training, eval, and the global view of placement and Herald, so every
rank and every planner sees the same ids), which costs one comparison per id.

data.out_of_range:
- error (default): the batch is refused before any state changes, with a message naming the table,
  the first bad id and the table's size (and how many ids of the batch are out of range);
- hash: each such id is replaced by id mod rows (floored, so -1 -> rows - 1): deterministic, the
  same on every rank and run; ids inside the table are unchanged. The number folded is counted
  (summary.json: `ids_hashed`).
Criteo's prepared blocks are checked against the data's own table sizes (meta.json) first, before
data.max_table_rows folds them into smaller tables (a folding the config asked for).
"""
from __future__ import annotations

import weakref

from typing import Any, Iterator

import numpy as np
import torch

from ...base.core.device import resident
from .batch import Batch
from .source import DataSource


ID_BITS = 56  # embedding.kind=dynamic: a table takes any id in [0, 2^ID_BITS) (docs/dynamic.md)
ID_LIMIT = 1 << ID_BITS


class IdRangeError(ValueError):
    """A batch holds ids outside their table (data.out_of_range=error); names table, id, size."""


_PASSED_KEPT = 64  # batches IdGuard.batch remembers as passed (a repeated one is not checked again)


class IdGuard:
    """Checks (and, with policy hash, folds) per-table ids against the tables' row counts."""

    def __init__(self, table_rows: list[int], policy: str, what: str = "data") -> None:
        if policy not in ("error", "hash"):
            raise ValueError(f"data.out_of_range={policy!r} is not one of error, hash")
        self.rows = torch.tensor(list(table_rows), dtype=torch.int64)  # copied to a device once (resident)
        self.policy, self.what = policy, what
        self._hashed = 0  # ids folded so far (policy hash), counted on the host
        self._hashed_on: list[torch.Tensor] = []  # ... and on devices (read only when reported)
        # the last batches that passed unchanged, by id, held weakly (a batch that dies leaves)
        self._passed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    @property
    def hashed(self) -> int:
        """Ids folded so far (policy hash)."""
        if self._hashed_on:
            self._hashed += int(sum(int(c) for c in self._hashed_on))
            self._hashed_on = []
        return self._hashed

    def values(self, values: torch.Tensor, table: torch.Tensor, where: str) -> torch.Tensor:
        """values [N] of tables table [N] -> in-range values [N] (the same tensor when all are)."""
        if values.numel() == 0:
            return values
        lim = resident(self.rows, values.device)[table]
        bad = (values < 0) | (values >= lim)
        if not bool(bad.any()):
            return values
        if self.policy == "error":
            self._raise(values, table, bad, where)
        self._hashed += int(bad.sum())
        return torch.remainder(values, lim)

    def columns(self, ids: torch.Tensor, where: str) -> torch.Tensor:
        """ids [b, T] with table t in column t (one id per bag), or [b, T, n] (bags of n ids) ->
        in-range ids of the same shape (without the [N] table index `values` needs, which costs
        more than the check itself on the host: 1.7M ids, ~30 ms against ~5). Nothing
        is copied per batch, and policy hash reads nothing back (the folded ids are counted where
        the batch is, read when reported: a DALI batch on the GPU goes on without waiting); policy
        error reads one flag per batch: the batch must be refused before anything uses it."""
        if ids.numel() == 0:
            return ids
        lim = resident(self.rows, ids.device).view(1, -1, *[1] * (ids.dim() - 2))
        bad = (ids < 0) | (ids >= lim)
        if self.policy == "hash":
            self._hashed_on.append(bad.sum())
            if len(self._hashed_on) >= 1024:  # keep the list short; one read per 1024 batches
                self._hashed_on = [torch.stack(self._hashed_on).sum()]
            return torch.where(bad, torch.remainder(ids, lim), ids)
        if bool(bad.any()):
            table = torch.arange(ids.shape[1], device=ids.device).view(lim.shape).expand_as(ids)
            self._raise(ids.reshape(-1), table.reshape(-1), bad.reshape(-1), where)
        return ids

    def batch(self, b: Batch, where: str) -> Batch:
        if self._passed.get(id(b)) is b:  # this very batch passed before (data.cycle_batches)
            return b
        out = self._check(b, where)
        if out is b:  # batches are never changed in place: a repeated one needs no second look
            self._passed[id(b)] = b
            if len(self._passed) > _PASSED_KEPT:
                self._passed.pop(next(iter(self._passed.keys())), None)
        return out

    def _check(self, b: Batch, where: str) -> Batch:
        n = b.uniform_bag_length()
        if n is not None:  # every bag holds n ids: checked by column, no per-id table index
            v = self.columns(b.values.view(b.batch_size, b.num_tables, n), where).reshape(-1)
            return b if v.data_ptr() == b.values.data_ptr() else Batch(b.dense, v, b.lengths, b.labels,
                                                                       bag_length=b.bag_length)
        tables = b.table_index().to(b.values.device)
        v = self.values(b.values, tables, where)
        return b if v is b.values else Batch(b.dense, v, b.lengths, b.labels, tables, b.bag_length)

    def sample_ids(self, values: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        """The numpy form (global views): values [N] with lengths [G, T] (sample-major bags)."""
        t = np.tile(np.arange(lengths.shape[1]), lengths.shape[0])
        table = np.repeat(t, lengths.reshape(-1))
        given = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        out = self.values(given, torch.from_numpy(table.astype(np.int64)), where)
        return values if out is given else out.numpy()

    def _raise(self, values: torch.Tensor, table: torch.Tensor, bad: torch.Tensor, where: str) -> None:
        first = int(torch.nonzero(bad)[0, 0])
        t, v = int(table[first]), int(values[first])
        rows = int(self.rows[t])
        raise IdRangeError(
            f"{self.what}: id {v} of table {t} is outside the table's {rows} rows (valid ids: 0..{rows - 1}); "
            f"{int(bad.sum())} of the {values.numel()} ids of the {where} are out of range. "
            "Set data.out_of_range=hash to fold such ids into their table (id mod rows)")


class MappedData:
    """A data source whose every batch (and global-view id list) passes through map_batch / map_ids
    (a subclass's); every other attribute is the wrapped source's."""

    def __init__(self, data: DataSource) -> None:
        self._data = data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._data, name)

    @property
    def val_rows(self) -> int:
        return self._data.val_rows

    def map_batch(self, b: Batch, where: str) -> Batch:
        raise NotImplementedError

    def map_ids(self, values: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        raise NotImplementedError

    def train_batch(self, step: int) -> Batch:
        return self.map_batch(self._data.train_batch(step), f"training batch of step {step}")

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        for b in self._data.eval_batches(split):
            yield self.map_batch(b, "eval batch" if split == "test" else "validation batch")

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        values, lengths = self._data.sample_ids(keys)
        return self.map_ids(values, lengths, "global batch"), lengths

    def sample_batch(self, keys: np.ndarray) -> Batch:
        return self.map_batch(self._data.sample_batch(keys), "training batch")


class GuardedData(MappedData):
    """A data source whose every batch (and global-view id list) passes through an IdGuard."""

    def __init__(self, data: DataSource, guard: IdGuard) -> None:
        super().__init__(data)
        self.guard = guard

    @property
    def source(self) -> Any:
        return self._data

    @property
    def ids_hashed(self) -> int:
        """Ids folded so far, here and by a source with a guard of its own (criteo's blocks)."""
        inner = getattr(self._data, "guard", None)
        return self.guard.hashed + (inner.hashed if isinstance(inner, IdGuard) else 0)

    def map_batch(self, b: Batch, where: str) -> Batch:
        return self.guard.batch(b, where)

    def map_ids(self, values: np.ndarray, lengths: np.ndarray, where: str) -> np.ndarray:
        return self.guard.sample_ids(values, lengths, where)
