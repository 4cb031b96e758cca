"""data.min_count: a vocabulary of the ids the training rows use often enough; every other id
shares one out-of-vocabulary row per table.

Why: a prepared set hashes every table into 1M rows by default, while a small set (a few thousand
rows) uses a few hundred to a few thousand ids per table. With min_count = 1 the model's tables
hold exactly the ids the training rows use, plus one shared row for the ids they never saw (those
read an untrained row otherwise): a small run no longer initialises, trains and checkpoints 26M
rows it never reads (the default command on the 2k sample went from ~42 s to ~6 s per model). With
min_count = K > 1 the ids seen fewer than K times also share that row, which is then trained on
every rare value of the table (the `min_categr_count` of FuxiCTR/BARS, DLRM's frequency
threshold). On the 2k sample that cost DLRM, DeepFM and WDL AUC (an id seen once in training often
returns in the test rows) but helped DCN; the tiny and small recipes take 1, and 2 for DCN (README).

The vocabulary is counted on the training rows only (the validation and test rows left out), over
the whole training split, so it is the same on every rank and for any W. Table t's ids become:
0 -> 0 (an empty field keeps its own row), an id seen >= min_count times -> 2 + its rank among
those, anything else -> 1 (the out-of-vocabulary row). Table t then has 2 + kept rows; these are
the data.table_rows the model is built with (data.max_table_rows still folds them afterwards).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from ...base.core.device import resident
from .criteo import EMPTY_ID, from_block
from .segment import Segment

OOV_ROW = 1  # the shared row of every id seen fewer than min_count times (or never)
FIRST_KEPT = 2


@dataclass(frozen=True)
class Vocab:
    """The kept ids of every table, as one sorted array of global keys (table offset + id)."""

    keys: torch.Tensor  # [K] int64 ascending: stored_offset[t] + id for each kept id of table t
    offsets: torch.Tensor  # [T] int64 stored-row offset of each table (exclusive cumulative sum)
    starts: torch.Tensor  # [T] int64 position in keys of table t's first kept id
    kept: list[int]  # [T] kept ids per table
    min_count: int

    @property
    def table_rows(self) -> list[int]:
        """Rows per table after the mapping: empty, out-of-vocabulary, then the kept ids."""
        return [FIRST_KEPT + k for k in self.kept]

    def map(self, ids: torch.Tensor) -> torch.Tensor:
        """Stored ids [b, T] (int64, in range) -> vocabulary ids [b, T] on the same device."""
        dev = ids.device
        keys, offsets, starts = (resident(x, dev) for x in (self.keys, self.offsets, self.starts))
        q = ids + offsets
        pos = torch.searchsorted(keys, q.reshape(-1)).reshape(q.shape)
        found = keys[pos.clamp(max=max(keys.numel() - 1, 0))] == q if keys.numel() else torch.zeros_like(q, dtype=torch.bool)
        out = torch.where(found, FIRST_KEPT + pos - starts, torch.full_like(ids, OOV_ROW))
        return torch.where(ids == EMPTY_ID, torch.full_like(ids, EMPTY_ID), out)


_CACHE: dict[tuple, Vocab] = {}


def _stamp(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return path, st.st_size, st.st_mtime_ns


def build_vocab(segs: list[Segment], num_dense: int, stored_rows: list[int], min_count: int) -> Vocab:
    """The vocabulary of ids seen >= min_count times in the rows of segs (ids folded into their
    table mod its stored rows, as data.out_of_range=hash would; an out-of-range id under the
    default policy is refused when its batch is read). Memory: one count per stored row. The
    result is cached per (segments, files' size and time, min_count): every rank and every config
    resolution in one process counts once."""
    if min_count < 1:
        raise ValueError(f"data.min_count={min_count}: a vocabulary needs min_count >= 1")
    key = (tuple(segs), tuple(_stamp(f) for f in sorted({s.file for s in segs})), tuple(stored_rows), min_count)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    counts = [np.zeros(n, np.int64) for n in stored_rows]
    for s in segs:
        ids = from_block(np.load(s.file, mmap_mode="r")[s.lo:s.hi], num_dense)[2]
        for t, n in enumerate(stored_rows):
            counts[t] += np.bincount(np.remainder(ids[:, t], n), minlength=n)
    kept_ids = []
    for c in counts:
        c[EMPTY_ID] = 0  # the empty field is never a vocabulary entry: it keeps row 0
        kept_ids.append(np.flatnonzero(c >= min_count))
    offsets = np.concatenate([[0], np.cumsum(stored_rows)[:-1]]).astype(np.int64)
    keys = np.concatenate([o + k for o, k in zip(offsets, kept_ids)]).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum([k.size for k in kept_ids])[:-1]]).astype(np.int64)
    vocab = Vocab(torch.from_numpy(keys), torch.from_numpy(offsets), torch.from_numpy(starts),
                  [int(k.size) for k in kept_ids], min_count)
    _CACHE[key] = vocab
    return vocab
