"""Synthetic skewed CTR data: per-table Zipf(alpha) ids, a planted signal, deterministic by seed.

Why: tests and benchmarks need data with real skew (a few rows take most lookups, as in Criteo)
and a learnable label, generated without a file and identical for any world size: sample i of the
training stream is a pure function of (seed, i), so each rank builds only its slice of the global
batch, and W workers together see exactly the global batch of the single-process reference.

Label model: logit = signal * (sum_t mean_{id in bag t} w_t[id] / sqrt(T) + x . v / sqrt(F)) with
planted w_t[id], v ~ N(0, 1); label ~ Bernoulli(sigmoid(logit)).

Drift (data.drift > 0, for embedding.kind=dynamic): the sample at stream position i draws its
ids as above and adds floor(drift x i) to each, so the id space is unbounded: new ids keep arriving
(drift per sample and table) and an id's popularity changes as the window moves over the scrambled
ranks. Evaluation samples are drawn as at training position data.drift_eval_at + their index.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Optional

import numpy as np
import torch

from ...base.config import DataConfig, val_rows
from . import rng
from .batch import Batch

TRAIN, EVAL = 0, 1
_S_LEN, _S_ID, _S_DENSE, _S_LABEL = 1, 2, 3, 4
_S_WEIGHT, _S_DENSE_W = 90, 91
_PLANTED_TABLE_MAX_ROWS = 20_000_000
_PLANTED_CHUNK = 1 << 20  # ids hashed at once for the planted weights' table
_CHUNK_MIN_SAMPLES = 4096  # data.loader_threads splits a batch into chunks of at least this many


def _stream(split: int, kind: int) -> int:
    return split * 100 + kind


def zipf_rank(u: np.ndarray, n: np.ndarray, alpha: float) -> np.ndarray:
    """Popularity rank in [0, n) for uniforms u: a continuous Zipf sampled in closed form.

    x has density ~ x ** -alpha on [1, n + 1) and rank = floor(x) - 1, so
    p(rank k) ~ integral_{k+1}^{k+2} x ** -alpha dx ~ (k + 1.5) ** -alpha. No per-table CDF is
    stored, so tables of any size cost nothing and sampling is one pow per id.
    """
    top = (n + 1).astype(np.float64)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * np.log(top))
    else:
        e = 1.0 - alpha
        x = (1.0 + u * (top ** e - 1.0)) ** (1.0 / e)
    return np.minimum(np.floor(x).astype(np.int64) - 1, n - 1).clip(min=0)


def coprime_multiplier(n: int) -> int:
    """A multiplier a with gcd(a, n) == 1, so rank -> (a * rank + c) mod n is a permutation."""
    a = int(0.6180339887 * n) | 1
    while math.gcd(a, n) != 1:
        a += 2 if n % 2 == 0 else 1
    return max(a, 1)


class SyntheticData:
    """Generates the local slice of each global batch for one rank."""

    def __init__(self, cfg: DataConfig, rows: list[int], rank: int, world: int, local_batch: int,
                 pin_memory: bool = False):
        self.cfg, self.rows, self.rank, self.world, self.b = cfg, list(rows), rank, world, local_batch
        self.pin_memory = pin_memory  # chunked batches in page-locked memory (batches for a GPU)
        self.T, self.F = len(rows), cfg.num_dense
        self._n = np.asarray(rows, dtype=np.int64)
        self._mult = np.asarray([coprime_multiplier(n) for n in rows], dtype=np.int64)
        self._shift = np.asarray([(7919 * (t + 1)) % n for t, n in enumerate(rows)], dtype=np.int64)
        self._dense_w = rng.normal(cfg.seed, _S_DENSE_W, np.arange(self.F))
        # a validation split (data.val_fraction) is the last training samples of the finite set
        n_val = val_rows(cfg.train_samples, cfg.val_fraction or 0.0) if cfg.train_samples > 0 else 0
        self.n_train = cfg.train_samples - n_val  # training samples the stream cycles over (0: endless)
        self.val_idx = np.arange(self.n_train, cfg.train_samples, dtype=np.int64)
        # planted weights: a lookup table when small enough (saves two hashes per id per batch)
        self._w_start = np.cumsum([0] + list(rows[:-1])).astype(np.int64)
        self._w_table = None
        self._drift = float(cfg.drift)
        if sum(rows) <= _PLANTED_TABLE_MAX_ROWS and not self._drift:  # drifting ids pass any row count
            # 4 B per row, made a chunk of ids at a time: the hashing's int64 / float64 temporaries
            # stay at a chunk's (whole, 14M rows peaked at 1 GB for a 56 MB table)
            self._w_table = np.empty(sum(rows), dtype=np.float32)
            for t, n in enumerate(rows):
                for lo in range(0, n, _PLANTED_CHUNK):
                    i = np.arange(lo, min(lo + _PLANTED_CHUNK, n), dtype=np.int64)
                    start = self._w_start[t] + lo
                    self._w_table[start:start + i.size] = self._planted(np.full(i.size, t, np.int64), i)
        # data.loader_threads > 1: a batch's samples are made in row chunks on a thread pool (numpy
        # releases the GIL in its array loops); every value is a function of its sample's index
        # alone, so the chunks give bit-identical batches (tests/unit/test_data_sharding.py)
        self._threads = max(1, int(cfg.loader_threads))
        self._pool: Optional[ThreadPoolExecutor] = None
        # bags of one fixed length: batches say so (the id guard then reads no lengths)
        self._bag_length = cfg.min_bag if cfg.min_bag == cfg.max_bag else None
        self._cycled: dict[int, Batch] = {}  # data.cycle_batches: the K local batches, once made

    @property
    def global_batch(self) -> int:
        return self.b * self.world

    # ---- sample generation -----------------------------------------------------------------
    def _lengths(self, split: int, idx: np.ndarray) -> np.ndarray:
        lo, hi = self.cfg.min_bag, self.cfg.max_bag
        if lo == hi:
            return np.full((idx.size, self.T), lo, dtype=np.int64)
        keys = idx[:, None] * self.T + np.arange(self.T)[None, :]
        u = rng.uniform(self.cfg.seed, _stream(split, _S_LEN), keys)
        return lo + np.floor(u * (hi - lo + 1)).astype(np.int64)

    def _ids(self, split: int, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self.cfg.min_bag == self.cfg.max_bag:
            return self._fixed_ids(split, idx, self.cfg.min_bag)
        return self._bag_ids(split, idx, lengths)

    def _bag_ids(self, split: int, idx: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """The ids of bags of any lengths [n, T], entry by entry."""
        flat = lengths.reshape(-1)
        bag = np.repeat(np.arange(flat.size), flat)
        starts = np.concatenate([[0], np.cumsum(flat)[:-1]]) if flat.size else flat
        pos = np.arange(bag.size) - np.repeat(starts, flat)
        table = bag % self.T
        key = (idx[bag // self.T] * self.cfg.max_bag + pos) * self.T + table
        u = rng.uniform(self.cfg.seed, _stream(split, _S_ID), key)
        rank = zipf_rank(u, self._n[table], self.cfg.zipf_alpha)
        ids = (rank * self._mult[table] + self._shift[table]) % self._n[table]
        return ids + self._offsets(split, idx)[bag // self.T] if self._drift else ids

    def _fixed_ids(self, split: int, idx: np.ndarray, length: int) -> np.ndarray:
        """_ids when every bag holds `length` ids: the same keys and the same elementwise
        arithmetic, laid out as [samples, T, length] by broadcasting instead of built per entry
        (no repeat / cumsum, and the per-table constants, Zipf's top ** e included, once per table
        instead of once per id), so the values are bit-identical to the general path."""
        t = np.arange(self.T, dtype=np.int64)[None, :, None]
        pos = np.arange(length, dtype=np.int64)[None, None, :]
        key = (idx[:, None, None] * self.cfg.max_bag + pos) * self.T + t
        u = rng.uniform(self.cfg.seed, _stream(split, _S_ID), key)
        n = self._n[None, :, None]
        rank = zipf_rank(u, n, self.cfg.zipf_alpha)
        ids = (rank * self._mult[None, :, None] + self._shift[None, :, None]) % n
        return (ids + self._offsets(split, idx)[:, None, None] if self._drift else ids).reshape(-1)

    def _offsets(self, split: int, idx: np.ndarray) -> np.ndarray:
        """[n] int64 drift of samples idx: floor(drift x stream position) (evaluation: as at
        training position data.drift_eval_at + index)."""
        pos = idx + (self.cfg.drift_eval_at if split == EVAL else 0)
        return np.floor(self._drift * pos.astype(np.float64)).astype(np.int64)

    def _planted(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        return rng.normal(self.cfg.seed, _S_WEIGHT, ids * self.T + table)

    def planted_weight(self, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """[N] hidden per-row weight w_t[id] ~ N(0, 1) of the label model."""
        if self._w_table is not None:
            return self._w_table[self._w_start[table] + ids]
        return self._planted(table, ids)

    def samples(self, split: int, idx: np.ndarray) -> Batch:
        """The samples with global indices idx (1-D int64) of a split (in row chunks on
        data.loader_threads threads when the batch is large enough: the same values)."""
        idx = np.asarray(idx, dtype=np.int64)
        chunks = min(self._threads, idx.size // _CHUNK_MIN_SAMPLES)
        if chunks <= 1:
            return self._samples(split, idx)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix="synthetic")
        parts = list(self._pool.map(lambda part: self._samples(split, part), np.array_split(idx, chunks)))
        fields = ("dense", "values", "lengths", "labels")
        # the whole batch in one buffer per field, page-locked when it goes to a GPU (the copy to
        # the device then starts from it directly); the chunks are copied in on the pool too
        starts = {f: np.cumsum([0] + [getattr(p, f).shape[0] for p in parts]) for f in fields}
        outs = [torch.empty((int(starts[f][-1]), *getattr(parts[0], f).shape[1:]),
                            dtype=getattr(parts[0], f).dtype, pin_memory=self.pin_memory) for f in fields]

        def fill(k: int) -> None:
            for out, f in zip(outs, fields):
                out[starts[f][k]:starts[f][k + 1]].copy_(getattr(parts[k], f))
        list(self._pool.map(fill, range(len(parts))))
        return Batch(*outs, bag_length=self._bag_length)

    def _samples(self, split: int, idx: np.ndarray) -> Batch:
        lengths = self._lengths(split, idx)
        values = self._ids(split, idx, lengths)
        dense = rng.normal(self.cfg.seed, _stream(split, _S_DENSE),
                           idx[:, None] * self.F + np.arange(self.F)[None, :])
        bag_mean = self._bag_means(values, lengths)
        logit = self.cfg.signal * (bag_mean.sum(1) / math.sqrt(self.T)
                                   + dense @ self._dense_w / math.sqrt(self.F))
        u = rng.uniform(self.cfg.seed, _stream(split, _S_LABEL), idx)
        labels = (u < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return Batch(torch.from_numpy(dense.astype(np.float32)), torch.from_numpy(values),
                     torch.from_numpy(lengths), torch.from_numpy(labels), bag_length=self._bag_length)

    def _bag_means(self, values: np.ndarray, lengths: np.ndarray, one_hot: bool | None = None) -> np.ndarray:
        """[n, T] mean planted weight of each bag (0 for an empty one). one_hot (default: the
        config's one id per bag): each bag's mean is its one row's weight, with no per-entry bag
        index (the same values as the general sum / length)."""
        if one_hot is None:
            one_hot = self.cfg.min_bag == self.cfg.max_bag == 1
        if one_hot:
            table = np.broadcast_to(np.arange(self.T, dtype=np.int64), lengths.shape).reshape(-1)
            return self.planted_weight(table, values).reshape(lengths.shape)
        bag = np.repeat(np.arange(lengths.size), lengths.reshape(-1))
        w = self.planted_weight(bag % self.T, values)
        bag_sum = np.bincount(bag, weights=w, minlength=lengths.size).reshape(lengths.shape)
        return bag_sum / np.maximum(lengths, 1)

    # ---- the global view (schedulers, placement profiles) ------------------------------------
    def stream_keys(self, pos: np.ndarray) -> np.ndarray:
        """Sample keys (training sample indices) at positions `pos` of the training stream."""
        pos = np.asarray(pos, dtype=np.int64)
        if self.cfg.cycle_batches:  # the stream repeats its first K global batches
            g = self.global_batch
            pos = (pos // g) % self.cfg.cycle_batches * g + pos % g
        return pos % self.n_train if self.n_train > 0 else pos

    def sample_ids(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values [N], lengths [n, T]) of training samples `keys`: the ids only, no features."""
        keys = np.asarray(keys, dtype=np.int64)
        lengths = self._lengths(TRAIN, keys)
        return self._ids(TRAIN, keys, lengths), lengths

    def sample_batch(self, keys: np.ndarray) -> Batch:
        return self.samples(TRAIN, keys)

    # ---- iteration -------------------------------------------------------------------------
    def train_indices(self, step: int) -> np.ndarray:
        if self.cfg.cycle_batches:
            step %= self.cfg.cycle_batches
        start = step * self.global_batch + self.rank * self.b
        idx = np.arange(start, start + self.b, dtype=np.int64)
        return idx % self.n_train if self.n_train > 0 else idx

    def train_batch(self, step: int) -> Batch:
        """This rank's slice [rank*b, (rank+1)*b) of global batch `step` (with data.cycle_batches
        = K: of global batch step mod K, made once and kept: K local batches in host memory)."""
        k = self.cfg.cycle_batches
        if not k:
            return self.samples(TRAIN, self.train_indices(step))
        if step % k not in self._cycled:
            self._cycled[step % k] = self.samples(TRAIN, self.train_indices(step))
        return self._cycled[step % k]

    @property
    def val_rows(self) -> int:
        return int(self.val_idx.size)

    def _split_size(self, split: str) -> int:
        if split not in ("test", "val"):
            raise ValueError(f"split={split!r}: must be test or val")
        return self.cfg.test_samples if split == "test" else self.val_rows

    def num_eval_steps(self, split: str = "test") -> int:
        per_step = self.cfg.eval_batch_size * self.world
        return -(-self._split_size(split) // per_step)

    def eval_batches(self, split: str = "test") -> Iterator[Batch]:
        """Every rank yields the same number of batches (some may be empty) covering the split
        (test: the eval samples; val: the validation samples of the training set)."""
        be, n = self.cfg.eval_batch_size, self._split_size(split)
        for k in range(self.num_eval_steps(split)):
            start = k * be * self.world + self.rank * be
            pos = np.arange(start, max(start, min(start + be, n)), dtype=np.int64)
            yield self.samples(EVAL, pos) if split == "test" else self.samples(TRAIN, self.val_idx[pos])
