"""MovieLens-100K as a real CTR dataset: rating >= 4 is a click, user and item features are
categorical fields, a seeded random held-out split.

Why this dataset: it is real (skewed users and items, a learnable signal) and ships inside the PyPI
wheel recbole==1.2.1 (recbole/dataset_example/ml-100k/, installed with --no-deps by
scripts/setup.sh), so tests and CI train on real data without a download step.

Fields (tables): user_id, item_id, age, gender, occupation, zip_code, release_year, and genres as a
multi-hot bag (1..6 ids). Id 0 of every table is reserved for a missing value. Dense features: age / 100,
(release_year - 1900) / 100 (0 when missing), number of genres / 6.

Order: like the synthetic data, sample i of the training stream is a pure function of (seed, i):
epoch e = i // n_train visits the training rows in a permutation seeded by (seed, e), and rank r
takes [r*b, (r+1)*b) of each global batch, so W workers see exactly the single-process batches.
"""
from __future__ import annotations

import csv
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterator, Optional

import numpy as np
import torch

from ...base.config import DataConfig, val_rows
from .batch import Batch

FIELDS = ("user_id", "item_id", "age", "gender", "occupation", "zip_code", "release_year", "genre")
NUM_DENSE = 3
FILES = ("ml-100k.inter", "ml-100k.user", "ml-100k.item")


class MovieLensNotFound(FileNotFoundError):
    """The ml-100k files are neither in data.dir nor in an installed recbole package."""


def locate(directory: Optional[str]) -> str:
    """data.dir, or recbole's dataset_example/ml-100k (found without importing recbole)."""
    if directory is None:
        spec = importlib.util.find_spec("recbole")
        if spec is None or not spec.submodule_search_locations:
            raise MovieLensNotFound("MovieLens-100K not found: install it with "
                                    "`pip install --no-deps recbole==1.2.1` (scripts/setup.sh does) "
                                    "or set data.dir to a folder with ml-100k.inter/.user/.item")
        directory = os.path.join(list(spec.submodule_search_locations)[0], "dataset_example", "ml-100k")
    missing = [f for f in FILES if not os.path.exists(os.path.join(directory, f))]
    if missing:
        raise MovieLensNotFound(f"{directory} lacks {', '.join(missing)}")
    return directory


def _rows(path: str) -> list[list[str]]:
    with open(path, newline="", encoding="latin-1") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]


def _vocab(values: list[str]) -> dict[str, int]:
    """Sorted distinct non-empty values -> ids 1.. (0 = missing)."""
    return {v: i + 1 for i, v in enumerate(sorted({v for v in values if v}))}


@dataclass
class Table:
    """The whole dataset in memory (100k rows)."""

    dense: np.ndarray  # [N, 3] float32
    ids: np.ndarray  # [N, 7] int64 one-hot fields
    genres: list[np.ndarray]  # [N] int64 arrays of genre ids (>= 1 id each)
    labels: np.ndarray  # [N] float32, rating >= 4
    table_rows: list[int]  # [8] rows per table (reserved id 0 included)


def _user_item_features(directory: str) -> tuple[dict, dict, list[dict[str, int]]]:
    users = {r[0]: r for r in _rows(os.path.join(directory, "ml-100k.user"))}
    items = {r[0]: r for r in _rows(os.path.join(directory, "ml-100k.item"))}
    cols = [[u[0] for u in users.values()], [i[0] for i in items.values()],
            *[[u[k] for u in users.values()] for k in (1, 2, 3, 4)], [i[2] for i in items.values()],
            [g for i in items.values() for g in i[3].split()]]
    return users, items, [_vocab(c) for c in cols]


@lru_cache(maxsize=4)
def load(directory: str) -> Table:
    """Parse ml-100k.inter/.user/.item into id, dense and label arrays."""
    users, items, vocab = _user_item_features(directory)
    inter = _rows(os.path.join(directory, "ml-100k.inter"))
    ids = np.zeros((len(inter), 7), np.int64)
    dense = np.zeros((len(inter), NUM_DENSE), np.float32)
    genres, labels = [], np.zeros(len(inter), np.float32)
    for n, (user, item, rating, _) in enumerate(inter):
        u, it = users.get(user, [user, "", "", "", ""]), items.get(item, [item, "", "", ""])
        for t, v in enumerate((user, item, u[1], u[2], u[3], u[4], it[2])):
            ids[n, t] = vocab[t].get(v, 0)
        g = [vocab[7][x] for x in it[3].split()] or [0]
        genres.append(np.asarray(g, np.int64))
        year = float(it[2]) if it[2].isdigit() else 1900.0
        dense[n] = (float(u[1] or 0) / 100.0, (year - 1900.0) / 100.0, len(g) / 6.0)
        labels[n] = float(float(rating) >= 4.0)
    return Table(dense, ids, genres, labels, [len(v) + 1 for v in vocab])


def shape(directory: Optional[str]) -> tuple[int, list[int]]:
    """(num_dense, table_rows) of the dataset, for the config (trainer.workload.data.resolve)."""
    return NUM_DENSE, list(load(locate(directory)).table_rows)


def train_split_rows(cfg: DataConfig) -> int:
    """Rows of the training split under cfg (the same split MovieLensData trains on, before a
    validation split is carved from it)."""
    return int(split(cfg, load(locate(cfg.dir)).labels.size)[1].size)


def split_validation(cfg: DataConfig, train_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) rows: the validation split is the last data.val_fraction of the
    training rows (already a seeded random order), never rows of the eval split."""
    k = val_rows(train_idx.size, cfg.val_fraction or 0.0)
    return train_idx[:train_idx.size - k], train_idx[train_idx.size - k:]


def split(cfg: DataConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(eval, train) rows of the n ratings: a seeded random data.test_fraction is held out;
    data.train_samples / data.test_samples (> 0) keep only the first rows of each."""
    perm = np.random.default_rng([cfg.seed, 11]).permutation(n)
    n_eval = int(round(cfg.test_fraction * n))
    eval_idx, train_idx = perm[:n_eval], perm[n_eval:]
    if cfg.train_samples > 0:
        train_idx = train_idx[:cfg.train_samples]
    if cfg.test_samples > 0:
        eval_idx = eval_idx[:cfg.test_samples]
    return eval_idx, train_idx


class MovieLensData:
    """make_data's source for data=movielens: seeded split, W-invariant global batches."""

    def __init__(self, cfg: DataConfig, rows: list[int], rank: int, world: int, local_batch: int) -> None:
        self.cfg, self.rank, self.world, self.b = cfg, rank, world, local_batch
        self.t = load(locate(cfg.dir))
        self.rows = np.asarray(rows, np.int64)
        self.eval_idx, self.train_idx = split(cfg, self.t.labels.size)
        self.train_idx, self.val_idx = split_validation(cfg, self.train_idx)
        self._order: tuple[int, np.ndarray] = (-1, np.zeros(0, np.int64))

    @property
    def train_rows(self) -> int:
        return int(self.train_idx.size)

    @property
    def global_batch(self) -> int:
        return self.b * self.world

    def samples(self, idx: np.ndarray) -> Batch:
        """The rows idx as a Batch (7 one-hot tables + the genre bag)."""
        bags = [self.t.genres[i] for i in idx]
        lengths = np.concatenate([np.ones((idx.size, 7), np.int64),
                                  np.asarray([len(g) for g in bags], np.int64).reshape(-1, 1)], axis=1)
        values = [np.concatenate([self.t.ids[i], g]) for i, g in zip(idx, bags)]
        flat = np.concatenate(values) if values else np.zeros(0, np.int64)
        table = np.repeat(np.tile(np.arange(8), idx.size), lengths.reshape(-1))
        flat = np.remainder(flat, self.rows[table])
        return Batch(torch.from_numpy(self.t.dense[idx]), torch.from_numpy(flat),
                     torch.from_numpy(lengths), torch.from_numpy(self.t.labels[idx]))

    def _train_rows(self, gidx: np.ndarray) -> np.ndarray:
        n = self.train_idx.size
        epochs, pos = np.divmod(gidx, n)
        out = np.empty_like(gidx)
        for e in np.unique(epochs):
            out[epochs == e] = self.train_idx[self._epoch_order(int(e))[pos[epochs == e]]]
        return out

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """[n_train] visiting order of epoch `epoch` (seeded permutation; cached)."""
        if self._order[0] != epoch:
            n = self.train_idx.size
            rng = np.random.default_rng([self.cfg.seed, 13, epoch])
            self._order = (epoch, rng.permutation(n) if self.cfg.shuffle else np.arange(n))
        return self._order[1]

    # ---- the global view (schedulers, placement profiles) ------------------------------------
    def stream_keys(self, pos: np.ndarray) -> np.ndarray:
        """Dataset rows at positions `pos` of the (epoch-shuffled) training stream."""
        return self._train_rows(np.asarray(pos, dtype=np.int64))

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        b = self.samples(np.asarray(keys, dtype=np.int64))
        return b.values.numpy(), b.lengths.numpy()

    def sample_batch(self, keys: np.ndarray) -> Batch:
        return self.samples(np.asarray(keys, dtype=np.int64))

    def train_batch(self, step: int) -> Batch:
        """This rank's slice [rank*b, (rank+1)*b) of global batch `step`."""
        start = step * self.global_batch + self.rank * self.b
        return self.samples(self._train_rows(np.arange(start, start + self.b, dtype=np.int64)))

    @property
    def val_rows(self) -> int:
        return int(self.val_idx.size)

    def _split_idx(self, split: str) -> np.ndarray:
        if split not in ("test", "val"):
            raise ValueError(f"split={split!r}: must be test or val")
        return self.eval_idx if split == "test" else self.val_idx

    def num_eval_steps(self, split: str = "test") -> int:
        return -(-self._split_idx(split).size // (self.cfg.eval_batch_size * self.world))

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        """Every rank yields the same number of batches (some may be empty) covering the split
        (test: the held-out eval split; val: the validation rows carved from the training rows)."""
        be, idx = self.cfg.eval_batch_size, self._split_idx(split)
        for k in range(self.num_eval_steps(split)):
            start = k * be * self.world + self.rank * be
            yield self.samples(idx[start:min(start + be, idx.size)])
